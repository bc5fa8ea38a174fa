"""The demo's training gives the same weights whatever the topology.

Same data, seeds and number of steps on 1 replica, 2 and 3 replicas in one process, and
2 workers x 2 replicas under ``mpiexec -n 2``; all must match a plain NumPy full-batch
gradient descent. 201 examples in global batches of 8 end with a batch of 1 row, so
the last step cuts it into one 1-row piece and empty pieces on every other replica.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

import gpustrat as gs  # noqa: E402
from gpustrat import demo  # noqa: E402

CONFIG = dict(epochs=3, n_samples=201, n_features=5, hidden=7, global_batch=8,
              learning_rate=0.1)
RTOL, ATOL = 1e-5, 1e-9


def train_on(devices) -> dict:
    strategy = gs.MirroredStrategy(devices)
    try:
        return demo.train(strategy, log=None, **CONFIG)
    finally:
        strategy.close()


def reference_weights() -> dict:
    """Mini-batch gradient descent in plain NumPy, no gpustrat: the ground truth."""
    c = CONFIG
    x, y = demo.make_dataset(c["n_samples"], c["n_features"])
    w = demo.init_weights(c["n_features"], c["hidden"])
    for _ in range(c["epochs"]):
        for start in range(0, len(x), c["global_batch"]):
            xb, yb = x[start:start + c["global_batch"]], y[start:start + c["global_batch"]]
            _, g = demo.forward_backward(w, xb, yb)
            w = {k: w[k] - c["learning_rate"] * g[k] / len(xb) for k in w}
    return w


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want) == sorted(demo.WEIGHT_NAMES)
    for k in want:
        assert got[k].shape == want[k].shape, (what, k)
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL,
                                   err_msg=f"{what}: weight {k}")


@pytest.fixture(scope="module")
def reference():
    ref = reference_weights()
    init = demo.init_weights(CONFIG["n_features"], CONFIG["hidden"])
    # Training moved the weights far beyond the tolerance: the comparisons mean something.
    assert all(np.max(np.abs(ref[k] - init[k])) > 1e-3 for k in ref)
    return ref


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"],
                                     ["cpu:0", "cpu:1", "cpu:2"]])
def test_in_process_topologies_match_full_batch_reference(devices, reference):
    assert_same(train_on(devices), reference, f"MirroredStrategy({devices})")


def test_partial_and_empty_pieces_happen():
    # The premise of this file: the last global batch leaves some replicas empty.
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        x, y = demo.make_dataset(CONFIG["n_samples"], CONFIG["n_features"])
        dist = strategy.experimental_distribute_dataset(
            gs.data.Dataset.from_tensor_slices((x, y)).batch(CONFIG["global_batch"]))
        rows = [[p[0].shape[0] for p in strategy.experimental_local_results(b)] for b in dist]
    finally:
        strategy.close()
    assert rows[0] == [4, 4] and rows[-1] == [1, 0] and len(rows) == 26


CHILD = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat import demo
config = dict(epochs={epochs}, n_samples={n_samples}, n_features={n_features},
              hidden={hidden}, global_batch={global_batch}, learning_rate={learning_rate})
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
assert s.num_workers == 2 and s.num_replicas_in_sync == 4
w = demo.train(s, log=None, **config)
np.savez(sys.argv[1] + f".rank{{s.worker_index}}.npz", **w)
s.close()
print(f"OK rank {{s.worker_index}}", flush=True)
"""


@pytest.mark.mpi
def test_two_workers_two_replicas_match_reference(tmp_path, reference):
    out = tmp_path / "weights"
    assert_mpi_ok(2, CHILD.format(**CONFIG), timeout=120, args=(out,),
                  expect_lines=2, marker="OK")
    for rank in (0, 1):
        with np.load(f"{out}.rank{rank}.npz") as f:
            got = {k: f[k] for k in f.files}
        assert_same(got, reference, f"2 workers x 2 replicas, rank {rank}")
