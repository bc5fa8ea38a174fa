"""Sources: range, from_tensors, from_tensor_slices, from_generator; specs and cardinality."""

import collections

import numpy as np
import pytest

from gpustrat.data import (INFINITE_CARDINALITY, STRING, UNKNOWN_CARDINALITY, Dataset,
                           TensorSpec)

Point = collections.namedtuple("Point", ["x", "y"])


def test_range_forms_dtype_and_cardinality():
    assert [int(v) for v in Dataset.range(5)] == [0, 1, 2, 3, 4]
    assert [int(v) for v in Dataset.range(2, 5)] == [2, 3, 4]
    assert [int(v) for v in Dataset.range(1, 5, 2)] == [1, 3]
    assert [int(v) for v in Dataset.range(5, 1, -2)] == [5, 3]
    assert list(Dataset.range(0)) == []
    first = next(iter(Dataset.range(3)))
    assert first.dtype == np.int64 and np.ndim(first) == 0
    assert Dataset.range(1, 10, 3).cardinality() == 3
    assert Dataset.range(5).element_spec == TensorSpec((), np.int64)
    assert Dataset.range(3, dtype=np.int32).element_spec.dtype == np.int32


def test_range_is_lazy_for_huge_ranges():
    ds = Dataset.range(10 ** 15)
    assert ds.cardinality() == 10 ** 15
    assert [int(v) for v in ds.take(3)] == [0, 1, 2]


def test_range_bad_arguments():
    with pytest.raises(ValueError):
        Dataset.range(0, 5, 0)
    with pytest.raises(TypeError, match="ints"):
        Dataset.range(2.5)


def test_from_tensors_single_element():
    ds = Dataset.from_tensors(([1, 2], {"a": 3.0}))
    (elem,) = list(ds)
    np.testing.assert_array_equal(elem[0], [1, 2])
    assert elem[1]["a"] == 3.0 and elem[1]["a"].dtype == np.float64
    assert ds.cardinality() == 1
    assert ds.element_spec == (TensorSpec((2,), np.int64), {"a": TensorSpec((), np.float64)})


def test_from_tensor_slices_nested_and_views():
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ds = Dataset.from_tensor_slices({"x": x, "p": Point(np.arange(4), np.arange(4) * 10)})
    out = list(ds)
    assert len(out) == 4 and ds.cardinality() == 4
    assert isinstance(out[2]["p"], Point)
    assert int(out[2]["p"].y) == 20
    np.testing.assert_array_equal(out[2]["x"], x[2])
    assert np.shares_memory(out[2]["x"], x)  # rows are views of the caller's array
    assert ds.element_spec == {"x": TensorSpec((3,), np.float32),
                               "p": Point(TensorSpec((), np.int64), TensorSpec((), np.int64))}


def test_from_tensor_slices_list_is_an_array_like_tf():
    assert [int(v) for v in Dataset.from_tensor_slices([1, 2, 3])] == [1, 2, 3]
    names = list(Dataset.from_tensor_slices(["a.txt", "b.txt"]))
    assert names == [b"a.txt", b"b.txt"]
    assert Dataset.from_tensor_slices(["a", "bc"]).element_spec == TensorSpec((), STRING)


def test_from_tensor_slices_errors_name_the_values():
    with pytest.raises(ValueError, match=r"\[3, 4\]"):
        Dataset.from_tensor_slices((np.zeros(3), np.zeros(4)))
    with pytest.raises(ValueError, match="scalar"):
        Dataset.from_tensor_slices(np.float32(1.0))


def test_fused_slice_batch_gives_views_and_tf_specs():
    x = np.arange(10 * 2).reshape(10, 2)
    ds = Dataset.from_tensor_slices(x).batch(4)
    batches = list(ds)
    assert [b.shape[0] for b in batches] == [4, 4, 2]
    assert all(np.shares_memory(b, x) for b in batches)
    assert ds.cardinality() == 3
    assert ds.element_spec == TensorSpec((None, 2), x.dtype)
    dropped = Dataset.from_tensor_slices((x, x[:, 0])).batch(4, drop_remainder=True)
    assert dropped.cardinality() == 2 and len(list(dropped)) == 2
    assert dropped.element_spec[0] == TensorSpec((4, 2), x.dtype)
    np.testing.assert_array_equal(list(dropped)[1][1], x[4:8, 0])


def test_range_batch_fused_matches_plain_batch():
    for n, b, drop in [(10, 3, False), (10, 3, True), (9, 3, False), (0, 2, False)]:
        fused = [list(map(int, v)) for v in Dataset.range(n).batch(b, drop)]
        plain = [list(map(int, v)) for v in Dataset.range(n).map(lambda v: v).batch(b, drop)]
        assert fused == plain
        assert Dataset.range(n).batch(b, drop).cardinality() == len(fused)


def test_from_generator_checks_and_converts():
    def gen():
        yield 1, [1.0, 2.0]
        yield 2, [3.0, 4.0]

    sig = (TensorSpec((), np.int64), TensorSpec((2,), np.float32))
    ds = Dataset.from_generator(gen, output_signature=sig)
    out = list(ds)
    assert out[1][1].dtype == np.float32 and out[0][0].dtype == np.int64
    assert ds.element_spec == sig and ds.cardinality() == UNKNOWN_CARDINALITY
    assert len(list(ds)) == 2  # every epoch calls the generator again


def test_from_generator_mismatch_names_index_expected_and_got():
    def gen():
        yield np.zeros(2, np.float32)
        yield np.zeros(3, np.float32)

    ds = Dataset.from_generator(gen, output_signature=TensorSpec((2,), np.float32))
    it = iter(ds)
    next(it)
    with pytest.raises(TypeError) as info:
        next(it)
    msg = str(info.value)
    assert "element 1" in msg and "(2,)" in msg and "(3,)" in msg
    with pytest.raises(StopIteration):
        next(it)


def test_from_generator_rejects_lossy_dtype_and_structure():
    ds = Dataset.from_generator(lambda: iter([1.5]), output_signature=TensorSpec((), np.int64))
    with pytest.raises(TypeError, match="element 0"):
        list(ds)
    ds = Dataset.from_generator(lambda: iter([(1, 2)]),
                                output_signature=(TensorSpec((), np.int64),))
    with pytest.raises(TypeError, match="structure"):
        list(ds)


def test_from_generator_args_and_legacy_types():
    ds = Dataset.from_generator(lambda n: range(n), output_types=np.int64,
                                output_shapes=(), args=(3,))
    assert [int(v) for v in ds] == [0, 1, 2]
    assert ds.element_spec == TensorSpec((), np.int64)


def test_cardinality_constants():
    assert INFINITE_CARDINALITY == -1 and UNKNOWN_CARDINALITY == -2
    assert Dataset.range(3).repeat().cardinality() == INFINITE_CARDINALITY
    with pytest.raises(TypeError, match="infinite"):
        len(Dataset.range(3).repeat())
    assert len(Dataset.range(3)) == 3


def test_iterator_protocol_and_restart():
    ds = Dataset.range(3)
    it = iter(ds)
    assert iter(it) is it
    assert int(it.get_next()) == 0
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    # each iter() is a new epoch that restarts
    assert [int(v) for v in ds] == [0, 1, 2]
    assert [int(v) for v in ds] == [0, 1, 2]
    assert it.element_spec == ds.element_spec


def test_reduce_and_single_element():
    assert int(Dataset.range(5).reduce(np.int64(0), lambda s, x: s + x)) == 10
    assert int(Dataset.range(4, 5).get_single_element()) == 4
    with pytest.raises(ValueError, match="more than one"):
        Dataset.range(2).get_single_element()
