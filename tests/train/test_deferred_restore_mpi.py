"""Deferred restores and the manager's schedules under mpiexec -n 2, with timeouts:
every worker restores variables made after the restore the same way, and every worker
skips and keeps the same checkpoints (worker 0's clock decides)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

PROGRAM = r"""
import os, sys
import numpy as np
import gpustrat as gs
from gpustrat.train import manager as manager_module

directory = sys.argv[1]
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index


class Lazy:
    def build(self):
        self.w = gs.Variable(np.zeros(2, np.float32), name="w")
        self.opt = gs.optimizers.SGD(0.1, momentum=0.9)


with s.scope():
    m = Lazy()
    m.build()
step = lambda model: s.run(lambda: model.opt.apply_gradients(
    [(np.float32([1, 2]), model.w)]))
step(m)
ck = gs.train.Checkpoint(model=m)
path = ck.save(os.path.join(directory, "c"))
step(m)
expected = m.w.numpy().tolist()

# A model whose variables are made after the restore.
m2 = Lazy()
ck2 = gs.train.Checkpoint(model=m2)
status = ck2.restore(path)
status.assert_existing_objects_matched()
with s.scope():
    m2.build()
status.run_restore_ops()
status.assert_consumed()
step(m2)
assert m2.w.numpy().tolist() == expected, (r, m2.w.numpy(), expected)

# Written before the deferred restore: refused on every worker, nothing restored.
m3 = Lazy()
status = gs.train.Checkpoint(model=m3).restore(path)
with s.scope():
    m3.build()
step(m3)
try:
    status.assert_consumed()
except ValueError as e:
    assert "'model/w': this variable was attached after the restore" in str(e), str(e)
else:
    raise AssertionError("no error")

# The manager's interval and hours: worker 1's clock is wrong on purpose.
class Clock:
    now = 1_000_000.0 + (0 if r == 0 else 5_000_000.0)
    def time(self):
        return self.now
clock = Clock()
manager_module.time = clock
with s.scope():
    counter = gs.Variable(0, dtype=np.int64)
mgr = gs.train.CheckpointManager(gs.train.Checkpoint(step=counter, model=m),
                                 os.path.join(directory, "run"), max_to_keep=2,
                                 keep_checkpoint_every_n_hours=1, step_counter=counter,
                                 checkpoint_interval=3)
saved = []
for k in range(10):
    counter.assign(k)
    clock.now += 1800
    p = mgr.save()
    saved.append(None if p is None else os.path.basename(p))
assert saved == ["ckpt-1", None, None, "ckpt-2", None, None, "ckpt-3", None, None,
                 "ckpt-4"], saved
kept = [os.path.basename(p) for p in mgr.checkpoints]
assert kept == ["ckpt-3", "ckpt-4"], kept
files = sorted(f[:-6] for f in os.listdir(os.path.join(directory, "run"))
               if f.endswith(".index"))
# ckpt-1 left 30 minutes after the manager was made: deleted; ckpt-2, 1.5 hours
# after it: preserved.
assert files == ["ckpt-2", "ckpt-3", "ckpt-4"], files
print(f"OK rank {r}", flush=True)
s.close()
"""


def test_deferred_restore_and_interval_saves_on_every_worker(tmp_path):
    assert_mpi_ok(2, PROGRAM, timeout=300, args=(str(tmp_path),), expect_lines=2)
