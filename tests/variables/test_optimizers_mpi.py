"""Optimizers across MPI workers (mpiexec -n 2, 2 replicas each) against the plain NumPy
reference, and workers that train different variables (an error on every rank)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402
from training_cases import OPTIMIZERS, reference  # noqa: E402

pytestmark = pytest.mark.mpi

TRAIN = r"""
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
import gpustrat as gs
from training_cases import OPTIMIZERS, train
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{{i}}" for i in range({local})])
out = {{}}
for which in sorted(OPTIMIZERS):
    ws, bs, it = train(s, which)
    out[which] = [[c.tolist() for c in ws], [c.tolist() for c in bs], it]
with open(sys.argv[1] + f".rank{{s.worker_index}}.json", "w") as f:
    json.dump(out, f)
print(f"OK rank {{s.worker_index}}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (2, 2), (3, 2)])
def test_same_weights_as_numpy_across_workers(tmp_path, ranks, local):
    # 3 x 2: the last batch of 7 rows is cut 2, 2, 2, 1, 0, 0 over the 6 replicas.
    out = tmp_path / "weights"
    assert_mpi_ok(ranks, TRAIN.format(here=str(HERE), local=local), timeout=300,
                  args=(out,), expect_lines=ranks)
    for rank in range(ranks):
        got = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        assert sorted(got) == sorted(OPTIMIZERS)
        for which, (ws, bs, iterations) in got.items():
            w_ref, b_ref, steps = reference(which)
            assert iterations == steps and len(ws) == len(bs) == local
            tol = dict(rtol=2e-2, atol=2e-3) if which.endswith("float16") else \
                dict(rtol=2e-5, atol=2e-6)
            for c in ws:
                np.testing.assert_allclose(c, w_ref, err_msg=f"{which} rank {rank}", **tol)
            for c in bs:
                np.testing.assert_allclose(c, b_ref, err_msg=f"{which} rank {rank}", **tol)


DISAGREE = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = s.worker_index
with s.scope():
    a = gs.Variable(np.zeros(3, np.float32), name="a")
    b = gs.Variable(np.zeros(3, np.float32), name="b")
    opt = gs.optimizers.SGD(0.1)
mine = [a] if rank == 0 else [b]          # the same shapes, other variables
try:
    s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v) for v in mine]))
except ValueError as e:
    assert "every worker must reduce the same values" in str(e), e
else:
    raise AssertionError("no error")
assert int(opt.iterations) == 0
s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), a)]))
assert all(np.allclose(np.asarray(c), -0.4) for c in s.experimental_local_results(a))
print(f"OK rank {rank}", flush=True)
s.close()
"""


def test_workers_training_different_variables_fail_on_every_rank():
    assert_mpi_ok(2, DISAGREE, timeout=120, expect_lines=2)
