"""Strategies on logical CPU devices: the seeds' examples, contexts, run, reductions."""

import collections
import re
import threading

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.distribute import runner as runner_mod


def cpus(n):
    return [f"cpu:{i}" for i in range(n)]


@pytest.fixture(params=[1, 2, 3, 5], ids=lambda n: f"{n}rep")
def strategy(request):
    s = gs.MirroredStrategy(cpus(request.param))
    yield s
    s.close()


# --- seed examples -------------------------------------------------------------------

def test_seed_run_on_constant():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    result = s.run(lambda x: x * 2.0, args=(3.0,))
    assert isinstance(result, gs.PerReplica)
    assert result.values == (6.0, 6.0)
    assert repr(result) == "PerReplica:{0: 6.0, 1: 6.0}"


def test_seed_all_reduce_of_replica_ids():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    values = s.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group)
    assert values.values == (0, 1)
    result = s.run(lambda v: gs.get_replica_context().all_reduce("sum", v), args=(values,))
    # Both replicas get 1 (TF 2.21: PerReplica {0: 1, 1: 1}).
    assert isinstance(result, gs.PerReplica) and result.values == (1, 1)


def test_single_replica_run_returns_plain_values():
    s = gs.MirroredStrategy(["cpu:0"])
    assert s.run(lambda x: x + 1, args=(1,)) == 2
    o = gs.OneDeviceStrategy("/cpu:0")
    assert o.run(lambda x: x * 2.0, args=(3.0,)) == 6.0
    assert o.num_replicas_in_sync == 1


def test_every_public_name_resolves():
    # `from gpustrat import *` looks up every name of __all__; one that does not resolve
    # ("experimental" did) breaks it for every user.
    ns = {}
    exec("from gpustrat import *", ns)
    assert set(gs.__all__) <= set(ns)
    assert ns["MirroredStrategy"] is gs.MirroredStrategy and ns["data"].Dataset


# --- contexts ------------------------------------------------------------------------

def test_contexts_like_tf_distribute():
    s = gs.MirroredStrategy(cpus(2))
    assert not gs.has_strategy()
    default_ctx = gs.get_replica_context()
    assert default_ctx is not None and default_ctx.replica_id_in_sync_group == 0
    assert default_ctx.num_replicas_in_sync == 1
    with s.scope():
        assert gs.has_strategy() and gs.get_strategy() is s
        assert gs.in_cross_replica_context()
        assert gs.get_replica_context() is None
        assert gs.get_cross_replica_context() is s
        seen = s.run(lambda: (gs.get_strategy() is s, gs.get_replica_context().replica_id_in_sync_group,
                              gs.in_cross_replica_context()))
        assert s.experimental_local_results(seen) == ((True, 0, False), (True, 1, False))
    assert not gs.has_strategy()


def test_scope_of_another_strategy_inside_is_refused():
    a, b = gs.MirroredStrategy(cpus(2)), gs.OneDeviceStrategy("cpu:0")
    with a.scope():
        with pytest.raises(RuntimeError, match="inside the scope of another strategy"):
            with b.scope():
                pass


def test_run_inside_run_and_reduce_inside_run_are_refused():
    s = gs.MirroredStrategy(cpus(2))
    with pytest.raises(RuntimeError, match="already running in a replica context"):
        s.run(lambda: s.run(lambda: 1))
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.reduce("sum", 1.0, axis=None))


# --- run -----------------------------------------------------------------------------

def test_per_replica_args_unpack_at_any_depth(strategy):
    n = strategy.num_replicas_in_sync
    pr = gs.PerReplica([np.full(2, i) for i in range(n)])
    out = strategy.run(lambda d, k=None: d["x"] + k, args=({"x": pr},), kwargs={"k": 10})
    local = strategy.experimental_local_results(out)
    for i, v in enumerate(local):
        np.testing.assert_array_equal(v, np.full(2, i + 10))


def test_run_result_keeps_structure():
    Out = collections.namedtuple("Out", "a b")
    s = gs.MirroredStrategy(cpus(3))
    out = s.run(lambda: Out(gs.get_replica_context().replica_id_in_sync_group, {"c": None}))
    assert isinstance(out, Out) and out.b == {"c": None}
    assert out.a.values == (0, 1, 2)


def test_threads_are_persistent_and_bound_per_replica():
    s = gs.MirroredStrategy(cpus(3))

    def fn():
        # A collective forces every replica onto its own thread.
        gs.get_replica_context().all_reduce("sum", 1)
        return threading.current_thread()
    first = s.experimental_local_results(s.run(fn))
    # Threads of strategies dropped by earlier tests may still be ending: no thread may
    # appear, whatever else goes away.
    before = set(threading.enumerate())
    for _ in range(20):
        again = s.experimental_local_results(s.run(fn))
    assert again == first and set(threading.enumerate()) <= before
    assert len(set(first)) == 3
    assert first[0] is threading.current_thread()


def test_long_steps_run_other_replicas_in_parallel_threads(monkeypatch):
    monkeypatch.setattr(runner_mod, "INLINE_STEP_LIMIT_S", 0.0)
    s = gs.MirroredStrategy(cpus(2))
    names = s.experimental_local_results(s.run(lambda: threading.current_thread().name))
    assert names[1].startswith("gpustrat-replica-1-cpu:1")


def test_exception_names_replica_and_others_do_not_hang():
    s = gs.MirroredStrategy(cpus(3))

    def fn():
        rid = gs.get_replica_context().replica_id_in_sync_group
        if rid == 2:
            raise KeyError("bad replica")
        return gs.get_replica_context().all_reduce("sum", 1.0)  # 0 and 1 wait here
    with pytest.raises(KeyError, match="bad replica") as ei:
        s.run(fn)
    assert "(raised in replica 2 on cpu:2)" in ei.value.__notes__
    # The strategy still works after the failure.
    out = s.run(lambda: gs.get_replica_context().all_reduce("sum", 1.0))
    assert s.experimental_local_results(out) == (3.0, 3.0, 3.0)


def test_mismatched_collectives_are_reported():
    s = gs.MirroredStrategy(cpus(2))

    def fn():
        ctx = gs.get_replica_context()
        return ctx.all_reduce("sum" if ctx.replica_id_in_sync_group == 0 else "max", 1.0)
    with pytest.raises(ValueError, match="replica 0 called .*SUM.* replica 1 called .*MAX"):
        s.run(fn)

    def late():
        ctx = gs.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            return ctx.all_reduce("sum", 1.0)
    with pytest.raises(ValueError, match="replica 0 never called"):
        s.run(late)


def test_old_name_experimental_run_v2():
    s = gs.MirroredStrategy(cpus(2))
    assert s.experimental_run_v2(lambda: 5).values == (5, 5)


# --- replica-context collectives -----------------------------------------------------

def test_all_reduce_nested_every_op(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        r = gs.get_replica_context().replica_id_in_sync_group
        value = {"a": np.array([r, 10.0 * r]), "b": (np.float32(r + 1),)}
        ctx = gs.get_replica_context()
        return tuple(ctx.all_reduce(op, value) for op in ("sum", gs.ReduceOp.MEAN, "MAX", "min"))
    for res in strategy.experimental_local_results(strategy.run(fn)):
        total = sum(range(n))
        s_, m_, mx, mn = res
        np.testing.assert_allclose(s_["a"], [total, 10.0 * total])
        np.testing.assert_allclose(m_["a"], [total / n, 10.0 * total / n])
        np.testing.assert_allclose(mx["b"][0], n)
        np.testing.assert_allclose(mn["b"][0], 1)


def test_booleans_reduce_alike_on_any_replica_count(strategy):
    # One array on a single replica takes a shortcut to the communicator: the same
    # rules as every other path (SUM and MEAN of booleans are errors; MAX is any).
    def fn(op):
        ctx = gs.get_replica_context()
        return ctx.all_reduce(op, np.array([ctx.replica_id_in_sync_group == 0, False]))
    for op in ("sum", gs.ReduceOp.MEAN):
        with pytest.raises(TypeError, match="of booleans is not defined"):
            strategy.run(fn, args=(op,))
    for res in strategy.experimental_local_results(strategy.run(fn, args=("max",))):
        np.testing.assert_array_equal(res, [True, False])


def test_complex_values_sum_but_have_no_max_on_any_replica_count(strategy):
    # As TensorFlow (no complex max kernel) and as between workers and over NCCL:
    # MAX and MIN of complex numbers are refused (the host path took NumPy's
    # lexicographic order); SUM and MEAN are exact.
    n = strategy.num_replicas_in_sync
    value = np.array([1 + 2j, 3 - 1j], np.complex64)

    def reduce_in_run(op):
        return gs.get_replica_context().all_reduce(op, value)
    for res in strategy.experimental_local_results(strategy.run(reduce_in_run,
                                                                args=("sum",))):
        np.testing.assert_array_equal(res, value * n)
    per_replica = strategy.run(lambda: value.copy())
    np.testing.assert_array_equal(strategy.reduce("MEAN", per_replica, axis=None), value)
    for op in ("max", "MIN"):
        with pytest.raises(TypeError, match="of complex numbers is not defined"):
            strategy.run(reduce_in_run, args=(op,))
        if n > 1:  # one replica's plain value is its own MAX, as in TensorFlow
            with pytest.raises(TypeError, match="of complex numbers is not defined"):
                strategy.reduce(op, per_replica, axis=None)
        with pytest.raises(TypeError, match="of complex numbers is not defined"):
            strategy.reduce(op, per_replica, axis=0)


def test_all_gather_uneven_rows(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        r = gs.get_replica_context().replica_id_in_sync_group
        return gs.get_replica_context().all_gather(np.full((r, 2), r), axis=0)
    expected = np.concatenate([np.full((r, 2), r) for r in range(n)])
    for v in strategy.experimental_local_results(strategy.run(fn)):
        np.testing.assert_array_equal(v, expected)


def test_all_reduce_results_are_independent_copies():
    s = gs.MirroredStrategy(cpus(2))

    def fn():
        out = gs.get_replica_context().all_reduce("sum", np.ones(3))
        out += gs.get_replica_context().replica_id_in_sync_group  # in place
        return out
    a, b = s.experimental_local_results(s.run(fn))
    np.testing.assert_array_equal(a, [2, 2, 2])
    np.testing.assert_array_equal(b, [3, 3, 3])


# --- cross-replica reduce, gather, local results -------------------------------------

def batch_split(strategy, batch):
    """SPEC's splitting rule, written out for the test."""
    n = strategy.num_replicas_in_sync
    per = -(-len(batch) // n)
    return gs.PerReplica([batch[i * per:(i + 1) * per] for i in range(n)])


def test_spec_observed_reduce_outputs():
    s = gs.MirroredStrategy(cpus(2))
    steps = [np.array([0, 1, 2, 3]), np.array([4, 5, 6, 7]), np.array([8])]
    expected = [(12.0, 3.0), (44.0, 11.0), (16.0, 16.0)]
    for batch, (sum_, mean_) in zip(steps, expected):
        out = s.run(lambda x: x * 2.0, args=(batch_split(s, batch),))
        assert float(s.reduce(gs.ReduceOp.SUM, out, axis=0)) == sum_
        assert float(s.reduce(gs.ReduceOp.MEAN, out, axis=0)) == mean_


def test_mean_weighs_every_example_with_partial_batch(strategy):
    batch = np.arange(6, dtype=np.float32)
    pr = batch_split(strategy, batch)
    assert float(strategy.reduce("mean", pr, axis=0)) == pytest.approx(batch.mean())
    assert float(strategy.reduce("sum", pr, axis=0)) == pytest.approx(batch.sum())
    assert float(strategy.reduce("max", pr, axis=0)) == 5.0
    assert float(strategy.reduce("min", pr, axis=0)) == 0.0


def test_empty_replicas_contribute_nothing_and_no_nan():
    s = gs.MirroredStrategy(cpus(5))
    pr = batch_split(s, np.arange(4.0).reshape(4, 1))  # [0] [1] [2] [3] []
    assert s.experimental_local_results(pr)[4].shape == (0, 1)
    with np.errstate(all="raise"):
        np.testing.assert_allclose(s.reduce("mean", pr, axis=0), [1.5])
        np.testing.assert_allclose(s.reduce("sum", pr, axis=0), [6.0])
        np.testing.assert_allclose(s.reduce("max", pr, axis=0), [3.0])
        np.testing.assert_allclose(s.reduce("min", pr, axis=0), [0.0])
    all_empty = gs.PerReplica([np.zeros((0,))] * 5)
    assert np.isnan(s.reduce("mean", all_empty, axis=0))


def test_axis_none_elementwise_and_shape_mismatch_error(strategy):
    n = strategy.num_replicas_in_sync
    pr = gs.PerReplica([np.array([i, 2.0 * i]) for i in range(n)])
    t = sum(range(n))
    np.testing.assert_allclose(strategy.reduce("sum", pr, axis=None), [t, 2 * t])
    np.testing.assert_allclose(strategy.reduce("mean", pr, axis=None), [t / n, 2 * t / n])
    np.testing.assert_allclose(strategy.reduce("max", pr, axis=None), [n - 1, 2 * (n - 1)])
    if n > 1:
        bad = batch_split(strategy, np.arange(2 * n - 1))
        with pytest.raises(ValueError, match=r"different shapes with axis=None \(replica 0: \(2,\)"):
            strategy.reduce("sum", bad, axis=None)


def test_reduce_nested_and_plain_values():
    s = gs.MirroredStrategy(cpus(2))
    pr = {"a": gs.PerReplica([np.array([1.0]), np.array([3.0])]), "b": 7.0}
    out = s.reduce("mean", pr, axis=None)
    np.testing.assert_allclose(out["a"], [2.0])
    assert out["b"] == 7.0
    with pytest.raises(ValueError, match="cannot SUM-reduce a plain value"):
        s.reduce("sum", 7.0, axis=None)
    with pytest.raises(ValueError, match="unknown reduce op 'avg'"):
        s.reduce("avg", pr, axis=None)


def test_gather_concatenates_in_replica_order(strategy):
    pr = batch_split(strategy, np.arange(7 * 2).reshape(7, 2))
    np.testing.assert_array_equal(strategy.gather(pr, axis=0), np.arange(14).reshape(7, 2))
    if strategy.num_replicas_in_sync > 1:
        bad = gs.PerReplica([np.zeros((2, 3))] + [np.zeros((2, 4))] *
                            (strategy.num_replicas_in_sync - 1))
        with pytest.raises(ValueError, match="differ only along that axis"):
            strategy.gather(bad, axis=0)


def test_local_results_and_values_from_function_placement():
    s = gs.MirroredStrategy(cpus(3))
    assert s.experimental_local_results(5) == (5,)
    v = s.experimental_distribute_values_from_function(
        lambda ctx: {"x": np.full(2, ctx.replica_id_in_sync_group), "n": ctx.num_replicas_in_sync})
    local = s.experimental_local_results(v)
    assert [d["n"] for d in local] == [3, 3, 3]
    assert [int(d["x"][0]) for d in local] == [0, 1, 2]


def test_per_replica_component_count_must_match():
    s = gs.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="3 components but the strategy has 2"):
        s.run(lambda x: x, args=(gs.PerReplica([1, 2, 3]),))


def test_experimental_make_numpy_dataset_old_name():
    s = gs.MirroredStrategy(cpus(2))
    ds = s.experimental_make_numpy_dataset(np.arange(6.0).reshape(3, 2))
    assert [r.tolist() for r in ds.as_numpy_iterator()] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]]


# --- a distributed value belongs to the devices it was made on ------------------------

def made_by(s):
    """One value of each kind ``s`` makes, on its devices."""
    ds = gs.data.Dataset.range(8).batch(4)
    return {
        "run": s.run(lambda: gs.get_replica_context().replica_id_in_sync_group * 1.0),
        "dataset element": next(iter(s.experimental_distribute_dataset(ds))),
        "values_from_function": s.experimental_distribute_values_from_function(
            lambda ctx: np.full(1, ctx.replica_id_in_sync_group, np.float32)),
        "Mirrored": gs.Mirrored([np.ones(1), np.ones(1)], devices=s.local_devices),
    }


@pytest.mark.parametrize("other_devices", [["cpu:2", "cpu:3"], ["cpu:1", "cpu:0"]])
def test_values_made_on_other_devices_are_refused_naming_both_device_lists(other_devices):
    # TF 2.21 (4 logical CPUs): a PerReplica from MirroredStrategy([cpu:0, cpu:1]), a
    # distributed dataset element or a MirroredVariable given to a strategy on
    # [cpu:2, cpu:3] (or [cpu:1, cpu:0]) is accepted by run, reduce and
    # experimental_local_results, the components copied to the other devices silently.
    a, b = gs.MirroredStrategy(cpus(2)), gs.MirroredStrategy(other_devices)
    msg = (r"made on devices \['cpu:0', 'cpu:1'\], but this strategy's local devices are "
           + re.escape(str(other_devices)))
    for kind, v in made_by(a).items():
        assert v.devices == a.local_devices, kind
        calls = {
            "run": lambda v=v: b.run(lambda x: x, args=(v,)),
            "run, nested": lambda v=v: b.run(lambda x, k: x, args=({"a": [v]},), kwargs={"k": 1}),
            "run, kwargs": lambda v=v: b.run(lambda x: x, kwargs={"x": v}),
            "reduce": lambda v=v: b.reduce("mean", v, axis=None),
            "reduce, nested": lambda v=v: b.reduce("max", (v,), axis=0),
            "gather": lambda v=v: b.gather({"x": v}, 0),
            "experimental_local_results": lambda v=v: b.experimental_local_results(v),
            "experimental_local_results, nested":
                lambda v=v: b.experimental_local_results([v, 1]),
        }
        for call, f in calls.items():
            with pytest.raises(ValueError, match=msg):
                f()
                pytest.fail(f"{kind} accepted by {call}")
    a.close()
    b.close()


def test_values_of_another_strategy_on_the_same_devices_and_hand_made_ones_are_accepted():
    a, b = gs.MirroredStrategy(cpus(2)), gs.MirroredStrategy(cpus(2))
    for v in made_by(a).values():
        assert [float(np.sum(x)) for x in b.experimental_local_results(
            b.run(lambda x: x * 2, args=(v,)))] == [float(np.sum(x)) * 2 for x in v.values]
    hand = gs.PerReplica([1.0, 2.0])
    assert hand.devices is None and b.reduce("sum", hand, axis=None) == 3.0
    named = gs.PerReplica([1.0, 2.0], devices=["/gpu:0", "GPU:1"])
    assert [d.name for d in named.devices] == ["gpu:0", "gpu:1"]
    with pytest.raises(ValueError, match=r"was given 1 devices"):
        gs.PerReplica([1.0, 2.0], devices=["cpu:0"])
    a.close()
    b.close()


def test_component_count_is_checked_by_every_method():
    # experimental_local_results of a nested 3-component value on 2 replicas dropped
    # the third component.
    s = gs.MirroredStrategy(cpus(2))
    three = gs.PerReplica([1, 2, 3])
    for f in (lambda: s.run(lambda x: x, args=({"k": three},)),
              lambda: s.reduce("mean", three, axis=None), lambda: s.gather(three, 0),
              lambda: s.experimental_local_results(three),
              lambda: s.experimental_local_results({"k": three})):
        with pytest.raises(ValueError, match=r"3 components but the strategy has 2 local "
                                             r"replicas \(\['cpu:0', 'cpu:1'\]\)"):
            f()
    s.close()


@pytest.mark.parametrize("make", [
    lambda: gs.MirroredStrategy(["cpu:0", "cpu:1"]),
    lambda: gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])], ids=["mirrored", "mwms"])
def test_an_axis_that_is_no_integer_is_named_at_the_call(make):
    # None or a string used to fail deep inside with "'<=' not supported".
    s = make()
    try:
        x = s.run(lambda: np.ones((2, 3), np.float32))
        for call, fn, bad in (
                ("strategy.gather", lambda a: s.gather(x, axis=a), None),
                ("strategy.gather", lambda a: s.gather(x, axis=a), "0"),
                ("strategy.reduce", lambda a: s.reduce("sum", x, axis=a), "0"),
                ("strategy.reduce", lambda a: s.reduce("sum", x, axis=a), 1.0),
                ("strategy.reduce", lambda a: s.reduce("sum", x, axis=a), True),
                ("all_gather in strategy.run", lambda a: s.run(
                    lambda: gs.get_replica_context().all_gather(np.ones(2), axis=a)), None)):
            with pytest.raises(TypeError, match=rf"{call}: axis must be an integer.*got "
                                                rf"{re.escape(repr(bad))}"):
                fn(bad)
        # NumPy integers are integers.
        n = s.num_replicas_in_sync
        assert np.asarray(s.gather(x, axis=np.int64(0))).shape == (2 * n, 3)
        assert np.asarray(s.reduce("sum", x, axis=np.int32(1))).tolist() == [3.0 * n] * 2
    finally:
        s.close()


def test_tensorflow_arguments_without_a_counterpart_say_so():
    # TensorFlow's MirroredStrategy(devices, cross_device_ops): the collectives are
    # chosen here; the argument is refused with the reason, not an unexpected-keyword
    # error (or, positionally, a crash later).
    with pytest.raises(TypeError, match=r"cross_device_ops=.* has no counterpart: the "
                                        r"collectives are chosen for you"):
        gs.MirroredStrategy(cpus(2), cross_device_ops=object())
    with pytest.raises(TypeError, match=r"communicator must be a gpustrat Communicator, "
                                        r"got object"):
        gs.MirroredStrategy(cpus(2), object())
    s = gs.MirroredStrategy(cpus(2), cross_device_ops=None)
    assert s.cluster_resolver is None   # as TensorFlow's, on one worker
    s.close()
