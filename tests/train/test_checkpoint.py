"""gs.train.Checkpoint / CheckpointManager on one worker: variables, optimizers, metrics,
numbers, the file format (NumPy alone), max_to_keep, and a crash before the commit."""

import json
import os

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.train import saving as ckpt_mod


def _train_state(strategy):
    with strategy.scope():
        w = gs.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), name="w")
        c = gs.Variable(np.float32(0.0), name="count",
                        synchronization=gs.VariableSynchronization.ON_READ,
                        aggregation=gs.VariableAggregation.SUM)
        opt = gs.optimizers.Adam(0.1)
        metric = gs.metrics.Mean()
    return w, c, opt, metric


def _step(strategy, w, opt, metric, c):
    def fn():
        opt.apply_gradients([(np.ones((2, 3), np.float32), w)])
        metric.update_state(np.float32(2.0))
        c.assign_add(np.float32(1.0))
    strategy.run(fn)


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_save_restore_roundtrip_all_kinds(tmp_path, devices):
    strategy = gs.MirroredStrategy(devices)
    w, c, opt, metric = _train_state(strategy)
    _step(strategy, w, opt, metric, c)
    ck = gs.train.Checkpoint(w=w, count=c, optimizer=opt, metric=metric, step=7, lr=0.5)
    path = ck.save(str(tmp_path / "ckpt"))
    assert path == str(tmp_path / "ckpt-1")
    saved_w, saved_m = w.numpy(), opt.get_slot(w, "m").numpy()
    saved_result, saved_count = float(metric.result()), float(c.numpy())
    assert saved_count == len(devices)
    _step(strategy, w, opt, metric, c)
    assert not np.array_equal(w.numpy(), saved_w)

    ck.step = 99
    ck.restore(path).assert_consumed()
    np.testing.assert_array_equal(w.numpy(), saved_w)
    np.testing.assert_array_equal(opt.get_slot(w, "m").numpy(), saved_m)
    assert int(opt.iterations.numpy()) == 1
    assert float(metric.result()) == saved_result
    assert float(c.numpy()) == saved_count
    assert ck.step == 7 and ck.lr == 0.5 and ck.save_counter == 1
    # A restored optimizer continues exactly as the original would have.
    _step(strategy, w, opt, metric, c)
    after = w.numpy()
    ck.restore(path)
    w2, c2, opt2, metric2 = _train_state(strategy)
    ck2 = gs.train.Checkpoint(w=w2, count=c2, optimizer=opt2, metric=metric2, step=0, lr=0.)
    ck2.restore(path)   # slots restored before the first step: deferred to their creation
    _step(strategy, w2, opt2, metric2, c2)
    np.testing.assert_allclose(w2.numpy(), after, rtol=0, atol=0)


def test_files_start_with_path_and_are_readable_with_numpy(tmp_path):
    w = gs.Variable(np.array([1.5, 2.5], np.float64), name="w")
    ck = gs.train.Checkpoint(w=w, epoch=3)
    path = ck.write(str(tmp_path / "model"))
    files = sorted(os.listdir(tmp_path))
    assert files == ["model.data", "model.index", "model.worker-0-of-1.npz"]
    index = json.load(open(path + ".index"))
    assert index["format"] == "gpustrat-checkpoint" and index["num_workers"] == 1
    key = index["objects"]["w"]["tree"]["__array__"]
    with open(path + ".data", "rb") as f:
        f.seek(index["array_offsets"][key])
        np.testing.assert_array_equal(np.load(f), [1.5, 2.5])
    assert index["objects"]["epoch"]["tree"] == 3
    assert ck.save_counter == 0


def test_manager_keeps_max_to_keep_whole_checkpoints(tmp_path):
    w = gs.Variable(np.zeros(3, np.float32), name="w")
    ck = gs.train.Checkpoint(w=w)
    m = gs.train.CheckpointManager(ck, str(tmp_path), max_to_keep=2)
    assert m.latest_checkpoint is None
    paths = []
    for i in range(4):
        w.assign(np.full(3, i, np.float32))
        paths.append(m.save())
    assert paths == [str(tmp_path / f"ckpt-{i}") for i in range(1, 5)]
    assert m.checkpoints == paths[-2:] and m.latest_checkpoint == paths[-1]
    left = sorted(os.listdir(tmp_path))
    assert not [f for f in left if f.startswith(("ckpt-1.", "ckpt-2."))], left
    assert gs.train.latest_checkpoint(str(tmp_path)) == paths[-1]
    # A new manager (a restarted job) finds them; restore gives the last value.
    m2 = gs.train.CheckpointManager(gs.train.Checkpoint(w=w), str(tmp_path), max_to_keep=2)
    assert m2.checkpoints == paths[-2:]
    ck.restore(m2.latest_checkpoint)
    np.testing.assert_array_equal(w.numpy(), [3, 3, 3])
    assert ck.save_counter == 4
    assert m.save(checkpoint_number=100).endswith("ckpt-100")


def test_crash_before_commit_leaves_previous_checkpoint(tmp_path, monkeypatch):
    w = gs.Variable(np.zeros(2, np.float32), name="w")
    ck = gs.train.Checkpoint(w=w)
    m = gs.train.CheckpointManager(ck, str(tmp_path))
    first = m.save()
    w.assign(np.ones(2, np.float32))

    def crash():
        raise KeyboardInterrupt("injected crash between the writes and the rename")
    monkeypatch.setattr(ckpt_mod, "_before_commit", crash)
    with pytest.raises(KeyboardInterrupt):
        m.save()
    monkeypatch.setattr(ckpt_mod, "_before_commit", None)
    assert not os.path.exists(str(tmp_path / "ckpt-2.index"))
    restarted = gs.train.CheckpointManager(gs.train.Checkpoint(w=w), str(tmp_path))
    assert restarted.latest_checkpoint == first
    gs.train.Checkpoint(w=w).restore(first)
    np.testing.assert_array_equal(w.numpy(), [0, 0])


def test_a_damaged_data_file_is_an_error_that_restores_nothing(tmp_path):
    # A flipped bit in a variable's bytes used to be restored as it was.
    w = gs.Variable(np.arange(6, dtype=np.float32), name="w")
    path = gs.train.Checkpoint(w=w, epoch=3).write(str(tmp_path / "model"))
    index = json.load(open(path + ".index"))
    key = index["objects"]["w"]["tree"]["__array__"]
    assert set(index["array_crc32"]) == set(index["array_offsets"])
    start = index["array_offsets"][key]
    end = min([o for o in index["array_offsets"].values() if o > start],
              default=os.path.getsize(path + ".data"))
    with open(path + ".data", "r+b") as f:
        at = end - 7  # within the array's 24 bytes, which end its record
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    w2 = gs.Variable(np.zeros(6, np.float32), name="w")
    ck = gs.train.Checkpoint(w=w2, epoch=0)
    with pytest.raises(RuntimeError, match=rf"model.data' is damaged: the bytes of {key!r} "
                                           r"do not match the checksum.*restore an earlier"):
        ck.restore(path)
    np.testing.assert_array_equal(w2.numpy(), np.zeros(6))
    assert ck.epoch == 0
    # A checkpoint written before checksums were kept restores unchecked.
    del index["array_crc32"]
    with open(path + ".index", "w") as f:
        json.dump(index, f)
    ck.restore(path)
    assert ck.epoch == 3


def test_clear_errors(tmp_path):
    w = gs.Variable(np.zeros(2, np.float32), name="w")
    with pytest.raises(TypeError, match="cannot save thing=object"):
        gs.train.Checkpoint(thing=object())
    ck = gs.train.Checkpoint(w=w)
    with pytest.raises(RuntimeError, match="no checkpoint at"):
        ck.restore(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="save_path is None"):
        ck.restore(None)
    path = ck.write(str(tmp_path / "a"))
    other = gs.train.Checkpoint(w=gs.Variable(np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(2,\)"):
        other.restore(path)
    with pytest.raises(AssertionError, match="not in the checkpoint"):
        gs.train.Checkpoint(w=w, v=gs.Variable(1.0)).restore(path).assert_consumed()
