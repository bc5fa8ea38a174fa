"""Where gpustrat once differed from Keras 3 or TensorFlow 2.21 (each case a program a
Keras user writes, with what Keras 3 or TensorFlow gives)."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs


# --- a callable learning rate ------------------------------------------------------------

def test_a_plain_callable_learning_rate_is_called_with_no_arguments(two):
    # Keras 3 (base_optimizer._get_current_learning_rate): a LearningRateSchedule is
    # given the step, any other callable is called with none: SGD(learning_rate=lambda:
    # 0.1) is Keras's own example.
    with two.scope():
        v = gs.Variable(np.ones(2, np.float32))
        opt = gs.optimizers.SGD(learning_rate=lambda: 0.1)
    assert opt.learning_rate == 0.1
    two.run(lambda: opt.apply_gradients([(np.full(2, 0.5, np.float32), v)]))
    # Two replicas' gradients summed: 1.0, times 0.1.
    np.testing.assert_allclose(v.numpy(), [0.9, 0.9], rtol=1e-6)

    class Halving(gs.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.2 * 0.5 ** step
    opt = gs.optimizers.SGD(Halving())
    assert opt.learning_rate == 0.2
    w = gs.Variable(np.ones(1, np.float32))
    opt.apply_gradients([(np.ones(1, np.float32), w)])
    assert opt.learning_rate == 0.1


def test_a_callable_that_needs_the_step_is_refused_with_the_schedule_to_use():
    with pytest.raises(TypeError, match=r"called with none \(as in Keras 3\).*subclass "
                                        r"gs.optimizers.schedules.LearningRateSchedule"):
        gs.optimizers.SGD(lambda step: 0.1)
    opt = gs.optimizers.SGD(0.1)
    with pytest.raises(TypeError, match="LearningRateSchedule"):
        opt.learning_rate = lambda step: 0.1
    assert opt.learning_rate == 0.1
