"""``Dataset.zip`` with ``enumerate``, ``map`` returning dicts and ``padded_batch`` of
dicts (padded shapes and values as dicts), compared with real ``tf.data``.

Every expected value, element_spec, cardinality and exception type here was recorded
by running the same pipeline with TensorFlow 2.21 (``tensorflow-cpu``;
``tests/data/record_tf_zip.py`` runs them all with either library and lists the
differences) and is hard-coded, so these tests need no TensorFlow. Error messages are
gpustrat's own; where gpustrat differs on purpose, the test says so.
"""

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset, TensorSpec

from tests.data.test_tf_parity_zip import I64, S, keys, r, ragged, vals


def V(*shape):
    return TensorSpec(shape, I64)


# --- enumerate ------------------------------------------------------------------------

def test_enumerate_of_zip_of_dicts():
    # TF 2.21: (counter, dict) with the dict in its key order.
    e = Dataset.zip({"y": r(3), "x": r(10, 13)}).enumerate()
    assert e.element_spec == (S, {"y": S, "x": S}) and e.cardinality() == 3
    assert keys(e.element_spec) == [None, [("y", None), ("x", None)]]
    assert vals(e) == [(0, {"y": 0, "x": 10}), (1, {"y": 1, "x": 11}),
                       (2, {"y": 2, "x": 12})]
    # TF 2.21: start=5 and a negative start; name= is accepted.
    assert vals(Dataset.zip((r(2), r(2))).enumerate(start=5)) == [(5, (0, 0)), (6, (1, 1))]
    assert vals(r(2).enumerate(start=-3)) == [(-3, 0), (-2, 1)]
    assert vals(r(2).enumerate(name="e")) == [(0, 0), (1, 1)]
    # TF 2.21: a map gets the counter and the dict as two arguments.
    assert vals(Dataset.zip({"x": r(3), "y": r(3)}).enumerate()
                .map(lambda i, d: d["x"] + d["y"] * 10 + i * 100)) == [0, 111, 222]
    # TF 2.21: batched: counters (None,) beside the dict's batches.
    b = Dataset.zip({"x": r(3), "y": r(3)}).enumerate().batch(2)
    assert b.element_spec == (V(None), {"x": V(None), "y": V(None)})
    assert vals(b) == [([0, 1], {"x": [0, 1], "y": [0, 1]}), ([2], {"x": [2], "y": [2]})]
    # TF 2.21: cardinality is the input's: infinite, unknown.
    inf = Dataset.zip({"x": r(3).repeat()}).enumerate()
    assert inf.cardinality() == -1
    assert vals(inf, limit=5) == [(i, {"x": i % 3}) for i in range(5)]
    unk = Dataset.zip({"x": r(5).filter(lambda x: x > 1)}).enumerate()
    assert unk.cardinality() == -2
    assert vals(unk) == [(0, {"x": 2}), (1, {"x": 3}), (2, {"x": 4})]


def test_zip_of_enumerates():
    # TF 2.21: each enumerate counts on its own.
    z = Dataset.zip({"e": r(3).enumerate(), "f": r(10, 12).enumerate(7)})
    assert z.element_spec == {"e": (S, S), "f": (S, S)} and z.cardinality() == 2
    assert vals(z) == [{"e": (0, 0), "f": (7, 10)}, {"e": (1, 1), "f": (8, 11)}]


# --- map returning dicts --------------------------------------------------------------

def test_map_returning_dicts():
    # TF 2.21: the returned dict's key order, nested dicts and tuples kept.
    m = r(3).map(lambda x: {"b": x, "a": x + 1})
    assert list(m.element_spec) == ["b", "a"] and m.cardinality() == 3
    assert vals(m) == [{"b": 0, "a": 1}, {"b": 1, "a": 2}, {"b": 2, "a": 3}]
    assert all(list(e) == ["b", "a"] for e in m)
    n = r(2).map(lambda x: {"o": {"z": x, "y": (x, x * 2)}})
    assert n.element_spec == {"o": {"z": S, "y": (S, S)}}
    assert keys(n.element_spec) == [("o", [("z", None), ("y", [None, None])])]
    assert vals(n)[1] == {"o": {"z": 1, "y": (1, 2)}}
    # TF 2.21: a list inside a dict is one array of shape (2,).
    lst = r(2).map(lambda x: {"v": [x, x + 1]})
    assert lst.element_spec == {"v": V(2)} and vals(lst) == [{"v": [0, 1]}, {"v": [1, 2]}]
    # TF 2.21 makes a returned Python int int32; NumPy's rule makes it int64 here.
    assert r(2).map(lambda x: {"v": x, "c": 3}).element_spec == {"v": S, "c": S}


def test_map_returning_dicts_with_zip():
    # TF 2.21: datasets of dicts zipped: a tuple of the dicts, each in its order.
    z = Dataset.zip(r(3).map(lambda x: {"v": x}), r(3).map(lambda x: {"w": x * 2, "v": -x}))
    assert z.element_spec == ({"v": S}, {"w": S, "v": S})
    assert keys(z.element_spec) == [[("v", None)], [("w", None), ("v", None)]]
    assert vals(z)[2] == ({"v": 2}, {"w": 4, "v": -2})
    # TF 2.21: a zip of dicts mapped to a dict holding it.
    m = Dataset.zip({"x": r(3), "y": r(3)}).map(lambda d: {"s": d["x"] + d["y"], "d": d})
    assert m.element_spec == {"s": S, "d": {"x": S, "y": S}}
    assert vals(m)[2] == {"s": 4, "d": {"x": 2, "y": 2}}
    # TF 2.21: two dicts merged by the function: keys in the merged order q, p.
    merged = Dataset.zip(r(2).map(lambda x: {"p": x}), r(2).map(lambda x: {"q": x * 3})) \
        .map(lambda d1, d2: {**d2, **d1})
    assert list(merged.element_spec) == ["q", "p"]
    assert vals(merged) == [{"q": 0, "p": 0}, {"q": 3, "p": 1}]
    # TF 2.21: batch and unbatch of mapped dicts.
    b = r(5).map(lambda x: {"k": x, "j": (x, x)}).batch(2)
    assert b.element_spec == {"k": V(None), "j": (V(None), V(None))}
    assert vals(b)[2] == {"k": [4], "j": ([4], [4])}
    u = r(4).batch(2).map(lambda x: {"a": x, "b": x * 2}).unbatch()
    assert u.element_spec == {"a": S, "b": S} and u.cardinality() == -2
    assert vals(u) == [{"a": i, "b": 2 * i} for i in range(4)]


def test_elements_with_no_component_are_refused():
    # TF 2.21: InvalidArgumentError ("Length for attr 'output_types' of 0") when a map
    # returns {}, () or {"x": ()}, and for from_tensors({}); ValueError here.
    for fn in (lambda x: {}, lambda x: (), lambda x: {"x": ()}):
        with pytest.raises(ValueError, match="no component"):
            r(2).map(fn).element_spec
        with pytest.raises(ValueError, match="no component"):
            list(r(2).map(fn))
    with pytest.raises(ValueError, match="no component"):
        Dataset.from_tensors({})
    # TF 2.21: an empty part beside a component is fine: (0, {}), (1, {}).
    assert vals(r(2).map(lambda x: (x, {}))) == [(0, {}), (1, {})]


# --- padded_batch of dicts ------------------------------------------------------------

def zipped(lengths=(1, 3, 2)):
    return Dataset.zip({"x": ragged(lengths), "y": r(len(lengths))})


def test_padded_batch_of_dicts_as_tf():
    # TF 2.21: no padded_shapes: each key to the batch's largest.
    p = zipped().padded_batch(2)
    assert p.element_spec == {"x": V(None, None), "y": V(None)} and p.cardinality() == -2
    assert vals(p) == [{"x": [[1, 0, 0], [3, 3, 3]], "y": [0, 1]}, {"x": [[2, 2]], "y": [2]}]
    # TF 2.21: padded_shapes and padding_values as dicts.
    p = zipped().padded_batch(2, padded_shapes={"x": [4], "y": []},
                              padding_values={"x": np.int64(-1), "y": np.int64(0)})
    assert p.element_spec == {"x": V(None, 4), "y": V(None)}
    assert vals(p) == [{"x": [[1, -1, -1, -1], [3, 3, 3, -1]], "y": [0, 1]},
                       {"x": [[2, 2, -1, -1]], "y": [2]}]
    # TF 2.21: a None dimension, drop_remainder: spec (2, None) and (2,).
    p = zipped().padded_batch(2, padded_shapes={"x": [None], "y": []}, drop_remainder=True)
    assert p.element_spec == {"x": V(2, None), "y": V(2)}
    assert vals(p) == [{"x": [[1, 0, 0], [3, 3, 3]], "y": [0, 1]}]
    # TF 2.21: one scalar padding value for every key; padding_values alone.
    p = zipped((1, 3)).padded_batch(2, padded_shapes={"x": [4], "y": []},
                                    padding_values=np.int64(-1))
    assert vals(p) == [{"x": [[1, -1, -1, -1], [3, 3, 3, -1]], "y": [0, 1]}]
    p = zipped((1, 3)).padded_batch(2, padding_values={"x": np.int64(-7), "y": np.int64(0)})
    assert p.element_spec == {"x": V(None, None), "y": V(None)}
    assert vals(p) == [{"x": [[1, -7, -7], [3, 3, 3]], "y": [0, 1]}]
    # TF 2.21: an int is a one-dimensional padded shape ({"x": 4} is {"x": [4]}).
    p = zipped().padded_batch(2, padded_shapes={"x": 4, "y": []})
    assert p.element_spec == {"x": V(None, 4), "y": V(None)}
    assert vals(p)[1] == {"x": [[2, 2, 0, 0]], "y": [2]}
    # TF 2.21: a padding value of None is the default; shapes as arrays.
    p = zipped().padded_batch(2, padded_shapes={"x": np.array([5]), "y": np.array([], int)},
                              padding_values={"x": None, "y": np.int64(3)})
    assert p.element_spec == {"x": V(None, 5), "y": V(None)}
    assert vals(p)[1] == {"x": [[2, 2, 0, 0, 0]], "y": [2]}


def test_padded_batch_of_nested_dicts_strings_and_cardinality():
    # TF 2.21: a tuple holding a dict, with shapes and values of that structure.
    p = Dataset.zip((ragged((2, 1, 3)), {"v": r(3), "w": ragged((1, 1, 2))})).padded_batch(
        2, padded_shapes=([3], {"v": [], "w": [None]}),
        padding_values=(np.int64(9), {"v": np.int64(0), "w": np.int64(-2)}))
    assert p.element_spec == (V(None, 3), {"v": V(None), "w": V(None, None)})
    assert vals(p) == [([[2, 2, 9], [1, 9, 9]], {"v": [0, 1], "w": [[1], [1]]}),
                       ([[3, 3, 3]], {"v": [2], "w": [[2, 2]]})]
    # TF 2.21: a string key beside a padded one.
    p = Dataset.zip({"s": Dataset.from_tensor_slices(np.array([b"a", b"bc", b"d"])),
                     "x": ragged((2, 1, 3))}).padded_batch(2)
    assert p.element_spec == {"s": TensorSpec((None,), object), "x": V(None, None)}
    assert vals(p) == [{"s": [b"a", b"bc"], "x": [[2, 2], [1, 0]]},
                       {"s": [b"d"], "x": [[3, 3, 3]]}]
    # TF 2.21: a mapped dict; a zip of known size keeps its cardinality (5 -> 3).
    assert vals(r(1, 4).map(lambda x: {"n": x}).padded_batch(2)) == [{"n": [1, 2]},
                                                                     {"n": [3]}]
    p = Dataset.zip({"x": r(5), "y": r(7)}).padded_batch(2, padded_shapes={"x": [], "y": []})
    assert p.cardinality() == 3 and vals(p)[2] == {"x": [4], "y": [4]}


def test_padded_batch_of_dicts_errors_as_tf():
    two = Dataset.zip({"x": ragged((1, 3)), "y": r(2)})
    # TF 2.21: ValueError when the dicts' keys differ (missing, extra or other keys).
    for shapes in ({"x": [4]}, {"x": [4], "y": [], "z": []}, {"x": [4], "z": []}):
        with pytest.raises(ValueError, match="keys"):
            two.padded_batch(2, padded_shapes=shapes).element_spec
    with pytest.raises(ValueError, match="keys"):
        two.padded_batch(2, padded_shapes={"x": [4], "y": []},
                         padding_values={"x": np.int64(-1)}).element_spec
    # TF 2.21: TypeError when a tuple is given for a dict, or a dict for a tuple.
    with pytest.raises(TypeError, match="padded_shapes must be a dict"):
        two.padded_batch(2, padded_shapes=([4], [])).element_spec
    with pytest.raises(TypeError, match="padding_values must be a dict"):
        two.padded_batch(2, padding_values=(np.int64(1), np.int64(2))).element_spec
    with pytest.raises(TypeError, match="padded_shapes must be a tuple"):
        Dataset.zip((r(2),)).padded_batch(2, padded_shapes={"x": []}).element_spec
    # TF 2.21: ValueError for a padded shape that is no shape: a dict or None for one
    # component, a nested list, a negative size; TypeError for a float size.
    plain = ragged((1, 2))
    for bad in ({"x": []}, "a", [[4]], [-2], -1):
        with pytest.raises(ValueError, match="padded shape"):
            plain.padded_batch(2, padded_shapes=bad).element_spec
    with pytest.raises(ValueError, match="padded shape"):
        Dataset.zip({"v": plain}).padded_batch(2, padded_shapes={"v": None}).element_spec
    with pytest.raises(TypeError, match="padded shape"):
        plain.padded_batch(2, padded_shapes=[2.5]).element_spec
    # TF 2.21: ValueError "The padded shape (4, 1) is not compatible with the shape
    # (None,)" for another rank, and for a shape given to a scalar key.
    for shapes in ({"x": [4, 1], "y": []}, {"x": [4], "y": 1}):
        with pytest.raises(ValueError, match="not compatible"):
            two.padded_batch(2, padded_shapes=shapes).element_spec
    # TF 2.21: DataLossError "Attempted to pad to a smaller size than the input element"
    # at iteration; gpustrat raises ValueError naming both shapes.
    small = two.padded_batch(2, padded_shapes={"x": [2], "y": []})
    assert small.element_spec == {"x": V(None, 2), "y": V(None)}
    with pytest.raises(ValueError, match=r"shape \(3,\), larger than the padded shape"):
        list(small)
    # TF 2.21: TypeError for Python int padding values (int32 against int64); gpustrat
    # converts a value that is exact.
    p = two.padded_batch(2, padded_shapes={"x": [4], "y": []},
                         padding_values={"x": -1, "y": 0})
    assert vals(p) == [{"x": [[1, -1, -1, -1], [3, 3, 3, -1]], "y": [0, 1]}]
    # TF 2.21: TypeError for a string padding value of an int64 key.
    with pytest.raises(TypeError, match="does not match the component dtype int64"):
        two.padded_batch(2, padding_values={"x": "a", "y": np.int64(3)}).element_spec


def test_distributed_padded_batch_of_dicts():
    # TF 2.21 (two logical CPUs): each replica gets 2 padded rows of every key.
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    dist = s.experimental_distribute_dataset(
        Dataset.zip({"x": ragged((1, 3, 2, 1)), "y": r(4)}).padded_batch(
            4, padded_shapes={"x": [3], "y": []}, drop_remainder=True))
    assert dist.element_spec == {"x": V(2, 3), "y": V(2)}
    (step,) = list(dist)
    assert list(step) == ["x", "y"]
    assert [np.asarray(p).tolist() for p in s.experimental_local_results(step["x"])] == \
        [[[1, 0, 0], [3, 3, 3]], [[2, 2, 0], [1, 0, 0]]]
    assert [np.asarray(p).tolist() for p in s.experimental_local_results(step["y"])] == \
        [[0, 1], [2, 3]]
