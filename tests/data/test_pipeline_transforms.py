"""padded_batch, rebatch, cache, sampling, window, grouping, scan, unique and
ignore_errors: properties of their arithmetic, the vectorised paths, and their use
under ``experimental_distribute_dataset`` on two logical CPU replicas."""

import logging
import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gpustrat as gs
from gpustrat import nest
from gpustrat.data import Dataset, TensorSpec, TextLineDataset, autoshard
from gpustrat.data.caching import CacheDataset

SETTINGS = settings(max_examples=40, deadline=None)


def ints(ds):
    return [int(v) for v in ds]


def rows(ds):
    return [np.asarray(b).tolist() for b in ds]


def ragged(lengths):
    return Dataset.from_generator(lambda: (np.arange(1, n + 1) for n in lengths),
                                  output_signature=TensorSpec((None,), np.int64))


# --- properties -----------------------------------------------------------------------

@SETTINGS
@given(batches=st.lists(st.integers(0, 7), max_size=8),
       sizes=st.lists(st.integers(0, 5), min_size=1, max_size=4).filter(any),
       drop=st.booleans())
def test_rebatch_preserves_every_element(batches, sizes, drop):
    data, start = [], 0
    for b in batches:
        data.append(np.arange(start, start + b))
        start += b
    src = Dataset.from_generator(lambda: iter(data),
                                 output_signature=TensorSpec((None,), np.int64))
    out = rows(src.rebatch(sizes if len(sizes) > 1 else sizes[0], drop_remainder=drop))
    flat = [v for b in out for v in b]
    # Batch j has sizes[j % len(sizes)] rows, except a short last one (kept or dropped).
    expected, pos, j = [], 0, 0
    while True:
        k = sizes[j % len(sizes)]
        if pos + k > start:
            break
        expected.append(list(range(pos, pos + k)))
        pos, j = pos + k, j + 1
    if pos < start and not drop:
        expected.append(list(range(pos, start)))
    if start == 0:
        assert all(b == [] for b in out)  # no rows: at most empty batches of size 0
    else:
        assert out == expected
    assert flat == list(range(pos if drop else start))


@SETTINGS
@given(lengths=st.lists(st.integers(0, 6), max_size=12), b=st.integers(1, 5),
       drop=st.booleans(), fixed=st.booleans(), pad=st.integers(-3, 3))
def test_padded_batch_preserves_every_element(lengths, b, drop, fixed, pad):
    shapes = [8] if fixed else None
    ds = ragged(lengths).padded_batch(b, padded_shapes=shapes, padding_values=pad,
                                      drop_remainder=drop)
    out = list(ds)
    kept = len(lengths) // b * b if drop else len(lengths)
    assert sum(len(x) for x in out) == kept
    assert len(out) == (len(lengths) // b if drop else math.ceil(len(lengths) / b))
    for i, batch in enumerate(out):
        group = lengths[i * b:(i + 1) * b]
        width = 8 if fixed else max(group)
        assert batch.shape == (len(group), width) and batch.dtype == np.int64
        for row, n in zip(batch, group):
            assert row[:n].tolist() == list(range(1, n + 1))
            assert (row[n:] == pad).all()


@SETTINGS
@given(n=st.integers(0, 30), size=st.integers(1, 6), shift=st.integers(1, 6),
       stride=st.integers(1, 4), drop=st.booleans())
def test_windows_cover_the_right_elements(n, size, shift, stride, drop):
    ds = Dataset.range(n).window(size, shift, stride, drop)
    got = [ints(w) for w in ds]
    expected = []
    for start in range(0, n, shift):
        w = [start + k * stride for k in range(size) if start + k * stride < n]
        if len(w) == size or not drop:
            expected.append(w)
    if drop:
        expected = [w for w in expected if len(w) == size]
    assert got == expected
    assert ds.cardinality() == len(expected)


@SETTINGS
@given(sizes=st.lists(st.integers(0, 8), min_size=1, max_size=4),
       seed=st.integers(0, 2 ** 31), weights=st.none() | st.lists(
           st.floats(0.1, 5), min_size=4, max_size=4))
def test_sampling_delivers_each_input_in_order_exactly_once(sizes, seed, weights):
    inputs = [Dataset.range(100 * i, 100 * i + n) for i, n in enumerate(sizes)]
    w = None if weights is None else weights[:len(sizes)]
    ds = Dataset.sample_from_datasets(inputs, weights=w, seed=seed)
    got = ints(ds)
    for i, n in enumerate(sizes):
        assert [v for v in got if v // 100 == i] == list(range(100 * i, 100 * i + n))
    assert len(got) == sum(sizes)
    assert ints(ds) == got  # a fixed seed: every epoch the same order


@SETTINGS
@given(values=st.lists(st.integers(0, 9), max_size=40), size=st.integers(1, 4),
       mod=st.integers(1, 4))
def test_group_by_window_delivers_every_element_once_in_groups(values, size, mod):
    ds = Dataset.from_tensor_slices(np.array(values, np.int64).reshape(-1)).group_by_window(
        lambda x: x % mod, lambda k, w: w.batch(size), window_size=size)
    out = rows(ds)
    assert sorted(v for b in out for v in b) == sorted(values)
    for b in out:
        assert 1 <= len(b) <= size and len({v % mod for v in b}) == 1
    for key in range(mod):  # each key's elements keep their order
        assert [v for b in out for v in b if v % mod == key] == \
            [v for v in values if v % mod == key]


@SETTINGS
@given(values=st.lists(st.integers(-5, 5), max_size=50), b=st.integers(1, 6))
def test_unique_fast_path_matches_the_element_path(values, b):
    arr = np.array(values, np.int64).reshape(-1)
    fast = Dataset.from_tensor_slices(arr).unique()
    slow = Dataset.from_tensor_slices(arr).map(lambda x: x).unique()
    expected = list(dict.fromkeys(values))
    assert ints(fast) == ints(slow) == expected
    assert rows(fast.batch(b)) == rows(slow.batch(b)) == \
        [expected[i:i + b] for i in range(0, len(expected), b)]


def test_empty_inputs_without_a_spec_give_nothing_and_iter_runs_no_code():
    def empty():
        return Dataset.from_generator(lambda: iter(()))  # no element, so no spec
    for make in (lambda d: d.padded_batch(2), lambda d: d.rebatch(2),
                 lambda d: d.window(2), lambda d: d.unique(), lambda d: d.cache(),
                 lambda d: d.group_by_window(lambda x: x, lambda k, w: w, window_size=2),
                 lambda d: d.bucket_by_sequence_length(len, [2], [1, 1]),
                 lambda d: Dataset.sample_from_datasets([d, d], seed=1),
                 lambda d: d.scan(0, lambda s, x: (s, x)), lambda d: d.ignore_errors()):
        assert list(make(empty())) == []
    calls = []
    src = Dataset.range(4).map(lambda x: calls.append(x) or np.arange(int(x)))
    for ds in (src.padded_batch(2), src.padded_batch(2).rebatch(1), src.window(2)):
        it = iter(ds)
        assert calls == []  # nothing runs before the first next
        next(it)
        it.close()
        calls.clear()


@SETTINGS
@given(n=st.integers(0, 12), stops=st.lists(st.integers(0, 12), max_size=3),
       in_file=st.booleans())
def test_cache_fills_only_from_a_complete_pass(tmp_path_factory, n, stops, in_file):
    reads = []

    def gen():
        for i in range(n):
            reads.append(i)
            yield i
    src = Dataset.from_generator(gen, output_signature=TensorSpec((), np.int64))
    c = src.cache(str(tmp_path_factory.mktemp("c") / "x") if in_file else "")
    for k in stops:  # passes stopped after k elements (a complete one when k >= n)
        it = iter(c)
        got = [int(v) for _, v in zip(range(k), it)]
        it.close()
        assert got == list(range(min(k, n)))
    reads.clear()
    assert ints(c) == list(range(n))
    # A pass is complete only when it saw the end of the input: reading exactly n
    # elements and stopping does not.
    filled = any(k > n for k in stops)
    assert reads == ([] if filled else list(range(n)))
    reads.clear()
    assert ints(c) == list(range(n)) and reads == []


# --- vectorised paths -----------------------------------------------------------------

def test_padded_batch_of_fixed_rows_slices_the_source():
    x = np.arange(24, dtype=np.float32).reshape(8, 3)
    out = list(Dataset.from_tensor_slices(x).padded_batch(3))
    assert [b.shape for b in out] == [(3, 3), (3, 3), (2, 3)]
    assert all(np.shares_memory(b, x) for b in out)  # no padding needed: views
    padded = list(Dataset.from_tensor_slices({"x": x, "i": np.arange(8)}).padded_batch(
        4, padded_shapes={"x": [5], "i": []}, padding_values={"x": -1.0, "i": 0},
        drop_remainder=True))
    assert [b["x"].shape for b in padded] == [(4, 5), (4, 5)]
    assert (padded[1]["x"][:, :3] == x[4:]).all() and (padded[1]["x"][:, 3:] == -1).all()
    assert padded[1]["i"].tolist() == [4, 5, 6, 7]


def test_rebatch_of_an_empty_input_gives_its_leading_empty_batches():
    # As tf.data: range(0).batch(4).rebatch([0, 3]) is one empty batch (it was none),
    # made from the element spec (unknown dimensions 0).
    def out(ds):
        return [[np.asarray(c).shape for c in nest.flatten(x)] for x in ds]
    empty = Dataset.range(0).batch(4)
    assert out(empty.rebatch([0, 3])) == [[(0,)]]
    assert out(empty.rebatch([0, 0, 3])) == [[(0,)], [(0,)]]
    assert out(empty.rebatch([3, 0])) == []
    pairs = Dataset.from_tensor_slices({"a": np.zeros((0, 2), np.float32),
                                        "b": np.zeros(0, np.int32)}).batch(4)
    got = list(iter(pairs.rebatch([0, 3])))
    assert [(x["a"].shape, x["a"].dtype, x["b"].shape) for x in got] == \
        [((0, 2), np.float32, (0,))]
    # Not an empty input: as before, the rows in order with the empty batches between.
    assert [np.asarray(x).tolist() for x in Dataset.range(3).batch(4).rebatch([0, 2])] == \
        [[], [0, 1], [], [2]]


def test_interleave_refuses_more_parallel_calls_than_a_fixed_cycle():
    ds = Dataset.range(3)
    with pytest.raises(ValueError, match=r"interleave: num_parallel_calls 2 is more than "
                                         r"the fixed cycle_length 1; give at most 1"):
        ds.interleave(lambda x: Dataset.range(x), cycle_length=1, num_parallel_calls=2)
    for cycle, calls in ((2, 2), (None, 8), (1, gs.data.AUTOTUNE)):
        got = ds.interleave(lambda x: Dataset.range(x), cycle_length=cycle,
                            num_parallel_calls=calls)
        assert sorted(int(v) for v in got) == [0, 0, 1]


def test_rebatch_takes_views_within_an_input_batch():
    x = np.arange(12)
    out = list(Dataset.from_tensor_slices(x).batch(6).rebatch(3))
    assert [b.tolist() for b in out] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert all(np.shares_memory(b, x) for b in out)


# --- cache ----------------------------------------------------------------------------

def test_memory_cache_two_iterations_at_once_and_errors():
    calls = []

    def gen():
        for i in range(3):
            calls.append(i)
            yield i
    c = Dataset.from_generator(gen, output_signature=TensorSpec((), np.int64)).cache()
    a, b = iter(c), iter(c)
    assert [int(next(a)), int(next(b))] == [0, 0]
    assert ints(a) == [1, 2] and ints(b) == [1, 2]  # the first to finish fills the cache
    calls.clear()
    assert ints(c) == [0, 1, 2] and calls == []

    def failing():
        yield 0
        raise OSError("disk gone")
    f = Dataset.from_generator(failing, output_signature=TensorSpec((), np.int64)).cache()
    for _ in range(2):  # a pass that failed leaves no cache behind
        with pytest.raises(OSError, match="disk gone"):
            list(f)


def test_file_cache_round_trips_every_kind_of_leaf(tmp_path):
    elements = {"f": np.linspace(0, 1, 6, dtype=np.float16).reshape(3, 2),
                "s": np.array([b"a\x00b", b"", b"zz"], dtype=object),
                "t": (np.arange(3, dtype=np.uint8), np.array([[1, 2], [3, 4], [5, 6]]).T.T)}
    src = Dataset.from_tensor_slices(elements).batch(2)
    c = src.cache(str(tmp_path / "k"))
    first, second = list(c), list(c)
    for a, b in zip(first, second):
        assert a["f"].dtype == b["f"].dtype == np.float16
        assert (a["f"] == b["f"]).all() and a["s"].tolist() == b["s"].tolist()
        assert a["t"][0].dtype == b["t"][0].dtype == np.uint8
        assert type(b["t"]) is tuple and (a["t"][1] == b["t"][1]).all()
    assert second[0]["s"].tolist() == [b"a\x00b", b""]
    other = Dataset.range(3).cache(str(tmp_path / "k"))  # same file, another structure
    with pytest.raises(ValueError, match="holds elements of 4 components, but this "
                                         "dataset's have 1"):
        list(other)
    path = str(tmp_path / "k") + ".gpustrat-cache"
    with open(path, "r+b") as f:  # a damaged cache file is an error naming it
        f.truncate(40)
    with pytest.raises(ValueError, match="truncated; delete it"):
        list(c)


def test_rebuilt_memory_cache_starts_empty(tmp_path):
    # Sharding by file rebuilds the pipeline: a filled memory cache must not leak the
    # whole data into a shard.
    paths = []
    for i in range(2):
        p = tmp_path / f"f{i}.txt"
        p.write_text("".join(f"{10 * i + j}\n" for j in range(3)))
        paths.append(str(p))
    c = TextLineDataset(paths).cache()
    assert len(list(c)) == 6
    shards = [[int(v) for v in autoshard.shard_files(c, 2, i)] for i in range(2)]
    assert shards == [[0, 1, 2], [10, 11, 12]]
    assert len(list(c)) == 6  # the original keeps its own cache


def test_unshardable_sources_leave_out_selectors(tmp_path):
    p = tmp_path / "a.txt"
    p.write_text("1\n2\n")
    lines = TextLineDataset([str(p)])
    zipped = Dataset.zip((lines, Dataset.range(2)))
    assert [type(n).__name__ for n in autoshard.unshardable_sources(zipped)] == \
        ["RangeDataset"]
    chosen = Dataset.choose_from_datasets([lines, lines], Dataset.range(2).repeat())
    assert autoshard.unshardable_sources(chosen) == []
    weights = Dataset.from_tensor_slices(np.ones((4, 2)))
    sampled = Dataset.sample_from_datasets([lines, lines], weights=weights, seed=1)
    assert autoshard.unshardable_sources(sampled) == []
    mixed = Dataset.sample_from_datasets([lines, Dataset.range(3)], seed=1)
    assert [type(n).__name__ for n in autoshard.unshardable_sources(mixed)] == \
        ["RangeDataset"]


# --- sampling -------------------------------------------------------------------------

def test_sampling_follows_the_weights_and_the_seed():
    a, b = Dataset.range(10 ** 6), Dataset.range(10 ** 6, 2 * 10 ** 6)
    ds = Dataset.sample_from_datasets([a, b], weights=[0.8, 0.2], seed=7).take(4000)
    got = ints(ds)
    share = sum(v < 10 ** 6 for v in got) / len(got)
    assert 0.76 < share < 0.84, share
    assert ints(ds) == got
    assert ints(Dataset.sample_from_datasets([a, b], weights=[0.8, 0.2], seed=8)
                .take(4000)) != got
    # TF 2.21: with a seed every epoch has the same order unless
    # rerandomize_each_iteration=True; without a seed every epoch draws anew.
    re = Dataset.sample_from_datasets([a, b], seed=7, rerandomize_each_iteration=True)
    assert ints(re.take(50)) != ints(re.take(50))
    unseeded = Dataset.sample_from_datasets([a, b])
    assert ints(unseeded.take(50)) != ints(unseeded.take(50))
    assert ints(Dataset.sample_from_datasets([a, b], seed=7)._with_seed(3).take(50)) == \
        ints(Dataset.sample_from_datasets([a, b], seed=3).take(50))


def test_sampling_stop_on_empty_dataset():
    a, b = Dataset.range(3), Dataset.range(100, 200)
    got = ints(Dataset.sample_from_datasets([a, b], seed=1, stop_on_empty_dataset=True))
    assert [v for v in got if v < 3] == [0, 1, 2] and len(got) < 103


# --- ignore_errors --------------------------------------------------------------------

def _fails_on_3(x):
    if int(x) == 3:
        raise RuntimeError("bad record 3")
    return x * 10


@pytest.mark.parametrize("parallel", [None, 4])
def test_ignore_errors_drops_failing_elements_upstream(parallel, caplog):
    base = Dataset.range(8).map(_fails_on_3, num_parallel_calls=parallel)
    ds = base.batch(3).ignore_errors(log_warning=True)
    with caplog.at_level(logging.WARNING, logger="gpustrat"):
        assert rows(ds) == [[0, 10, 20], [40, 50, 60], [70]]
    assert "bad record 3" in caplog.text
    pred = Dataset.range(6).filter(lambda x: 1 // (int(x) - 2) >= -1).ignore_errors()
    assert ints(pred) == [0, 1, 3, 4, 5]
    assert ds.element_spec == TensorSpec((None,), np.int64)

    def gen():
        yield from range(3)
        raise OSError("stream broke")
    g = Dataset.from_generator(gen, output_signature=TensorSpec((), np.int64))
    assert ints(g.ignore_errors()) == [0, 1, 2]  # an error that ends a stage ends it


# --- distributed (two logical CPU replicas) --------------------------------------------

def mirrored():
    return gs.MirroredStrategy(["cpu:0", "cpu:1"])


def pieces(strategy, dist):
    return [[np.asarray(p).tolist() for p in strategy.experimental_local_results(x)]
            for x in dist]


def test_distributed_padded_batch_and_bucketing():
    s = mirrored()
    dist = s.experimental_distribute_dataset(
        ragged([1, 3, 2, 1]).padded_batch(4, drop_remainder=True))
    assert dist.element_spec == TensorSpec((2, None), np.int64)
    assert pieces(s, dist) == [[[[1, 0, 0], [1, 2, 3]], [[1, 2, 0], [1, 0, 0]]]]
    bk = ragged([1, 5, 2, 6]).bucket_by_sequence_length(len, [4], [2, 2])
    assert pieces(s, s.experimental_distribute_dataset(bk)) == \
        [[[[1, 0]], [[1, 2]]], [[[1, 2, 3, 4, 5, 0]], [[1, 2, 3, 4, 5, 6]]]]


def test_distributed_rebatch_scan_unique_sampling_cache():
    s = mirrored()
    rb = Dataset.range(10).batch(3).rebatch(4)
    assert pieces(s, s.experimental_distribute_dataset(rb)) == \
        [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]
    sc = Dataset.range(4).scan(np.int64(0), lambda c, x: (c + x, c + x)).batch(2)
    assert pieces(s, s.experimental_distribute_dataset(sc)) == [[[0], [1]], [[3], [6]]]
    un = Dataset.from_tensor_slices(np.array([3, 3, 1, 2, 1])).unique().batch(2)
    assert pieces(s, s.experimental_distribute_dataset(un)) == [[[3], [1]], [[2], []]]
    sm = Dataset.sample_from_datasets([Dataset.range(4), Dataset.range(4, 8)], seed=5)
    dist = s.experimental_distribute_dataset(sm.batch(4).cache())
    first = pieces(s, dist)
    assert sorted(v for step in first for p in step for v in p) == list(range(8))
    assert pieces(s, dist) == first


def test_distributed_ignore_errors_choose_and_zip_of_dicts():
    s = mirrored()
    ig = Dataset.range(8).map(_fails_on_3).ignore_errors().batch(4)
    assert pieces(s, s.experimental_distribute_dataset(ig)) == \
        [[[0, 10], [20, 40]], [[50, 60], [70]]]
    ch = Dataset.choose_from_datasets([Dataset.range(3), Dataset.range(10, 13)],
                                      Dataset.range(2).repeat()).batch(2)
    assert pieces(s, s.experimental_distribute_dataset(ch)) == \
        [[[0], [10]], [[1], [11]], [[2], [12]]]
    z = Dataset.zip({"b": Dataset.range(4), "a": Dataset.range(10, 14)}).batch(4)
    (step,) = list(s.experimental_distribute_dataset(z))
    assert list(step) == ["b", "a"]
    assert [np.asarray(p).tolist() for p in s.experimental_local_results(step["a"])] == \
        [[10, 11], [12, 13]]


def test_distributed_dataset_refuses_windows_and_new_transforms():
    s = mirrored()
    with pytest.raises(ValueError, match=r"elements are datasets .*made by window\(\)"):
        s.experimental_distribute_dataset(Dataset.range(8).window(2))
    with pytest.raises(ValueError, match="elements are datasets"):
        s.distribute_datasets_from_function(lambda ctx: Dataset.range(8).window(2))
    dist = s.experimental_distribute_dataset(Dataset.range(8).batch(2))
    for name in ("window", "padded_batch", "rebatch", "cache", "unique", "scan"):
        with pytest.raises(AttributeError, match=f"cannot be transformed further \\('{name}'"):
            getattr(dist, name)


def test_window_flat_map_distributes():
    s = mirrored()
    ds = Dataset.range(6).window(4, 2, 1, True).flat_map(lambda w: w.batch(4))
    assert pieces(s, s.experimental_distribute_dataset(ds)) == \
        [[[0, 1], [2, 3]], [[2, 3], [4, 5]]]


def test_concurrent_file_cache_readers_after_fill(tmp_path):
    c = Dataset.range(50).cache(str(tmp_path / "shared"))
    assert ints(c) == list(range(50))
    results = []
    threads = [threading.Thread(target=lambda: results.append(ints(c))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [list(range(50))] * 3
    assert isinstance(c, CacheDataset) and c.path.endswith("shared.gpustrat-cache")


def test_batching_elements_of_different_shapes_points_to_padded_batch():
    ds = Dataset.range(4).map(lambda x: np.arange(x)).batch(2)
    with pytest.raises(ValueError, match=r"different shapes \[\(0,\), \(1,\)\] into one "
                                         r"batch; use padded_batch"):
        list(ds)
    assert [b.shape for b in Dataset.range(4).map(lambda x: np.arange(x)).padded_batch(2)] \
        == [(2, 1), (2, 3)]
