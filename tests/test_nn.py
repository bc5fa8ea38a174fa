"""gs.nn.compute_average_loss and scale_regularization_loss on 2 logical CPU replicas.

TensorFlow's values were recorded from TF 2.21 (MirroredStrategy, 2 logical CPUs) and
are hard-coded: replica 0's per-example losses are [1, 2, 3], replica 1's are [4].
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpustrat as gs

PIECES = [np.array([1.0, 2.0, 3.0], np.float32), np.array([4.0], np.float32)]
WEIGHTS = [np.array([1.0, 0.5, 2.0], np.float32), np.array([3.0], np.float32)]

# Recorded from TensorFlow 2.21: replica 0's and replica 1's results.
TF = {"gbs8": [0.75, 0.5], "weighted_gbs8": [1.0, 1.5], "scalar_weight_gbs8": [1.5, 1.0],
      "2d": [1.5, 1.0], "reg": [3.0, 2.0], "no_gbs": [1.0, 2.0]}


@pytest.fixture
def two():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    yield s
    s.close()


def per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group])


def run(strategy, fn):
    out = strategy.run(fn, args=(per_replica(strategy, PIECES),
                                 per_replica(strategy, WEIGHTS)))
    return list(strategy.experimental_local_results(out))


@pytest.mark.parametrize("name, fn", [
    ("gbs8", lambda x, w: gs.nn.compute_average_loss(x, global_batch_size=8)),
    ("weighted_gbs8", lambda x, w: gs.nn.compute_average_loss(x, w, global_batch_size=8)),
    ("scalar_weight_gbs8",
     lambda x, w: gs.nn.compute_average_loss(x, sample_weight=2.0, global_batch_size=8)),
    ("2d", lambda x, w: gs.nn.compute_average_loss(np.stack([x, x], 1), global_batch_size=8)),
    ("reg", lambda x, w: gs.nn.scale_regularization_loss(x.sum())),
])
def test_matches_tensorflow_with_a_global_batch_size(two, name, fn):
    got = run(two, fn)
    assert [float(g) for g in got] == TF[name]
    assert all(isinstance(g, np.ndarray) and g.dtype == np.float32 for g in got)


def test_without_global_batch_size_every_example_weighs_the_same(two):
    # TensorFlow divides by local rows x replicas: 6 / 6 and 4 / 2 (TF["no_gbs"]), so the
    # one example of replica 1 weighs three times the others. Here both divide by the 4
    # examples of the global batch, and the replicas' sum is the true mean, 2.5.
    got = [float(g) for g in run(two, lambda x, w: gs.nn.compute_average_loss(x))]
    assert got == [1.5, 1.0] and sum(got) == np.mean(np.concatenate(PIECES))
    assert sum(TF["no_gbs"]) != 2.5


def test_empty_pieces_add_nothing_and_float64_is_kept(two):
    pieces = [np.array([2.0, 4.0]), np.zeros(0)]
    out = two.run(lambda x: gs.nn.compute_average_loss(x),
                  args=(per_replica(two, pieces),))
    got = two.experimental_local_results(out)
    assert [float(g) for g in got] == [3.0, 0.0] and got[0].dtype == np.float64


def test_errors(two):
    with pytest.raises(ValueError, match="rank >= 1"):
        two.run(lambda: gs.nn.compute_average_loss(np.float32(1.0), global_batch_size=2))
    with pytest.raises(TypeError, match="numeric losses, got dtype bool"):
        two.run(lambda: gs.nn.compute_average_loss(np.array([True, False]),
                                                   global_batch_size=2))
    with pytest.raises(ValueError, match="sample_weight of shape"):
        two.run(lambda: gs.nn.compute_average_loss(np.ones(3), np.ones(2), 4))
    with two.scope():
        with pytest.raises(RuntimeError, match="cross-replica context"):
            gs.nn.compute_average_loss(np.ones(2))


# Recorded from TensorFlow 2.21 (2 logical CPUs): in cross-replica context, with a
# global batch size, compute_average_loss divides without any replica; a global batch
# of 0 gives 0 in both contexts (div_no_nan).
TF_CROSS = {"gbs8": 0.75, "weighted_gbs8": 1.0, "gbs0": 0.0, "scalar_weight_gbs3": 4.0}
TF_REPLICA_GBS0 = [0.0, 0.0]


def test_cross_replica_context_with_a_global_batch_size_matches_tensorflow(two):
    x, w = PIECES[0], WEIGHTS[0]
    with two.scope():
        got = {"gbs8": gs.nn.compute_average_loss(x, global_batch_size=8),
               "weighted_gbs8": gs.nn.compute_average_loss(x, w, global_batch_size=8),
               "gbs0": gs.nn.compute_average_loss(x, global_batch_size=0),
               "scalar_weight_gbs3": gs.nn.compute_average_loss(x, 2.0, 3)}
        with pytest.raises(RuntimeError, match="or give global_batch_size"):
            gs.nn.compute_average_loss(x)
        with pytest.raises(RuntimeError, match="cross-replica context"):
            gs.nn.scale_regularization_loss(x)
    assert {k: float(v) for k, v in got.items()} == TF_CROSS
    assert all(v.dtype == np.float32 and v.shape == () for v in got.values())
    out = run(two, lambda x, w: gs.nn.compute_average_loss(x, global_batch_size=0))
    assert [float(g) for g in out] == TF_REPLICA_GBS0
    with pytest.raises(ValueError, match="non-negative"):
        run(two, lambda x, w: gs.nn.compute_average_loss(x, global_batch_size=-1))


def test_column_weights_of_flat_losses_as_tensorflow():
    # Recorded from TensorFlow 2.21: (3,) losses with (3, 1) weights, global batch 4.
    # The weights used to broadcast against the losses into a 3 x 3 table (5.25).
    loss, w = np.array([1.0, 2.0, 3.0], np.float32), np.array([[1.0], [0.5], [2.0]], np.float32)
    assert float(gs.nn.compute_average_loss(loss, w, global_batch_size=4)) == 2.0
    with pytest.raises(ValueError, match="more axes"):
        gs.nn.compute_average_loss(loss, w[..., None], global_batch_size=4)


def test_outside_any_strategy_is_the_plain_mean():
    assert float(gs.nn.compute_average_loss(np.array([1.0, 3.0]))) == 2.0
    assert float(gs.nn.scale_regularization_loss(np.array([1.0, 3.0]))) == 4.0


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=3, max_size=3).filter(lambda r: sum(r) > 0),
       st.integers(0, 2 ** 16))
def test_replica_shares_add_up_to_the_global_mean(rows, seed):
    # Any cut of a global batch over 3 replicas, empty pieces included.
    rng = np.random.default_rng(seed)
    losses = [rng.random(n) for n in rows]
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    try:
        out = strategy.run(lambda x: gs.nn.compute_average_loss(x),
                           args=(per_replica(strategy, losses),))
        total = float(strategy.reduce("sum", out))
    finally:
        strategy.close()
    assert total == pytest.approx(np.concatenate(losses).mean(), rel=1e-12)
