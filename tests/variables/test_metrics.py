"""Metrics on sync-on-read variables: per-replica accumulation inside run, one fused
reduction for result() in cross-replica context, partial batches, reset."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset



def test_mean_and_sum_over_an_epoch_with_a_partial_batch(two):
    with two.scope():
        mean, total = gs.metrics.Mean(), gs.metrics.Sum()
    assert isinstance(mean.total, gs.Variable) and not mean.total.trainable
    assert mean.total.synchronization is gs.VariableSynchronization.ON_READ
    data = np.arange(9.0, dtype=np.float32)
    for batch in two.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(4)):
        two.run(lambda x: (mean.update_state(x), total.update_state(x)), args=(batch,))
    with two.scope():
        assert float(mean.result()) == 4.0 and float(total.result()) == 36.0
        assert mean.result().dtype == np.float32
    # The components hold each replica's part: [0,1] [4,5] [8] and [2,3] [6,7] [].
    assert [float(c) for c in two.experimental_local_results(mean.count)] == [5.0, 4.0]
    mean.reset_state()
    with two.scope():
        assert float(mean.result()) == 0.0        # no division by zero


def test_result_inside_run_is_the_replicas_own(two):
    with two.scope():
        m = gs.metrics.Mean()
    out = two.run(lambda: m(np.full(2, float(gs.get_replica_context()
                                              .replica_id_in_sync_group + 1))))
    assert [float(x) for x in two.experimental_local_results(out)] == [1.0, 2.0]
    with two.scope():
        assert float(m.result()) == 1.5


def test_weighted_mean_and_accuracies(two):
    with two.scope():
        mean = gs.metrics.Mean()
        acc = gs.metrics.Accuracy()
        sparse = gs.metrics.SparseCategoricalAccuracy()
    labels = [np.array([1, 0]), np.array([2])]
    scores = [np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]), np.array([[0.5, 0.4, 0.1]])]
    weights = [np.array([1.0, 3.0]), np.array([2.0])]
    per = lambda xs: two.experimental_distribute_values_from_function(  # noqa: E731
        lambda ctx: xs[ctx.replica_id_in_sync_group])

    def step(y, p, w):
        sparse.update_state(y, p, sample_weight=w)
        acc.update_state(y, p.argmax(axis=1))
        mean.update_state(p, sample_weight=w)          # a weight per row
    two.run(step, args=(per(labels), per(scores), per(weights)))
    with two.scope():
        # hits: 1, 1 (weights 1, 3), miss (weight 2): 4 / 6.
        assert float(sparse.result()) == pytest.approx(4 / 6)
        assert float(acc.result()) == pytest.approx(2 / 3)
        want = (1 * 1.0 + 3 * 1.0 + 2 * 1.0) / (3 * (1 + 3 + 2))   # rows sum to 1
        assert float(mean.result()) == pytest.approx(want)


def test_sparse_accuracy_takes_column_labels_and_empty_pieces():
    m = gs.metrics.SparseCategoricalAccuracy()          # plain, outside any scope
    m.update_state(np.array([[2], [0]]), np.array([[0, 0, 1.0], [0, 1.0, 0]]))
    m.update_state(np.zeros((0,), int), np.zeros((0, 3)))
    assert float(m.result()) == 0.5
    with pytest.raises(ValueError, match="does not\\s+match y_pred"):
        m.update_state(np.array([1, 2, 3]), np.zeros((2, 3)))


def test_cross_replica_update_counts_once(two):
    with two.scope():
        s = gs.metrics.Sum()
        s.update_state(np.array([1.0, 2.0]))
        assert float(s.result()) == 3.0


def test_cross_replica_update_is_spread_evenly_over_the_replicas(two):
    # TensorFlow 2.21 (Keras 3 metrics, 2 logical CPUs): a cross-replica update of [1, 3]
    # then each replica adding 10 * (r + 1) gives replica results [6.0, 11.0]; the whole
    # update used to go to replica 0 ([4.67, 20.0]). The total is the same either way.
    with two.scope():
        m, s = gs.metrics.Mean(), gs.metrics.Sum()
    m.update_state(np.float32([1.0, 3.0]))
    s.update_state(np.float32([1.0, 3.0]))
    assert float(m.result()) == 2.0 and float(s.result()) == 4.0
    assert [c.numpy().item() for c in s.total.values] == [2.0, 2.0]

    def fn():
        r = gs.get_replica_context().replica_id_in_sync_group
        m.update_state([10.0 * (r + 1.0)])
        return m.result()
    got = two.experimental_local_results(two.run(fn))
    assert [float(x) for x in got] == [6.0, 11.0]
    assert float(m.result()) == 8.5


def test_metric_of_one_strategy_under_another_is_an_error(two):
    with two.scope():
        m = gs.metrics.Mean()
    other = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with other.scope():
            with pytest.raises(ValueError, match="was made under"):
                m.result()
        with pytest.raises(ValueError, match="was made under"):
            other.run(lambda: m.update_state(np.ones(2)))
    finally:
        other.close()


def test_a_metric_made_outside_the_scope_is_refused_inside_run(two):
    m = gs.metrics.Sum()
    with pytest.raises(ValueError, match="made outside strategy.scope"):
        two.run(lambda: m.update_state(np.ones(2)))


F = np.float32
W_COLUMN = np.array([[1.0], [0.5], [2.0]], F)
# Keras 3 (TensorFlow 2.21) metrics fed these updates in turn; recorded from TensorFlow:
# each state variable (total, count) and result(). An example (a row) counts once in a
# Mean, with its weight; (n, 1) labels and weights go with (n,) values.
KERAS_CASES = {
    "mean_rows_then_scalar_rows": ("Mean", [((np.ones((2, 2), F),), {}),
                                            ((np.array([4.0], F),), {})]),
    "mean_weight_column": ("Mean", [((np.array([1.0, 2.0, 3.0], F),),
                                     {"sample_weight": W_COLUMN})]),
    "sum_weight_column": ("Sum", [((np.array([1.0, 2.0, 3.0], F),),
                                   {"sample_weight": W_COLUMN})]),
    "mean_full_weights_then_rows": (
        "Mean", [((np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], F),),
                  {"sample_weight": np.array([[1.0, 0.0], [0.5, 1.0], [2.0, 2.0]], F)}),
                 ((np.array([7.0], F),), {})]),
    "mean_scalar_weight_then_more": ("Mean", [((np.array([1.0, 2.0, 3.0], F),),
                                               {"sample_weight": F(2.0)}),
                                              ((np.array([10.0], F),), {})]),
    "mean_scalar_value_then_rows": ("Mean", [((F(5.0),), {}),
                                             ((np.array([1.0, 2.0], F),), {})]),
    "mean_row_weights_3d": ("Mean", [((np.arange(12, dtype=F).reshape(3, 2, 2),),
                                      {"sample_weight": np.array([1.0, 0.0, 2.0], F)}),
                                     ((np.array([1.0], F),), {})]),
    "sum_rows_row_weights": ("Sum", [((np.arange(6, dtype=F).reshape(3, 2),),
                                      {"sample_weight": np.array([1.0, 0.5, 2.0], F)})]),
    "sca_column_labels_column_weights": (
        "SparseCategoricalAccuracy", [((np.array([[0], [1], [2]]), np.eye(3, dtype=F)[[0, 1, 1]]),
                                       {"sample_weight": W_COLUMN})]),
    "accuracy_column_vs_flat": ("Accuracy", [((np.array([[0.0], [1.0], [2.0]], F),
                                               np.array([0.0, 1.0, 1.0], F)), {})]),
    "accuracy_rows_then_one": ("Accuracy", [((np.array([[0.0, 1.0], [1.0, 1.0]], F),
                                              np.array([[0.0, 0.0], [1.0, 1.0]], F)), {}),
                                             ((np.array([[2.0]], F), np.array([[2.0]], F)),
                                              {})]),
}
TF_KERAS = {
    "mean_rows_then_scalar_rows": [6.0, 3.0, 2.0],
    "mean_weight_column": [8.0, 3.5, 2.2857143878936768],
    "sum_weight_column": [8.0, 8.0],
    "mean_full_weights_then_rows": [21.25, 4.25, 5.0],
    "mean_scalar_weight_then_more": [14.0, 3.0, 4.666666507720947],
    "mean_scalar_value_then_rows": [8.0, 3.0, 2.6666667461395264],
    "mean_row_weights_3d": [21.5, 4.0, 5.375],
    "sum_rows_row_weights": [21.5, 21.5],
    "sca_column_labels_column_weights": [1.5, 3.5, 0.4285714328289032],
    "accuracy_column_vs_flat": [2.0, 3.0, 0.6666666865348816],
    "accuracy_rows_then_one": [2.5, 3.0, 0.8333333134651184],
}


@pytest.mark.parametrize("name", sorted(KERAS_CASES))
def test_shapes_and_weights_as_keras(name):
    # Column weights with flat values used to be refused (or, in Mean, rows of several
    # values counted once per value, so that later updates weighed differently).
    cls, calls = KERAS_CASES[name]
    m = getattr(gs.metrics, cls)()
    for args, kwargs in calls:
        m.update_state(*args, **kwargs)
    got = [float(v.numpy()) for v in m.variables] + [float(m.result())]
    assert got == pytest.approx(TF_KERAS[name], rel=1e-6)


@pytest.mark.parametrize("name", ["mean_full_weights_then_rows", "accuracy_rows_then_one"])
def test_shapes_and_weights_as_keras_inside_run(two, name):
    # Every replica gets the whole batch: the totals are twice TensorFlow's one-process
    # ones, and the result the same.
    cls, calls = KERAS_CASES[name]
    with two.scope():
        m = getattr(gs.metrics, cls)()
    for args, kwargs in calls:
        two.run(lambda: m.update_state(*args, **kwargs))
    with two.scope():
        got = [float(v.numpy()) for v in m.variables] + [float(m.result())]
    want = [2 * x for x in TF_KERAS[name][:-1]] + TF_KERAS[name][-1:]
    assert got == pytest.approx(want, rel=1e-6)
