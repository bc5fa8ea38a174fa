import collections
import gc
import weakref

import pytest

from gpustrat import nest

Point = collections.namedtuple("Point", "x y")


def test_flatten_and_pack_round_trip_all_containers():
    s = {"b": (1, [2, 3]), "a": Point(4, {"z": 5, "y": 6})}
    flat = nest.flatten(s)
    assert flat == [4, 6, 5, 1, 2, 3]  # dict keys sorted, namedtuples in field order
    back = nest.pack_sequence_as(s, flat)
    assert back == s and isinstance(back["a"], Point) and isinstance(back["b"][1], list)


def test_map_structure_and_mismatch_message():
    assert nest.map_structure(lambda a, b: a + b, (1, {"k": 2}), (10, {"k": 20})) == (11, {"k": 22})
    with pytest.raises(ValueError, match=r"sequence lengths differ at \[1\]: 2 vs 3"):
        nest.assert_same_structure((1, (2, 3)), (1, (2, 3, 4)))
    with pytest.raises(ValueError, match="dict keys differ"):
        nest.assert_same_structure({"a": 1}, {"b": 1})


def test_pack_with_wrong_count():
    with pytest.raises(ValueError, match="has 2 leaves but 3 values"):
        nest.pack_sequence_as((1, 2), [1, 2, 3])


def test_packed_leaves_are_freed_when_the_structure_is_dropped_without_a_collection():
    # Device arrays go back to their pool when their last reference goes: packing must
    # not leave a reference cycle that holds the leaves until the garbage collector runs.
    class Leaf:
        pass
    leaves = [Leaf(), Leaf(), Leaf()]
    refs = [weakref.ref(x) for x in leaves]
    gc.disable()
    try:
        packed = nest.pack_sequence_as((0, {"a": 0, "b": [0]}), leaves)
        assert packed[1]["b"][0] is leaves[2]
        del leaves, packed
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()


def test_describe_tells_apart_what_pairs_leaves_differently():
    assert nest.describe({"b": [1, 2], "a": (3,)}) == "{'a': (.,), 'b': [., .]}"
    assert nest.describe(Point(1, {"k": 2})) == "Point(x=., y={'k': .})"
    # The same type name with the fields in another order pairs leaves differently.
    assert nest.describe(collections.namedtuple("Point", "y x")(1, 2)) != \
        nest.describe(Point(1, 2))
    assert nest.describe(3.5) == "."
    # Insertion order does not matter (leaves pair in sorted key order); keys, lengths
    # and nesting do.
    assert nest.describe({"a": 1, "b": 2}) == nest.describe({"b": 1, "a": 2})
    assert nest.describe({"a": 1, "b": 2}) != nest.describe({"a": 1, "c": 2})
    assert nest.describe([1, 2]) != nest.describe([1, 2, 3])
    assert nest.describe([1, [2]]) != nest.describe([1, 2])
