"""Checkpoint paths under mpiexec -n 2/3 (1 or 2 replicas each), with timeouts: every
worker must write and restore the same path; where one differs, or is missing on one
worker, every worker raises the same error, nothing is restored, and the workers go
on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

PATHS = r"""
import os, re, sys
import numpy as np
import gpustrat as gs

directory, L = sys.argv[1], int(sys.argv[2])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W = s.worker_index, s.num_workers
with s.scope():
    w = gs.Variable(np.zeros(4, np.float32), name="w")
    opt = gs.optimizers.SGD(0.5, momentum=0.9)
ck = gs.train.Checkpoint(w=w, opt=opt)


def expect(kind, fn, pattern):
    try:
        fn()
    except kind as e:
        assert re.search(pattern, str(e), re.S), f"rank {r}: {e}"
    else:
        raise AssertionError(f"rank {r}: no error, expected {pattern!r}")


def step():
    s.run(lambda: opt.apply_gradients([(np.ones(4, np.float32), w)]))


step()
a = ck.write(os.path.join(directory, "a"))
step()
b = ck.write(os.path.join(directory, "b"))
at_b = w.numpy().copy()
mine = os.path.join(directory, "w%d" % r)
expect(ValueError, lambda: ck.write(mine), r"Checkpoint.write: the workers gave "
       r"different paths \[.*w0', .*w1'.*\]; every worker must write the same")
# One worker restores another checkpoint: refused on every worker, nothing restored.
other = b if r == W - 1 else a
expect(ValueError, lambda: ck.restore(other), r"Checkpoint.restore: the workers gave "
       r"different paths .*every worker must restore the same checkpoint path")
expect(ValueError, lambda: ck.read(other), r"Checkpoint.read: the workers gave")
assert (w.numpy() == at_b).all() and int(opt.iterations) == 2
# A path with no checkpoint: an error on every worker naming it.
expect(RuntimeError, lambda: ck.restore(os.path.join(directory, "nothing")),
       rf"reading checkpoint .*nothing' failed on {W} of {W} workers: worker 0: "
       r"FileNotFoundError: no checkpoint at")
# The same path everywhere: restored, and training goes on.
ck.restore(a)
assert int(opt.iterations) == 1
step()
# A Checkpoint of metrics alone (made in the scope, saved outside it) is the workers'
# too: it used to act as a one-worker job on each rank, ignoring the others.
with s.scope():
    loss = gs.metrics.Mean()
s.run(lambda: loss.update_state(np.float32(2.0)))
only = gs.train.Checkpoint(loss=loss)
m1 = only.write(os.path.join(directory, "m1"))
loss.update_state(np.float32(8.0))   # every worker alike, outside run
m2 = only.write(os.path.join(directory, "m2"))
expect(ValueError, lambda: only.read(m2 if r == W - 1 else m1),
       r"Checkpoint.read: the workers gave different paths")
only.read(m1)
assert float(loss.result()) == 2.0, float(loss.result())
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (3, 2)])
def test_workers_that_give_different_checkpoint_paths_raise_on_every_worker(
        tmp_path, ranks, local):
    # A restore from different paths used to fail inside the first variable's assign,
    # with a message about value checksums.
    assert_mpi_ok(ranks, PATHS, timeout=300, args=(str(tmp_path), local),
                  expect_lines=ranks)
