"""Asynchronous saves under mpiexec -n 2: the background commit runs beside the training
loop's collectives without mixing with them (MPI_THREAD_MULTIPLE: on a duplicate group;
less than that: at the next call on the calling thread), errors surface on every worker,
a crash before the commit keeps the previous checkpoint, the end of the job finishes or
reports a save in flight."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

# argv: directory, thread level ("multiple" or "serialized"), what to do
PRELUDE = r"""
import os, sys
import mpi4py
mpi4py.rc.thread_level = sys.argv[2]
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.train import format as fmt, saving

directory, level, what = sys.argv[1], sys.argv[2], sys.argv[3]
ASYNC = gs.train.CheckpointOptions(enable_async=True)
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = s.worker_index
with s.scope():
    w = gs.Variable(np.zeros(5000, np.float32), name="w")
    opt = gs.optimizers.SGD(0.5)
it = iter(s.experimental_distribute_dataset(Dataset.range(200).batch(8)))
ck = gs.train.Checkpoint(w=w, opt=opt, input=it, step=0)
manager = gs.train.CheckpointManager(ck, directory, max_to_keep=3)
from mpi4py import MPI
assert MPI.Query_thread() == {"multiple": MPI.THREAD_MULTIPLE,
                              "serialized": MPI.THREAD_SERIALIZED}[level]

def step(batch):
    def fn(x):
        # every replica's gradient depends on its data: the sum is a real collective
        g = np.full(5000, float(np.asarray(x).sum()), np.float32)
        opt.apply_gradients([(g, w)])
    s.run(fn, args=(batch,))
"""

TRAIN = PRELUDE + r"""
expected = {}
for k, batch in enumerate(it, 1):
    step(batch)
    if k % 3 == 0:
        ck.step = k
        expected[k] = w.numpy()
        path = manager.save(options=ASYNC)
        latest = manager.latest_checkpoint
        assert latest is None or os.path.exists(latest + ".index"), latest
    if k == 20:
        break
ck.sync()
assert manager.latest_checkpoint.endswith("ckpt-6"), manager.latest_checkpoint
assert gs.train.latest_checkpoint(directory) == manager.latest_checkpoint
for path in manager.checkpoints:
    with s.scope():
        w2 = gs.Variable(np.zeros(5000, np.float32), name="w")
    ck2 = gs.train.Checkpoint(w=w2, step=0)
    ck2.restore(path)
    np.testing.assert_array_equal(w2.numpy(), expected[ck2.step])
assert sorted(os.listdir(directory)) == ["checkpoint"] + sorted(
    f"ckpt-{n}.{ext}" for n in (4, 5, 6) for ext in
    ("data", "index", "worker-0-of-2.npz", "worker-1-of-2.npz")), os.listdir(directory)
print(f"OK {rank} {[os.path.basename(p) for p in manager.checkpoints]}", flush=True)
"""


@pytest.mark.parametrize("level", ["multiple", "serialized"])
def test_mpi_async_saves_during_training(tmp_path, level):
    out = assert_mpi_ok(2, TRAIN, timeout=180, args=(tmp_path, level, "train"),
                        expect_lines=2)
    assert out.count("['ckpt-4', 'ckpt-5', 'ckpt-6']") == 2, out


ERRORS = PRELUDE + r"""
if what == "fail-one":
    next(it)
    manager.save()
    real = fmt.write_npz
    def failing(path, arrays, tree=None):
        if rank == 1:
            raise OSError(28, "No space left on device")
        return real(path, arrays, tree)
    fmt.write_npz = failing
    manager.save(options=ASYNC)
    step(next(it))
    try:
        ck.sync()
    except RuntimeError as e:
        print(f"OK {rank} {e}", flush=True)
    fmt.write_npz = real
    assert manager.latest_checkpoint.endswith("ckpt-1")
    s.workers.barrier()   # every worker has removed its temporary files
    assert not [f for f in os.listdir(directory) if "tmp" in f or "ckpt-2" in f]
elif what == "crash":
    next(it)
    w.assign(np.ones(5000, np.float32))
    manager.save(options=ASYNC)
    ck.sync()
    w.assign(np.full(5000, 2.0, np.float32))
    if rank == 0:
        saving._before_commit = lambda: os._exit(3)   # dies after every worker wrote
    manager.save(options=ASYNC)
    step(next(it))
    ck.sync()
    print("NOT REACHED", flush=True)
elif what == "resume":
    ck.restore(manager.latest_checkpoint)
    got = [np.asarray(p).tolist() for p in s.experimental_local_results(next(it))]
    print(f"OK {rank} {os.path.basename(manager.latest_checkpoint)} {float(w.numpy()[0])} "
          f"{got}", flush=True)
elif what == "exit":
    w.assign(np.full(5000, 3.0, np.float32))
    manager.save(options=ASYNC)
    print(f"OK {rank} returned", flush=True)   # and the program ends without sync()
"""


def test_mpi_a_failure_on_one_worker_surfaces_on_every_worker(tmp_path):
    out = assert_mpi_ok(2, ERRORS, timeout=120, args=(tmp_path, "multiple", "fail-one"),
                        expect_lines=2)
    assert out.count("the asynchronous save of checkpoint") == 2, out
    assert out.count("failed on 1 of 2 workers: worker 1: OSError") == 2, out


@pytest.mark.parametrize("level", ["multiple", "serialized"])
def test_mpi_crash_before_the_background_commit_keeps_the_previous_checkpoint(
        tmp_path, level):
    rc, out, err = run_mpi(2, ERRORS, timeout=120, args=(tmp_path, level, "crash"))
    assert rc != 0 and "NOT REACHED" not in out, (rc, out, err)
    files = sorted(os.listdir(tmp_path))
    assert "ckpt-1.index" in files and "ckpt-2.index" not in files, files
    out = assert_mpi_ok(2, ERRORS, timeout=120, args=(tmp_path, level, "resume"),
                        expect_lines=2)
    # DATA: the second global batch [8..15] cut over 4 replicas, 2 per worker.
    assert "OK 0 ckpt-1 1.0 [[8, 9], [12, 13]]" in out, out
    assert "OK 1 ckpt-1 1.0 [[10, 11], [14, 15]]" in out, out


def test_mpi_the_end_of_the_job_commits_a_save_in_flight(tmp_path):
    assert_mpi_ok(2, ERRORS, timeout=120, args=(tmp_path, "multiple", "exit"),
                  expect_lines=2)
    assert os.path.basename(
        __import__("gpustrat").train.latest_checkpoint(str(tmp_path))) == "ckpt-1"


def test_mpi_without_thread_multiple_the_end_of_the_job_reports_an_uncommitted_save(
        tmp_path):
    rc, out, err = run_mpi(2, ERRORS, timeout=120, args=(tmp_path, "serialized", "exit"))
    assert rc == 0 and out.count("returned") == 2, (rc, out, err)
    assert err.count("was written but not committed") == 2, err
    assert "checkpoint" not in os.listdir(tmp_path)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".index")]
