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


class _Linear(gs.optimizers.schedules.LearningRateSchedule):
    """0.01 * (step + 1)."""

    def __call__(self, step):
        return 0.01 * (step + 1)


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
    path = ck.write(str(tmp_path / "a"))
    other = gs.train.Checkpoint(w=gs.Variable(np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match=r"shape \(3,\).*shape \(2,\)"):
        other.restore(path)
    with pytest.raises(AssertionError, match="not in the checkpoint"):
        gs.train.Checkpoint(w=w, v=gs.Variable(1.0)).restore(path).assert_consumed()


def test_save_names_its_checkpoint_the_latest_and_restoring_none_restores_nothing(
        tmp_path):
    # TensorFlow's tutorial loop: restore(latest_checkpoint(dir)) at the start (None on
    # a fresh directory), then ckpt.save(prefix); a later job finds the last save.
    w = gs.Variable(np.zeros(2, np.float32), name="w")
    ck = gs.train.Checkpoint(w=w)
    status = ck.restore(gs.train.latest_checkpoint(str(tmp_path)))
    status.expect_partial()
    status.run_restore_ops()
    for check in (status.assert_consumed, status.assert_existing_objects_matched,
                  status.assert_nontrivial_match):
        with pytest.raises(AssertionError, match="save_path=None"):
            check()
    assert w.numpy().tolist() == [0, 0]
    prefix = str(tmp_path / "ckpt")
    first = ck.save(prefix)
    assert gs.train.latest_checkpoint(str(tmp_path)) == first == prefix + "-1"
    w.assign(np.ones(2, np.float32))
    second = ck.save(prefix)
    with open(tmp_path / "checkpoint") as f:
        assert json.load(f) == {"model_checkpoint_path": "ckpt-2",
                                "all_model_checkpoint_paths": ["ckpt-2"]}
    ck.write(str(tmp_path / "written"))     # write records nothing, as TensorFlow's
    assert gs.train.latest_checkpoint(str(tmp_path)) == second
    again = gs.train.Checkpoint(w=gs.Variable(np.zeros(2, np.float32), name="w"))
    again.restore(gs.train.latest_checkpoint(str(tmp_path))).assert_consumed()
    assert again.save_counter == 2 and again.w.numpy().tolist() == [1, 1]


def _values(*variables):
    return [v.numpy().tolist() for v in variables]


def test_a_restore_that_fails_a_check_restores_nothing(tmp_path):
    # 'b' (saved float32) into an int32 variable: the error used to come after 'a', the
    # optimizer and the numbers were restored, and named the variable, not the key.
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with s.scope():
            a = gs.Variable(np.float32([1.0, 2.0]), name="a")
            b = gs.Variable(np.float32([1.5]), name="b")
            opt = gs.optimizers.SGD(0.1, momentum=0.9)
            mean = gs.metrics.Mean()
        s.run(lambda: opt.apply_gradients([(np.float32([1.0, 1.0]), a)]))
        mean.update_state(np.float32(3.0))
        path = gs.train.Checkpoint(a=a, opt=opt, m=mean, b=b, step=7).save(
            str(tmp_path / "c"))
        with s.scope():
            a2 = gs.Variable(np.zeros(2, np.float32), name="a")
            b2 = gs.Variable(np.zeros(1, np.int32), name="bias")
            opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
            mean2 = gs.metrics.Mean()
        ck = gs.train.Checkpoint(a=a2, opt=opt2, m=mean2, b=b2, step=0)
        with pytest.raises(ValueError, match=r"variable 'b' has dtype int32, the checkpoint "
                                             r"holds dtype float32; nothing was restored"):
            ck.restore(path)
        assert _values(a2, b2) == [[0.0, 0.0], [0]]
        assert int(opt2.iterations) == 0 and float(mean2.result()) == 0.0
        assert ck.step == 0 and ck.save_counter == 0
        # The deferred slots were not taken either: a first step starts them at zero.
        s.run(lambda: opt2.apply_gradients([(np.float32([1.0, 1.0]), a2)]))
        np.testing.assert_allclose(opt2.get_slot(a2, "momentum").numpy(), [-0.2, -0.2],
                                   rtol=1e-6)   # -lr * (1 + 1): no saved momentum in it
    finally:
        s.close()


@pytest.mark.parametrize("saved, restored", [
    (np.float64, np.float32), (np.float32, np.float64), (np.float32, np.float16),
    (np.float32, np.int32), (np.int64, np.int32)])
def test_a_restore_never_casts(tmp_path, saved, restored):
    # As TensorFlow ("expected dtype half does not equal original dtype float"): it used
    # to cast, and a float32 70000 became inf in a float16 variable.
    path = gs.train.Checkpoint(c=gs.Variable(np.array([70000], saved))).write(
        str(tmp_path / "c"))
    c = gs.Variable(np.zeros(1, restored))
    with pytest.raises(ValueError, match=rf"variable 'c' has dtype {np.dtype(restored)}, "
                                         rf"the checkpoint holds dtype {np.dtype(saved)}"):
        gs.train.Checkpoint(c=c).restore(path)
    assert c.numpy().tolist() == [0]


def test_an_optimizer_saved_with_other_slots_is_refused_before_anything_is_written(tmp_path):
    # Adam(amsgrad=True) into an Adam() that has stepped used to restore the variable,
    # iterations and 'm' first; into a fresh one, 'vhat' was dropped without a word; the
    # hint said to use "the same optimizer class", which it was.
    w = gs.Variable(np.ones(2, np.float32), name="w")
    opt = gs.optimizers.Adam(0.1, amsgrad=True)
    for _ in range(3):
        opt.apply_gradients([(np.float32([1.0, -2.0]), w)])
    path = gs.train.Checkpoint(w=w, opt=opt, epoch=4).save(str(tmp_path / "c"))
    message = (r"checkpoint key 'opt': Adam 'Adam' keeps slots \['momentum', "
               r"'velocity'\], but the checkpoint holds slot 'velocity_hat' for variable "
               r"'w'.* \(it was saved with amsgrad=True; this optimizer has "
               r"amsgrad=False\): make the optimizer with the saved settings; nothing was "
               r"restored")
    w2 = gs.Variable(np.ones(2, np.float32), name="w")
    stepped = gs.optimizers.Adam(0.1)
    stepped.apply_gradients([(np.float32([0.5, 0.5]), w2)])
    before = _values(w2, stepped.get_slot(w2, "m"), stepped.get_slot(w2, "v"))
    ck = gs.train.Checkpoint(w=w2, opt=stepped, epoch=0)
    with pytest.raises(ValueError, match=message):
        ck.restore(path)
    assert _values(w2, stepped.get_slot(w2, "m"), stepped.get_slot(w2, "v")) == before
    assert int(stepped.iterations) == 1 and ck.epoch == 0
    w3 = gs.Variable(np.ones(2, np.float32), name="w")
    with pytest.raises(ValueError, match=message):
        gs.train.Checkpoint(w=w3, opt=gs.optimizers.Adam(0.1), epoch=0).restore(path)
    assert w3.numpy().tolist() == [1.0, 1.0]


def test_a_slot_the_checkpoint_lacks_starts_at_zero(tmp_path):
    # Adam() restored into an Adam(amsgrad=True) that has stepped: 'vhat' restarts, as a
    # fresh optimizer's would, instead of keeping this run's running maximum.
    w = gs.Variable(np.ones(2, np.float32), name="w")
    opt = gs.optimizers.Adam(0.1)
    opt.apply_gradients([(np.float32([1.0, -2.0]), w)])
    path = gs.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "c"))
    w2 = gs.Variable(np.ones(2, np.float32), name="w")
    ams = gs.optimizers.Adam(0.1, amsgrad=True)
    ams.apply_gradients([(np.float32([9.0, 9.0]), w2)])
    gs.train.Checkpoint(w=w2, opt=ams).restore(path).assert_consumed()
    assert ams.get_slot(w2, "vhat").numpy().tolist() == [0.0, 0.0]
    np.testing.assert_array_equal(ams.get_slot(w2, "v").numpy(), opt.get_slot(w, "v").numpy())


def test_a_metric_of_another_dtype_is_refused(tmp_path):
    m = gs.metrics.Mean()
    m.update_state(np.float32(2.0))
    path = gs.train.Checkpoint(m=m).write(str(tmp_path / "c"))
    m64 = gs.metrics.Mean(dtype=np.float64)
    m64.update_state(5.0)
    with pytest.raises(ValueError, match=r"checkpoint key 'm': metric 'mean': the "
                                         r"checkpoint's 'mean/total' is float32 .* "
                                         r"dtype='float32'"):
        gs.train.Checkpoint(m=m64).restore(path)
    assert float(m64.result()) == 5.0


def test_a_failed_position_restore_restores_no_variable(tmp_path):
    # The per-worker positions are restored before the shared objects are written.
    w = gs.Variable(np.float32([1.0]), name="w")
    it = iter(gs.data.Dataset.range(10).batch(2))
    next(it)
    path = gs.train.Checkpoint(w=w, it=it, step=3).write(str(tmp_path / "c"))
    w2 = gs.Variable(np.float32([0.0]), name="w")
    other = iter(gs.data.Dataset.range(10).map(lambda x: x).batch(3))
    ck = gs.train.Checkpoint(w=w2, it=other, step=0)
    with pytest.raises(RuntimeError, match=r"per-worker state .* were not restored"):
        ck.restore(path)
    assert w2.numpy().tolist() == [0.0] and ck.step == 0


def _two_unnamed(strategy):
    with strategy.scope():
        a = gs.Variable(np.ones(3, np.float32))      # both called "Variable"
        b = gs.Variable(np.ones(3, np.float32))
        opt = gs.optimizers.SGD(0.1, momentum=0.9)
    return a, b, opt


@pytest.mark.parametrize("stepped", [False, True])
def test_slots_belong_to_the_variable_at_the_same_key_not_of_the_same_name(tmp_path, stepped):
    # Slots used to be saved by variable name: b's momentum went to a, b got none, and
    # assert_consumed() passed. TensorFlow resumes exactly (the uninterrupted run's
    # values below are TensorFlow's too: a = b = 1 - 0.1 * [2, -10] * (1 + 0.9) ...).
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        a, b, opt = _two_unnamed(s)
        s.run(lambda: opt.apply_gradients([(np.full(3, 1.0, np.float32), a),
                                           (np.full(3, -5.0, np.float32), b)]))
        path = gs.train.Checkpoint(a=a, b=b, opt=opt).save(str(tmp_path / "c"))
        a2, b2, opt2 = _two_unnamed(s)
        if stepped:   # slots exist: written at the restore; else when the step makes them
            s.run(lambda: opt2.apply_gradients([(np.ones(3, np.float32), b2),
                                                (np.ones(3, np.float32), a2)]))
        gs.train.Checkpoint(a=a2, b=b2, opt=opt2).restore(path).assert_consumed()
        z = np.zeros(3, np.float32)
        for o, x, y in ((opt, a, b), (opt2, a2, b2)):
            s.run(lambda o=o, x=x, y=y: o.apply_gradients([(z, x), (z, y)]))
        np.testing.assert_allclose(a.numpy(), [0.62] * 3, rtol=1e-6)
        np.testing.assert_allclose(b.numpy(), [2.9] * 3, rtol=1e-6)
        np.testing.assert_array_equal(a2.numpy(), a.numpy())
        np.testing.assert_array_equal(b2.numpy(), b.numpy())
        np.testing.assert_array_equal(opt2.get_slot(b2, "momentum").numpy(),
                                      opt.get_slot(b, "momentum").numpy())
    finally:
        s.close()


class _Layer:
    def __init__(self, n):
        self.kernel = gs.Variable(np.ones(n, np.float32), name="kernel")
        self.bias = gs.Variable(np.zeros(n, np.float32), name="bias")


def test_a_model_of_layers_with_the_same_names_resumes_exactly(tmp_path):
    def make():
        layers = [_Layer(2), _Layer(2)]
        return layers, gs.optimizers.Adam(0.1)

    def step(layers, opt, scale):
        opt.apply_gradients([(np.float32([scale * (i + 1), -1.0]), v)
                             for i, layer in enumerate(layers)
                             for v in (layer.kernel, layer.bias)])

    layers, opt = make()
    step(layers, opt, 1.0)
    path = gs.train.Checkpoint(model={"layers": layers}, optimizer=opt).write(
        str(tmp_path / "c"))
    index = json.load(open(path + ".index"))
    keys = [k for k, _ in index["objects"]["optimizer"]["tree"]["__dict__"]]
    assert keys == ["iterations", "learning_rate", "config", "variable_slots",
                    "named_slots"]
    layers2, opt2 = make()
    gs.train.Checkpoint(model={"layers": layers2}, optimizer=opt2).restore(path)
    for ls, o in ((layers, opt), (layers2, opt2)):
        step(ls, o, 3.0)
    for l1, l2 in zip(layers, layers2):
        np.testing.assert_array_equal(l2.kernel.numpy(), l1.kernel.numpy())
        np.testing.assert_array_equal(l2.bias.numpy(), l1.bias.numpy())


def test_slots_of_variables_the_checkpoint_does_not_hold_go_by_unique_names(tmp_path):
    # Without the variables the slots can only go by name: two of one name are refused
    # when saving, distinct names restore (when the first step makes the slots).
    a, b = gs.Variable(np.ones(2, np.float32)), gs.Variable(np.ones(2, np.float32))
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.float32([1.0, 1.0]), a), (np.float32([2.0, 2.0]), b)])
    with pytest.raises(RuntimeError, match=r"SGD 'SGD' has slots for 2 variables named "
                                         r"'Variable' that this Checkpoint does not hold.* "
                                         r"nothing was saved: put the variables in the "
                                         r"Checkpoint too"):
        gs.train.Checkpoint(opt=opt).write(str(tmp_path / "c"))
    assert not os.path.exists(str(tmp_path / "c.index"))
    u, v = gs.Variable(np.ones(2, np.float32), name="u"), gs.Variable(np.ones(2, np.float32),
                                                                      name="v")
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.float32([1.0, 1.0]), u), (np.float32([2.0, 2.0]), v)])
    path = gs.train.Checkpoint(opt=opt).write(str(tmp_path / "d"))
    u2, v2 = gs.Variable(np.ones(2, np.float32), name="u"), gs.Variable(np.ones(2, np.float32),
                                                                        name="v")
    opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
    gs.train.Checkpoint(opt=opt2).restore(path).assert_consumed()
    opt2.apply_gradients([(np.zeros(2, np.float32), v2), (np.zeros(2, np.float32), u2)])
    np.testing.assert_allclose(opt2.get_slot(v2, "momentum").numpy(), [-0.18, -0.18],
                               rtol=1e-6)    # 0.9 * -0.2
    np.testing.assert_allclose(opt2.get_slot(u2, "momentum").numpy(), [-0.09, -0.09],
                               rtol=1e-6)
    # A third "u" would take slots that belong to one variable called so: refused, before
    # its step writes anything.
    u3 = gs.Variable(np.ones(2, np.float32), name="u")
    with pytest.raises(ValueError, match=r"slots for a variable named 'u' by its name.* 2 "
                                         r"variables here are called 'u'"):
        opt2.apply_gradients([(np.ones(2, np.float32), u3)])
    assert u3.numpy().tolist() == [1.0, 1.0]


def test_a_checkpoint_with_slots_by_name_restores_them_unless_names_collide(tmp_path,
                                                                            monkeypatch):
    # Checkpoints written before slots were keyed by the variables' keys kept them by
    # variable name (``slots``): they still restore, and refuse where names collide.
    def old_state(self, keys=None):
        return {"iterations": self._iterations,
                "slots": {v.name: dict(made) for v, made in self._slots.items()}}

    a, b = gs.Variable(np.ones(2, np.float32), name="a"), gs.Variable(np.ones(2, np.float32))
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.float32([1.0, 1.0]), a), (np.float32([2.0, 2.0]), b)])
    with monkeypatch.context() as m:
        m.setattr(gs.optimizers.Optimizer, "_checkpoint_state", old_state)
        path = gs.train.Checkpoint(x=a, y=b, opt=opt).write(str(tmp_path / "old"))
    a2, b2 = gs.Variable(np.ones(2, np.float32), name="a"), gs.Variable(np.ones(2, np.float32))
    opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
    gs.train.Checkpoint(x=a2, y=b2, opt=opt2).restore(path).assert_consumed()
    opt2.apply_gradients([(np.zeros(2, np.float32), a2), (np.zeros(2, np.float32), b2)])
    np.testing.assert_allclose(opt2.get_slot(a2, "momentum").numpy(), [-0.09] * 2, rtol=1e-6)
    np.testing.assert_allclose(opt2.get_slot(b2, "momentum").numpy(), [-0.18] * 2, rtol=1e-6)
    # Two variables called "Variable" here: the saved slots of "Variable" could be either's.
    c2 = gs.Variable(np.ones(2, np.float32))
    opt3 = gs.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"checkpoint key 'opt': .* named 'Variable' by its "
                                         r"name .* 2 variables here are called 'Variable'.* "
                                         r"nothing was restored"):
        gs.train.Checkpoint(x=a2, y=b2, z=c2, opt=opt3).restore(path)
    assert int(opt3.iterations) == 0


def test_slots_waiting_for_their_variable_are_checked_before_the_step_writes(tmp_path):
    u = gs.Variable(np.ones(2, np.float32), name="u")
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.float32([1.0, 1.0]), u)])
    path = gs.train.Checkpoint(opt=opt).write(str(tmp_path / "c"))
    opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
    gs.train.Checkpoint(opt=opt2).restore(path)
    wide = gs.Variable(np.ones(3, np.float32), name="u")
    with pytest.raises(ValueError, match=r"slot 'momentum' of variable 'u' is float32 of "
                                         r"shape \(2,\), but the variable is float32 of "
                                         r"shape \(3,\)"):
        opt2.apply_gradients([(np.ones(3, np.float32), wide)])
    assert wide.numpy().tolist() == [1.0] * 3 and int(opt2.iterations) == 1


def test_the_learning_rate_set_between_steps_is_saved(tmp_path):
    # As Keras 3, which saves its learning-rate variable: the restored optimizer used to
    # keep its constructor's rate.
    v = gs.Variable(np.ones(2, np.float32), name="v")
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    opt.apply_gradients([(np.ones(2, np.float32), v)])
    opt.learning_rate = 0.5
    path = gs.train.Checkpoint(v=v, opt=opt).write(str(tmp_path / "c"))
    v2 = gs.Variable(np.ones(2, np.float32), name="v")
    opt2 = gs.optimizers.SGD(0.1, momentum=0.9)
    gs.train.Checkpoint(v=v2, opt=opt2).restore(path).assert_consumed()
    assert opt2.learning_rate == 0.5
    for o, w in ((opt, v), (opt2, v2)):
        o.apply_gradients([(np.ones(2, np.float32), w)])
    np.testing.assert_array_equal(v2.numpy(), v.numpy())
    # A schedule keeps giving its own rates; a checkpoint of a schedule saves none.
    scheduled = gs.optimizers.SGD(_Linear(), momentum=0.9)
    gs.train.Checkpoint(v=v2, opt=scheduled).restore(path)
    assert scheduled.learning_rate == pytest.approx(0.02)       # step 1 of the schedule
    path = gs.train.Checkpoint(v=v2, opt=scheduled).write(str(tmp_path / "s"))
    plain = gs.optimizers.SGD(0.3, momentum=0.9)
    gs.train.Checkpoint(v=v2, opt=plain).restore(path)
    assert plain.learning_rate == 0.3


def test_a_checkpoint_without_a_learning_rate_keeps_the_optimizers(tmp_path, monkeypatch):
    v = gs.Variable(np.ones(2, np.float32), name="v")
    opt = gs.optimizers.SGD(0.1)
    opt.learning_rate = 0.5
    real = gs.optimizers.Optimizer._checkpoint_state

    def older(self, keys=None):      # as written before the rate was saved
        state = real(self, keys)
        del state["learning_rate"]
        return state
    with monkeypatch.context() as m:
        m.setattr(gs.optimizers.Optimizer, "_checkpoint_state", older)
        path = gs.train.Checkpoint(v=v, opt=opt).write(str(tmp_path / "c"))
    opt2 = gs.optimizers.SGD(0.2)
    gs.train.Checkpoint(v=v, opt=opt2).restore(path).assert_consumed()
    assert opt2.learning_rate == 0.2
