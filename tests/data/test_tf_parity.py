"""Behaviours compared against real ``tf.data``.

Every expected value here was observed by running the same pipeline with TensorFlow
2.21 (``tensorflow-cpu``) and is hard-coded, so these tests need no TensorFlow.
"""

import numpy as np
import pytest

from gpustrat.data import UNKNOWN_CARDINALITY, Dataset, TensorSpec
from gpustrat.data.spec import STRING


def ints(ds):
    return [int(v) for v in ds]


# --- lists: values given to sources are arrays; a function's top-level list is a tuple --

def test_from_tensor_slices_list_of_tuples_is_one_array():
    # TF 2.21: from_tensor_slices([(1, 2), (3, 4)]) yields [1 2], [3 4]; spec (2,).
    ds = Dataset.from_tensor_slices([(1, 2), (3, 4)])
    assert [v.tolist() for v in ds] == [[1, 2], [3, 4]]
    assert ds.cardinality() == 2
    assert ds.element_spec.shape == (2,)


def test_from_tensors_list_of_tuples_is_one_array():
    # TF 2.21: from_tensors([(1, 2), (3, 4)]) yields one element [[1 2] [3 4]], spec (2, 2);
    # from_tensors(([1, 2], [(1, 2)])) yields ([1 2], [[1 2]]).
    (elem,) = list(Dataset.from_tensors([(1, 2), (3, 4)]))
    assert isinstance(elem, np.ndarray) and elem.tolist() == [[1, 2], [3, 4]]
    (a, b) = next(iter(Dataset.from_tensors(([1, 2], [(1, 2)]))))
    assert a.tolist() == [1, 2] and isinstance(b, np.ndarray) and b.shape == (1, 2)


def test_map_returning_a_list_gives_a_tuple():
    # TF 2.21: range(3).map(lambda x: [x, x * 2]) yields (0, 0), (1, 2), (2, 4) with spec
    # (TensorSpec((), int64), TensorSpec((), int64)); a nested list stays a tensor:
    # map(lambda x: [[x, x], [x, x]]) yields ([0 0], [0 0]), ...
    ds = Dataset.range(3).map(lambda x: [x, x * 2])
    out = list(ds)
    assert all(type(e) is tuple for e in out)
    assert [(int(a), int(b)) for a, b in out] == [(0, 0), (1, 2), (2, 4)]
    assert ds.element_spec == (TensorSpec((), np.int64), TensorSpec((), np.int64))
    assert ints(ds.map(lambda a, b: a + b)) == [0, 3, 6]
    nested = next(iter(Dataset.range(3).map(lambda x: [[x, x], [x, x]])))
    assert type(nested) is tuple and [v.shape for v in nested] == [(2,), (2,)]



def test_none_is_not_an_element_component():
    # TF 2.21: range(3).map(lambda x: None) raises when built ("Length for attr
    # 'output_shapes' of 0 must be at least minimum 1"); gpustrat yielded None with a
    # string spec. It now raises TypeError naming the value.
    with pytest.raises(TypeError, match="NoneType None cannot be a component"):
        list(Dataset.range(3).map(lambda x: None))
    with pytest.raises(TypeError, match="cannot be a component"):
        Dataset.from_tensors((1, object()))


# --- range ------------------------------------------------------------------------------

def test_range_accepts_tf_output_type_keyword():
    # TF 2.21: Dataset.range(3, output_type=tf.int32).element_spec is TensorSpec((), int32).
    ds = Dataset.range(3, output_type=np.int32)
    assert ds.element_spec == TensorSpec((), np.int32)
    assert [v.dtype for v in ds] == [np.int32] * 3
    assert Dataset.range(4, output_type=np.int32).batch(3).element_spec.dtype == np.int32


# --- cardinality ------------------------------------------------------------------------

def test_filter_cardinality_is_unknown_even_for_empty_input():
    # TF 2.21: range(0).filter(lambda x: x > 0).cardinality() == -2.
    assert Dataset.range(0).filter(lambda x: x > 0).cardinality() == UNKNOWN_CARDINALITY


def test_interleave_cardinality_is_unknown_even_for_empty_input():
    # TF 2.21: range(0).interleave(lambda x: range(2), cycle_length=2).cardinality() == -2.
    ds = Dataset.range(0).interleave(lambda x: Dataset.range(2), cycle_length=2)
    assert ds.cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.range(0).flat_map(lambda x: Dataset.range(2)).cardinality() == -2


def test_unbatch_cardinality_unknown_unless_batch_dim_known_and_positive():
    # TF 2.21: range(0).batch(3).unbatch() -> -2; from_tensors(zeros((0, 3))).unbatch()
    # -> -2; range(0).batch(3, drop_remainder=True).unbatch() -> 0;
    # from_tensors(zeros((2, 3))).repeat().unbatch() -> -1.
    assert Dataset.range(0).batch(3).unbatch().cardinality() == UNKNOWN_CARDINALITY
    assert Dataset.from_tensors(np.zeros((0, 3))).unbatch().cardinality() == -2
    assert Dataset.range(0).batch(3, drop_remainder=True).unbatch().cardinality() == 0
    assert Dataset.from_tensors(np.zeros((2, 3))).repeat().unbatch().cardinality() == -1


def test_skip_all_keeps_infinite_and_unknown_cardinality():
    # TF 2.21: range(5).repeat().skip(-1) -> -1; range(5).filter(...).skip(-1) -> -2;
    # range(5).skip(-1) -> 0; range(5).repeat().skip(-3) -> -1.
    assert Dataset.range(5).repeat().skip(-1).cardinality() == -1
    assert Dataset.range(5).filter(lambda x: True).skip(-1).cardinality() == -2
    assert Dataset.range(5).skip(-1).cardinality() == 0
    assert Dataset.range(5).repeat().skip(-3).cardinality() == -1


# --- argument checking ------------------------------------------------------------------

@pytest.mark.parametrize("make", [
    lambda ds: ds.take(2.0),
    lambda ds: ds.skip(1.5),
    lambda ds: ds.repeat(2.0),
    lambda ds: ds.enumerate(start=0.5),
])
def test_counts_must_be_ints(make):
    # TF 2.21: range(5).take(2.0) raises TypeError ("Cannot convert 2.0 to EagerTensor of
    # dtype int64"); gpustrat names the argument and the value.
    with pytest.raises(TypeError, match=r"must be an int, got float"):
        make(Dataset.range(5))


def test_counts_accept_numpy_ints():
    assert ints(Dataset.range(5).take(np.int64(2))) == [0, 1]
    assert ints(Dataset.range(2).repeat(np.int32(2))) == [0, 1, 0, 1]


def test_concatenate_incompatible_structures_fail_before_any_element():
    # TF 2.21: range(3).concatenate(from_tensor_slices((a, b))) and a concatenation of
    # int64 with float32 raise TypeError "Incompatible dataset elements" when built;
    # gpustrat raises at the start of iteration (the spec may need user code to run).
    mixed = Dataset.range(3).concatenate(
        Dataset.from_tensor_slices((np.arange(2), np.arange(2))))
    with pytest.raises(TypeError, match="incompatible"):
        next(iter(mixed))
    dtypes = Dataset.range(3).concatenate(Dataset.from_tensor_slices(np.zeros(2, np.float32)))
    with pytest.raises(TypeError, match="incompatible"):
        list(dtypes)
    keys = Dataset.from_tensors({"a": 1}).concatenate(Dataset.from_tensors({"b": 1}))
    with pytest.raises(TypeError, match="incompatible"):
        list(keys)


def test_concatenate_with_an_empty_input_of_unknown_spec_still_iterates():
    empty = Dataset.from_generator(lambda: iter(()))
    assert ints(Dataset.range(2).concatenate(empty)) == [0, 1]


# --- from_generator ---------------------------------------------------------------------

def test_from_generator_output_types_without_shapes():
    # TF 2.21: from_generator(g, output_types=tf.int64) with g yielding 0, 1, 2 yields
    # int64 0, 1, 2 (shapes unchecked).
    def gen():
        yield from range(3)

    ds = Dataset.from_generator(gen, output_types=np.int64)
    out = list(ds)
    assert [int(v) for v in out] == [0, 1, 2] and all(v.dtype == np.int64 for v in out)

    def pairs():
        yield 1, [1, 2]
        yield 2, [3, 4, 5]

    ds = Dataset.from_generator(pairs, output_types=(np.int32, np.float32))
    (a, b), (c, d) = list(ds)
    assert a.dtype == np.int32 and b.dtype == np.float32 and d.tolist() == [3.0, 4.0, 5.0]
    with pytest.raises(TypeError, match="element 0 does not match output_signature: "
                                        "expected dtype int64, got"):
        list(Dataset.from_generator(lambda: iter(["x"]), output_types=np.int64))


def test_from_generator_casts_numpy_numbers_to_the_declared_dtype():
    # TF 2.21: NumPy values are cast to the declared dtype (np.random.rand(4) under
    # output_types=tf.float32 gives float32; np.array([1.5]) under tf.int32 gives [1]);
    # a Python 1.5 under int64 is still refused (test_sources).
    ds = Dataset.from_generator(lambda: iter([np.array([0.25, 0.5], np.float64)]),
                                output_types=np.float32, output_shapes=(2,))
    (out,) = list(ds)
    assert out.dtype == np.float32 and out.tolist() == [0.25, 0.5]
    (out,) = list(Dataset.from_generator(lambda: iter([np.array([1.5])]), output_types=np.int32))
    assert out.dtype == np.int32 and out.tolist() == [1]


# --- element_spec of functions over empty inputs ----------------------------------------

def test_interleave_spec_of_empty_input_calls_map_func_on_zeros():
    # TF 2.21: range(0).interleave(lambda x: range(2), cycle_length=2).element_spec is
    # TensorSpec((), int64).
    ds = Dataset.range(0).interleave(lambda x: Dataset.from_tensors(x).repeat(2),
                                     cycle_length=2)
    assert ds.element_spec == TensorSpec((), np.int64)
    assert list(ds) == []


def test_map_spec_after_an_empty_filter():
    # TF 2.21: range(0).filter(lambda x: x > 0).map(lambda x: (x, 1.0)).element_spec is
    # (TensorSpec((), int64), TensorSpec((), float32)) (float64 in gpustrat: NumPy rules).
    ds = Dataset.range(0).filter(lambda x: x > 0).map(lambda x: (x, np.float32(1)))
    assert ds.element_spec == (TensorSpec((), np.int64), TensorSpec((), np.float32))


def test_dict_elements_keep_the_users_key_order():
    # Observed from TF 2.21: tf.data keeps {'b', 'a'} in that order (flat and nested).
    flat = Dataset.from_tensor_slices({"b": [1, 2], "a": [3, 4]})
    first = next(iter(flat))
    assert list(first) == ["b", "a"] and (first["b"], first["a"]) == (1, 3)
    assert list(flat.element_spec) == ["b", "a"]
    assert [list(e) for e in flat.batch(2)] == [["b", "a"]]
    nested = Dataset.from_tensor_slices({"b": [1, 2], "a": ([3, 4], [5, 6])})
    assert list(next(iter(nested))) == ["b", "a"]


# --- element_spec of functions: no element may contradict it -----------------------------

def _assert_every_element_fits(ds):
    from gpustrat import nest
    spec = ds.element_spec
    for element in ds:
        for s, leaf in zip(nest.flatten(spec), nest.flatten(element)):
            assert s.is_compatible_with(leaf), (spec, element)


@pytest.mark.parametrize("ds,want", [
    # Recorded from TF 2.21 (element_spec of the same pipelines).
    (Dataset.range(5).batch(2).map(lambda x: x * 2), TensorSpec((None,), np.int64)),
    (Dataset.range(5).batch(2, drop_remainder=True).map(lambda x: x * 2),
     TensorSpec((2,), np.int64)),
    (Dataset.range(5).batch(2).map(lambda x: x.reshape(-1, 1)),
     TensorSpec((None, 1), np.int64)),
    (Dataset.range(5).batch(2).map(lambda x: (x, np.ones(3, np.float32))),
     (TensorSpec((None,), np.int64), TensorSpec((3,), np.float32))),
    (Dataset.range(4).interleave(lambda x: Dataset.from_tensors(np.arange(x)), cycle_length=2),
     TensorSpec((None,), np.int64)),
    (Dataset.range(4).flat_map(lambda x: Dataset.range(x).batch(2)),
     TensorSpec((None,), np.int64)),
], ids=["map-batch", "map-static-batch", "reshape", "tuple", "interleave", "flat_map"])
def test_function_specs_claim_only_dimensions_every_element_has(ds, want):
    assert ds.element_spec == want
    _assert_every_element_fits(ds)


def test_unbatch_of_a_mapped_batch_counts_what_it_yields():
    # TF 2.21: cardinality -2 (unknown batch dimension); 4 with drop_remainder.
    ds = Dataset.range(5).batch(2).map(lambda x: x * 2).unbatch()
    assert ds.cardinality() == UNKNOWN_CARDINALITY and len(list(ds)) == 5
    assert Dataset.range(5).batch(2, True).map(lambda x: x * 2).unbatch().cardinality() == 4


def test_specs_of_values_that_vary_between_elements():
    # Shapes that depend on the values, not on the input's shape.
    ragged = Dataset.range(5).map(lambda x: np.arange(x))
    assert ragged.element_spec == TensorSpec((None,), np.int64)
    _assert_every_element_fits(ragged)
    # The first elements equal (3, 3): later ones are read for one that differs (TF
    # 2.21 gives (None,) here, and (None, None) for the padded batches distributed).
    repeated = Dataset.from_tensor_slices(np.array([3, 3, 5, 2])).map(np.arange)
    assert repeated.element_spec == TensorSpec((None,), np.int64)
    _assert_every_element_fits(repeated)
    # Constant elements read a few past the second, no more (an infinite input too).
    constant = Dataset.from_tensors(np.ones(3)).repeat().map(lambda x: x * 2)
    assert constant.element_spec == TensorSpec((3,), np.float64)
    # An empty input: the function sees zeros, but its outputs' sizes are not known.
    assert Dataset.range(0).batch(2).map(lambda x: x * 2).element_spec == \
        TensorSpec((None,), np.int64)
    # A generator without output_shapes says nothing about its shapes (TF 2.21: unknown).
    gen = Dataset.from_generator(lambda: iter([np.zeros((2, 3)), np.zeros((1, 3))]))
    assert gen.element_spec == TensorSpec((None, None), np.float64)
    _assert_every_element_fits(gen)
    # A function that fails on a resized probe: every dimension unknown, rank known.
    picky = Dataset.range(6).batch(4).map(lambda x: x.reshape(2, 2) if len(x) == 4 else
                                          x.reshape(1, 2))
    assert picky.element_spec == TensorSpec((None, None), np.int64)
    _assert_every_element_fits(picky)
    # Strings keep their dtype through the probes.
    words = Dataset.from_tensor_slices(["a", "bb", "ccc"]).batch(2).map(lambda w: w[::-1])
    assert words.element_spec == TensorSpec((None,), STRING)


def test_unbatch_refuses_components_whose_spec_shows_different_leading_sizes():
    # TF 2.21 refuses it when the dataset is built: "`unbatch()` is only supported for
    # datasets of elements whose components have a matching leading dimension.
    # Encountered both 2 and 1." gpustrat refuses it when the spec is first needed (the
    # first iteration, element_spec or cardinality), as concatenate checks its inputs.
    ds = Dataset.from_tensor_slices((np.zeros((3, 2)), np.zeros((3, 1)))).take(0).unbatch()
    for use in (list, lambda d: d.element_spec, lambda d: d.cardinality()):
        with pytest.raises(ValueError, match=r"leading dimensions are known to differ \(2 and 1"):
            use(ds)
    # Unknown sizes are checked element by element, as before.
    ragged = Dataset.range(3).map(lambda x: (np.zeros(int(x)), np.zeros(1))).unbatch()
    with pytest.raises(ValueError, match=r"different leading dimensions \[0, 1\]"):
        list(ragged)
    same = Dataset.from_tensor_slices((np.zeros((3, 2)), np.ones((3, 2, 4)))).unbatch()
    assert same.cardinality() == 6 and len(list(same)) == 6
