"""Property tests: batch/unbatch/shard/take/skip arithmetic and cardinalities."""

import math

from hypothesis import given, settings, strategies as st

from gpustrat.data import Dataset

SETTINGS = settings(max_examples=60, deadline=None)
n_st = st.integers(0, 60)


def _rows(ds):
    return [[int(v) for v in b] for b in ds]


@SETTINGS
@given(n=n_st, b=st.integers(1, 13), drop=st.booleans(), fused=st.booleans())
def test_batch_shapes_counts_and_unbatch(n, b, drop, fused):
    base = Dataset.range(n) if fused else Dataset.range(n).map(lambda x: x)
    ds = base.batch(b, drop_remainder=drop)
    batches = _rows(ds)
    want = n // b if drop else math.ceil(n / b)
    assert len(batches) == want == ds.cardinality()
    assert all(len(x) == b for x in batches[:-1] if batches)
    flat = [v for x in batches for v in x]
    assert flat == list(range(want * b if drop else n))
    assert [int(v) for v in ds.unbatch()] == flat


@SETTINGS
@given(n=n_st, k=st.integers(1, 7), data=st.data())
def test_shards_partition_the_data(n, k, data):
    i = data.draw(st.integers(0, k - 1))
    ds = Dataset.range(n).shard(k, i)
    got = [int(v) for v in ds]
    assert got == [v for v in range(n) if v % k == i]
    assert ds.cardinality() == len(got)
    everything = sorted(int(v) for j in range(k) for v in Dataset.range(n).shard(k, j))
    assert everything == list(range(n))  # every element exactly once


@SETTINGS
@given(n=n_st, t=st.integers(-1, 70), s=st.integers(-1, 70))
def test_take_skip(n, t, s):
    ds = Dataset.range(n).skip(s).take(t)
    ref = list(range(n))
    ref = [] if s < 0 else ref[s:]
    ref = ref if t < 0 else ref[:t]
    assert [int(v) for v in ds] == ref
    assert ds.cardinality() == len(ref)


@SETTINGS
@given(n=st.integers(0, 40), b=st.integers(1, 9), seed=st.integers(0, 2 ** 32))
def test_shuffle_then_batch_delivers_everything_once(n, b, seed):
    ds = Dataset.range(n).shuffle(b, seed=seed).batch(b)
    flat = sorted(v for x in _rows(ds) for v in x)
    assert flat == list(range(n))


@SETTINGS
@given(lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6),
       cycle=st.integers(1, 4), block=st.integers(1, 4))
def test_interleave_delivers_each_sub_dataset_in_order(lengths, cycle, block):
    ds = Dataset.from_tensor_slices(lengths).enumerate().interleave(
        lambda i, m: Dataset.range(m).map(lambda v: (i, v)), cycle_length=cycle,
        block_length=block)
    seen = {}
    for i, v in ds:
        seen.setdefault(int(i), []).append(int(v))
    assert seen == {i: list(range(m)) for i, m in enumerate(lengths) if m}
