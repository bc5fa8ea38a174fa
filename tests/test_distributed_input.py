"""Distributed input on one worker: SPEC's observed TensorFlow outputs, the splitting
rule for every nesting and dtype, iterators, options and errors."""

import collections
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.errors import OutOfRangeError

Pair = collections.namedtuple("Pair", "image label")


def mirrored(n):
    return gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def steps(strategy, dist):
    """Each step as a list over local replicas of Python lists."""
    return [[np.asarray(p).tolist() for p in strategy.experimental_local_results(x)]
            for x in dist]


def rule(batch, n):
    per = -(-len(batch) // n)
    return [batch[i * per:(i + 1) * per] for i in range(n)]


SPEC_TABLE = [
    (Dataset.range(6).batch(4), 2, [[[0, 1], [2, 3]], [[4], [5]]]),
    (Dataset.range(4).batch(4), 5, [[[0], [1], [2], [3], []]]),
    (Dataset.range(8).batch(4), 3, [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]),
    (Dataset.range(9).batch(4), 2, [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]),
    (Dataset.range(10).batch(6), 4, [[[0, 1], [2, 3], [4, 5], []], [[6], [7], [8], [9]]]),
    (Dataset.range(13).batch(7), 3, [[[0, 1, 2], [3, 4, 5], [6]], [[7, 8], [9, 10], [11, 12]]]),
    (Dataset.range(17).batch(5, drop_remainder=True), 2,
     [[[0, 1, 2], [3, 4]], [[5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14]]]),
]


@pytest.mark.parametrize("dataset,n,expected", SPEC_TABLE, ids=lambda v: str(v)[:20])
def test_spec_table_rows_exactly(dataset, n, expected):
    s = mirrored(n)
    assert steps(s, s.experimental_distribute_dataset(dataset)) == expected


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("size,batch,drop", [(6, 4, False), (4, 4, False), (8, 4, False),
                                             (9, 4, False), (10, 6, False), (13, 7, False),
                                             (17, 5, True)])
def test_table_datasets_on_one_to_five_replicas(n, size, batch, drop):
    s = mirrored(n)
    got = steps(s, s.experimental_distribute_dataset(Dataset.range(size).batch(batch, drop)))
    data = list(range(size))
    batches = [data[i:i + batch] for i in range(0, size, batch)]
    if drop:
        batches = [b for b in batches if len(b) == batch]
    expected = [rule(b, n) for b in batches]
    if n == 1:
        expected = [[b] for b in batches]
    assert got == expected


def test_empty_pieces_keep_trailing_shape_and_dtype_in_every_nesting():
    s = mirrored(3)
    images = np.arange(4 * 2 * 3, dtype=np.float16).reshape(4, 2, 3)
    labels = np.arange(4, dtype=np.int32)
    ds = Dataset.from_tensor_slices(
        {"pair": Pair(images, labels), "w": (np.ones(4, np.float64),)}).batch(4)
    dist = s.experimental_distribute_dataset(ds)
    (step,) = list(dist)
    assert isinstance(step["pair"], Pair)
    pieces = s.experimental_local_results(step["pair"].image)
    assert [p.shape for p in pieces] == [(2, 2, 3), (2, 2, 3), (0, 2, 3)]
    assert all(p.dtype == np.float16 for p in pieces)
    lab = s.experimental_local_results(step["pair"].label)
    assert [p.tolist() for p in lab] == [[0, 1], [2, 3], []] and lab[2].dtype == np.int32
    w = s.experimental_local_results(step["w"][0])
    assert [p.shape for p in w] == [(2,), (2,), (0,)]
    # Every leaf is cut at the same row boundaries.
    np.testing.assert_array_equal(pieces[1], images[2:4])


def test_cpu_pieces_are_views_of_the_batch():
    s = mirrored(2)
    base = np.arange(64, dtype=np.float32).reshape(16, 4)
    pieces = []
    for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(base).batch(8)):
        a, b = s.experimental_local_results(x)
        # No copy anywhere: the pieces are views of the source array.
        assert np.shares_memory(a, base) and np.shares_memory(b, base)
        pieces += [a, b]
    np.testing.assert_array_equal(np.concatenate(pieces), base)


def test_iterator_protocol_and_epochs():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(Dataset.range(9).batch(4))
    for _ in range(2):  # a new pass per epoch
        it = iter(dist)
        printed = []
        while True:
            opt = it.get_next_as_optional()
            if not opt.has_value():
                break
            printed.append(str(tuple(np.asarray(v) for v in
                                     s.experimental_local_results(opt.get_value()))))
        assert printed == ["(array([0, 1]), array([2, 3]))", "(array([4, 5]), array([6, 7]))",
                           "(array([8]), array([], dtype=int64))"]
        with pytest.raises(OutOfRangeError):
            it.get_next()
        with pytest.raises(StopIteration):
            next(it)
        with pytest.raises(OutOfRangeError):
            it.get_next_as_optional().get_value()
    it = iter(dist)
    first = it.get_next()
    assert s.experimental_local_results(first)[0].tolist() == [0, 1]


def test_element_spec_cardinality_and_len():
    s = mirrored(2)
    ds = Dataset.from_tensor_slices((np.zeros((10, 3), np.float32), np.zeros(10, np.int64))).batch(4)
    dist = s.experimental_distribute_dataset(ds)
    spec = dist.element_spec
    assert tuple(spec[0].shape) == (None, 3) and spec[0].dtype == np.float32
    assert tuple(spec[1].shape) == (None,) and spec[1].dtype == np.int64
    assert dist.cardinality() == 3 and len(dist) == 3
    inf = s.experimental_distribute_dataset(Dataset.range(4).repeat().batch(2))
    assert inf.cardinality() == -1
    with pytest.raises(TypeError, match="infinite"):
        len(inf)


def test_distributed_dataset_cannot_be_transformed():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(Dataset.range(8).batch(4))
    for name in ("map", "batch", "filter", "shuffle", "prefetch"):
        with pytest.raises(AttributeError, match=f"cannot be transformed further \\('{name}'\\)"):
            getattr(dist, name)
    # The error lists what a distributed dataset still offers, and each works.
    with pytest.raises(AttributeError, match=r"element_spec, cardinality\(\) or len\(\)"):
        getattr(dist, "map")
    assert dist.cardinality() == len(dist) == 2 and dist.element_spec.shape == (None,)


def test_unbatched_dataset_is_a_clear_error():
    s = mirrored(2)
    with pytest.raises(ValueError, match="batched by the global batch size.*call .batch"):
        s.experimental_distribute_dataset(Dataset.range(8))


def test_prefetch_of_num_replicas_is_appended_for_slow_pipelines():
    pulled = []

    def gen():
        for i in range(64):
            time.sleep(0.002)  # a slow pipeline: prefetching pays
            pulled.append(i)
            yield np.full((2,), i)
    s = mirrored(2)
    ds = Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((2,), np.int64))
    it = iter(s.experimental_distribute_dataset(ds))
    for _ in range(9):  # past the inline probe of the first batches
        next(it)
    taken = len(pulled)
    deadline = time.monotonic() + 5
    while len(pulled) < taken + 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # The prefetcher read ahead on its own thread, num_replicas_in_sync batches at most.
    assert taken + 2 <= len(pulled) <= taken + 2 + 1
    it.close()


def test_cheap_pipelines_are_not_handed_to_a_thread():
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(Dataset.range(4000).batch(4))
    before = threading.active_count()
    it = iter(dist)
    for _ in range(100):
        next(it)
    assert threading.active_count() == before


# --- distribute_datasets_from_function ------------------------------------------------

def test_from_function_spec_example_and_context():
    s = mirrored(2)
    seen = []

    def dataset_fn(ctx):
        seen.append(ctx)
        return Dataset.range(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id).batch(2)
    dist = s.distribute_datasets_from_function(dataset_fn)
    assert steps(s, dist) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], []]]
    ctx = seen[0]
    assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
    assert ctx.get_per_replica_batch_size(8) == 4
    with pytest.raises(ValueError, match=r"global batch size \(7\) is not divisible by "
                                         r"num_replicas_in_sync \(2\)"):
        ctx.get_per_replica_batch_size(7)
    old = s.experimental_distribute_datasets_from_function(dataset_fn)
    assert steps(s, old) == steps(s, dist)


def test_from_function_needs_batched_data():
    s = mirrored(2)
    with pytest.raises(ValueError, match="per-replica batch size"):
        s.distribute_datasets_from_function(lambda ctx: Dataset.range(4))


# --- end to end with run and reduce --------------------------------------------------

def test_spec_reduce_outputs_from_a_distributed_dataset():
    s = mirrored(2)
    got = []
    for x in s.experimental_distribute_dataset(Dataset.range(9).batch(4)):
        out = s.run(lambda v: v * 2.0, args=(x,))
        got.append((float(s.reduce(gs.ReduceOp.SUM, out, axis=0)),
                    float(s.reduce(gs.ReduceOp.MEAN, out, axis=0))))
    assert got == [(12.0, 3.0), (44.0, 11.0), (16.0, 16.0)]


def test_seed_experimental_distribute_dataset_example():
    s = mirrored(2)
    result = [s.run(lambda v: v * 2, args=(x,))
              for x in s.experimental_distribute_dataset(Dataset.range(4).batch(2))]
    assert [[p.tolist() for p in r.values] for r in result] == [[[0], [2]], [[4], [6]]]
    assert repr(result[0]) == "PerReplica:{0: array([0]), 1: array([2])}"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_prediction_keeps_order(n):
    s = mirrored(n)
    ds = Dataset.range(24).enumerate().batch(6)
    predictions = {}
    for x in s.experimental_distribute_dataset(ds):
        idx, doubled = s.run(lambda i, v: (i, 2 * v), args=x)
        for i, v in zip(s.experimental_local_results(idx), s.experimental_local_results(doubled)):
            predictions.update(zip(np.asarray(i).tolist(), np.asarray(v).tolist()))
    assert predictions == {i: 2 * i for i in range(24)}


def test_input_options():
    s = mirrored(2)
    opts = gs.InputOptions(experimental_fetch_to_device=False,
                           experimental_per_replica_buffer_size=3)
    got = steps(s, s.experimental_distribute_dataset(Dataset.range(4).batch(4), opts))
    assert got == [[[0, 1], [2, 3]]]
    with pytest.raises(ValueError, match="at least 1, got 0"):
        gs.InputOptions(experimental_per_replica_buffer_size=0)
    with pytest.raises(ValueError, match="PER_WORKER"):
        gs.InputOptions(experimental_replication_mode="PER_REPLICA")


def test_error_in_the_pipeline_reaches_the_caller():
    s = mirrored(2)

    def boom(x):
        if int(x[0]) >= 4:
            raise ZeroDivisionError("bad batch")
        return x
    dist = s.experimental_distribute_dataset(Dataset.range(12).batch(4).map(boom))
    it = iter(dist)
    next(it)
    with pytest.raises(ZeroDivisionError, match="bad batch"):
        next(it)


# --- property test -------------------------------------------------------------------

@st.composite
def pipelines(draw):
    size = draw(st.integers(0, 60))
    n = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 12))
    drop = draw(st.booleans())
    ops = draw(st.lists(st.sampled_from(["map", "filter", "repeat", "take", "skip",
                                         "enumerate"]), max_size=3))
    nested = draw(st.sampled_from(["leaf", "tuple", "dict"]))
    return size, n, batch, drop, ops, nested


def build(size, ops, nested):
    x = np.arange(size, dtype=np.int64)
    if nested == "leaf":
        ds = Dataset.from_tensor_slices(x)
    elif nested == "tuple":
        ds = Dataset.from_tensor_slices((x, np.stack([x, -x], axis=1).astype(np.float32)))
    else:
        ds = Dataset.from_tensor_slices({"a": x, "b": x.astype(np.float64) / 2})
    for op in ops:
        if op == "map":
            ds = ds.map(lambda *e: e[0] if len(e) == 1 else e)
        elif op == "filter":
            ds = ds.filter(lambda *e: int(np.asarray(e[0] if not isinstance(e[0], dict)
                                                     else e[0]["a"])) % 3 != 1)
        elif op == "repeat":
            ds = ds.repeat(2)
        elif op == "take":
            ds = ds.take(max(0, size // 2))
        elif op == "skip":
            ds = ds.skip(2)
        elif op == "enumerate":
            ds = ds.enumerate()
    return ds


@settings(max_examples=60, deadline=None)
@given(pipelines())
def test_concatenated_pieces_give_back_the_batches(case):
    size, n, batch, drop, ops, nested = case
    reference = list(build(size, ops, nested).batch(batch, drop_remainder=drop))
    s = mirrored(n)
    dist = s.experimental_distribute_dataset(build(size, ops, nested).batch(batch, drop))
    got = list(dist)
    assert len(got) == len(reference)  # iteration stops exactly when the data ends
    from gpustrat import nest
    for step, ref in zip(got, reference):
        flat_ref = nest.flatten(ref)
        rows = len(flat_ref[0])
        per_leaf = [s.experimental_local_results(v) for v in nest.flatten(step)]
        for pieces, want in zip(per_leaf, flat_ref):
            assert len(pieces) == n
            assert all(len(p) <= -(-rows // n) for p in pieces)
            np.testing.assert_array_equal(np.concatenate(pieces), want)
            assert all(p.dtype == want.dtype and p.shape[1:] == want.shape[1:] for p in pieces)


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 40), st.integers(1, 9), st.booleans(), st.integers(1, 4),
       st.integers(1, 3))
def test_data_policy_deals_pieces_round_robin_and_delivers_each_element_once(
        size, batch, drop, workers, local):
    # DATA over `workers` workers of `local` replicas, every worker's dealing worked out
    # in one process: piece k of each global batch goes to worker k % workers, whose
    # replicas take its pieces in order.
    from gpustrat.distribute.splitting import Splitter, deal_steps
    n = workers * local
    ds = Dataset.range(size).batch(batch, drop_remainder=drop)
    per_worker = [[[p.tolist() for p in step]
                   for step in deal_steps(iter(ds), Splitter(n), w, workers, local, False)]
                  for w in range(workers)]
    batches = [b.tolist() for b in ds]
    for w, got in enumerate(per_worker):
        assert got == [rule(b, n)[w::workers] for b in batches]
    delivered = sorted(v for got in per_worker for step in got for p in step for v in p)
    assert delivered == sorted(v for b in batches for v in b)


def test_per_replica_spec_of_a_mapped_batch_holds_for_every_piece():
    # map's output spec comes from the input's spec: an unknown batch dimension stays
    # unknown, so the pieces' spec does not claim rows the last step lacks.
    s = mirrored(2)
    dist = s.experimental_distribute_dataset(Dataset.range(5).batch(2).map(lambda x: x * 2))
    assert dist.element_spec.shape == (None,)
    assert steps(s, dist) == [[[0], [2]], [[4], [6]], [[8], []]]
    static = s.experimental_distribute_dataset(
        Dataset.range(5).batch(2, drop_remainder=True).map(lambda x: x * 2))
    assert static.element_spec.shape == (1,)
    assert all(np.asarray(p).shape == (1,) for step in static
               for p in s.experimental_local_results(step))


class _OtherWorker:
    """Worker 0 of two, whose partner's data holds ``theirs`` steps (a scripted group:
    what the partner sends in each collective follows from that count)."""

    rank, size = 0, 2

    def __init__(self, theirs, known):
        self._theirs, self._known, self._read = theirs, known, 0

    def allgather(self, obj):
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], bool):
            return [obj, (self._theirs, True)]      # naming the counts
        return [obj, (self._theirs if self._known else -1, obj[1])]

    def allreduce_ints(self, values, op):
        block = max(1, int(values[0]))
        ready = min(block, self._theirs - self._read)
        self._read += ready
        return np.maximum(values, np.array([ready, -ready]))


@pytest.mark.parametrize("known", [True, False])
def test_data_steps_that_differ_between_workers_raise_naming_each_count(known):
    from gpustrat.distribute import end_of_data
    mine = [[np.arange(2)] for _ in range(9)]
    steps = end_of_data.agreed_steps(iter(mine), _OtherWorker(5, known), 1,
                                     9 if known else None, lambda p: p[:0],
                                     end_of_data.Agreement(), same_steps=True)
    with pytest.raises(end_of_data.DataLengthMismatch,
                       match="worker 0: (at least )?[0-9]+ steps, worker 1: 5 steps"):
        list(steps)
    # Without same_steps (OFF, FILE) the shorter worker is padded and nothing raises.
    padded = end_of_data.agreed_steps(iter(mine[:5]), _OtherWorker(9, known), 1,
                                      5 if known else None, lambda p: p[:0],
                                      end_of_data.Agreement())
    got = list(padded)
    assert len(got) == 9 and all(len(s[0]) == 0 for s in got[5:])


def test_a_worker_short_of_its_promised_steps_raises():
    from gpustrat.distribute import end_of_data
    steps = end_of_data.agreed_steps(iter([[np.arange(2)]] * 3), _OtherWorker(4, True), 1,
                                     4, lambda p: p[:0], end_of_data.Agreement())
    with pytest.raises(RuntimeError, match="worker 0 has 3 steps but its dataset's "
                                           "cardinality promised 4"):
        list(steps)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_next_inside_run_is_an_error_that_takes_no_step(n):
    # Each replica used to take a whole step (a per-replica value of per-replica values),
    # consuming the dataset n times as fast.
    s = mirrored(n)
    it = iter(s.experimental_distribute_dataset(Dataset.range(6 * n).batch(2 * n)))
    for take in (next, lambda i: i.get_next(), lambda i: i.get_next_as_optional()):
        with pytest.raises(RuntimeError, match=r"next\(\) of a distributed iterator "
                           r"inside strategy.run.*strategy.run\(fn, args=\(next\(iterator\),\)\)"):
            s.run(take, args=(it,))
    first = s.experimental_local_results(next(it))  # still the first step
    assert [np.asarray(p).tolist() for p in first] == [[2 * i, 2 * i + 1] for i in range(n)]


def test_what_is_not_a_dataset_a_function_or_options_is_named_at_the_call():
    s = mirrored(2)
    ds = Dataset.range(8).batch(4)
    with pytest.raises(TypeError, match=r"experimental_distribute_dataset needs a "
                                        r"gs.data.Dataset, got list"):
        s.experimental_distribute_dataset([np.ones(2), np.ones(2)])
    # Options as a dict used to be taken, and fail when iterated.
    with pytest.raises(TypeError, match=r"options must be a gs.distribute.InputOptions, "
                                        r"got dict \{'experimental_fetch_to_device': False\}"):
        s.experimental_distribute_dataset(ds, {"experimental_fetch_to_device": False})
    with pytest.raises(TypeError, match=r"distribute_datasets_from_function: options must"):
        s.distribute_datasets_from_function(lambda ctx: ds, {"x": 1})
    with pytest.raises(TypeError, match=r"needs a function dataset_fn\(input_context\).*got "
                                        r"RangeBatchDataset.*experimental_distribute_dataset"):
        s.distribute_datasets_from_function(ds)
    with pytest.raises(TypeError, match=r"calls dataset_fn\(input_context\) with one "
                                        r"argument, but 'make' has the signature \(\)"):
        def make():
            return ds
        s.distribute_datasets_from_function(make)
    # A list of arrays used to be iterated as if it were a dataset.
    for bad, name in (([np.ones(2), np.ones(2)], "list"), (None, "NoneType")):
        with pytest.raises(TypeError, match=rf"dataset_fn must return a gs.data.Dataset "
                                            rf"\(batched by the per-replica batch size\), "
                                            rf"got {name}"):
            s.distribute_datasets_from_function(lambda ctx, bad=bad: bad)
    # What is right still works: a function with defaults after the context, options.
    dist = s.distribute_datasets_from_function(
        lambda ctx, n=2: Dataset.range(8).batch(n),
        gs.distribute.InputOptions(experimental_fetch_to_device=False))
    assert len(list(dist)) == 2
