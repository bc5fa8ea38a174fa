"""Transformations against tf.data's documented behaviour."""

import subprocess
import sys

import numpy as np
import pytest

from gpustrat.data import (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset, Options,
                           TensorSpec)


def ints(ds):
    return [int(v) for v in ds]


def rows(ds):
    return [list(map(int, v)) for v in ds]


def test_batch_remainder_and_cardinality():
    # tf.data docs: range(8).batch(3) -> [0,1,2] [3,4,5] [6,7]; drop_remainder drops [6,7]
    ds = Dataset.range(8).map(lambda x: x).batch(3)
    assert rows(ds) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert ds.cardinality() == 3
    assert rows(Dataset.range(8).map(lambda x: x).batch(3, drop_remainder=True)) == [
        [0, 1, 2], [3, 4, 5]]
    assert Dataset.range(8).map(lambda x: x).batch(3, True).cardinality() == 2
    assert Dataset.range(8).repeat().batch(3).cardinality() == INFINITE_CARDINALITY


def test_batch_of_structures_and_spec():
    ds = Dataset.range(5).map(lambda x: {"a": x, "b": (x * 2.0, np.full(2, x))}).batch(2)
    out = list(ds)
    assert out[0]["b"][1].shape == (2, 2) and out[-1]["a"].shape == (1,)
    spec = ds.element_spec
    assert spec["b"][1] == TensorSpec((None, 2), np.int64)
    assert spec["b"][0] == TensorSpec((None,), np.float64)
    ds = Dataset.range(5).map(lambda x: x).batch(2, drop_remainder=True)
    assert ds.element_spec == TensorSpec((2,), np.int64)


def test_batch_errors():
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        Dataset.range(3).batch(0)
    with pytest.raises(ValueError, match="-2"):
        Dataset.range(3).batch(-2)
    ragged = Dataset.range(3).map(lambda x: np.zeros(int(x) + 1))
    with pytest.raises(ValueError, match="different shapes"):
        list(ragged.batch(2))


def test_unbatch_inverts_batch():
    ds = Dataset.from_tensor_slices((np.arange(7), np.arange(7) * 10.0)).batch(3).unbatch()
    out = list(ds)
    assert [int(a) for a, _ in out] == list(range(7))
    assert float(out[4][1]) == 40.0
    assert ds.element_spec == (TensorSpec((), np.int64), TensorSpec((), np.float64))
    assert Dataset.range(6).batch(2, drop_remainder=True).unbatch().cardinality() == 6
    assert Dataset.range(6).batch(4).unbatch().cardinality() == UNKNOWN_CARDINALITY


def test_map_calls_once_per_batch_and_unpacks_tuples():
    calls = []

    def fn(x, y):
        calls.append(x.shape)
        return x + y

    ds = Dataset.from_tensor_slices((np.arange(10), np.arange(10))).batch(4).map(fn)
    assert rows(ds) == [[0, 2, 4, 6], [8, 10, 12, 14], [16, 18]]
    assert calls == [(4,), (4,), (2,)]


def test_map_returns_python_values_as_numpy():
    ds = Dataset.range(2).map(lambda x: (1.5, "s", int(x)))
    a, s, i = next(iter(ds))
    assert a.dtype == np.float64 and s == b"s" and i.dtype == np.int64


def test_map_spec_for_empty_input_uses_zeros():
    ds = Dataset.range(0).map(lambda x: (x, np.float32(1)))
    assert ds.element_spec == (TensorSpec((), np.int64), TensorSpec((), np.float32))
    assert list(ds) == []


def test_filter():
    assert ints(Dataset.range(10).filter(lambda x: x % 3 == 0)) == [0, 3, 6, 9]
    assert Dataset.range(10).filter(lambda x: True).cardinality() == UNKNOWN_CARDINALITY
    with pytest.raises(ValueError, match="scalar boolean"):
        list(Dataset.range(3).map(lambda x: np.ones(2)).filter(lambda x: x > 0))


def test_repeat_take_skip_cardinalities():
    assert ints(Dataset.range(3).repeat(2)) == [0, 1, 2, 0, 1, 2]
    assert Dataset.range(3).repeat(2).cardinality() == 6
    assert Dataset.range(0).repeat().cardinality() == 0
    assert list(Dataset.range(0).repeat()) == []  # an empty dataset repeated stays empty
    assert ints(Dataset.range(3).repeat().take(7)) == [0, 1, 2, 0, 1, 2, 0]
    assert Dataset.range(3).repeat().take(7).cardinality() == 7
    assert Dataset.range(5).take(-1).cardinality() == 5
    assert ints(Dataset.range(5).skip(2)) == [2, 3, 4]
    assert Dataset.range(5).skip(9).cardinality() == 0
    assert list(Dataset.range(5).skip(-1)) == []
    assert Dataset.range(5).skip(-1).cardinality() == 0
    assert Dataset.range(3).repeat().skip(2).cardinality() == INFINITE_CARDINALITY
    assert Dataset.range(3).filter(lambda x: True).take(2).cardinality() == UNKNOWN_CARDINALITY


def test_shard():
    assert ints(Dataset.range(10).shard(3, 0)) == [0, 3, 6, 9]
    assert ints(Dataset.range(10).shard(3, 2)) == [2, 5, 8]
    assert Dataset.range(10).shard(3, 0).cardinality() == 4
    assert Dataset.range(10).shard(3, 1).cardinality() == 3
    with pytest.raises(ValueError, match="num_shards must be positive, got 0"):
        Dataset.range(3).shard(0, 0)
    with pytest.raises(ValueError, match=r"index 2 is out of range for 2 shards"):
        Dataset.range(3).shard(2, 2)
    with pytest.raises(ValueError, match="-1"):
        Dataset.range(3).shard(2, -1)


def test_enumerate_zip_concatenate():
    out = list(Dataset.range(3, 6).enumerate(start=10))
    assert [(int(i), int(x)) for i, x in out] == [(10, 3), (11, 4), (12, 5)]
    assert out[0][0].dtype == np.int64
    z = Dataset.zip(Dataset.range(3), Dataset.range(10, 20))
    assert [(int(a), int(b)) for a, b in z] == [(0, 10), (1, 11), (2, 12)]
    assert z.cardinality() == 3
    zd = Dataset.zip(datasets={"a": Dataset.range(2), "b": Dataset.range(5).repeat()})
    assert [int(e["b"]) for e in zd] == [0, 1] and zd.cardinality() == 2
    assert zd.element_spec == {"a": TensorSpec((), np.int64), "b": TensorSpec((), np.int64)}
    c = Dataset.range(2).concatenate(Dataset.range(5, 7))
    assert ints(c) == [0, 1, 5, 6] and c.cardinality() == 4
    with pytest.raises(TypeError, match="incompatible"):
        Dataset.range(2).concatenate(Dataset.from_tensor_slices([1.0])).element_spec
    merged = Dataset.from_tensors(np.zeros(2)).concatenate(Dataset.from_tensors(np.zeros(3)))
    assert merged.element_spec == TensorSpec((None,), np.float64)


def test_interleave_matches_tf_documented_order():
    expected = [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 3, 3, 4, 4,
                5, 5, 5, 5, 5, 5]
    fn = lambda x: Dataset.from_tensors(x).repeat(6)  # noqa: E731
    ds = Dataset.range(1, 6).interleave(fn, cycle_length=2, block_length=4)
    assert ints(ds) == expected
    par = Dataset.range(1, 6).interleave(fn, cycle_length=2, block_length=4,
                                         num_parallel_calls=2)
    assert ints(par) == expected
    assert ds.element_spec == TensorSpec((), np.int64)
    assert ds.cardinality() == UNKNOWN_CARDINALITY


def test_interleave_uneven_lengths_and_flat_map():
    # Elements 1, 2, 3 give datasets of x copies of x; cycle 2, block 1.
    ds = Dataset.range(1, 4).interleave(lambda x: Dataset.from_tensors(x).repeat(x),
                                        cycle_length=2)
    assert ints(ds) == [1, 2, 2, 3, 3, 3]
    fm = Dataset.range(3).flat_map(lambda x: Dataset.range(x))
    assert ints(fm) == [0, 0, 1]
    with pytest.raises(TypeError, match="must return a Dataset"):
        list(Dataset.range(2).interleave(lambda x: x, cycle_length=1))


def test_shuffle_is_a_permutation_with_tf_buffer_bound():
    n, b = 200, 10
    out = ints(Dataset.range(n).shuffle(b, seed=3))
    assert sorted(out) == list(range(n))
    # With a buffer of b, output k is drawn from the first k + b inputs.
    assert all(v < k + b for k, v in enumerate(out))
    assert ints(Dataset.range(20).shuffle(1, seed=0)) == list(range(20))
    assert out != list(range(n))


def test_shuffle_seed_and_reshuffle():
    ds = Dataset.range(50).shuffle(50, seed=7)
    e1, e2 = ints(ds), ints(ds)
    assert e1 != e2 and sorted(e1) == sorted(e2)
    # a fresh dataset with the same seed repeats the same sequence of epochs
    again = Dataset.range(50).shuffle(50, seed=7)
    assert ints(again) == e1 and ints(again) == e2
    fixed = Dataset.range(50).shuffle(50, seed=7, reshuffle_each_iteration=False)
    assert ints(fixed) == ints(fixed) == e1
    # repeat() after shuffle reshuffles each repetition
    rep = ints(Dataset.range(50).shuffle(50, seed=7).repeat(2))
    assert rep == e1 + e2
    # computing element_spec does not consume an epoch
    peeked = Dataset.range(50).shuffle(50, seed=7).map(lambda x: x)
    assert peeked.element_spec == TensorSpec((), np.int64)
    assert ints(peeked) == e1
    with pytest.raises(ValueError, match="buffer_size must be positive, got 0"):
        Dataset.range(3).shuffle(0)


def test_shuffle_order_is_the_same_in_another_process():
    code = ("from gpustrat.data import Dataset;"
            "print([int(v) for v in Dataset.range(30).shuffle(8, seed=42)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.strip()
    assert out == str(ints(Dataset.range(30).shuffle(8, seed=42)))


def test_options_merge_later_wins_for_set_fields():
    from gpustrat.data import AutoShardPolicy
    a = Options()
    a.experimental_distribute.auto_shard_policy = AutoShardPolicy.DATA
    a.deterministic = False
    b = Options()
    b.experimental_distribute.auto_shard_policy = AutoShardPolicy.OFF
    ds = Dataset.range(3).with_options(a).map(lambda x: x).with_options(b)
    merged = ds.options()
    assert merged.experimental_distribute.auto_shard_policy == AutoShardPolicy.OFF
    assert merged.deterministic is False  # b did not set it
    assert Dataset.range(1).options().experimental_distribute.auto_shard_policy == \
        AutoShardPolicy.AUTO
    zipped = Dataset.zip(Dataset.range(2).with_options(a), Dataset.range(2))
    assert zipped.options().deterministic is False
    assert [int(AutoShardPolicy.OFF), int(AutoShardPolicy.AUTO), int(AutoShardPolicy.FILE),
            int(AutoShardPolicy.DATA)] == [-1, 0, 1, 2]
    with pytest.raises(AttributeError, match="no option"):
        Options().not_an_option = 1
    with pytest.raises(ValueError, match="auto_shard_policy"):
        Options().experimental_distribute.auto_shard_policy = 7


def test_prefetch_keeps_order_and_values():
    ds = Dataset.range(100).map(lambda x: x * 2).prefetch(3)
    assert ints(ds) == [2 * i for i in range(100)]
    assert ds.cardinality() == 100
    with pytest.raises(ValueError, match="buffer_size"):
        Dataset.range(3).prefetch(-5)


def test_batch_rows_full_and_last_batch_when_the_size_is_known():
    from gpustrat.data import Dataset
    assert Dataset.range(10).batch(4).batch_rows() == (4, 2)              # fused range
    assert Dataset.range(10).batch(4, drop_remainder=True).batch_rows() == (4, 4)
    assert Dataset.from_tensor_slices([1, 2, 3]).batch(2).batch_rows() == (2, 1)
    assert Dataset.range(9).map(lambda x: x).batch(3).prefetch(2).batch_rows() == (3, 3)
    assert Dataset.range(3).batch(4, drop_remainder=True).batch_rows() is None  # no batch
    assert Dataset.range(0).batch(2).batch_rows() is None
    assert Dataset.range(10).filter(lambda x: x > 2).batch(3).batch_rows() is None
    assert Dataset.range(10).batch(3).take(2).batch_rows() is None  # not the last node
