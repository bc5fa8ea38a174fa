"""Variables, merge_call and strategy.extended on logical CPU replicas."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.values import Mirrored, PerReplica




def rid():
    return gs.get_replica_context().replica_id_in_sync_group


def comps(strategy, v):
    return [np.asarray(c).tolist() for c in strategy.experimental_local_results(v)]


def test_components_are_separate_arrays_on_their_devices(three):
    with three.scope():
        v = gs.Variable(np.arange(3.0))
    parts = three.experimental_local_results(v)
    assert [c.device for c in parts] == ["cpu:0", "cpu:1", "cpu:2"]
    parts[1].assign([7.0, 7.0, 7.0])          # a component is a variable of its own
    assert comps(three, v) == [[0, 1, 2], [7, 7, 7], [0, 1, 2]]


def test_plain_variable_outside_any_scope():
    v = gs.Variable([1.0, 2.0], name="w")
    assert type(v) is gs.Variable and v.device == "cpu:0" and v.name == "w"
    assert v.assign_add([1.0, 1.0]) is v
    np.testing.assert_array_equal(v.numpy(), [2.0, 3.0])
    assert v.dtype == np.float32 and v.shape == (2,)


def test_reading_gives_copies_and_readonly_views(two):
    with two.scope():
        v = gs.Variable([1.0, 2.0])
    kept = v.read_value()
    view = v.value()
    with pytest.raises(ValueError):
        view[0] = 5.0                          # the live value cannot be written through
    kept[0] = 9.0                              # a copy: the variable does not change
    with two.scope():
        v.assign([3.0, 4.0])
    assert comps(two, v) == [[3.0, 4.0], [3.0, 4.0]]


def test_arithmetic_and_numpy_functions_read_the_value(two):
    with two.scope():
        v = gs.Variable([[1.0, 2.0], [3.0, 4.0]])
    x = np.ones((1, 2), np.float32)
    np.testing.assert_array_equal(x @ v, [[4.0, 6.0]])
    np.testing.assert_array_equal(v @ x.T, [[3.0], [7.0]])
    np.testing.assert_array_equal(np.tanh(v), np.tanh(np.float32([[1, 2], [3, 4]])))
    np.testing.assert_array_equal(2 * v - 1, [[1, 3], [5, 7]])
    np.testing.assert_array_equal(np.asarray(v), [[1, 2], [3, 4]])
    assert float(v[1, 1]) == 4.0 and len(v) == 2


def test_replica_reads_see_their_own_component_of_a_sync_on_read_variable(two):
    with two.scope():
        v = gs.Variable(0.0, synchronization="on_read", aggregation="sum")

    def step():
        v.assign_add(float(rid() + 1))
        return float(v), v.device
    out = two.run(step)
    assert two.experimental_local_results(out) == ((1.0, "cpu:0"), (2.0, "cpu:1"))
    with two.scope():
        assert float(v) == 3.0
        assert float(two.reduce("sum", v)) == 3.0     # a variable reduces by its components


def test_mirrored_none_aggregation_update_in_replica_context_is_an_error(two):
    with two.scope():
        v = gs.Variable([1.0, 2.0], name="w")
    with pytest.raises(ValueError, match="'w'.*NONE.*SUM, MEAN or\\s+ONLY_FIRST_REPLICA"):
        two.run(lambda: v.assign_add([1.0, 1.0]))
    assert comps(two, v) == [[1.0, 2.0], [1.0, 2.0]]


def test_sum_aggregation_over_three_replicas_and_a_second_step(three):
    with three.scope():
        v = gs.Variable([0.0], aggregation=gs.VariableAggregation.SUM)
    for _ in range(2):
        three.run(lambda: v.assign_add([float(rid())]))
    assert comps(three, v) == [[6.0]] * 3


def test_variable_made_inside_run_takes_replica_zeros_value(two):
    def step():
        return gs.Variable([float(rid())], name="made_in_run")
    out = two.run(step)
    assert isinstance(out, gs.Variable)           # the same variable on every replica
    assert comps(two, out) == [[0.0], [0.0]]


def test_integer_mean_and_none_sync_are_refused(two):
    with two.scope():
        with pytest.raises(ValueError, match="MEAN needs a floating dtype"):
            gs.Variable([1, 2], aggregation="mean")
    plain = gs.Variable([1, 2], aggregation="mean")  # a plain variable: nothing to aggregate
    assert plain.dtype == np.int32


def test_variable_of_one_strategy_refuses_another_strategys_scope(two):
    other = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with two.scope():
            v = gs.Variable([1.0], name="mine")
        with other.scope():
            with pytest.raises(ValueError, match="'mine' was made under"):
                v.assign([2.0])
        with pytest.raises(ValueError, match="'mine' was made under"):
            other.run(lambda: v.assign_add([1.0]))
    finally:
        other.close()
    assert comps(two, v) == [[1.0], [1.0]]


def test_updates_outside_the_scope_act_in_cross_replica_context(two):
    with two.scope():
        v = gs.Variable([1.0], aggregation="sum")
    v.assign_add([2.0])
    assert comps(two, v) == [[3.0], [3.0]]


# --- merge_call and extended ---------------------------------------------------------------
# The values below (reduce_to, batch_reduce_to MEAN, update in both contexts, a merge_call
# that reduces) are what TensorFlow 2.21 gives on 2 logical CPUs (recorded by a side
# script): reduce_to SUM of [1, 2] and [3, 4] is [4, 6] on both; batch_reduce_to MEAN of
# ones and 3 * ones is [2, 2, 2]; the updates give [-1, -2], then [0, -1] / [1, 0]; the
# merge_call gives 3.0 to both replicas.

def test_merge_call_merges_arguments_and_hands_back_each_replicas_part(two):
    seen = {}

    def merge_fn(strategy, value, shared):
        seen["ctx"] = (gs.get_replica_context(), gs.in_cross_replica_context())
        seen["value"] = value
        total = strategy.reduce("sum", value)                # allowed here
        return total, PerReplica((10, 20))

    marker = object()

    def step():
        return gs.get_replica_context().merge_call(
            merge_fn, args=(float(rid() + 1),), kwargs={"shared": marker})
    out = two.run(step)
    assert seen["ctx"] == (None, True)
    assert isinstance(seen["value"], PerReplica) and seen["value"].values == (1.0, 2.0)
    assert two.experimental_local_results(out) == ((3.0, 10), (3.0, 20))


def test_run_inside_merge_call_is_an_error(two):
    def merge_fn(strategy):
        return strategy.run(lambda: 1)
    with pytest.raises(RuntimeError, match="inside a merge_call"):
        two.run(lambda: gs.get_replica_context().merge_call(merge_fn))


def test_extended_reduce_to_and_batch_reduce_to(two):
    values = two.experimental_distribute_values_from_function(
        lambda ctx: np.array([1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1))
    with two.scope():
        one = two.extended.reduce_to("sum", values, None)
        many = two.extended.batch_reduce_to(
            "mean", [(values, None), (PerReplica((np.ones(3), 3 * np.ones(3))), None)])
    assert isinstance(one, Mirrored)
    assert [x.tolist() for x in one.values] == [[3.0, 6.0], [3.0, 6.0]]
    assert [x.tolist() for x in many[0].values] == [[1.5, 3.0], [1.5, 3.0]]
    assert [x.tolist() for x in many[1].values] == [[2.0] * 3, [2.0] * 3]
    with pytest.raises(ValueError, match="cannot SUM-reduce a plain value"):
        two.extended.reduce_to("sum", 1.0, None)


def test_extended_update_in_both_contexts(two):
    with two.scope():
        v = gs.Variable([1.0, 1.0])
        grads = two.extended.reduce_to(
            "sum", PerReplica((np.array([1.0, 2.0]), np.array([3.0, 4.0]))), v)
        out = two.extended.update(v, lambda c, g: c.assign_sub(0.5 * g), args=(grads,))
    assert comps(two, v) == [[-1.0, -2.0], [-1.0, -2.0]]
    assert isinstance(out, Mirrored) and out.values[0] is two.experimental_local_results(v)[0]

    def step():
        # In replica context update goes through a merge_call: each replica's delta
        # reaches its own component.
        return two.extended.update(v, lambda c, d: c.assign_add(d),
                                   args=(np.full(2, rid() + 1.0),), group=False)
    two.run(step)
    assert comps(two, v) == [[0.0, -1.0], [1.0, 0.0]]


def test_merge_call_error_reaches_every_replica(two):
    def merge_fn(strategy):
        raise KeyError("in merge")
    with pytest.raises(KeyError, match="in merge"):
        two.run(lambda: gs.get_replica_context().merge_call(merge_fn))
    # The strategy still works afterwards.
    assert two.experimental_local_results(two.run(lambda: rid())) == (0, 1)


def test_replicas_updating_different_variables_is_an_error(two):
    with two.scope():
        a = gs.Variable([0.0], aggregation="sum", name="a")
        b = gs.Variable([0.0], aggregation="sum", name="b")
    with pytest.raises(ValueError, match="different collectives"):
        two.run(lambda: (a if rid() == 0 else b).assign_add([1.0]))
    assert comps(two, a) == comps(two, b) == [[0.0], [0.0]]


def test_one_replica_with_a_bad_value_fails_the_step_without_a_hang(two):
    with two.scope():
        v = gs.Variable([0.0, 0.0], aggregation="mean", name="w")
    with pytest.raises(ValueError, match="shape \\(2,\\) got a value of shape \\(3,\\)"):
        two.run(lambda: v.assign([1.0, 2.0] if rid() == 0 else [1.0, 2.0, 3.0]))
    assert comps(two, v) == [[0.0, 0.0], [0.0, 0.0]]


def test_one_device_and_default_strategies():
    one = gs.OneDeviceStrategy("cpu:0")
    try:
        with one.scope():
            v = gs.Variable([1.0], aggregation="mean")
        one.run(lambda: v.assign_add([2.0]))
        assert comps(one, v) == [[3.0]]
    finally:
        one.close()


def test_cross_replica_value_of_a_first_replica_variable_is_read_only(two):
    with two.scope():
        v = gs.Variable([1.0], synchronization="on_read", aggregation="only_first_replica")
        with pytest.raises(ValueError):
            v.value()[0] = 5.0
        kept = v.read_value()
        kept[0] = 7.0
    assert comps(two, v) == [[1.0], [1.0]]


def test_variables_made_in_the_default_strategys_run_are_plain():
    v = gs.get_strategy().run(lambda: gs.Variable([1.0]))
    assert type(v) is gs.Variable
    v.assign_add([1.0])
    assert v.numpy().tolist() == [2.0]
