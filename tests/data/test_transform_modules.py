"""The transformations live in one module per family; the names they were always
imported by, pickles that refer to them there, and iterator positions saved before the
split keep working."""

import json
import pickle

import numpy as np

from gpustrat import nest
from gpustrat.data import Dataset, Options, transforms
from gpustrat.train import format as fmt


def test_transforms_names_the_classes_the_dataset_methods_build():
    ds = Dataset.range(6)
    mapped = ds.map(lambda x: x)  # a range's batch is sliced from the range instead
    built = {
        "BatchDataset": mapped.batch(2), "UnbatchDataset": mapped.batch(2).unbatch(),
        "MapDataset": ds.map(lambda x: x), "FilterDataset": ds.filter(lambda x: x > 1),
        "ShuffleDataset": ds.shuffle(2, seed=1), "RepeatDataset": ds.repeat(2),
        "TakeDataset": ds.take(2), "SkipDataset": ds.skip(2), "ShardDataset": ds.shard(2, 0),
        "EnumerateDataset": ds.enumerate(), "PrefetchDataset": ds.prefetch(1),
        "OptionsDataset": ds.with_options(Options()), "ZipDataset": Dataset.zip((ds, ds)),
        "ConcatenateDataset": ds.concatenate(ds)}
    assert sorted(built) == sorted(set(transforms.__all__) - {"UnaryDataset"})
    for name, dataset in built.items():
        cls = getattr(transforms, name)
        assert type(dataset) is cls and issubclass(cls, Dataset), name
    for name in transforms.__all__:
        if name not in ("ZipDataset", "ConcatenateDataset"):
            assert issubclass(getattr(transforms, name), transforms.UnaryDataset), name


def test_a_pickle_naming_the_old_module_finds_the_class():
    for name in transforms.__all__:
        old = f"cgpustrat.data.transforms\n{name}\n.".encode()
        assert pickle.loads(old) is getattr(transforms, name)


def _build():
    a = Dataset.range(10).map(lambda x: x * 2).filter(lambda x: x % 3 != 0).batch(3).unbatch()
    b = a.repeat(2).skip(1).take(12).shard(2, 0).enumerate(5)
    c = Dataset.range(4).shuffle(4, seed=7)
    first = Dataset.zip((b, Dataset.range(100)))
    second = Dataset.zip((Dataset.zip((c, c)), c))
    return first.concatenate(second).prefetch(2).with_options(Options())


# The position of _build()'s iterator after 3 elements, as a checkpoint file held it
# when every transformation was defined in gpustrat/data/transforms.py (JSON, then the
# arrays of the .npz).
_SAVED_TREE = (
    '{"__dict__": [["dataset", ["OptionsDataset:-2", "PrefetchDataset:-2", '
    '"ConcatenateDataset:-2", "ZipDataset:-2", "EnumerateDataset:-2", "ShardDataset:-2", '
    '"TakeDataset:-2", "SkipDataset:-2", "RepeatDataset:-2", "UnbatchDataset:-2", '
    '"BatchDataset:-2", "FilterDataset:-2", "MapDataset:10", "RangeDataset:10", '
    '"RangeDataset:100", "ZipDataset:4", "ZipDataset:4", "ShuffleDataset:4", '
    '"RangeDataset:4", "ShuffleDataset:4", "RangeDataset:4", "ShuffleDataset:4", '
    '"RangeDataset:4"]], ["position", {"__dict__": [["input", {"__dict__": [["fields", '
    '{"__dict__": [["which", 0]]}], ["inputs", [{"__dict__": [["fields", {"__dict__": '
    '[]}], ["inputs", [{"__dict__": [["fields", {"__dict__": [["i", 9]]}], ["inputs", '
    '[{"__dict__": [["fields", {"__dict__": [["started", true]]}], ["inputs", '
    '[{"__dict__": [["fields", {"__dict__": [["taken", 7]]}], ["inputs", [{"__dict__": '
    '[["fields", {"__dict__": [["skipped", 1]]}], ["inputs", [{"__dict__": [["pass", 1], '
    '["got", true], ["done", false], ["input", {"__dict__": [["input", {"__dict__": '
    '[["fields", {"__dict__": [["done", false]]}], ["inputs", [{"__dict__": [["fields", '
    '{"__dict__": []}], ["inputs", [{"__dict__": [["fields", {"__dict__": []}], '
    '["inputs", [{"__dict__": [["pos", 5]]}]]]}]]]}]]]}], ["current", {"__dict__": '
    '[["element", {"__array__": "it#0"}], ["row", 2]]}]]}]]}]]]}]]]}]]]}]]]}, '
    '{"__dict__": [["pos", 4]]}]]]}, {"__dict__": [["fields", {"__dict__": []}], '
    '["inputs", [{"__dict__": [["fields", {"__dict__": []}], ["inputs", [{"__dict__": '
    '[["started", false], ["epoch", 0], ["seed", 7], ["input", {"__dict__": [["pos", '
    '0]]}]]}, {"__dict__": [["started", false], ["epoch", 1], ["seed", 7], ["input", '
    '{"__dict__": [["pos", 0]]}]]}]]]}, {"__dict__": [["started", false], ["epoch", 2], '
    '["seed", 7], ["input", {"__dict__": [["pos", 0]]}]]}]]]}]]]}], ["pending", '
    '{"__dict__": [["template", {"__tuple__": [{"__tuple__": [{"__scalar__": "it#1"}, '
    '{"__scalar__": "it#2"}]}, {"__scalar__": "it#3"}]}], ["columns", [{"__array__": '
    '"it#4"}, {"__array__": "it#5"}, {"__array__": "it#6"}]]]}], ["threaded", true], '
    '["probe_left", 0], ["spent", 0.0]]}]]}'
)
_SAVED_ARRAYS = {"it#0": [2, 4, 8], "it#1": 8, "it#2": 4, "it#3": 3, "it#4": [8], "it#5": [4],
                 "it#6": [3]}


def _rows(elements):
    return [tuple(np.asarray(v).tolist() for v in nest.flatten(e)) for e in elements]


def test_a_position_saved_before_the_split_restores():
    rest = [(8, 4, 3), (9, 10, 4), (10, 16, 5), (2, 3, 1), (3, 0, 3), (1, 2, 2), (0, 1, 0)]
    full = _rows(_build())
    assert full[3:] == rest
    arrays = {k: np.asarray(v, np.int64) for k, v in _SAVED_ARRAYS.items()}
    state = fmt.decode(json.loads(_SAVED_TREE), arrays)
    it = iter(_build())
    it.set_state(state)
    assert _rows(it) == rest
    # What the iterator saves now has the same shape.
    it = iter(_build())
    for _ in range(3):
        next(it)
    now = it.get_state()
    assert now["dataset"] == state["dataset"]
    assert set(now["position"]) == set(state["position"])
