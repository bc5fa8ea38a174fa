"""Deferred restores on one worker: saved values the restoring graph lacks go to objects
attached or made later, at the status's methods and the Checkpoint's next save or
restore, all or nothing, never over a value written since the restore."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import gpustrat as gs


class Lazy:
    def __init__(self):
        self.layers = []

    def build(self, dtype=np.float32):
        self.w = gs.Variable(np.zeros(2, dtype), name="w")
        self.layers.append(gs.Variable(np.zeros(1, np.float32), name="b"))


def _saved(tmp_path, **extra):
    m = Lazy()
    m.build()
    m.w.assign(np.float32([3, 4]))
    m.layers[0].assign(np.float32([5]))
    return gs.train.Checkpoint(model=m, **extra).save(str(tmp_path / "c")), m


def test_a_model_without_variables_takes_them_at_the_next_save(tmp_path):
    path, _ = _saved(tmp_path, epoch=7)
    m = Lazy()
    ck = gs.train.Checkpoint(model=m)
    status = ck.restore(path)           # was a TypeError: 'model' holds no savable
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match=r"saved objects not restored \['epoch', "
                       r"'model/layers/0', 'model/w'\]"):
        status.assert_consumed()
    m.build()
    ck.epoch = 0
    out = ck.save(str(tmp_path / "again"))   # restores first, then saves
    assert m.w.numpy().tolist() == [3, 4] and m.layers[0].numpy().tolist() == [5]
    assert ck.epoch == 7
    status.assert_consumed()
    back = gs.train.Checkpoint(model=Lazy(), epoch=0)
    back.model.build()
    back.restore(out).assert_consumed()
    assert back.model.w.numpy().tolist() == [3, 4]


def test_run_restore_ops_and_a_nested_checkpoint_attached_later(tmp_path):
    path, _ = _saved(tmp_path)
    ck = gs.train.Checkpoint()
    status = ck.restore(path)
    with pytest.raises(AssertionError, match="nothing of the checkpoint was restored"):
        status.assert_nontrivial_match()
    m = Lazy()
    m.build()
    ck.model = m
    assert status.run_restore_ops() is None
    assert m.layers[0].numpy().tolist() == [5]
    status.assert_nontrivial_match().assert_consumed()


def test_a_variable_written_before_its_deferred_restore_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    m = Lazy()
    status = gs.train.Checkpoint(model=m).restore(path)
    m.build()
    m.layers[0].assign(np.float32([9]))     # a step trained it first
    with pytest.raises(ValueError, match=r"'model/layers/0': this variable was attached "
                       r"after the restore .* written before its saved value"):
        status.assert_consumed()
    # All or nothing: w was not restored either.
    assert m.w.numpy().tolist() == [0, 0] and m.layers[0].numpy().tolist() == [9]


def test_a_write_that_bypasses_assign_is_seen_too(tmp_path):
    path, _ = _saved(tmp_path)
    m = Lazy()
    ck = gs.train.Checkpoint(model=m)
    ck.restore(path)
    m.build()
    opt = gs.optimizers.SGD(0.5)
    opt.apply_gradients([(np.ones(2, np.float32), m.w)])   # the optimizer's own step
    with pytest.raises(ValueError, match=r"'model/w': this variable was attached"):
        ck.save(str(tmp_path / "x"))
    assert not os.path.exists(str(tmp_path / "x-1.index"))


def test_a_deferred_restore_never_casts_and_restores_nothing_on_a_mismatch(tmp_path):
    path, _ = _saved(tmp_path)
    m = Lazy()
    status = gs.train.Checkpoint(model=m).restore(path)
    m.build(dtype=np.float16)
    with pytest.raises(ValueError, match=r"variable 'model/w' has dtype float16, the "
                       r"checkpoint holds dtype float32; nothing was restored"):
        status.expect_partial()
    assert m.layers[0].numpy().tolist() == [0]


def test_optimizer_slots_reach_variables_made_after_the_restore(tmp_path):
    m = Lazy()
    m.build()
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    grads = lambda: [(np.float32([1, 2]), m.w), (np.float32([3]), m.layers[0])]  # noqa
    opt.apply_gradients(grads())
    path = gs.train.Checkpoint(model=m, opt=opt).save(str(tmp_path / "c"))
    opt.apply_gradients(grads())
    expected = [m.w.numpy().tolist(), m.layers[0].numpy().tolist()]

    m2 = Lazy()
    opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
    status = gs.train.Checkpoint(model=m2, opt=opt2).restore(path)
    m2.build()
    status.assert_consumed()
    opt2.apply_gradients([(np.float32([1, 2]), m2.w), (np.float32([3]), m2.layers[0])])
    assert [m2.w.numpy().tolist(), m2.layers[0].numpy().tolist()] == expected
    assert int(opt2.iterations) == 2


def test_an_iterator_attached_later_takes_its_position(tmp_path):
    it = iter(gs.data.Dataset.range(10))
    next(it), next(it), next(it)
    v = gs.Variable(np.float32(1))
    path = gs.train.Checkpoint(v=v, data=[it]).save(str(tmp_path / "c"))
    holder = []
    ck = gs.train.Checkpoint(v=gs.Variable(np.float32(0)), data=holder)
    status = ck.restore(path)
    holder.append(iter(gs.data.Dataset.range(10)))
    status.assert_consumed()
    assert int(next(holder[0])) == 3


def test_a_later_restore_replaces_what_an_earlier_one_left_pending(tmp_path):
    path, first = _saved(tmp_path)
    first.layers[0].assign(np.float32([6]))
    second = gs.train.Checkpoint(model=first).save(str(tmp_path / "d"))
    m = Lazy()
    ck = gs.train.Checkpoint(model=m)
    old = ck.restore(path)
    new = ck.restore(second)
    m.build()
    new.assert_consumed()
    assert m.layers[0].numpy().tolist() == [6]
    with pytest.raises(AssertionError):
        old.assert_consumed()   # its values were dropped by the later restore


def test_manager_arguments_as_tensorflow(tmp_path):
    ck = gs.train.Checkpoint(v=gs.Variable(np.float32(0)))
    with pytest.raises(TypeError, match="checkpoint_name is the fifth argument"):
        gs.train.CheckpointManager(ck, str(tmp_path), 3, "ckpt")
    with pytest.raises(ValueError, match="step_counter must be given with "
                       "checkpoint_interval"):
        gs.train.CheckpointManager(ck, str(tmp_path), 3, checkpoint_interval=5)
    mgr = gs.train.CheckpointManager(ck, str(tmp_path), 3, checkpoint_name="model")
    assert mgr.restore_or_initialize() is None and mgr.latest_checkpoint is None
    path = mgr.save()
    state = json.load(open(tmp_path / "checkpoint"))
    assert sorted(state) == ["all_model_checkpoint_paths", "all_model_checkpoint_timestamps",
                             "last_preserved_timestamp", "model_checkpoint_path"]
    assert state["model_checkpoint_path"] == "model-1"
    assert len(state["all_model_checkpoint_timestamps"]) == 1
    assert mgr.restore_or_initialize() == path == gs.train.latest_checkpoint(str(tmp_path))


def test_a_state_file_without_times_keeps_its_checkpoints(tmp_path):
    ck = gs.train.Checkpoint(v=gs.Variable(np.float32(0)))
    mgr = gs.train.CheckpointManager(ck, str(tmp_path), 2)
    mgr.save(), mgr.save()
    state = tmp_path / "checkpoint"
    old = json.load(open(state))
    json.dump({k: old[k] for k in ("model_checkpoint_path", "all_model_checkpoint_paths")},
              open(state, "w"))
    again = gs.train.CheckpointManager(ck, str(tmp_path), 2)
    assert [os.path.basename(p) for p in again.checkpoints] == ["ckpt-1", "ckpt-2"]
    again.save()
    assert not os.path.exists(str(tmp_path / "ckpt-1.index"))
