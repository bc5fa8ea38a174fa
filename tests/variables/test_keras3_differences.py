"""Where gpustrat once differed from Keras 3 or TensorFlow 2.21 (each case a program a
Keras user writes, with what Keras 3 or TensorFlow gives)."""

from __future__ import annotations

import re

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


# --- accuracy shape rules ------------------------------------------------------------------

def test_sparse_accuracy_broadcasts_labels_against_the_arg_max_as_keras():
    # keras/src/metrics/accuracy_metrics_test.py SparseCategoricalAccuracyTest.
    # test_reshape_matches: labels (2, 1), scores (1, 2, 3): the arg-max (1, 2) and the
    # labels broadcast to (2, 2), every one a hit.
    m = gs.metrics.SparseCategoricalAccuracy()
    m.update_state(np.array([[0], [0]], np.int64),
                   np.array([[[0.9, 0.1, 0.0], [0.8, 0.15, 0.05]]], np.float32))
    assert float(m.result()) == 1.0
    assert gs.metrics.sparse_categorical_accuracy(
        np.array([[0], [0]]), np.array([[[0.9, 0.1, 0.0], [0.1, 0.8, 0.1]]])).tolist() == \
        [[1.0, 0.0], [1.0, 0.0]]


def test_accuracy_rules_on_two_replicas(two):
    # The same cases, one example per replica (BinaryAccuracyTest.test_unweighted's
    # broadcasting case: labels (4,), scores (4, 1)).
    with two.scope():
        binary = gs.metrics.BinaryAccuracy()
    per = two.experimental_distribute_values_from_function
    labels = np.array([1, 1, 0, 0])
    scores = np.array([[0.98], [1], [0], [0.6]])
    two.run(lambda t, p: binary.update_state(t, p),
            args=(per(lambda c: labels[2 * c.replica_id_in_sync_group:][:2]),
                  per(lambda c: scores[2 * c.replica_id_in_sync_group:][:2])))
    assert float(binary.result()) == 0.75


def test_labels_that_do_not_broadcast_name_both_shapes():
    with pytest.raises(ValueError, match=r"y_true of shape \(3,\) does not match y_pred "
                                         r"of shape \(2, 3\)"):
        gs.metrics.SparseCategoricalAccuracy().update_state(np.array([1, 2, 3]),
                                                            np.zeros((2, 3)))


# --- Adam's slot names ---------------------------------------------------------------------

@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_adam_slots_have_keras_3_names_and_old_checkpoints_still_restore(two, cls):
    # keras/src/optimizers/adam.py: self._momentums, self._velocities and, with
    # amsgrad, self._velocity_hats, made as "momentum", "velocity", "velocity_hat".
    def make():
        with two.scope():
            w = gs.Variable(np.ones(3, np.float32), name="w")
            opt = getattr(gs.optimizers, cls)(0.1, amsgrad=True)
        return w, opt

    w, opt = make()
    assert opt.slot_names == ("momentum", "velocity", "velocity_hat")
    for g in (np.float32([1, -2, 3]), np.float32([-1, 0.5, 2])):
        two.run(lambda: opt.apply_gradients([(g / 2, w)]))
    assert [v.name for v in opt.variables[1:]] == ["w/momentum", "w/velocity",
                                                   "w/velocity_hat"]
    state = opt._checkpoint_state()
    # A checkpoint written when the slots were called m, v and vhat (by name).
    old = {k: v for k, v in state.items() if k not in ("variable_slots", "named_slots")}
    old["named_slots"] = {"w": {old_name: state["named_slots"]["w"][new]
                                for old_name, new in (("m", "momentum"), ("v", "velocity"),
                                                      ("vhat", "velocity_hat"))}}
    old["variable_slots"] = {}
    w2, restored = make()
    w2.assign(w.numpy())
    restored._restore_checkpoint_state(old)
    two.run(lambda: restored.apply_gradients([(np.zeros(3, np.float32), w2)]))
    two.run(lambda: opt.apply_gradients([(np.zeros(3, np.float32), w)]))
    for s in opt.slot_names:
        np.testing.assert_array_equal(restored.get_slot(w2, s).numpy(),
                                      opt.get_slot(w, s).numpy())
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    # TensorFlow's Keras 2 names still find the slots.
    assert restored.get_slot(w2, "m") is restored.get_slot(w2, "momentum")
    assert restored.get_slot(w2, "vhat") is restored.get_slot(w2, "velocity_hat")


# --- TensorFlow 2.21's variables and losses ------------------------------------------------

def test_summing_one_python_value_over_replicas_is_refused_as_tensorflow(two):
    from tf_recorded_variables import TF_LOOPS
    want = TF_LOOPS["mirrored/SUM/replica/assign_add(2.0)"].removeprefix("ERR ValueError: ")
    with two.scope():
        v = gs.Variable(10.0, aggregation=gs.VariableAggregation.SUM)
    with pytest.raises(ValueError, match=re.escape(want[:-1])):
        two.run(lambda: v.assign_add(2.0))
    assert float(v.numpy()) == 10.0                  # nothing was added (it was 14)
    # Per-replica values are summed; zeros (the same on every replica) add nothing.
    two.run(lambda: v.assign_add(float(gs.get_replica_context().replica_id_in_sync_group)))
    two.run(lambda: v.assign_add(0.0))
    assert float(v.numpy()) == 11.0
    with two.scope():
        mean = gs.Variable(10.0, aggregation=gs.VariableAggregation.MEAN)
    two.run(lambda: mean.assign_add(2.0))
    assert float(mean.numpy()) == 12.0


def test_one_device_updates_a_variable_without_aggregation_in_replica_context():
    from tf_recorded_variables import TF_LOOPS
    one = gs.OneDeviceStrategy("cpu:0")
    with one.scope():
        v = gs.Variable(10.0)
    assert v.aggregation is gs.VariableAggregation.NONE
    one.run(lambda: v.assign_add(2.0))
    assert float(v.numpy()) == TF_LOOPS["one_device/NONE/replica/assign_add(2.0)"]
    # Several replicas still refuse it (their copies would diverge).
    two = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    with two.scope():
        w = gs.Variable(10.0)
    with pytest.raises(ValueError, match="needs an aggregation"):
        two.run(lambda: w.assign_add(2.0))


def test_average_loss_of_integer_losses_is_float64(two):
    from tf_recorded_variables import TF_LOOPS
    dtype, value = TF_LOOPS["compute_average_loss/int32/global_batch_size=4"]
    got = gs.nn.compute_average_loss(np.array([1, 2, 3], np.int32), global_batch_size=4)
    assert (str(got.dtype), float(got)) == (dtype, value)
    dtype, value = TF_LOOPS["compute_average_loss/int32/2 replicas"]
    out = two.run(lambda: gs.nn.compute_average_loss(np.array([1, 2, 3], np.int32)))
    for got in two.experimental_local_results(out):
        assert (str(got.dtype), float(got)) == (dtype, value)
