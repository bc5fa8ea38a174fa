"""Gradient accumulation, EMA and LossScaleOptimizer against Keras 3's own cases
(keras/src/optimizers/optimizer_test.py and loss_scale_optimizer_test.py: each test names
the Keras test its values come from), without a strategy and on 2 replicas (each replica
given half the gradient, so that their sum is Keras's), and in checkpoints."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs

O = gs.optimizers


def strategy_of(n):
    return None if n == 1 else gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def make(n, fn):
    s = strategy_of(n)
    if s is None:
        return None, fn()
    with s.scope():
        return s, fn()


def apply(s, opt, grads, variables, buffers=False):
    """One step: each of the strategy's replicas gives ``grads / replicas``."""
    n = 1 if s is None else s.num_replicas_in_sync

    def step():
        gs_ = [np.asarray(g, np.float32) / n for g in grads]
        if buffers:
            bufs = opt.gradient_buffers(variables)
            for b, g in zip(bufs, gs_):
                b[...] = g
            gs_ = bufs
        opt.apply_gradients(zip(gs_, variables))
    if s is None:
        step()
    else:
        s.run(step)


def value(v):
    return np.asarray(v.numpy())


# --- gradient accumulation (optimizer_test.py) ------------------------------------------------

@pytest.mark.parametrize("n, buffers", [(1, False), (2, False), (2, True)])
def test_gradient_accumulation(n, buffers):     # OptimizerTest.test_gradient_accumulation
    s, (v, opt) = make(n, lambda: (gs.Variable(np.float32([[1.0, 2.0], [3.0, 4.0]])),
                                   O.SGD(learning_rate=1.0, gradient_accumulation_steps=3)))
    assert opt.gradient_accumulation_steps == 3
    grads = [np.ones((2, 2), np.float32)]
    want = [([[1.0, 2.0], [3.0, 4.0]], 1.0, 1, 0), ([[1.0, 2.0], [3.0, 4.0]], 2.0, 2, 0),
            ([[0.0, 1.0], [2.0, 3.0]], 0.0, 3, 1), ([[0.0, 1.0], [2.0, 3.0]], 1.0, 4, 1)]
    for weights, acc, calls, updates in want:
        apply(s, opt, grads, [v], buffers)
        np.testing.assert_allclose(value(v), weights)
        np.testing.assert_allclose(value(opt.get_slot(v, "gradient_accumulator")),
                                   np.full((2, 2), acc))
        assert int(opt._iterations.numpy()) == calls and int(opt.iterations) == updates
        # As Keras's tensor: numpy() too (a Keras loop's opt.iterations.numpy()), and
        # it cannot be written.
        assert opt.iterations.numpy() == updates and opt.iterations.numpy().shape == ()
        with pytest.raises(ValueError, match="read-only"):
            opt.iterations[...] = 7


ALGORITHMS = ["SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
              "Lion", "Ftrl", "Lamb", "Adafactor"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_gradient_accumulation_with_weight_decay(name, n):
    # OptimizerTest.test_gradient_accumulation_with_weigth_decay: 3 accumulated steps
    # are one step of their mean, with every algorithm.
    rng = np.random.default_rng(1)
    cls = getattr(O, name)
    s, (v1, v3, o1, o3) = make(n, lambda: (
        gs.Variable(np.float32([[0.9], [0.5]])), gs.Variable(np.float32([[0.9], [0.5]])),
        cls(weight_decay=0.05), cls(weight_decay=0.05, gradient_accumulation_steps=3)))
    for _ in range(8):
        grads3 = rng.random([3, 2, 1]).astype(np.float32)
        apply(s, o1, [grads3.mean(axis=0)], [v1])
        for batch in range(3):
            apply(s, o3, [grads3[batch]], [v3])
    np.testing.assert_allclose(value(v3), value(v1), rtol=1e-5, atol=1e-6)


def test_accumulation_with_a_schedule_sees_every_call():
    # Keras 3.15.1 (TensorFlow 2.21) on this program: the schedule is called with the
    # raw call counter, so the rates are 0.1, 0.05, ... and the updates at calls 2, 4
    # and 6 use 0.05, 0.0125 and 0.003125; iterations counts the 3 updates.
    schedule = O.schedules.ExponentialDecay(0.1, 1, 0.5)
    v = gs.Variable(np.zeros(2, np.float32))
    opt = O.SGD(schedule, gradient_accumulation_steps=2)
    rates = []
    for _ in range(6):
        rates.append(opt.learning_rate)
        opt.apply_gradients([(np.ones(2, np.float32), v)])
    np.testing.assert_allclose(rates, [0.1, 0.05, 0.025, 0.0125, 0.00625, 0.003125])
    np.testing.assert_allclose(value(v), -np.full(2, 0.065625), rtol=1e-6)
    assert int(opt.iterations.numpy()) == 3


def test_accumulation_mid_way_is_saved_and_restored(tmp_path):
    two = gs.MirroredStrategy(["cpu:0", "cpu:1"])

    def fresh():
        with two.scope():
            return (gs.Variable(np.ones(3, np.float32), name="w"),
                    O.Adam(0.1, gradient_accumulation_steps=3))
    w, opt = fresh()
    grads = [np.float32([1, 2, 3]), np.float32([-1, 0, 2]), np.float32([4, 4, 4]),
             np.float32([1, 1, 1])]
    for g in grads[:2]:
        apply(two, opt, [g], [w])
    path = gs.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "c"))
    np.testing.assert_allclose(value(opt.get_slot(w, "gradient_accumulator")), [0, 2, 5])
    w2, opt2 = fresh()
    gs.train.Checkpoint(w=w2, opt=opt2).restore(path)
    for g in grads[2:]:
        apply(two, opt, [g], [w])
        apply(two, opt2, [g], [w2])
    np.testing.assert_array_equal(value(w2), value(w))
    assert int(opt2.iterations) == 1 and int(opt2._iterations.numpy()) == 4


def test_accumulation_arguments_are_checked():
    for bad in (1, 0.5, True):
        with pytest.raises(ValueError, match="`gradient_accumulation_steps` must be an "
                                             "integer >= 2"):
            O.SGD(gradient_accumulation_steps=bad)


# --- EMA (optimizer_test.py) ----------------------------------------------------------------

@pytest.mark.parametrize("n, buffers", [(1, False), (2, False), (2, True)])
def test_ema(n, buffers):                       # OptimizerTest.test_ema
    s, (v, opt) = make(n, lambda: (
        gs.Variable(np.float32([[3.0, 4.0], [5.0, 6.0]])),
        O.SGD(learning_rate=1.0, use_ema=True, ema_momentum=0.9, ema_overwrite_frequency=3)))
    grads = [np.ones((2, 2), np.float32)]
    want = [([[2.0, 3.0], [4.0, 5.0]], [[2.0, 3.0], [4.0, 5.0]]),
            ([[1.0, 2.0], [3.0, 4.0]], [[1.9, 2.9], [3.9, 4.9]]),
            ([[1.71, 2.71], [3.71, 4.71]], [[1.71, 2.71], [3.71, 4.71]])]
    for weights, average in want:
        apply(s, opt, grads, [v], buffers)
        np.testing.assert_allclose(value(v), weights, rtol=1e-6)
        np.testing.assert_allclose(value(opt.get_slot(v, "average")), average, rtol=1e-6)
    if s is not None:
        for c in s.experimental_local_results(v):
            np.testing.assert_allclose(c.numpy(), want[-1][0], rtol=1e-6)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_ema_follows_the_weights_with_every_algorithm(name, n):
    # The average starts at the weights after the first step and then moves by
    # (1 - ema_momentum) towards them after each step, whatever the algorithm (a matrix
    # and a vector: Adafactor factors the one, not the other).
    rng = np.random.default_rng(2)
    s, (m, b, opt) = make(n, lambda: (
        gs.Variable(np.float32([[0.9, -0.2], [0.5, 0.1]])), gs.Variable(np.float32([0.3, 0.7])),
        getattr(O, name)(use_ema=True, ema_momentum=0.8)))
    want = None
    for _ in range(4):
        apply(s, opt, [rng.random((2, 2)).astype(np.float32),
                       rng.random(2).astype(np.float32)], [m, b])
        now = [value(m), value(b)]
        want = now if want is None else [0.8 * w + 0.2 * x for w, x in zip(want, now)]
    for v, w in zip((m, b), want):
        np.testing.assert_allclose(value(opt.get_slot(v, "average")), w, rtol=1e-5,
                                   atol=1e-6)


def test_ema_finalize_and_fit_values():
    # OptimizerTest.test_ema_with_model_fit: Dense(2, kernel ones, no bias) on x = 1,
    # y = 0 with mse, 2 epochs of one batch: the gradient is 2 * w / 2 = w per unit.
    w = gs.Variable(np.ones((1, 2), np.float32))
    opt = O.SGD(learning_rate=0.1, use_ema=True, ema_momentum=0.9)
    for _ in range(2):
        opt.apply_gradients([(value(w) * 2 / 2, w)])
    np.testing.assert_allclose(value(opt.get_slot(w, "average")), [[0.891, 0.891]],
                               atol=1e-5)
    opt.finalize_variable_values([w])
    np.testing.assert_allclose(value(w), [[0.891, 0.891]], atol=1e-5)
    O.SGD(0.1).finalize_variable_values([w])            # no EMA: nothing
    np.testing.assert_allclose(value(w), [[0.891, 0.891]], atol=1e-5)


def test_ema_arguments_and_config():
    with pytest.raises(ValueError, match=r"`ema_momentum` must be in the range \[0, 1\]"):
        O.Adam(use_ema=True, ema_momentum=1.5)
    with pytest.raises(ValueError, match="`ema_overwrite_frequency` must be an integer"):
        O.Adam(use_ema=True, ema_overwrite_frequency=0.5)
    opt = O.Adam(0.01, use_ema=True, ema_momentum=0.95, ema_overwrite_frequency=4,
                 gradient_accumulation_steps=2)
    config = opt.get_config()
    assert {k: config[k] for k in ("use_ema", "ema_momentum", "ema_overwrite_frequency",
                                   "gradient_accumulation_steps")} == \
        {"use_ema": True, "ema_momentum": 0.95, "ema_overwrite_frequency": 4,
         "gradient_accumulation_steps": 2}
    again = O.Adam.from_config(config)
    assert again.get_config() == config
    assert again.kept_slot_names == ("momentum", "velocity", "gradient_accumulator",
                                     "average")
    # Keras's common settings are in every config, as Keras's get_config has them.
    plain = O.Adam(0.01).get_config()
    assert {k: plain[k] for k in ("use_ema", "ema_momentum", "ema_overwrite_frequency",
                                  "gradient_accumulation_steps", "loss_scale_factor")} == \
        {"use_ema": False, "ema_momentum": 0.99, "ema_overwrite_frequency": None,
         "gradient_accumulation_steps": None, "loss_scale_factor": None}
    assert O.Adam.from_config(plain).get_config() == plain
    with pytest.raises(ValueError, match=r"loss_scale_factor=128.0 is not supported: .*"
                                         r"LossScaleOptimizer"):
        O.Adam(0.01, loss_scale_factor=128.0)


# --- LossScaleOptimizer (loss_scale_optimizer_test.py) ---------------------------------------

def lso(n, **kwargs):
    return make(n, lambda: (gs.Variable(np.float32([1.0, 2.0, 3.0, 4.0])),
                            O.LossScaleOptimizer(O.SGD(learning_rate=0.5), **kwargs)))


@pytest.mark.parametrize("n, buffers", [(1, False), (2, False), (2, True)])
def test_finite_step(n, buffers):               # LossScaleOptimizerTest.test_finite_step
    s, (v, opt) = lso(n)
    apply(s, opt, [np.float32([1.0, 6.0, 7.0, 2.0]) * opt.initial_scale], [v], buffers)
    np.testing.assert_allclose(value(v), [0.5, -1.0, -0.5, 3.0], rtol=1e-4, atol=1e-4)
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("n, buffers", [(1, False), (2, False), (2, True)])
def test_infinite_step(n, buffers):             # LossScaleOptimizerTest.test_infinite_step
    s, (v, opt) = lso(n)
    apply(s, opt, [np.float32([np.inf] * 4)], [v], buffers)
    np.testing.assert_allclose(value(v), [1.0, 2.0, 3.0, 4.0])
    assert int(opt.iterations.numpy()) == 0 and float(opt.scale_loss(1.0)) == 2.0 ** 14


@pytest.mark.parametrize("n", [1, 2])
def test_downscaling_and_upscaling(n):          # .test_downscaling, .test_upscaling
    s, (v, opt) = lso(n, initial_scale=400.0)
    for _ in range(4):
        apply(s, opt, [np.float32([np.inf] * 4)], [v])
    assert float(opt.scale_loss(1.0)) == 25.0
    s, (v, opt) = lso(n, initial_scale=2.0, dynamic_growth_steps=2)
    for _ in range(8):
        apply(s, opt, [np.float32([1.0, 6.0, 7.0, 2.0])], [v])
    assert float(opt.scale_loss(1.0)) == 32.0


def test_iterations_update():                   # .test_iterations_update
    _, (v, opt) = lso(1)
    assert int(opt.iterations.numpy()) == 0
    for i in range(3):
        apply(None, opt, [np.float32([1.0, 6.0, 7.0, 2.0])], [v])
        assert int(opt.iterations.numpy()) == i + 1


def test_a_nan_on_one_replica_skips_the_step_on_every_replica():
    # The decision is taken on the summed gradients: a NaN in replica 1's gradient only
    # (Keras under tf.distribute looks at replica 0's) skips the step everywhere.
    two = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    with two.scope():
        v = gs.Variable(np.float32([1.0, 2.0]))
        opt = O.LossScaleOptimizer(O.Adam(0.1), initial_scale=8.0)

    def step(bad):
        r = gs.get_replica_context().replica_id_in_sync_group
        g = np.float32([np.nan, 1.0]) if bad and r == 1 else np.float32([4.0, 4.0])
        opt.apply_gradients([(g, v)])
    two.run(step, args=(True,))
    assert int(opt.iterations.numpy()) == 0 and float(opt.scale_loss(1.0)) == 4.0
    for c in two.experimental_local_results(v):
        np.testing.assert_array_equal(c.numpy(), [1.0, 2.0])
    two.run(step, args=(False,))
    assert int(opt.iterations.numpy()) == 1
    c0, c1 = two.experimental_local_results(v)
    np.testing.assert_array_equal(c0.numpy(), c1.numpy())
    assert not np.array_equal(c0.numpy(), [1.0, 2.0])


def test_an_overflowing_sum_of_finite_values_is_still_checked_per_element():
    _, (v, opt) = lso(1, initial_scale=1.0)
    big = np.float32([3e38, 3e38, -1e38, 0.0])    # their sum overflows; each is finite
    apply(None, opt, [big], [v])
    assert int(opt.iterations.numpy()) == 1


@pytest.mark.parametrize("n", [1, 2])
def test_the_decision_over_tensors_of_two_dtypes(n):
    # Variables of two dtypes are not one flat buffer: the check covers every tensor.
    s = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    with s.scope():
        a = gs.Variable(np.zeros(3, np.float32), name="a")
        b = gs.Variable(np.zeros(2, np.float16), name="b")
        opt = O.LossScaleOptimizer(O.SGD(learning_rate=1.0), initial_scale=1.0)

    def step(ga, gb):
        opt.apply_gradients([(np.float32(ga) / n, a), (np.float16(gb) / n, b)])
    s.run(step, args=([1.0, 2.0, 3.0], [1.0, -np.inf]))     # an inf in the float16 one
    assert int(opt.iterations.numpy()) == 0 and float(opt.scale_loss(1.0)) == 0.5
    np.testing.assert_array_equal(value(a), [0.0, 0.0, 0.0])
    # Finite tensors whose checks add up past float32's range: still applied.
    s.run(step, args=([1.4e19, 1.4e19, 0.0], [1.0, 2.0]))
    assert int(opt.iterations.numpy()) == 1
    np.testing.assert_allclose(value(a), [-2.8e19, -2.8e19, 0.0], rtol=1e-6)
    np.testing.assert_array_equal(value(b), np.float16([-2.0, -4.0]))


def test_serialization_arguments_and_checkpoint(tmp_path):
    # .test_serialization, .test_init_dynamic_arg, .test_init_unsupported_arg,
    # .test_init_base_optimizer_unsupported_args.
    opt = O.LossScaleOptimizer(O.SGD(learning_rate=0.5), initial_scale=2.0,
                               dynamic_growth_steps=2, name="test_opt")
    config = opt.get_config()
    assert config == {"name": "test_opt", "initial_scale": 2.0, "dynamic_growth_steps": 2,
                      "inner_optimizer": {"class_name": "SGD",
                                          "config": O.SGD(learning_rate=0.5).get_config()}}
    again = O.LossScaleOptimizer.from_config(config)
    assert again.get_config() == config
    with pytest.raises(ValueError, match="no longer supports `dynamic=False`"):
        O.LossScaleOptimizer(O.SGD(), dynamic=False)
    with pytest.raises(ValueError, match="does not support arguments: `foo`"):
        O.LossScaleOptimizer(O.SGD(), foo=True)
    for arg, val in (("clipnorm", 1.0), ("use_ema", True), ("weight_decay", 0.1)):
        with pytest.raises(ValueError, match=f"does not support `{arg}`"):
            O.LossScaleOptimizer(O.SGD(), **{arg: val})
    # The scale and its counter are saved and restored with the inner optimizer.
    v = gs.Variable(np.float32([1.0, 2.0]), name="v")
    opt = O.LossScaleOptimizer(O.Adam(0.1), initial_scale=4.0, dynamic_growth_steps=3)
    for g in ([1.0, 1.0], [np.inf, 0.0], [2.0, 2.0]):
        apply(None, opt, [np.float32(g) * float(opt.scale_loss(1.0))], [v])
    path = gs.train.Checkpoint(v=v, opt=opt).write(str(tmp_path / "c"))
    v2 = gs.Variable(np.float32([1.0, 2.0]), name="v")
    opt2 = O.LossScaleOptimizer(O.Adam(0.1))
    gs.train.Checkpoint(v=v2, opt=opt2).restore(path)
    v2.assign(v.numpy())
    assert float(opt2.scale_loss(1.0)) == 2.0 and int(opt2.step_counter.numpy()) == 1
    for o, w in ((opt, v), (opt2, v2)):
        apply(None, o, [np.float32([1.0, -1.0]) * float(o.scale_loss(1.0))], [w])
    np.testing.assert_array_equal(value(v2), value(v))
