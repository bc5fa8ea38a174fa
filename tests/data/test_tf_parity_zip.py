"""``Dataset.zip`` of tuples, dicts and nested structures, and zip with ``enumerate``,
``map`` returning dicts and ``padded_batch`` of dicts, compared with real ``tf.data``.

Every expected value, element_spec, cardinality and exception type here was recorded
by running the same pipeline with TensorFlow 2.21 (``tensorflow-cpu``;
``tests/data/record_tf_zip.py`` runs them all with either library and lists the
differences) and is hard-coded, so these tests need no TensorFlow. Error messages are
gpustrat's own; where gpustrat differs on purpose, the test says so.
"""

import collections

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset, TensorSpec
from gpustrat.data.windowing import DatasetSpec

I64, F32 = np.dtype(np.int64), np.dtype(np.float32)
S = TensorSpec((), I64)
Pair = collections.namedtuple("Pair", ["left", "right"])


def r(*args):
    return Dataset.range(*args)


def vals(ds, limit=None):
    def conv(x):
        if isinstance(x, dict):
            return type(x)((k, conv(v)) for k, v in x.items())
        if isinstance(x, tuple):
            items = [conv(v) for v in x]
            return type(x)(*items) if hasattr(type(x), "_fields") else tuple(items)
        if isinstance(x, Dataset):
            return [conv(v) for v in x]
        return x.tolist() if hasattr(x, "tolist") else x
    out = []
    for e in ds:
        if limit is not None and len(out) == limit:
            break
        out.append(conv(e))
    return out


def keys(x):
    """Dict key order, nested: what dict equality does not check."""
    if isinstance(x, dict):
        return [(k, keys(v)) for k, v in x.items()]
    if isinstance(x, tuple):
        return [keys(v) for v in x]
    return None


def ragged(lengths):
    """Elements ``[n] * n`` with the spec (None,)."""
    return Dataset.from_generator(lambda: (np.full(n, n, np.int64) for n in lengths),
                                  output_signature=TensorSpec((None,), I64))


# --- how zip is called --------------------------------------------------------------

def test_zip_positional_tuple_and_datasets_keyword():
    # TF 2.21: zip(a, b), zip((a, b)) and zip(datasets=(a, b)) are the same: tuples,
    # cardinality the shortest.
    for z in (Dataset.zip(r(3), r(10, 15)), Dataset.zip((r(3), r(10, 15))),
              Dataset.zip(datasets=(r(3), r(10, 15)))):
        assert z.element_spec == (S, S) and z.cardinality() == 3
        assert vals(z) == [(0, 10), (1, 11), (2, 12)]
    z = Dataset.zip(r(3), r(10, 15), r(20, 22))
    assert z.element_spec == (S, S, S) and vals(z) == [(0, 10, 20), (1, 11, 21)]
    # TF 2.21: one dataset is itself (no tuple); a 1-tuple stays a 1-tuple.
    for one in (Dataset.zip(r(2)), Dataset.zip(datasets=r(2))):
        assert one.element_spec == S and vals(one) == [0, 1] and one.cardinality() == 2
    assert Dataset.zip((r(2),)).element_spec == (S,)
    assert vals(Dataset.zip((r(2),))) == [(0,), (1,)]
    # TF 2.21: zip takes name= (as every transformation).
    assert vals(Dataset.zip(r(2), r(2), name="z")) == [(0, 0), (1, 1)]


def test_zip_of_dicts_keeps_key_order():
    # TF 2.21: spec and elements in the dict's own key order.
    z = Dataset.zip({"y": r(3), "x": r(10, 15)})
    assert z.element_spec == {"y": S, "x": S} and keys(z.element_spec) == \
        [("y", None), ("x", None)]
    assert vals(z) == [{"y": 0, "x": 10}, {"y": 1, "x": 11}, {"y": 2, "x": 12}]
    assert all(keys(e) == [("y", None), ("x", None)] for e in z) and z.cardinality() == 3
    assert vals(Dataset.zip(datasets={"x": r(3)})) == [{"x": 0}, {"x": 1}, {"x": 2}]
    # TF 2.21: int keys keep their order too; mixed int and str keys cannot be sorted
    # (TypeError).
    ints = Dataset.zip({2: r(2), 1: r(5, 7)})
    assert list(ints.element_spec) == [2, 1] and vals(ints) == [{2: 0, 1: 5}, {2: 1, 1: 6}]
    with pytest.raises(TypeError):
        Dataset.zip({1: r(2), "x": r(2)})
    # TF 2.21: an OrderedDict stays one, in its order; a namedtuple stays one.
    od = Dataset.zip(collections.OrderedDict([("b", r(2)), ("a", r(2))]))
    assert type(od.element_spec) is collections.OrderedDict
    assert list(od.element_spec) == ["b", "a"]
    assert all(type(e) is collections.OrderedDict and list(e) == ["b", "a"] for e in od)
    nt = Dataset.zip(Pair(r(2), r(5, 7)))
    assert nt.element_spec == Pair(S, S) and type(nt.element_spec) is Pair
    assert vals(nt) == [Pair(0, 5), Pair(1, 6)]
    assert vals(nt.map(lambda p: p.right - p.left)) == [5, 5]


def test_zip_nested_structures():
    # TF 2.21: (a, (b, c)): card 3, the shortest.
    n = Dataset.zip((r(3), (r(10, 14), r(20, 25))))
    assert n.element_spec == (S, (S, S)) and n.cardinality() == 3
    assert vals(n) == [(0, (10, 20)), (1, (11, 21)), (2, (12, 22))]
    # TF 2.21: a tuple holding a dict of a tuple: card 2.
    n = Dataset.zip((r(3), {"a": r(2), "b": (r(4), r(5))}))
    assert n.element_spec == (S, {"a": S, "b": (S, S)}) and n.cardinality() == 2
    assert vals(n) == [(0, {"a": 0, "b": (0, 0)}), (1, {"a": 1, "b": (1, 1)})]
    # TF 2.21: a dict of tuples, in key order x, w.
    d = Dataset.zip({"x": (r(3), r(10, 13)), "w": r(20, 23)})
    assert d.element_spec == {"x": (S, S), "w": S} and list(d.element_spec) == ["x", "w"]
    assert vals(d)[2] == {"x": (2, 12), "w": 22}
    # TF 2.21: a dict of dicts keeps the inner order q, p.
    dd = Dataset.zip({"o": {"q": r(2), "p": r(5, 7)}})
    assert keys(dd.element_spec) == [("o", [("q", None), ("p", None)])]
    assert vals(dd) == [{"o": {"q": 0, "p": 5}}, {"o": {"q": 1, "p": 6}}]
    # TF 2.21: zips of zips nest.
    zz = Dataset.zip(Dataset.zip({"x": r(3)}), Dataset.zip((r(3), r(3))))
    assert zz.element_spec == ({"x": S}, (S, S))
    assert vals(zz)[1] == ({"x": 1}, (1, 1))
    # TF 2.21: an empty part of a structure is kept: (0, {}), (0, ()).
    assert vals(Dataset.zip((r(2), {}))) == [(0, {}), (1, {})]
    assert Dataset.zip((r(2), ())).element_spec == (S, ())


def test_zip_of_datasets_with_structured_elements():
    # TF 2.21: a dataset of dicts is one dict component of the tuple.
    z = Dataset.zip(r(3).map(lambda x: {"q": x, "p": x * 2}), r(10, 13))
    assert z.element_spec == ({"q": S, "p": S}, S)
    assert keys(z.element_spec) == [[("q", None), ("p", None)], None]
    assert vals(z) == [({"q": 0, "p": 0}, 10), ({"q": 1, "p": 2}, 11),
                       ({"q": 2, "p": 4}, 12)]
    z = Dataset.zip({"m": r(3).map(lambda x: {"q": x, "p": (x, x + 1)}), "n": r(3)})
    assert z.element_spec == {"m": {"q": S, "p": (S, S)}, "n": S}
    assert vals(z)[2] == {"m": {"q": 2, "p": (2, 3)}, "n": 2}
    # TF 2.21: shapes and dtypes of each input: float32 (2, 4), string (), int64 (None,).
    z = Dataset.zip({"m": Dataset.from_tensor_slices(np.zeros((3, 2, 4), np.float32)),
                     "s": Dataset.from_tensor_slices(np.array([b"a", b"bc", b"d"])),
                     "b": r(7).batch(3)})
    assert z.element_spec == {"m": TensorSpec((2, 4), F32), "s": TensorSpec((), object),
                              "b": TensorSpec((None,), I64)}
    assert [(e["s"], e["b"]) for e in vals(z)] == [(b"a", [0, 1, 2]), (b"bc", [3, 4, 5]),
                                                   (b"d", [6])]
    # TF 2.21: windows zip as DatasetSpec components.
    w = Dataset.zip({"w": r(5).window(2), "v": r(3)})
    assert w.element_spec == {"w": DatasetSpec(S), "v": S} and w.cardinality() == 3
    assert vals(w) == [{"w": [0, 1], "v": 0}, {"w": [2, 3], "v": 1}, {"w": [4], "v": 2}]


# --- cardinality ----------------------------------------------------------------------

CARDINALITIES = [
    # (inputs, TF 2.21's cardinality): the smallest finite one; unknown if any input is
    # unknown (even beside an empty one); infinite only when every input is.
    ((r(3), r(5)), 3),
    ((r(3), r(2).repeat()), 3),
    ((r(3).repeat(), r(2).repeat()), -1),
    ((r(3).repeat(), r(5).filter(lambda x: True)), -2),
    ((r(3), r(5).filter(lambda x: True)), -2),
    ((r(0), r(5).filter(lambda x: True)), -2),
    ((r(0), r(2).repeat()), 0),
    ((r(2).repeat().take(4), r(2).repeat()), 4),
]


@pytest.mark.parametrize("inputs,card", CARDINALITIES)
def test_zip_cardinality_as_tf(inputs, card):
    assert Dataset.zip(inputs).cardinality() == card
    assert Dataset.zip(dict(zip("ab", inputs))).cardinality() == card


def test_zip_stops_at_the_shortest():
    # TF 2.21: the empty input gives nothing; a filtered one stops it after 4.
    assert vals(Dataset.zip((r(0), r(2).repeat()))) == []
    assert vals(Dataset.zip((r(2).repeat().take(4), r(2).repeat()))) == \
        [(0, 0), (1, 1), (0, 0), (1, 1)]
    assert vals(Dataset.zip((r(10).filter(lambda x: x % 3 == 0), r(10, 20)))) == \
        [(0, 10), (3, 11), (6, 12), (9, 13)]


# --- errors ---------------------------------------------------------------------------

def test_zip_errors_as_tf():
    # TF 2.21: TypeError "Must pass at least one dataset to `zip`".
    for call in (lambda: Dataset.zip(), lambda: Dataset.zip(datasets=None)):
        with pytest.raises(TypeError, match="at least one dataset"):
            call()
    # TF 2.21: TypeError "Both `*args` and `datasets` cannot be set".
    with pytest.raises(TypeError, match="positionally or as datasets=, not both"):
        Dataset.zip(r(2), datasets=(r(2),))
    # TF 2.21: InvalidArgumentError for a structure with no dataset in it; ValueError here.
    for empty in ((), {}):
        with pytest.raises(ValueError, match="no dataset"):
            Dataset.zip(empty)
        with pytest.raises(ValueError, match="no dataset"):
            Dataset.zip(datasets=empty)
    # TF 2.21: TypeError for anything else than a dataset at a leaf.
    for bad, found in (((r(3), 1), "int"), ({"x": r(3), "y": np.arange(3)}, "ndarray"),
                       ((r(3), None), "NoneType")):
        with pytest.raises(TypeError, match=f"found {found}"):
            Dataset.zip(bad)
    with pytest.raises(TypeError, match="found int"):
        Dataset.zip(r(3), 1)
    # TF 2.21: TypeError for a list anywhere in the structure ("use `tuple` instead").
    for bad in ([r(3), r(3)], (r(3), [r(3)]), {"x": [r(3), r(3)]}):
        with pytest.raises(TypeError, match="list .*use a tuple"):
            Dataset.zip(bad)
    with pytest.raises(TypeError, match="list .*use a tuple"):
        Dataset.zip(r(3), [r(3)])


# --- what follows a zip ---------------------------------------------------------------

def test_map_after_zip():
    # TF 2.21: a dict is one argument; a tuple is spread over the arguments (the outer
    # one only); a 1-tuple gives one argument.
    assert vals(Dataset.zip({"x": r(3), "y": r(10, 15)}).map(lambda d: d["x"] + d["y"])) \
        == [10, 12, 14]
    assert vals(Dataset.zip(r(3), r(10, 15)).map(lambda x, y: x * y)) == [0, 11, 24]
    assert vals(Dataset.zip((r(3), (r(3), r(3)))).map(lambda x, yz: x + yz[0] + yz[1])) \
        == [0, 3, 6]
    assert vals(Dataset.zip((r(3),)).map(lambda x: x + 1)) == [1, 2, 3]
    # TF 2.21: shuffled dicts stay whole.
    assert vals(Dataset.zip({"x": r(4), "y": r(4)}).shuffle(4, seed=1)
                .map(lambda d: d["x"] - d["y"])) == [0, 0, 0, 0]


def test_batch_and_unbatch_after_zip_of_dicts():
    # TF 2.21: batch stacks each key: spec (None,), or (2,) with drop_remainder.
    b = Dataset.zip({"y": r(5), "x": r(10, 15)}).batch(2)
    assert b.element_spec == {"y": TensorSpec((None,), I64), "x": TensorSpec((None,), I64)}
    assert list(b.element_spec) == ["y", "x"] and b.cardinality() == 3
    assert vals(b) == [{"y": [0, 1], "x": [10, 11]}, {"y": [2, 3], "x": [12, 13]},
                       {"y": [4], "x": [14]}]
    d = Dataset.zip({"y": r(5), "x": r(10, 15)}).batch(2, drop_remainder=True)
    assert d.element_spec == {"y": TensorSpec((2,), I64), "x": TensorSpec((2,), I64)}
    assert d.cardinality() == 2 and vals(d)[1] == {"y": [2, 3], "x": [12, 13]}
    # TF 2.21: nested dict and tuple, float32 inside: [1.5, 3.0] batched with [2, 3].
    floats = Dataset.from_tensor_slices(np.arange(3, dtype=np.float32))
    n = Dataset.zip({"t": (r(3), floats.map(lambda x: {"v": x * 1.5})), "u": r(3)}).batch(2)
    assert n.element_spec == {"t": (TensorSpec((None,), I64),
                                    {"v": TensorSpec((None,), F32)}),
                              "u": TensorSpec((None,), I64)}
    assert vals(n) == [{"t": ([0, 1], {"v": [0.0, 1.5]}), "u": [0, 1]},
                       {"t": ([2], {"v": [3.0]}), "u": [2]}]
    # TF 2.21: unbatch gives the dicts back (cardinality unknown).
    u = Dataset.zip({"x": r(3), "y": r(3)}).batch(2).unbatch()
    assert u.element_spec == {"x": S, "y": S} and u.cardinality() == -2
    assert vals(u) == [{"x": 0, "y": 0}, {"x": 1, "y": 1}, {"x": 2, "y": 2}]
    assert Dataset.zip({"x": r(3).repeat(), "y": r(2).repeat()}).batch(2).cardinality() \
        == -1


# --- experimental_distribute_dataset --------------------------------------------------

def _pieces(strategy, step):
    """A step's values with every per-replica leaf as the list of its pieces."""
    if isinstance(step, dict):
        return {k: _pieces(strategy, v) for k, v in step.items()}
    if isinstance(step, tuple):
        return tuple(_pieces(strategy, v) for v in step)
    return [np.asarray(p).tolist() for p in strategy.experimental_local_results(step)]


def test_distributed_zip_of_dicts_as_tf():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    # TF 2.21 (two logical CPUs): a dict of per-replica values, halves of each batch.
    dist = s.experimental_distribute_dataset(
        Dataset.zip({"b": r(8), "a": r(10, 18)}).batch(4))
    steps = list(dist)
    assert [list(step) for step in steps] == [["b", "a"]] * 2
    assert [_pieces(s, step) for step in steps] == [
        {"b": [[0, 1], [2, 3]], "a": [[10, 11], [12, 13]]},
        {"b": [[4, 5], [6, 7]], "a": [[14, 15], [16, 17]]}]
    # TF 2.21 gives each leaf a PerReplicaSpec of the piece's spec per replica; gpustrat
    # gives the piece's spec: (None,), or (2,) under drop_remainder.
    assert dist.element_spec == {"b": TensorSpec((None,), I64),
                                 "a": TensorSpec((None,), I64)}
    drop = s.experimental_distribute_dataset(
        Dataset.zip({"b": r(6), "a": r(10, 16)}).batch(4, drop_remainder=True))
    assert drop.element_spec == {"b": TensorSpec((2,), I64), "a": TensorSpec((2,), I64)}
    assert [_pieces(s, step) for step in drop] == [
        {"b": [[0, 1], [2, 3]], "a": [[10, 11], [12, 13]]}]
    # TF 2.21: nested dict and tuple; a short last batch leaves replica 1 empty.
    floats = Dataset.from_tensor_slices(np.arange(4, dtype=np.float32))
    nested = s.experimental_distribute_dataset(Dataset.zip(
        ({"x": r(4), "y": (r(4), floats.map(lambda v: v * 0.5))}, r(4))).batch(4))
    assert nested.element_spec == ({"x": TensorSpec((None,), I64),
                                    "y": (TensorSpec((None,), I64),
                                          TensorSpec((None,), F32))},
                                   TensorSpec((None,), I64))
    assert [_pieces(s, step) for step in nested] == [
        ({"x": [[0, 1], [2, 3]], "y": ([[0, 1], [2, 3]], [[0.0, 0.5], [1.0, 1.5]])},
         [[0, 1], [2, 3]])]
    short = s.experimental_distribute_dataset(
        Dataset.zip({"x": r(5), "y": r(5)}).batch(4))
    assert [_pieces(s, step) for step in short][1] == {"x": [[4], []], "y": [[4], []]}
    # TF 2.21 fails inside its rebatching (IndexError) on unbatched dicts; gpustrat says
    # to batch first.
    with pytest.raises(ValueError, match="batched by the global batch size"):
        s.experimental_distribute_dataset(Dataset.zip({"x": r(4), "y": r(4)}))
