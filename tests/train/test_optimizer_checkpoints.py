"""Checkpoints of RMSprop, Adagrad, Nadam, Adamax and Adadelta (with clipping and weight
decay on) under two mirrored replicas: a run resumed from a checkpoint ends where an
uninterrupted one does, and a restore into an optimizer that keeps other slots is
refused before anything is written."""

import numpy as np
import pytest

import gpustrat as gs

OPTIMIZERS = {
    "rmsprop": lambda: gs.optimizers.RMSprop(0.05, momentum=0.5, centered=True,
                                             clipnorm=0.5, weight_decay=0.1),
    "adagrad": lambda: gs.optimizers.Adagrad(0.1, clipvalue=0.3, weight_decay=0.1),
    "nadam": lambda: gs.optimizers.Nadam(0.05, global_clipnorm=0.5),
    "adamax": lambda: gs.optimizers.Adamax(0.05, weight_decay=0.1),
    "adadelta": lambda: gs.optimizers.Adadelta(1.0, clipnorm=0.5),
}


def _setup(strategy, which):
    with strategy.scope():
        w = gs.Variable(np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2), name="w")
        b = gs.Variable(np.zeros(2, np.float32), name="b")
        opt = OPTIMIZERS[which]()
    return w, b, opt


def _train(strategy, w, b, opt, steps, start):
    def fn(k):
        r = gs.get_replica_context().replica_id_in_sync_group
        gw = np.float32(np.sin(np.arange(6) + k + r)).reshape(3, 2) * np.float32(w.value())
        gb = np.float32([0.3, -0.2]) * (k + 1 + r)
        opt.apply_gradients([(gw, w), (gb, b)])
    for k in range(start, start + steps):
        strategy.run(fn, args=(k,))


def _state(w, b, opt):
    return [w.numpy(), b.numpy()] + [opt.get_slot(v, s).numpy()
                                     for v in (w, b) for s in opt.slot_names]


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path, which):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        w, b, opt = _setup(s, which)
        _train(s, w, b, opt, 3, 0)
        path = gs.train.Checkpoint(w=w, b=b, opt=opt).write(str(tmp_path / "c"))
        _train(s, w, b, opt, 3, 3)
        want = _state(w, b, opt)
    finally:
        s.close()
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        w, b, opt = _setup(s, which)
        gs.train.Checkpoint(w=w, b=b, opt=opt).restore(path).assert_consumed()
        assert int(opt.iterations) == 3
        _train(s, w, b, opt, 3, 3)
        got = _state(w, b, opt)
        for v in (w, b):         # every replica holds the same values
            comps = [np.asarray(c) for c in s.experimental_local_results(v)]
            np.testing.assert_array_equal(comps[0], comps[1])
    finally:
        s.close()
    assert int(opt.iterations) == 6
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g, e)


def test_adagrad_accumulators_start_at_the_initial_value():
    w = gs.Variable(np.ones(2, np.float32), name="w")
    opt = gs.optimizers.Adagrad(0.1, initial_accumulator_value=0.25)
    opt.apply_gradients([(np.float32([1.0, 2.0]), w)])
    np.testing.assert_allclose(opt.get_slot(w, "accumulator").numpy(), [1.25, 4.25])


@pytest.mark.parametrize("saved, restoring, message", [
    (lambda: gs.optimizers.RMSprop(0.1, centered=True),
     lambda: gs.optimizers.RMSprop(0.1, momentum=0.5),
     r"keeps slots \['velocity', 'momentum'\], but the checkpoint holds slot "
     r"'average_gradient'.*saved with momentum=0.0, centered=True; this optimizer has "
     r"momentum=0.5, centered=False"),
    (lambda: gs.optimizers.Adagrad(0.1), lambda: gs.optimizers.RMSprop(0.1),
     "saved from class Adagrad, but this Checkpoint has class RMSprop"),
    (lambda: gs.optimizers.Nadam(0.1), lambda: gs.optimizers.Adam(0.1),
     "saved from class Nadam, but this Checkpoint has class Adam"),
])
def test_a_restore_into_other_slots_is_refused_before_anything_is_written(
        tmp_path, saved, restoring, message):
    w = gs.Variable(np.ones(2, np.float32), name="w")
    opt = saved()
    for _ in range(2):
        opt.apply_gradients([(np.float32([1.0, -2.0]), w)])
    path = gs.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "c"))
    w2 = gs.Variable(np.full(2, 5.0, np.float32), name="w")
    other = restoring()
    other.apply_gradients([(np.float32([0.5, 0.5]), w2)])
    before = [w2.numpy()] + [other.get_slot(w2, s).numpy() for s in other.slot_names]
    with pytest.raises(ValueError, match=message + ".*nothing was restored"):
        gs.train.Checkpoint(w=w2, opt=other).restore(path)
    after = [w2.numpy()] + [other.get_slot(w2, s).numpy() for s in other.slot_names]
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert int(other.iterations) == 1
