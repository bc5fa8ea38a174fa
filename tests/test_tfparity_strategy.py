"""Differential checks against tf.distribute: every expected value here was observed
from TF 2.21 (tensorflow-cpu, logical CPU devices) running the same scenario."""

import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpustrat as gs
from gpustrat import nest
from gpustrat.data import Dataset


def cpus(n):
    return [f"cpu:{i}" for i in range(n)]


@pytest.fixture(scope="module")
def two():
    s = gs.MirroredStrategy(cpus(2))
    yield s
    s.close()


def by_replica(s, fn):
    """A per-replica value from ``fn(replica_id)``."""
    return s.experimental_distribute_values_from_function(
        lambda ctx: fn(ctx.replica_id_in_sync_group))


def as_lists(x):
    if isinstance(x, gs.PerReplica):
        return ("PR", [as_lists(v) for v in x.values])
    if isinstance(x, dict):
        return {k: as_lists(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(as_lists(v) for v in x)
    return x.tolist() if hasattr(x, "tolist") else x


# --- nested structures keep the user's dict order ---------------------------------------

def test_nest_keeps_dict_insertion_order_while_flattening_sorted():
    # observed from TF 2.21: tf.nest.flatten({'b': 1, 'a': 2}) == [2, 1], and packing
    # gives the keys back in the template's order: {'b': 20, 'a': 10}.
    d = {"b": 1, "a": 2}
    assert nest.flatten(d) == [2, 1]
    assert list(nest.pack_sequence_as(d, [10, 20]).items()) == [("b", 20), ("a", 10)]
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    back = nest.pack_sequence_as(od, [10, 20])
    assert type(back) is collections.OrderedDict and list(back.items()) == [("b", 20), ("a", 10)]
    dd = collections.defaultdict(list, {"b": 1, "a": 2})
    back = nest.pack_sequence_as(dd, [10, 20])
    assert type(back) is collections.defaultdict and back.default_factory is list
    assert list(back.items()) == [("b", 20), ("a", 10)]
    assert list(nest.map_structure(lambda x: x * 2, d).items()) == [("b", 2), ("a", 4)]


def test_run_result_and_dataset_elements_keep_dict_order(two):
    # observed from TF 2.21: run returning {'z': replica_id, 'a': 1} gives
    # {'z': PerReplica, 'a': 1} in that order, and a dataset of {'b': ..., 'a': ...}
    # yields elements with 'b' first. ('a' is plain in TF only because both replicas
    # return the same cached int object; here every leaf is per replica.)
    r = two.run(lambda: {"z": gs.get_replica_context().replica_id_in_sync_group, "a": 1})
    assert list(r) == ["z", "a"] and r["a"].values == (1, 1) and r["z"].values == (0, 1)
    assert [list(x) for x in two.experimental_local_results(r)] == [["z", "a"], ["z", "a"]]
    ds = Dataset.range(5).batch(3).map(lambda x: {"b": x, "a": x * 10})
    steps = [as_lists(e) for e in two.experimental_distribute_dataset(ds)]
    assert [list(e) for e in steps] == [["b", "a"], ["b", "a"]]
    assert steps[0] == {"b": ("PR", [[0, 1], [2]]), "a": ("PR", [[0, 10], [20]])}


# --- reduce, gather ---------------------------------------------------------------------

def test_integer_sum_along_an_axis_keeps_the_dtype(two):
    # observed from TF 2.21: reduce(SUM, [1,2,3]*(id+1) int32, axis=0) is an int32 18;
    # the MEAN is a float64 3.0; the partial batch [0,1,2,3] / [0,1] sums to int32 7.
    v = by_replica(two, lambda r: np.array([1, 2, 3], np.int32) * (r + 1))
    out = two.reduce("SUM", v, axis=0)
    assert out.dtype == np.int32 and out == 18
    mean = two.reduce("MEAN", v, axis=0)
    assert mean.dtype == np.float64 and mean == 3.0
    ragged = by_replica(two, lambda r: np.arange(4 - 2 * r, dtype=np.int32))
    out = two.reduce("SUM", ragged, axis=0)
    assert out.dtype == np.int32 and out == 7
    u8 = by_replica(two, lambda r: np.array([[1, 2], [3, 4]], np.uint8))
    assert two.reduce("SUM", u8, axis=1).dtype == np.uint8


def test_reduce_of_plain_values(two):
    # observed from TF 2.21 (2 replicas, plain tensor [1., 2., 3.]): MEAN axis=None is
    # the value, MEAN axis=0 is 2.0, SUM axis=0 counts it on both replicas (12.0), SUM
    # axis=None is refused; an int32 [1, 2] MEAN along axis 0 is a float64 1.5.
    x = np.array([1.0, 2.0, 3.0], np.float32)
    np.testing.assert_array_equal(two.reduce("MEAN", x, axis=None), x)
    assert two.reduce("MEAN", x, axis=0) == 2.0
    assert two.reduce("SUM", x, axis=0) == 12.0
    with pytest.raises(ValueError, match="cannot SUM-reduce a plain value"):
        two.reduce("SUM", x, axis=None)
    m = two.reduce("MEAN", np.array([1, 2], np.int32), axis=0)
    assert m.dtype == np.float64 and m == 1.5


def test_gather_of_a_plain_value_returns_it_unchanged(two):
    # observed from TF 2.21: strategy.gather(tf.constant([1, 2]), 0) with 2 replicas is
    # [1, 2] (a non-distributed value is returned as is), not [1, 2, 1, 2].
    x = np.array([1, 2])
    np.testing.assert_array_equal(two.gather(x, 0), [1, 2])
    v = by_replica(two, lambda r: np.full([1], r))
    out = two.gather({"pr": v, "plain": x}, 0)
    np.testing.assert_array_equal(out["pr"], [0, 1])
    np.testing.assert_array_equal(out["plain"], [1, 2])


def test_gather_and_reduce_along_negative_axes(two):
    # observed from TF 2.21: components [[0,1,2],[3,4,5]] and [[0..5],[6..11]] gathered
    # along axis 1 or -1 give [[0,1,2,0,1,2,3,4,5],[3,4,5,6,7,8,9,10,11]].
    v = by_replica(two, lambda r: np.arange(6 * (r + 1), dtype=np.int32).reshape(2, -1))
    want = [[0, 1, 2, 0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert two.gather(v, 1).tolist() == want and two.gather(v, -1).tolist() == want
    # [[1,2,3],[4,5,6]] * (id + 1), float32: MEAN axis -1 = [3, 7.5], axis -2 =
    # [3.75, 5.25, 6.75]; SUM axis 1 = [18, 45].
    f = by_replica(two, lambda r: np.array([[1, 2, 3], [4, 5, 6]], np.float32) * (r + 1))
    assert two.reduce("MEAN", f, axis=-1).tolist() == [3.0, 7.5]
    assert two.reduce("MEAN", f, axis=-2).tolist() == [3.75, 5.25, 6.75]
    assert two.reduce("SUM", f, axis=1).tolist() == [18.0, 45.0]


def test_all_reduce_of_a_none_leaf_is_a_clear_error(two):
    # TF 2.21 fails here too, with "'NoneType' object has no attribute 'dtype'".
    with pytest.raises(TypeError, match="a None leaf"):
        two.run(lambda: gs.get_replica_context().all_reduce("sum", (np.float32(1), None)))


# --- run's results are per replica, whatever the interpreter shares ---------------------

def rid():
    return gs.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("rows", [1, 32, 256, 257, 512])
def test_a_size_computed_on_each_replica_is_per_replica_whatever_its_value(n, rows):
    # TF 2.21 (2 replicas, a distributed range(2 * rows).batch(2 * rows)):
    # run(lambda x: x.shape[0]) returns a plain int for 32 and 256 rows (CPython's
    # cached small int, one object on both replicas), which reduce("SUM") refuses
    # ("A non-DistributedValues value 32 cannot be reduced"), and PerReplica
    # {0: 512, 1: 512} for 512 rows. Here it is per replica at every size.
    s = gs.MirroredStrategy(cpus(n))
    x = next(iter(s.experimental_distribute_dataset(Dataset.range(n * rows).batch(n * rows))))
    r = s.run(lambda x: x.shape[0], args=(x,))
    assert isinstance(r, gs.PerReplica) and r.values == (rows,) * n
    assert int(s.reduce("sum", r, axis=None)) == n * rows
    s.close()


def test_python_constants_are_per_replica_and_none_stays_none(two):
    # TF 2.21: run(lambda: 1) and run(lambda: "abc") return the plain object (both
    # replicas return one object) and reduce("SUM") of it is refused; run(lambda: None)
    # is None; (None, replica_id) gives (None, PerReplica); None on replica 0 and 1 on
    # replica 1 give PerReplica {0: None, 1: 1}. Here a constant is per replica like
    # any other result, so its SUM is 2 and its MEAN 1 (TF's MEAN: 1).
    one = two.run(lambda: 1)
    assert isinstance(one, gs.PerReplica) and one.values == (1, 1)
    assert two.reduce("sum", one, axis=None) == 2 and two.reduce("mean", one, axis=None) == 1
    assert two.run(lambda: "abc").values == ("abc", "abc")
    assert two.run(lambda: None) is None
    pair = two.run(lambda: (None, rid()))
    assert pair[0] is None and pair[1].values == (0, 1)
    assert two.run(lambda: None if rid() == 0 else 1).values == (None, 1)


def test_a_distributed_value_returned_by_every_replica_is_returned_as_is(two):
    pr, mirrored = by_replica(two, lambda r: r), gs.Mirrored([1.0, 1.0])
    assert two.run(lambda: pr) is pr
    out = two.run(lambda: {"m": mirrored, "pr": pr})
    assert out["m"] is mirrored and out["pr"] is pr


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.integers(-2**62, 2**62 - 1), st.floats(-1e300, 1e300),
                 st.booleans(), st.text(max_size=3), st.binary(max_size=3)))
def test_run_result_is_per_replica_for_any_python_value(two, value):
    # Every replica rebuilds the value, so whether the objects are one depends only on
    # CPython's caches (small ints, one-character strings, True/False).
    r = two.run(lambda: type(value)(value))
    assert isinstance(r, gs.PerReplica) and r.values == (value, value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert two.reduce("sum", r, axis=None) == 2 * value


# --- only numbers are reduced ------------------------------------------------------------

NOT_NUMBERS = [
    (["a", "bc"], r"str 'a' \(component 0\)"),
    ([b"x", b"y"], r"bytes b'x' \(component 0\)"),
    ([np.array(["a"]), np.array(["b"])], r"array of dtype <U1 \(component 0\)"),
    ([np.array([object()]), np.array([1])], r"array of dtype object \(component 0\)"),
    ([1.0, "b"], r"str 'b' \(component 1\)"),
    ([None, 1.0], r"a None leaf \(component 0\)"),
]


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
@pytest.mark.parametrize("comps,shown", NOT_NUMBERS)
def test_reduce_and_gather_refuse_what_is_not_a_number(two, op, comps, shown):
    # TF 2.21: reduce of string tensors fails (InvalidArgumentError: AddN has no string
    # kernel), gather of strings too (TypeError: DataType string not in list of allowed
    # values), and Python strs give AttributeError ('str' object has no attribute
    # 'device'). gpustrat returned one replica's bytes for SUM and blamed the dtype
    # lengths for strings.
    v = gs.PerReplica(comps)
    with pytest.raises(TypeError, match=rf"strategy.reduce\({op.upper()}\): .*{shown}"):
        two.reduce(op, v, axis=None)
    if isinstance(comps[0], np.ndarray):
        with pytest.raises(TypeError, match=shown):
            two.reduce(op, v, axis=0)
        with pytest.raises(TypeError, match=rf"strategy.gather: .*{shown}"):
            two.gather(v, 0)
    with pytest.raises(TypeError, match=shown):
        two.reduce(op, {"ok": by_replica(two, float), "bad": [v]}, axis=None)


@pytest.mark.parametrize("op", ["sum", "mean", "max", "min"])
def test_collectives_refuse_what_is_not_a_number(two, op):
    # TF 2.21: all_reduce of a string tensor fails (InvalidArgumentError:
    # CollectiveReduceV2 has no string kernel), of a Python str with AttributeError,
    # all_gather of strings with TypeError. gpustrat returned one replica's string.
    ctx = gs.get_replica_context
    with pytest.raises(TypeError, match=rf"all_reduce\({op.upper()}\): str 's0' \(replica 0\)"):
        two.run(lambda: ctx().all_reduce(op, f"s{rid()}"))
    with pytest.raises(TypeError, match=r"str 'x' \(replica 0\) is not a number"):
        two.run(lambda: ctx().all_reduce(op, {"a": 1.0, "b": [np.float32(2), "x"]}))
    with pytest.raises(TypeError, match=r"all_gather: an array of dtype <U1 \(replica 0\)"):
        two.run(lambda: ctx().all_gather(np.array(["a"]), 0))
    assert two.run(lambda: ctx().all_reduce(op, 2.0)).values == (
        {"sum": 4.0, "mean": 2.0, "max": 2.0, "min": 2.0}[op],) * 2


def test_booleans_have_max_min_and_gather_but_no_sum_or_mean(two):
    # TF 2.21 refuses bool tensors in reduce, all_reduce, gather and all_gather alike (its
    # kernels have no bool; it has no MAX/MIN). Here MAX is any and MIN is all, and
    # gathers concatenate; SUM and MEAN are refused: they gave a logical or, and MEAN of
    # [True]/[True] gave 0.5.
    b = gs.PerReplica([np.array([True, False]), np.array([True, True])])
    assert two.reduce("max", b, axis=None).tolist() == [True, True]
    assert two.reduce("min", b, axis=None).tolist() == [True, False]
    assert bool(two.reduce("max", b, axis=0)) and not bool(two.reduce("min", b, axis=0))
    assert two.gather(b, 0).tolist() == [True, False, True, True]
    for op in ("sum", "mean"):
        for axis in (None, 0):
            with pytest.raises(TypeError, match=rf"{op.upper()} of booleans is not defined"):
                two.reduce(op, b, axis=axis)
        with pytest.raises(TypeError, match=r"\(the bool True, replica 0\)"):
            two.run(lambda op=op: gs.get_replica_context().all_reduce(op, rid() == 0))
    ctx = gs.get_replica_context
    assert two.run(lambda: ctx().all_reduce("max", rid() == 1)).values == (True, True)
    assert two.run(lambda: ctx().all_reduce("min", rid() == 1)).values == (False, False)
    got = two.run(lambda: ctx().all_gather(np.array([rid() == 1]), 0))
    assert [v.tolist() for v in got.values] == [[False, True]] * 2


# --- one replica: values and input are not wrapped or cut --------------------------------

def test_values_from_function_on_one_device_and_default_strategies_are_plain():
    # observed from TF 2.21: OneDeviceStrategy and the default strategy return
    # value_fn's result as is (0, 1); MirroredStrategy(['/cpu:0']) gives PerReplica:{0: 0}.
    o = gs.OneDeviceStrategy("cpu:0")
    assert o.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group) == 0
    assert gs.get_strategy().experimental_distribute_values_from_function(lambda ctx: 1) == 1
    m = gs.MirroredStrategy(["cpu:0"])
    v = m.experimental_distribute_values_from_function(lambda ctx: ctx.replica_id_in_sync_group)
    assert isinstance(v, gs.PerReplica) and v.values == (0,)


@pytest.mark.parametrize("make", [lambda: gs.OneDeviceStrategy("cpu:0"),
                                  lambda: gs.MirroredStrategy(["cpu:0"])],
                         ids=["one_device", "mirrored1"])
def test_one_replica_in_sync_passes_elements_through(make):
    # observed from TF 2.21, OneDeviceStrategy and MirroredStrategy(['/cpu:0']):
    # an unbatched range(3) iterates as 0, 1, 2 with element_spec TensorSpec(shape=());
    # batch(4, drop_remainder=True) keeps the static shape (4,); batch(4) gives (None,).
    s = make()
    dd = s.experimental_distribute_dataset(Dataset.range(3))
    assert [int(x) for x in dd] == [0, 1, 2]
    assert dd.element_spec.shape == ()
    dd = s.experimental_distribute_dataset(Dataset.range(12).batch(4, drop_remainder=True))
    assert dd.element_spec.shape == (4,)
    assert s.experimental_distribute_dataset(Dataset.range(12).batch(4)).element_spec.shape \
        == (None,)
    dfn = s.distribute_datasets_from_function(lambda ctx: Dataset.range(3))
    assert [int(x) for x in dfn] == [0, 1, 2] and dfn.element_spec.shape == ()
    dfn = s.distribute_datasets_from_function(lambda ctx: Dataset.range(12).batch(3, True))
    assert dfn.element_spec.shape == (3,)


def test_per_replica_spec_is_static_when_the_global_batch_divides(two):
    # observed from TF 2.21, 2 replicas: batch(4, drop_remainder=True) gives per-replica
    # TensorSpec(shape=(2,)), batch(5, drop_remainder=True) and batch(4) give (None,).
    spec = two.experimental_distribute_dataset(
        Dataset.range(12).batch(4, drop_remainder=True)).element_spec
    assert spec.shape == (2,)
    for ds in (Dataset.range(12).batch(5, drop_remainder=True), Dataset.range(12).batch(4)):
        assert two.experimental_distribute_dataset(ds).element_spec.shape == (None,)
    ds = Dataset.from_tensor_slices({"x": np.zeros((8, 3), np.float32), "y": np.arange(8)})
    spec = two.experimental_distribute_dataset(ds.batch(4, drop_remainder=True)).element_spec
    assert spec["x"].shape == (2, 3) and spec["y"].shape == (2,)


# --- several workers: a plain value is each worker's own ---------------------------------

PLAIN_ACROSS_WORKERS = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(["cpu:0"])
r = s.worker_index
loss = s.run(lambda: np.float32(r + 1))  # one local replica: run returns a plain value
assert not isinstance(loss, gs.PerReplica)
total, mean = float(s.reduce("sum", loss, axis=None)), float(s.reduce("mean", loss, axis=None))
gathered = s.gather(np.array([r]), axis=0).tolist()
print(f"OK {total} {mean} {gathered}", flush=True)
"""


@pytest.mark.mpi
def test_reduce_of_a_plain_value_across_workers():
    # tf.distribute's MultiWorkerMirroredStrategy (collective_all_reduce_strategy
    # _reduce_to, TF 2.21) reduces a non-distributed value over the workers when there
    # are several: per-worker losses 1 and 2 give SUM 3 and MEAN 1.5 on every worker
    # (gpustrat gave a SUM error and each worker's own value as the MEAN).
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import assert_mpi_ok  # noqa: PLC0415
    out = assert_mpi_ok(2, PLAIN_ACROSS_WORKERS, timeout=120, expect_lines=2)
    assert out.splitlines().count("OK 3.0 1.5 [0, 1]") == 2


NOT_NUMBERS_ACROSS_WORKERS = r"""
import sys
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy([f"cpu:{i}" for i in range(int(sys.argv[1]))])
ctx = gs.get_replica_context
rid = lambda: ctx().replica_id_in_sync_group
refused = []
for what, f in [
        ("reduce of strings", lambda: s.reduce("max", s.run(lambda: f"r{rid()}"), axis=None)),
        ("reduce of a plain string", lambda: s.reduce("mean", "abc", axis=None)),
        ("SUM of booleans", lambda: s.reduce("sum", s.run(lambda: np.array([rid() == 0])), 0)),
        ("gather of strings", lambda: s.gather(s.run(lambda: np.array([str(rid())])), 0)),
        ("all_reduce of a string", lambda: s.run(lambda: ctx().all_reduce("max", "x")))]:
    try:
        f()
    except TypeError:
        refused.append(what)
total = s.reduce("sum", s.run(lambda: float(rid())), axis=None)
print(f"OK {len(refused)} {float(total)}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks,local", [(2, 2), (3, 1)])
def test_what_is_not_a_number_is_refused_on_every_worker(ranks, local):
    # Every worker raises the TypeError (none waits in a collective for another), and
    # the strategy then reduces numbers correctly.
    import sys  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import assert_mpi_ok  # noqa: PLC0415
    out = assert_mpi_ok(ranks, NOT_NUMBERS_ACROSS_WORKERS, timeout=120, args=(local,),
                        expect_lines=ranks)
    n = ranks * local
    assert out.splitlines().count(f"OK 5 {float(n * (n - 1) // 2)}") == ranks
