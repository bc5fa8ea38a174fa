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
    for buffers in (False, True):
        ws, bs, it = train(s, which, buffers=buffers)
        out[which + ("+buffers" if buffers else "")] = [[c.tolist() for c in ws],
                                                         [c.tolist() for c in bs], it]
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
        assert sorted(got) == sorted(OPTIMIZERS) + sorted(f"{w}+buffers" for w in OPTIMIZERS) \
            or sorted(got) == sorted(list(OPTIMIZERS) + [f"{w}+buffers" for w in OPTIMIZERS])
        for key, (ws, bs, iterations) in got.items():
            which = key.split("+")[0]
            w_ref, b_ref, steps = reference(which)
            assert iterations == steps and len(ws) == len(bs) == local
            tol = dict(rtol=2e-2, atol=2e-3) if which.endswith("float16") else \
                dict(rtol=2e-5, atol=2e-6)
            for c in ws:
                np.testing.assert_allclose(c, w_ref, err_msg=f"{key} rank {rank}", **tol)
            for c in bs:
                np.testing.assert_allclose(c, b_ref, err_msg=f"{key} rank {rank}", **tol)


DISAGREE = r"""
import re
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = s.worker_index
with s.scope():
    a = gs.Variable(np.zeros(3, np.float32), name="a")
    b = gs.Variable(np.zeros(3, np.float32), name="b")
    opt = gs.optimizers.SGD(0.1)
mine = [a] if rank == 0 else [b]          # the same shapes, other variables


def arrays():
    opt.apply_gradients([(np.ones(3, np.float32), v) for v in mine])


def buffers():
    bufs = opt.gradient_buffers(mine)
    for g in bufs:
        g[...] = 1
    opt.apply_gradients(zip(bufs, mine))


# The first step makes each worker's plan (its buffers are plain arrays); the next
# ones reduce the plan's gradient buffers in place: every way raises on every rank.
for way in (arrays, buffers, buffers):
    try:
        s.run(way)
    except ValueError as e:
        assert "every worker must reduce the same values" in str(e), e
        assert re.search(r"rank 0: \(a(#\d+)?:3:float32\); rank 1: \(b(#\d+)?:3:float32\)",
                         str(e)), e
    else:
        raise AssertionError(f"no error from {way.__name__}")
assert int(opt.iterations) == 0
s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), a)]))
assert all(np.allclose(np.asarray(c), -0.4) for c in s.experimental_local_results(a))
print(f"OK rank {rank}", flush=True)
s.close()
"""


def test_workers_training_different_variables_fail_on_every_rank():
    assert_mpi_ok(2, DISAGREE, timeout=120, expect_lines=2)


LONG = r"""
import re
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
rank = s.worker_index
with s.scope():
    vs = [gs.Variable(np.zeros(2, np.float32), name=f"w{j}") for j in range(11)]
    opt = gs.optimizers.SGD(0.1)
if rank == 1:
    vs[6] = vs.pop()                      # another variable far down a long list
else:
    vs.pop()
try:
    s.run(lambda: opt.apply_gradients([(np.ones(v.shape, np.float32), v) for v in vs]))
except ValueError as e:
    text = str(e)
    assert re.search(r"rank 0: 10 entries, entry 6 w6(#\d+)?:2:float32; "
                     r"rank 1: 10 entries, entry 6 w10(#\d+)?:2:float32", text), text
else:
    raise AssertionError("no error")
print(f"OK rank {rank}", flush=True)
s.close()
"""


def test_a_long_variable_list_names_the_first_difference():
    assert_mpi_ok(2, LONG, timeout=120, expect_lines=2)


ONE_HEADER = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
with s.scope():
    vs = [gs.Variable(np.zeros(4, np.float32), name=f"v{j}") for j in range(5)]
    opt = gs.optimizers.SGD(0.5)
grads = [np.full(4, s.worker_index + 1.0, np.float32) for _ in vs]
ch = s.communicator._ch


def buffers():
    bufs = opt.gradient_buffers(vs)
    for b, g in zip(bufs, grads):
        b[...] = g
    opt.apply_gradients(zip(bufs, vs))


def arrays():
    opt.apply_gradients(zip(grads, vs))


for way in (arrays, buffers, buffers, arrays):
    before = ch.calls
    s.run(way)
    # One bucket: its header carries the workers' agreement on the variables too.
    assert ch.calls - before == 1, (way.__name__, ch.calls - before)
with s.scope():
    out = s.extended.batch_reduce_to("sum", [(g, None) for g in grads])
    assert ch.calls - before == 2
assert all(np.array_equal(o, np.full(4, 3.0)) for o in out)
for v in vs:
    np.testing.assert_array_equal(np.asarray(v), -6.0)   # 4 steps of 0.5 * 3
print(f"OK rank {s.worker_index}", flush=True)
s.close()
"""


def test_the_agreement_rides_in_the_reduction_header():
    assert_mpi_ok(2, ONE_HEADER, timeout=120, expect_lines=2)


MIXED_WAYS = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
rank = s.worker_index
for compression in (None, "float16", "bfloat16"):
    with s.scope():
        vs = [gs.Variable(np.zeros(3, np.float32), name=f"{compression}{j}") for j in range(4)]
        opt = gs.optimizers.SGD(0.5, compression=compression)

    def step():
        # Rank 0 writes into its gradient buffers, rank 1 passes arrays: the same
        # collectives (16-byte buckets: several per step), the same sums.
        grads = [np.full(3, (rank + 1) * (j + 1), np.float32) for j in range(4)]
        if rank == 0:
            bufs = opt.gradient_buffers(vs)
            for b, g in zip(bufs, grads):
                b[...] = g
            grads = bufs
        opt.apply_gradients(zip(grads, vs))
        return grads

    for _ in range(3):
        last = s.run(step)
    for j, v in enumerate(vs):
        np.testing.assert_array_equal(np.asarray(v), np.full(3, -4.5 * (j + 1)))
        if rank == 0:      # the buffers hold the sums
            np.testing.assert_array_equal(last[j], np.full(3, 3.0 * (j + 1)))
print(f"OK rank {rank}", flush=True)
s.close()
"""


def test_workers_mixing_gradient_buffers_and_arrays_make_the_same_collectives():
    assert_mpi_ok(2, MIXED_WAYS, timeout=120, expect_lines=2,
                  env={"GPUSTRAT_FUSION_BUCKET_BYTES": "16"})


CLIPPED = r"""
import json, sys
sys.path.insert(0, {here!r})
import numpy as np
import gpustrat as gs
from test_optimizers_keras_parity import train
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
out = {{}}
for name in {names!r}:
    steps, slots, *_ = train(s, name, "float32", buffers=name.startswith("adagrad"))
    out[name] = [[[a.tolist() for a in step] for step in steps],
                 {{k: [a.tolist() for a in v] for k, v in slots.items()}}]
with open(sys.argv[1] + f".rank{{s.worker_index}}.json", "w") as f:
    json.dump(out, f)
print(f"OK rank {{s.worker_index}}", flush=True)
s.close()
"""


def test_new_optimizers_with_clipping_match_one_process_across_workers(tmp_path):
    # 2 workers of one replica each; clipping applies to the gradients summed over the
    # workers, so every rank ends where one process does on the same global batches.
    import gpustrat as gs
    from test_optimizers_keras_parity import train
    # And the training state of Keras 3: a schedule seen through accumulation, the
    # moving average overwriting the weights, and a loss scale whose skipped step has
    # its inf on the last worker only.
    names = ["rmsprop_clipnorm_active", "nadam_global_clipnorm_active",
             "adagrad_clipvalue_active", "adam_accumulation_schedule",
             "sgd_ema_overwrite", "sgd_loss_scale"]
    out = tmp_path / "clipped"
    assert_mpi_ok(2, CLIPPED.format(here=str(HERE), names=names), timeout=300,
                  args=(out,), expect_lines=2)
    for name in names:
        one = gs.MirroredStrategy(["cpu:0"])
        try:
            steps, slots, *_ = train(one, name, "float32")
        finally:
            one.close()
        for rank in range(2):
            got_steps, got_slots = json.loads(Path(f"{out}.rank{rank}.json").read_text())[name]
            for i, (got, want) in enumerate(zip(got_steps, steps)):
                for g, w in zip(got, want):
                    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7,
                                               err_msg=f"{name} rank {rank} step {i + 1}")
            for k, values in slots.items():
                for g, w in zip(got_slots[k], values):
                    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7,
                                               err_msg=f"{name} rank {rank} slot {k}")
