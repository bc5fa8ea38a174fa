"""Optimizers under strategies against a plain NumPy reference: the same weights on 1,
2 and 3 replicas (partial batches included), and errors."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from training_cases import OPTIMIZERS, reference, train

RTOL, ATOL = 2e-5, 2e-6


def assert_matches(got, want, what):
    ws, bs, iterations = got
    w_ref, b_ref, steps = want
    assert iterations == steps
    for c in ws:
        np.testing.assert_allclose(c, w_ref, rtol=RTOL, atol=ATOL, err_msg=what)
    for c in bs:
        np.testing.assert_allclose(c, b_ref, rtol=RTOL, atol=ATOL, err_msg=what)


class _Seen(gs.optimizers.schedules.LearningRateSchedule):
    """0.1 at every step, each step it is asked for appended to ``seen``."""

    def __init__(self, seen: list):
        self.seen = seen

    def __call__(self, step):
        self.seen.append(step)
        return 0.1


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_same_weights_as_numpy_on_any_replica_count(which, n):
    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    try:
        got = train(strategy, which)
    finally:
        strategy.close()
    want = reference(which)
    if which.endswith("float16"):
        # Rounding happens to each replica's share: compare loosely, and check that
        # compression changed nothing but the rounding.
        ws, bs, _ = got
        np.testing.assert_allclose(ws[0], want[0], rtol=2e-2, atol=2e-3)
        return
    assert_matches(got, want, f"{which} on {n} replica(s)")


def test_training_moved_the_weights():
    w_ref, _, _ = reference("adam")
    _, _, w0, _ = __import__("training_cases").data()
    assert np.abs(w_ref - w0).max() > 0.1


def test_one_fused_reduction_per_step(monkeypatch):
    from gpustrat.collectives import host
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    calls = []
    for name in ("all_reduce_inplace", "all_reduce_shared"):
        def counting(self, buffers, op, real=getattr(host.HostCommunicator, name)):
            calls.append(len(buffers))
            return real(self, buffers, op)
        monkeypatch.setattr(host.HostCommunicator, name, counting)
    try:
        with strategy.scope():
            vs = [gs.Variable(np.zeros(5, np.float32)) for _ in range(20)]
            opt = gs.optimizers.SGD(0.1)
        strategy.run(lambda: opt.apply_gradients(
            [(np.ones(5, np.float32), v) for v in vs]))
    finally:
        strategy.close()
    assert calls == [2]            # one collective for the 20 gradients of 2 replicas
    assert all(np.allclose(np.asarray(v), -0.2) for v in vs)   # summed over 2 replicas


def test_plain_variables_without_a_strategy():
    v = gs.Variable([1.0, 2.0])
    opt = gs.optimizers.SGD(0.5, momentum=0.5)
    opt.apply_gradients([(np.array([1.0, 1.0], np.float32), v)])
    opt.apply_gradients([(np.array([1.0, 1.0], np.float32), v)])
    # m = -0.5, then m = -0.25 - 0.5 = -0.75
    np.testing.assert_allclose(v.numpy(), [1.0 - 1.25, 2.0 - 1.25])
    assert int(opt.iterations) == 2
    np.testing.assert_allclose(opt.get_slot(v, "momentum").numpy(), [-0.75, -0.75])


def test_cross_replica_apply_takes_the_gradient_as_summed():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            v = gs.Variable([1.0])
            opt = gs.optimizers.SGD(0.5)
            opt.apply_gradients([(np.array([2.0], np.float32), v)])
        assert [np.asarray(c).tolist() for c in strategy.experimental_local_results(v)] == [[0.0]] * 2
        slots = opt.variables
        assert slots[0] is opt.iterations and isinstance(opt.iterations, gs.Variable)
    finally:
        strategy.close()


def test_errors():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            v = gs.Variable(np.zeros(3, np.float32), name="w")
            opt = gs.optimizers.Adam()
        with pytest.raises(ValueError, match="no gradients provided"):
            strategy.run(lambda: opt.apply_gradients([(None, v)]))
        with pytest.raises(ValueError, match=r"'w' has shape \(2,\)"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(2), v)]))
        with pytest.raises(TypeError, match="not a gs.Variable"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(3), np.zeros(3))]))
        with pytest.raises(TypeError, match="floating point"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(3, int), v)]))
        other = gs.MirroredStrategy(["cpu:0", "cpu:1"])
        try:
            with other.scope():
                u = gs.Variable(np.zeros(3, np.float32), name="u")
            with pytest.raises(ValueError, match="'u' belongs to"):
                strategy.run(lambda: opt.apply_gradients([(np.ones(3), v),
                                                          (np.ones(3), u)]))
        finally:
            other.close()
        assert int(opt.iterations) == 0 and np.all(np.asarray(v) == 0)
        for bad in (-1.0, 0, "0.1", float("inf"), float("nan"), None):
            with pytest.raises(ValueError, match=r"learning_rate must be a positive "
                               rf"finite number or a callable schedule, got {bad!r}"):
                gs.optimizers.SGD(bad)
        with pytest.raises(ValueError, match="got '0.2'"):
            opt.learning_rate = "0.2"
        with pytest.raises(ValueError, match="compression"):
            gs.optimizers.SGD(compression="int8")
    finally:
        strategy.close()


@pytest.mark.parametrize("compression, wire", [("float16", np.float16),
                                               ("bfloat16", np.uint16)])
def test_compression_sends_16_bit_values_and_rounds_each_share(monkeypatch, compression,
                                                               wire):
    from gpustrat.collectives import host
    seen = []
    for name in ("all_reduce_inplace", "all_reduce", "all_gather"):
        real = getattr(host.HostCommunicator, name)

        def spy(self, buffers, *a, _real=real, **k):
            seen.append(buffers[0].dtype)
            return _real(self, buffers, *a, **k)
        monkeypatch.setattr(host.HostCommunicator, name, spy)
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            v = gs.Variable(np.zeros(2, np.float32))
            opt = gs.optimizers.SGD(1.0, compression=compression)
        # 1 + 2**-12 is not representable in 16 bits: each share rounds to 1.
        g = np.array([1 + 2.0 ** -12, 3.0], np.float32)
        strategy.run(lambda: opt.apply_gradients([(g, v)]))
    finally:
        strategy.close()
    assert seen == [np.dtype(wire)]
    np.testing.assert_array_equal(np.asarray(v), [-2.0, -6.0])


def test_variables_made_outside_the_scope_are_refused_inside_run():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        v = gs.Variable(np.zeros(2, np.float32), name="outside")
        with strategy.scope():
            opt = gs.optimizers.SGD(0.1)
        with pytest.raises(ValueError, match="'outside' was made outside"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), v)]))
        assert np.all(v.numpy() == 0)
    finally:
        strategy.close()


def test_variables_move_into_one_arena_and_a_second_optimizer_still_updates_them():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            a = gs.Variable(np.ones(3, np.float32), name="a")
            b = gs.Variable(np.ones((2, 2), np.float32), name="b")
            first = gs.optimizers.SGD(0.1, momentum=0.5)
            second = gs.optimizers.SGD(1.0)
        grads = [np.full(3, 1.0, np.float32), np.full((2, 2), 2.0, np.float32)]
        strategy.run(lambda: first.apply_gradients(zip(grads, [a, b])))
        # Both variables' components (and the momentum slots) now share one buffer per
        # replica, so that the step is a few whole-buffer operations.
        for i in range(2):
            ca = strategy.experimental_local_results(a)[i]._array
            cb = strategy.experimental_local_results(b)[i]._array
            assert np.shares_memory(ca.base, cb.base)
        strategy.run(lambda: second.apply_gradients([(grads[1], b)]))   # not in its arena
        strategy.run(lambda: first.apply_gradients(zip(grads, [a, b])))
    finally:
        strategy.close()
    # Summed over 2 replicas: g = 2, 4.  first: m = -0.1 g; second: -1.0 * 4;
    # first again: m = 0.5 m - 0.1 g.
    m_a, m_b = -0.2, -0.4
    want_a = 1 + m_a + (0.5 * m_a - 0.2)
    want_b = 1 + m_b - 4.0 + (0.5 * m_b - 0.4)
    for c in strategy.experimental_local_results(a):
        np.testing.assert_allclose(np.asarray(c), want_a, rtol=1e-6)
    for c in strategy.experimental_local_results(b):
        np.testing.assert_allclose(np.asarray(c), want_b, rtol=1e-6)


def test_replicas_training_different_variables_is_an_error():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            a = gs.Variable(np.zeros(2, np.float32), name="a")
            b = gs.Variable(np.zeros(2, np.float32), name="b")
            opt = gs.optimizers.SGD(0.1)

        def step():
            mine = a if gs.get_replica_context().replica_id_in_sync_group == 0 else b
            opt.apply_gradients([(np.ones(2, np.float32), mine)])
        with pytest.raises(ValueError, match=r"replica 1 passed other variables \(\['b'\]\)"):
            strategy.run(step)
        assert int(opt.iterations) == 0
        assert np.all(np.asarray(a) == 0) and np.all(np.asarray(b) == 0)
    finally:
        strategy.close()


def test_a_step_after_iterations_is_assigned_counts_from_the_assigned_value(two):
    # The step count is kept on the host between steps; an assign to iterations (a
    # restore, a user reset) must still decide the next step's schedule and Adam's bias
    # correction.
    seen = []
    with two.scope():
        v = gs.Variable(np.zeros(2, np.float32))
        opt = gs.optimizers.Adam(_Seen(seen))
    grad = np.ones(2, np.float32)
    two.run(lambda: opt.apply_gradients([(grad, v)]))
    opt.iterations.assign(100)
    two.run(lambda: opt.apply_gradients([(grad, v)]))
    two.run(lambda: opt.apply_gradients([(grad, v)]))
    assert seen == [0, 100, 101] and int(opt.iterations) == 102
    opt.iterations.assign(0)
    assert opt.learning_rate == 0.1 and seen[-1] == 0


def test_a_step_count_held_elsewhere_is_read_each_time():
    # An iterations variable without a local array (one held by another process, as
    # on parameter servers) is counted where it lives: the host copy is not trusted.
    class Elsewhere(gs.Variable):
        count = 0

        def read_value(self):
            return np.asarray(self.count, np.int64)

    seen = []
    opt = gs.optimizers.SGD(_Seen(seen))
    held = object.__new__(Elsewhere)
    opt._iterations = held
    opt._remember_step(0)
    for n in (3, 7):
        Elsewhere.count = n
        assert opt.learning_rate == 0.1
    assert seen == [3, 7]


def test_warm_step_still_checks_each_replica_and_each_pair():
    # After a step has built the plan, the whole-list checks must still catch one bad
    # gradient on one replica, and odd pairs, with the same messages.
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    try:
        with strategy.scope():
            vs = [gs.Variable(np.zeros(4, np.float32), name=f"w{j}") for j in range(3)]
            opt = gs.optimizers.SGD(1.0)

        def grads(shape1=(4,), dtype1=np.float32):
            ctx = gs.get_replica_context()
            i = ctx.replica_id_in_sync_group
            return [np.ones(shape1 if (i == 1 and j == 2) else (4,),
                            dtype1 if (i == 2 and j == 0) else np.float32)
                    for j in range(3)]
        strategy.run(lambda: opt.apply_gradients(zip(grads(), vs)))
        assert np.asarray(vs[2]).tolist() == [-3.0] * 4
        with pytest.raises(ValueError, match=r"'w2' has shape \(5,\)"):
            strategy.run(lambda: opt.apply_gradients(zip(grads(shape1=(5,)), vs)))
        with pytest.raises(TypeError, match="floating point"):
            strategy.run(lambda: opt.apply_gradients(zip(grads(dtype1=np.int32), vs)))
        with pytest.raises(ValueError, match="appears twice"):
            strategy.run(lambda: opt.apply_gradients(zip(grads(), [vs[0], vs[1], vs[0]])))
        with pytest.raises(TypeError, match="pairs"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(4), vs[0], 1)]))
        # float64 gradients are cast; None skips a variable; lists work as pairs.
        strategy.run(lambda: opt.apply_gradients(
            [[np.ones(4), vs[0]], [None, vs[1]], (np.ones(4, np.float32), vs[2])]))
        assert [np.asarray(v)[0] for v in vs] == [-6.0, -3.0, -6.0]
        assert int(opt.iterations) == 2
    finally:
        strategy.close()


@pytest.mark.parametrize("kwargs", [{}, {"momentum": 0.9}, {"momentum": 0.5, "nesterov": True}])
def test_sgd_updates_replicas_sharing_a_gradient_as_one_update_each(kwargs):
    opt = gs.optimizers.SGD(0.03, **kwargs)
    rng = np.random.default_rng(3)
    grad = rng.standard_normal(50).astype(np.float32)
    grad.flags.writeable = False
    params = [rng.standard_normal(50).astype(np.float32) for _ in range(3)]
    slots = [{s: rng.standard_normal(50).astype(np.float32) for s in opt.slot_names}
             for _ in range(3)]
    want_p = [p.copy() for p in params]
    want_s = [{k: v.copy() for k, v in s.items()} for s in slots]
    for p, s in zip(want_p, want_s):
        opt.update_step(p, grad, s, 0.03, 1, None)
    opt.update_replicas(params, grad, slots, 0.03, 1)
    for p, w in zip(params, want_p):
        np.testing.assert_array_equal(p, w)          # bit for bit
    for s, w in zip(slots, want_s):
        for k in s:
            np.testing.assert_array_equal(s[k], w[k])


def test_an_update_that_writes_its_shared_gradient_raises():
    class Scaling(gs.optimizers.SGD):
        def update_step(self, param, grad, slots, lr, step, name):
            grad *= 2                              # the gradient is read-only
            super().update_step(param, grad, slots, lr, step, name)

    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            v = gs.Variable(np.zeros(3, np.float32))
            opt = Scaling(0.1)
        with pytest.raises(ValueError, match="read-only"):
            strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v)]))
    finally:
        strategy.close()


def test_a_subclass_update_step_is_used_for_replicas_sharing_a_gradient():
    class Doubling(gs.optimizers.SGD):
        def update_step(self, param, grad, slots, lr, step, name):
            super().update_step(param, 2 * grad, slots, lr, step, name)

    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with strategy.scope():
            v = gs.Variable(np.zeros(3, np.float32))
            opt = Doubling(0.25)
        strategy.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v)]))
    finally:
        strategy.close()
    for c in strategy.experimental_local_results(v):
        np.testing.assert_array_equal(c.numpy(), [-1.0, -1.0, -1.0])   # 0.25 * 2 * (1 + 1)


def test_sgd_momentum_changes_keep_its_slot_or_are_refused():
    # Momentum 0 keeps no slot: turning it on after steps used to fail with KeyError
    # 'momentum' in the middle of a step (on a server, after other servers' updates).
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with s.scope():
            w = gs.Variable(np.ones(2, np.float32), name="w")
            plain, heavy = gs.optimizers.SGD(0.1), gs.optimizers.SGD(0.1, momentum=0.5)
        fresh = gs.optimizers.SGD(0.1)
        fresh.momentum = 0.9              # before any step: it keeps a slot from now on
        assert fresh.slot_names == ("momentum",)
        for opt in (plain, heavy):
            s.run(lambda opt=opt: opt.apply_gradients([(np.ones(2, np.float32), w)]))
        with pytest.raises(ValueError, match=r"momentum 0 -> 0.9: this SGD has taken steps "
                                             r"without a momentum slot"):
            plain.momentum = 0.9
        with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\), got 1.5"):
            heavy.momentum = 1.5
        assert plain.momentum == 0.0 and heavy.momentum == 0.5
        heavy.momentum = 0.0              # its slot is kept, unused, for a later momentum
        assert heavy.slot_names == ("momentum",)
        heavy.momentum = 0.8              # used from the next step
        before = w.numpy().copy()
        m = heavy.get_slot(w, "momentum").numpy().copy()
        s.run(lambda: heavy.apply_gradients([(np.ones(2, np.float32), w)]))
        g = 2.0                           # the gradients summed over the 2 replicas
        np.testing.assert_allclose(w.numpy(), before + (0.8 * m - 0.1 * g), rtol=1e-6)
    finally:
        s.close()


def test_adamw_exclusions_are_fixed_by_the_first_step():
    # A change after the first step used to be ignored without a word (the decayed
    # variables were remembered, and a fused step decays its whole arena).
    s = gs.MirroredStrategy(["cpu:0"])
    try:
        with s.scope():
            w = gs.Variable(np.ones(2, np.float32), name="w")
            b = gs.Variable(np.ones(2, np.float32), name="bias")
            opt = gs.optimizers.AdamW(0.1, weight_decay=0.5, exclude_from_weight_decay=["x"])
        opt.exclude_from_weight_decay = ["bias"]      # before any step: taken
        assert opt.exclude_from_weight_decay == ("bias",)
        s.run(lambda: opt.apply_gradients([(np.zeros(2, np.float32), w),
                                           (np.zeros(2, np.float32), b)]))
        np.testing.assert_allclose(w.numpy(), [0.95, 0.95], rtol=1e-6)   # 1 - 0.5 * 0.1
        assert b.numpy().tolist() == [1.0, 1.0]
        with pytest.raises(ValueError, match=r"exclude_from_weight_decay \['bias'\] -> \[\]: "
                                             r"this AdamW has taken steps"):
            opt.exclude_from_weight_decay = []
        opt.exclude_from_weight_decay = ("bias",)       # the same: nothing changes
        assert opt.get_config()["exclude_from_weight_decay"] == ["bias"]
    finally:
        s.close()


@pytest.mark.parametrize("bad_first", [False, True])
def test_an_integer_variable_is_refused_before_anything_is_written(two, bad_first):
    # It used to raise NumPy's UFuncTypeError in the middle of the step: 'w' updated,
    # 'iterations' not counted.
    with two.scope():
        iv = gs.Variable(np.zeros(2, np.int32), name="iv")
        w = gs.Variable(np.ones(2, np.float32), name="w")
        opt = gs.optimizers.SGD(0.1, momentum=0.9)
    pairs = [(np.ones(2, np.float32), w), (np.ones(2, np.float32), iv)]
    if bad_first:
        pairs.reverse()
    with pytest.raises(TypeError, match=r"SGD.apply_gradients: variable 'iv' has dtype "
                                        r"int32, .* floating-point variables only; "
                                        r"nothing was updated"):
        two.run(lambda: opt.apply_gradients(pairs))
    assert w.numpy().tolist() == [1.0, 1.0] and iv.numpy().tolist() == [0, 0]
    assert int(opt.iterations) == 0 and opt.variables == [opt.iterations]   # no slot made
    # Without it the step goes on as usual.
    two.run(lambda: opt.apply_gradients([(np.ones(2, np.float32), w)]))
    np.testing.assert_allclose(w.numpy(), [0.8, 0.8], rtol=1e-6)
    assert int(opt.iterations) == 1


def test_adamw_exclusions_are_regular_expressions_searched_in_the_name():
    # As Keras 3 (re.search of the patterns joined by "|"): they used to be substrings,
    # so "bias$" excluded nothing and "bias" could not be anchored.
    names = ["dense/bias", "bias_scale", "kernel", "w"]
    ws = [gs.Variable(np.ones(2, np.float32), name=n) for n in names]
    opt = gs.optimizers.AdamW(0.1, weight_decay=0.5, exclude_from_weight_decay=["bias$", "^w$"])
    opt.apply_gradients([(np.zeros(2, np.float32), w) for w in ws])
    decayed = {n: w.numpy()[0] != 1.0 for n, w in zip(names, ws)}
    assert decayed == {"dense/bias": False, "bias_scale": True, "kernel": True, "w": False}
    np.testing.assert_allclose(ws[2].numpy(), [0.95, 0.95], rtol=1e-6)   # 1 - 0.5 * 0.1
    one = gs.optimizers.AdamW(exclude_from_weight_decay="bias")    # one string: one pattern
    assert one.exclude_from_weight_decay == ("bias",)
    with pytest.raises(ValueError, match=r"exclude_from_weight_decay \['bias\('\]: not a "
                                         r"regular expression .*re.escape"):
        gs.optimizers.AdamW(exclude_from_weight_decay=["bias("])
    with pytest.raises(TypeError, match=r"regular expressions \(strings\).*\[3\]"):
        gs.optimizers.AdamW(exclude_from_weight_decay=["bias", 3])


def test_clip_and_decay_arguments_are_checked_on_every_optimizer():
    for cls in (gs.optimizers.SGD, gs.optimizers.Adam, gs.optimizers.AdamW,
                gs.optimizers.RMSprop, gs.optimizers.Adagrad, gs.optimizers.Nadam,
                gs.optimizers.Adamax, gs.optimizers.Adadelta):
        for name in ("clipnorm", "clipvalue", "global_clipnorm"):
            for bad in (-1.0, 0, float("inf"), float("nan"), "1", True):
                with pytest.raises(ValueError, match=rf"{name} must be a positive finite "
                                   rf"number or None \(no clipping\), got {bad!r}"):
                    cls(**{name: bad})
            assert getattr(cls(**{name: 2}), name) == 2.0
        with pytest.raises(ValueError, match=r"at most one of clipnorm, clipvalue and "
                           r"global_clipnorm can be set, got clipnorm=1\.0, "
                           r"global_clipnorm=2\.0"):
            cls(clipnorm=1.0, global_clipnorm=2.0)
        with pytest.raises(ValueError, match="at most one"):
            cls(clipvalue=1.0, clipnorm=2.0)
        for bad in (-0.1, float("inf"), "0.1"):
            with pytest.raises(ValueError, match=rf"weight_decay must be a non-negative "
                               rf"finite number.*got {bad!r}"):
                cls(weight_decay=bad)
        with pytest.raises(TypeError, match="unexpected keyword argument 'clip_norm'"):
            cls(clip_norm=1.0)
    with pytest.raises(ValueError, match="AdamW's weight_decay must be a non-negative "
                       "number, got None"):
        gs.optimizers.AdamW(weight_decay=None)
    for kwargs, message in [({"rho": 1.0}, r"rho must be in \[0, 1\), got 1\.0"),
                            ({"momentum": -0.5}, r"momentum must be in \[0, 1\)"),
                            ({"epsilon": 0}, "epsilon must be a positive finite number")]:
        with pytest.raises(ValueError, match=message):
            gs.optimizers.RMSprop(**kwargs)
    with pytest.raises(ValueError, match="initial_accumulator_value must be a non-negative"):
        gs.optimizers.Adagrad(initial_accumulator_value=-1)
    with pytest.raises(ValueError, match=r"beta_2 must be in \[0, 1\)"):
        gs.optimizers.Nadam(beta_2=1.5)
    with pytest.raises(AttributeError):
        gs.optimizers.RMSprop().momentum = 0.5    # it decides the slots: fixed


def test_clipping_and_decay_apply_to_the_summed_gradient(three):
    # Each replica's gradient is under the clip; their sum (3 * [3, 4], norm 15) is not:
    # the step clips the sum to norm 1, as one process would on the global batch.
    # Weight decay: 1 - 1 * 0.5 * lr, then the summed step.
    for kwargs, want in [({"clipnorm": 1.0}, [0.4, 0.2]),
                         ({"global_clipnorm": 1.0}, [0.4, 0.2]),
                         ({"clipvalue": 5.0}, [-4.0, -4.0]),
                         ({"weight_decay": 0.5}, [0.5 - 9.0, 0.5 - 12.0])]:
        with three.scope():
            v = gs.Variable(np.float32([1.0, 1.0]), name="v")
            opt = gs.optimizers.SGD(1.0, **kwargs)
        three.run(lambda: opt.apply_gradients([(np.float32([3.0, 4.0]), v)]))
        for c in three.experimental_local_results(v):
            np.testing.assert_allclose(np.asarray(c), want, rtol=1e-6,
                                       err_msg=str(kwargs))


def test_no_clip_or_decay_leaves_the_step_as_it_was(monkeypatch):
    from gpustrat.optimizers import clipping
    monkeypatch.setattr(clipping, "clip_flat", None)     # never reached
    monkeypatch.setattr(clipping, "clip_tensors", None)
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with s.scope():
            v = gs.Variable(np.ones(3, np.float32), name="v")
            opt = gs.optimizers.Adam(0.1)
        s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v)]))
    finally:
        s.close()


def test_get_slot_before_the_first_step_says_when_slots_are_made():
    w = gs.Variable(np.zeros(2, np.float32), name="w")
    opt = gs.optimizers.SGD(0.1, momentum=0.9)
    with pytest.raises(KeyError, match=r"no slot 'momentum' for variable 'w' yet: slots "
                                       r"are made on the first apply_gradients"):
        opt.get_slot(w, "momentum")
    with pytest.raises(KeyError, match=r"SGD keeps no slot 'velocity': its slots are "
                                       r"\['momentum'\]"):
        opt.get_slot(w, "velocity")
    opt.apply_gradients([(np.ones(2, np.float32), w)])
    np.testing.assert_allclose(opt.get_slot(w, "momentum").numpy(), [-0.1, -0.1])
