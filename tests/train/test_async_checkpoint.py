"""Asynchronous saves on one worker: a snapshot at the call, written in the background;
sync() and the next save wait; latest_checkpoint never names an unfinished checkpoint;
errors surface at the next call; the end of the program finishes a save in flight."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.train import format as fmt
from gpustrat.train import saving

ASYNC = gs.train.CheckpointOptions(enable_async=True)
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # for mpi_util
from mpi_util import repo_env  # noqa: E402


@pytest.fixture
def held_writes(monkeypatch):
    """Hold every background write of the shared data file until ``release`` is set."""
    release = threading.Event()
    started = threading.Event()
    real = fmt.write_arrays

    def write_arrays(path, arrays):
        if threading.current_thread().name == "gpustrat-checkpoint":
            started.set()
            assert release.wait(60), "the test never released the background write"
        return real(path, arrays)
    monkeypatch.setattr(fmt, "write_arrays", write_arrays)
    return started, release


def test_options_names_as_tensorflow():
    assert gs.train.CheckpointOptions(experimental_enable_async_checkpoint=True).enable_async
    assert not gs.train.CheckpointOptions().enable_async
    with pytest.raises(TypeError, match="options must be a gs.train.CheckpointOptions"):
        gs.train.Checkpoint(w=gs.Variable(1.0)).save("/tmp/never", options={"async": 1})


def test_the_snapshot_is_taken_at_the_call(tmp_path, held_writes):
    started, release = held_writes
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    with s.scope():
        w = gs.Variable(np.arange(6, dtype=np.float32), name="w")
        opt = gs.optimizers.Adam(0.1)
    s.run(lambda: opt.apply_gradients([(np.ones(6, np.float32), w)]))
    it = iter(s.experimental_distribute_dataset(Dataset.range(40).batch(4)))
    next(it)
    ck = gs.train.Checkpoint(w=w, opt=opt, input=it, step=1)
    before_w, before_m = w.numpy(), opt.get_slot(w, "m").numpy()
    path = ck.save(str(tmp_path / "ck"), options=ASYNC)
    assert path == str(tmp_path / "ck-1") and ck.save_counter == 1
    assert started.wait(60)
    # Training goes on while the files are written: the checkpoint keeps the state of
    # the call, not what the loop changes meanwhile.
    assert not os.path.exists(path + ".index")
    s.run(lambda: opt.apply_gradients([(np.ones(6, np.float32), w)]))
    w.assign_add(np.full(6, 100, np.float32))
    next(it)
    release.set()
    ck.sync()
    assert os.path.exists(path + ".index")
    with s.scope():
        w2 = gs.Variable(np.zeros(6, np.float32), name="w")
        opt2 = gs.optimizers.Adam(0.1)
    it2 = iter(s.experimental_distribute_dataset(Dataset.range(40).batch(4)))
    gs.train.Checkpoint(w=w2, opt=opt2, input=it2, step=0).restore(path)
    np.testing.assert_array_equal(w2.numpy(), before_w)
    s.run(lambda: opt2.apply_gradients([(np.zeros(6, np.float32), w2)]))
    assert int(opt2.iterations.numpy()) == 2     # 1 saved + this step
    np.testing.assert_allclose(opt2.get_slot(w2, "m").numpy(), before_m * 0.9, rtol=1e-6)
    got = [np.asarray(p).tolist() for p in s.experimental_local_results(next(it2))]
    assert got == [[4, 5], [6, 7]]


def test_latest_checkpoint_never_names_an_unfinished_one(tmp_path, held_writes):
    started, release = held_writes
    w = gs.Variable(np.zeros(3, np.float32))
    ck = gs.train.Checkpoint(w=w)
    manager = gs.train.CheckpointManager(ck, str(tmp_path), max_to_keep=1)
    release.set()
    first = manager.save(options=ASYNC)
    manager.sync()
    assert manager.latest_checkpoint == first
    release.clear()
    started.clear()
    w.assign(np.ones(3, np.float32))
    second = manager.save(options=ASYNC)
    assert started.wait(60)
    assert manager.latest_checkpoint == first == gs.train.latest_checkpoint(str(tmp_path))
    assert manager.checkpoints == [first]
    release.set()
    ck.sync()
    assert manager.latest_checkpoint == second == gs.train.latest_checkpoint(str(tmp_path))
    assert not os.path.exists(first + ".index")   # max_to_keep=1, removed once committed
    ck.restore(second)
    np.testing.assert_array_equal(w.numpy(), [1, 1, 1])


def test_a_second_save_waits_for_the_first(tmp_path, held_writes):
    started, release = held_writes
    w = gs.Variable(np.zeros(3, np.float32))
    ck = gs.train.Checkpoint(w=w)
    first = ck.save(str(tmp_path / "ck"), options=ASYNC)
    assert started.wait(60)
    timer = threading.Timer(0.3, release.set)
    timer.start()
    w.assign(np.ones(3, np.float32))
    second = ck.save(str(tmp_path / "ck"))          # synchronous: waits, then writes
    assert os.path.exists(first + ".index") and os.path.exists(second + ".index")
    timer.join()
    ck.restore(first)
    np.testing.assert_array_equal(w.numpy(), [0, 0, 0])


def test_a_background_error_surfaces_at_the_next_call(tmp_path, monkeypatch):
    w = gs.Variable(np.zeros(3, np.float32))
    ck = gs.train.Checkpoint(w=w)
    manager = gs.train.CheckpointManager(ck, str(tmp_path))
    first = manager.save()

    def full(path, arrays):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fmt, "write_arrays", full)
    second = manager.save(options=ASYNC)
    with pytest.raises(RuntimeError, match=r"asynchronous save of checkpoint .*ckpt-2.* "
                                           r"failed: writing checkpoint .* failed on 1 of 1 "
                                           r"workers: worker 0: OSError.*No space left"):
        ck.sync()
    ck.sync()   # reported once
    assert manager.latest_checkpoint == first
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"] + sorted(
        os.path.basename(f) for f in (first + ".data", first + ".index",
                                      first + ".worker-0-of-1.npz"))
    monkeypatch.setattr(fmt, "write_arrays", full)
    manager.save(options=ASYNC)
    with pytest.raises(RuntimeError, match="No space left"):
        manager.save()   # the next save raises the previous one's error, saving nothing
    monkeypatch.undo()
    assert second.endswith("ckpt-2") and manager.save().endswith("ckpt-4")


def test_a_crash_before_the_background_commit_keeps_the_previous_checkpoint(
        tmp_path, monkeypatch):
    w = gs.Variable(np.zeros(2, np.float32))
    ck = gs.train.Checkpoint(w=w)
    manager = gs.train.CheckpointManager(ck, str(tmp_path))
    first = manager.save(options=ASYNC)
    ck.sync()
    w.assign(np.ones(2, np.float32))

    def crash():
        raise OSError("injected crash between the writes and the rename")
    monkeypatch.setattr(saving, "_before_commit", crash)
    manager.save(options=ASYNC)
    with pytest.raises(RuntimeError, match="committing checkpoint .*ckpt-2.* injected"):
        ck.restore(first)    # a restore waits for the save in flight first
    assert not os.path.exists(str(tmp_path / "ckpt-2.index"))
    assert gs.train.latest_checkpoint(str(tmp_path)) == first
    gs.train.Checkpoint(w=w).restore(first)
    np.testing.assert_array_equal(w.numpy(), [0, 0])


EXIT = r"""
import sys
import numpy as np
import gpustrat as gs
w = gs.Variable(np.arange(1 << 20, dtype=np.float32))
manager = gs.train.CheckpointManager(gs.train.Checkpoint(w=w), sys.argv[1])
manager.save(options=gs.train.CheckpointOptions(enable_async=True))
print("returned", flush=True)
"""


def test_the_end_of_the_program_finishes_a_save_in_flight(tmp_path):
    env = repo_env()
    out = subprocess.run([sys.executable, "-c", EXIT, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert out.returncode == 0 and "returned" in out.stdout, out
    latest = gs.train.latest_checkpoint(str(tmp_path))
    assert latest is not None and latest.endswith("ckpt-1"), os.listdir(tmp_path)
    w = gs.Variable(np.zeros(1 << 20, np.float32))
    gs.train.Checkpoint(w=w).restore(latest).assert_consumed()
    np.testing.assert_array_equal(w.numpy(), np.arange(1 << 20, dtype=np.float32))
