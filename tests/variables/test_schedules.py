"""gs.optimizers.schedules against Keras 3's own cases
(keras/src/optimizers/schedules/learning_rate_schedule_test.py: each test names the
Keras test its values come from), in an optimizer on 1 and 2 replicas, and in
checkpoints."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gpustrat as gs

S = gs.optimizers.schedules


def close(got, want, rtol=1e-6):
    np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-7)


# --- ExponentialDecayTest --------------------------------------------------------------------

def test_exponential_continuous():               # ExponentialDecayTest.test_continuous
    close(S.ExponentialDecay(0.05, 10, 0.96)(5), 0.05 * 0.96 ** (5.0 / 10.0))


def test_exponential_staircase():                # test_staircase, test_variables
    lr = S.ExponentialDecay(0.1, 3, 0.96, staircase=True)
    close(lr(1.0), 0.1)
    close(lr(2), 0.1)
    close(lr(100), 0.1 * 0.96 ** (100 // 3))


# --- PiecewiseConstantDecayTest --------------------------------------------------------------

def test_piecewise_values():                     # test_piecewise_values
    lr = S.PiecewiseConstantDecay([100, 110, 120], [1.0, 0.1, 0.01, 0.001])
    for step, want in ((-999.0, 1.0), (100, 1.0), (105, 0.1), (110, 0.1), (120, 0.01),
                       (999, 0.001)):
        close(lr(step), want)


def test_piecewise_boundary_values():            # test_boundary_values
    lr = S.PiecewiseConstantDecay([1, 2, 3], [0.4, 0.5, 0.6, 0.7])
    for step, want in ((0, 0.4), (1, 0.4), (2, 0.5), (3, 0.6), (4, 0.7)):
        close(lr(np.int64(step)), want)


def test_piecewise_lengths_must_fit():
    with pytest.raises(ValueError, match="1 less than the length of values"):
        S.PiecewiseConstantDecay([1, 2], [0.1, 0.2])


# --- LinearDecayTest and SqrtDecayTest (PolynomialDecay) ------------------------------------

@pytest.mark.parametrize("power", [1.0, 0.5])
def test_polynomial(power):
    lr, end = 0.05, 0.001
    close(S.PolynomialDecay(lr, 10, 0.0, power=power)(5), lr * 0.5 ** power)  # halfway
    close(S.PolynomialDecay(lr, 10, end, power=power)(10), end)                # end
    close(S.PolynomialDecay(lr, 10, end, power=power)(5),                      # with end
          (lr - end) * 0.5 ** power + end)
    close(S.PolynomialDecay(lr, 10, end, power=power)(15), end)                # beyond
    close(S.PolynomialDecay(lr, 10, end, power=power, cycle=True)(15),         # cycle
          (lr - end) * 0.25 ** power + end)


def test_polynomial_begin_with_cycle():          # SqrtDecayTest.test_begin_with_cycle
    close(S.PolynomialDecay(0.001, 10, cycle=True)(0), 0.001)


def test_polynomial_default_end():
    assert S.PolynomialDecay(0.1, 10).end_learning_rate == 0.0001


# --- InverseTimeDecayTest ----------------------------------------------------------------------

@pytest.mark.parametrize("staircase", [False, True])
def test_inverse_time(staircase):                # test_decay, test_staircase
    lr = S.InverseTimeDecay(0.1, 10, 0.96, staircase=staircase)
    for i in range(11):
        want = 0.1 / (1 + 0.96 * (i // 10)) if staircase else 0.1 / (1 + i / 10 * 0.96)
        close(lr(float(i)), want)


# --- CosineDecayTest ---------------------------------------------------------------------------

def np_cosine_decay(step, decay_steps, alpha=0.0):
    step = min(step, decay_steps)
    decay = 0.5 * (1.0 + math.cos(math.pi * step / decay_steps))
    return (1.0 - alpha) * decay + alpha


@pytest.mark.parametrize("alpha", [0.0, 0.1])
@pytest.mark.parametrize("initial", [1.0, np.float64(1.0)])
def test_cosine(alpha, initial):                 # test_decay, test_alpha, test_float64
    for step in range(0, 1500, 250):
        close(S.CosineDecay(initial, 1000, alpha)(step), np_cosine_decay(step, 1000, alpha))


def test_cosine_warmup():                        # test_warmup
    for step in range(0, 1500, 250):
        close(S.CosineDecay(0.0, 10, warmup_target=10.0, warmup_steps=1500)(step),
              step / 1500 * 10.0)


def test_cosine_warmup_decay():                  # test_warmup_decay
    for step in range(0, 3000, 250):
        lr = S.CosineDecay(0.0, 1000, warmup_target=10.0, warmup_steps=2000)
        want = step / 2000 * 10.0 if step < 2001 else \
            10.0 * np_cosine_decay(step - 2000, 1000)
        close(lr(step), want)


# --- CosineDecayRestartsTest -------------------------------------------------------------------

def np_cosine_decay_restarts(step, decay_steps, t_mul=2.0, m_mul=1.0, alpha=0.0):
    fac = 1.0
    while step >= decay_steps:
        step -= decay_steps
        decay_steps *= t_mul
        fac *= m_mul
    decay = fac * 0.5 * (1.0 + math.cos(math.pi * step / decay_steps))
    return (1.0 - alpha) * decay + alpha


@pytest.mark.parametrize("kwargs", [{}, {"alpha": 0.1}, {"m_mul": 0.9}, {"t_mul": 1.0},
                                    {"t_mul": 3.0, "m_mul": 4.0, "alpha": 0.1}])
@pytest.mark.parametrize("initial", [1.0, np.float64(1.0)])
def test_cosine_restarts(kwargs, initial):       # test_decay/_alpha/_mmul/_tmul/_float64
    for step in range(0, 1500, 250):
        close(S.CosineDecayRestarts(initial, 1000, **kwargs)(step),
              np_cosine_decay_restarts(step, 1000, **kwargs))


# --- test_config (run_class_serialization_test) -------------------------------------------------

CONFIGS = [
    S.ExponentialDecay(initial_learning_rate=0.05, decay_steps=10, decay_rate=0.96,
                       staircase=True, name="my_ed"),
    S.PiecewiseConstantDecay(boundaries=[10, 20], values=[1, 2, 3], name="my_pcd"),
    S.PolynomialDecay(initial_learning_rate=0.1, decay_steps=100, end_learning_rate=0.005,
                      power=1.0, cycle=False, name="my_ld"),
    S.InverseTimeDecay(initial_learning_rate=0.05, decay_steps=10, decay_rate=0.96,
                       staircase=True, name="my_itd"),
    S.CosineDecay(initial_learning_rate=0.05, decay_steps=10, alpha=0.1, warmup_target=0.2,
                  warmup_steps=2, name="my_cd"),
    S.CosineDecayRestarts(initial_learning_rate=0.05, first_decay_steps=10, alpha=0.1,
                          t_mul=3.0, m_mul=4.0, name="my_cdr"),
]


@pytest.mark.parametrize("schedule", CONFIGS, ids=lambda s: type(s).__name__)
def test_config_round_trip(schedule):
    again = type(schedule).from_config(schedule.get_config())
    assert again.get_config() == schedule.get_config()
    back = S.deserialize(S.serialize(schedule))
    assert type(back) is type(schedule) and back.get_config() == schedule.get_config()
    for step in (0, 3, 11, 40):
        assert again(step) == schedule(step) == back(step)
    opt = gs.optimizers.SGD(schedule)
    again_opt = gs.optimizers.SGD.from_config(opt.get_config())
    assert again_opt.get_config()["learning_rate"] == S.serialize(schedule)
    assert again_opt.learning_rate == opt.learning_rate


def test_bad_arguments_name_the_value():
    for make in (lambda: S.ExponentialDecay(0.1, 0, 0.9),
                 lambda: S.PolynomialDecay(0.1, -1), lambda: S.InverseTimeDecay(0.1, 0, 1),
                 lambda: S.CosineDecay(0.1, 0)):
        with pytest.raises(ValueError, match="decay_steps` must be > 0"):
            make()
    with pytest.raises(ValueError, match="first_decay_steps` must be > 0"):
        S.CosineDecayRestarts(0.1, 0)
    with pytest.raises(ValueError, match="unknown learning rate schedule 'Mine'"):
        S.deserialize({"class_name": "Mine", "config": {}})


# --- in an optimizer ------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2])
def test_sgd_follows_the_schedule_on_any_replica_count(n):
    # Each replica's gradient is scaled by 1 / n, so that their sum is the gradient.
    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    schedule = S.CosineDecay(0.1, 4, warmup_target=0.5, warmup_steps=2)
    with strategy.scope():
        w = gs.Variable(np.zeros(3, np.float32))
        opt = gs.optimizers.SGD(schedule)
    grad = np.float32([1.0, -2.0, 0.5])
    want = np.zeros(3, np.float64)
    for step in range(8):
        assert opt.learning_rate == pytest.approx(schedule(step))
        strategy.run(lambda: opt.apply_gradients([(grad / n, w)]))
        want -= schedule(step) * grad
    for c in strategy.experimental_local_results(w):
        np.testing.assert_allclose(c.numpy(), want, rtol=1e-5)
    strategy.close()


def test_a_checkpoint_keeps_the_schedule_and_the_restore_carries_on(tmp_path):
    schedule = S.ExponentialDecay(0.1, 2, 0.5, staircase=True)
    w = gs.Variable(np.ones(2, np.float32), name="w")
    opt = gs.optimizers.Adam(schedule)
    for _ in range(3):
        opt.apply_gradients([(np.float32([1.0, -1.0]), w)])
    path = gs.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "c"))
    state = opt._checkpoint_state()
    assert state["learning_rate_schedule"] == S.serialize(schedule)
    assert "learning_rate" not in state
    w2 = gs.Variable(np.zeros(2, np.float32), name="w")
    again = gs.optimizers.Adam(S.ExponentialDecay(0.1, 2, 0.5, staircase=True))
    gs.train.Checkpoint(w=w2, opt=again).restore(path)
    assert int(again.iterations) == 3 and again.learning_rate == schedule(3) == 0.05
    for o, v in ((opt, w), (again, w2)):
        o.apply_gradients([(np.float32([0.5, 2.0]), v)])
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
