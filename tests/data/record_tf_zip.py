"""Runs the pipelines of ``test_tf_parity_zip.py`` with real ``tf.data`` or with
gpustrat and prints what each gives: element_spec, cardinality, elements (or per-replica
pieces under two mirrored CPU replicas) and the error raised.

Not a test and not imported by the tests (pytest collects ``test_*.py`` only). The tests
hard-code the TensorFlow answers, so they need no TensorFlow. To record again and see
every difference, with a venv that has ``tensorflow-cpu==2.21.*``::

    /path/to/tf-venv/bin/python tests/data/record_tf_zip.py tf > /tmp/tf_zip.json
    python tests/data/record_tf_zip.py gs --compare /tmp/tf_zip.json

The first prints TensorFlow's answers as JSON; the second runs the same pipelines with
gpustrat and prints the cases whose answers differ (error messages are compared by
exception type only: gpustrat words its own).
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

MAX_ELEMENTS = 8  # elements read from each dataset (some are infinite)


class Api:
    """What a case needs from either library, by the same names."""

    def __init__(self, which: str):
        self.which = which
        if which == "tf":
            import tensorflow as tf
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
            self.tf = tf
            self.Dataset, self.TensorSpec = tf.data.Dataset, tf.TensorSpec
            self._strategy = lambda: tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        else:
            # This checkout's gpustrat, not one installed elsewhere.
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            import gpustrat as gs
            self.Dataset, self.TensorSpec = gs.data.Dataset, gs.data.TensorSpec
            self._strategy = lambda: gs.MirroredStrategy(["cpu:0", "cpu:1"])

    def strategy(self):
        return self._strategy()

    def ragged(self, lengths, dtype=np.int64):
        """Elements ``[n] * n`` with the spec (None,)."""
        return self.Dataset.from_generator(
            lambda: (np.full(n, n, dtype) for n in lengths),
            output_signature=self.TensorSpec((None,), dtype))


# --- describing what a library gives, the same way for both --------------------------

def spec_text(spec):
    if isinstance(spec, dict):
        return {type(spec).__name__: [[repr(k), spec_text(v)] for k, v in spec.items()]}
    if isinstance(spec, (tuple, list)):
        return {type(spec).__name__: [spec_text(s) for s in spec]}
    if spec is None:
        return None
    name = type(spec).__name__
    if name == "TensorSpec":
        shape = spec.shape
        dims = shape.as_list() if hasattr(shape, "as_list") and shape.rank is not None \
            else list(shape)
        dtype = spec.dtype.name if hasattr(spec.dtype, "name") else str(spec.dtype)
        return f"TensorSpec({dims}, {'string' if dtype == 'object' else dtype})"
    if name == "DatasetSpec":
        return {"DatasetSpec": spec_text(spec.element_spec)}
    if name == "PerReplicaSpec":  # TensorFlow's: one spec per replica
        return {"PerReplica": [spec_text(s) for s in spec._value_specs]}
    return name


def value(x):
    if hasattr(x, "element_spec"):  # a dataset (elements made by window)
        return {"dataset": [value(v) for v in x]}
    if isinstance(x, dict):
        return {type(x).__name__: [[repr(k), value(v)] for k, v in x.items()]}
    if isinstance(x, (tuple, list)) and not hasattr(x, "numpy"):
        return {type(x).__name__: [value(v) for v in x]}
    if hasattr(x, "numpy"):
        x = x.numpy()
    x = np.asarray(x)
    if x.dtype == object or x.dtype.kind == "S":
        return np.vectorize(lambda b: b.decode() if isinstance(b, bytes) else b,
                            otypes=[object])(x).tolist()
    return x.tolist()


def error(e):
    return {"error": type(e).__name__, "message": str(e).splitlines()[0][:300]}


def describe(api, built):
    """A case's outcome: a dataset's spec, cardinality and first elements; or a
    ("dist", strategy, distributed dataset); or any value."""
    if isinstance(built, tuple) and built and built[0] == "dist":
        _, strategy, dist = built
        out = {"spec": spec_text(dist.element_spec), "steps": []}
        try:
            for step in dist:
                out["steps"].append(_per_replica(strategy, step))
        except Exception as e:  # noqa: BLE001
            out["steps"].append(error(e))
        return out
    if not isinstance(built, api.Dataset):
        return {"value": value(built)}
    out = {"spec": spec_text(built.element_spec), "card": int(built.cardinality())}
    elements = []
    try:
        for i, e in enumerate(built):
            if i == MAX_ELEMENTS:
                break
            elements.append(value(e))
    except Exception as e:  # noqa: BLE001
        elements.append(error(e))
    out["elements"] = elements
    return out


def _per_replica(strategy, step):
    if isinstance(step, dict):
        return {"dict": [[repr(k), _per_replica(strategy, v)] for k, v in step.items()]}
    if isinstance(step, tuple) and type(step).__name__ == "tuple":
        return {"tuple": [_per_replica(strategy, v) for v in step]}
    return {"PerReplica": [value(p) for p in strategy.experimental_local_results(step)]}


# --- the cases ------------------------------------------------------------------------

def r(api, *args):
    return api.Dataset.range(*args)


Pair = collections.namedtuple("Pair", ["left", "right"])


def floats(api, n):
    return api.Dataset.from_tensor_slices(np.arange(n, dtype=np.float32))


CASES = {
    # How zip is called.
    "positional": lambda a: a.Dataset.zip(r(a, 3), r(a, 10, 15)),
    "positional_three": lambda a: a.Dataset.zip(r(a, 3), r(a, 10, 15), r(a, 20, 22)),
    "tuple": lambda a: a.Dataset.zip((r(a, 3), r(a, 10, 15))),
    "one_dataset": lambda a: a.Dataset.zip(r(a, 2)),
    "one_tuple": lambda a: a.Dataset.zip((r(a, 2),)),
    "datasets_kw_tuple": lambda a: a.Dataset.zip(datasets=(r(a, 2), r(a, 5, 7))),
    "datasets_kw_dict": lambda a: a.Dataset.zip(datasets={"x": r(a, 3)}),
    "datasets_kw_one": lambda a: a.Dataset.zip(datasets=r(a, 2)),
    "name_kw": lambda a: a.Dataset.zip(r(a, 2), r(a, 2), name="z"),
    "dict": lambda a: a.Dataset.zip({"y": r(a, 3), "x": r(a, 10, 15)}),
    "dict_int_keys": lambda a: a.Dataset.zip({2: r(a, 2), 1: r(a, 5, 7)}),
    "dict_mixed_keys": lambda a: a.Dataset.zip({1: r(a, 2), "x": r(a, 2)}),
    "nested": lambda a: a.Dataset.zip((r(a, 3), (r(a, 10, 14), r(a, 20, 25)))),
    "nested_dict": lambda a: a.Dataset.zip(
        (r(a, 3), {"a": r(a, 2), "b": (r(a, 4), r(a, 5))})),
    "dict_of_tuples": lambda a: a.Dataset.zip({"x": (r(a, 3), r(a, 10, 13)),
                                               "w": r(a, 20, 23)}),
    "dict_of_dicts": lambda a: a.Dataset.zip({"o": {"q": r(a, 2), "p": r(a, 5, 7)}}),
    "elements_are_dicts": lambda a: a.Dataset.zip(
        r(a, 3).map(lambda x: {"q": x, "p": x * 2}), r(a, 10, 13)),
    "dict_of_dict_elements": lambda a: a.Dataset.zip(
        {"m": r(a, 3).map(lambda x: {"q": x, "p": (x, x + 1)}), "n": r(a, 3)}),
    "zip_of_zips": lambda a: a.Dataset.zip(
        a.Dataset.zip({"x": r(a, 3)}), a.Dataset.zip((r(a, 3), r(a, 3)))),
    "shapes_and_dtypes": lambda a: a.Dataset.zip(
        {"m": a.Dataset.from_tensor_slices(np.zeros((3, 2, 4), np.float32)),
         "s": a.Dataset.from_tensor_slices(np.array([b"a", b"bc", b"d"])),
         "b": r(a, 7).batch(3)}),
    # Cardinality: the smallest finite one; unknown wins; infinite only when all are.
    "card_min": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 5)}).cardinality(),
    "card_finite_infinite": lambda a: a.Dataset.zip(
        (r(a, 3), r(a, 2).repeat())).cardinality(),
    "card_all_infinite": lambda a: a.Dataset.zip(
        {"x": r(a, 3).repeat(), "y": r(a, 2).repeat()}).cardinality(),
    "card_unknown_infinite": lambda a: a.Dataset.zip(
        {"x": r(a, 3).repeat(), "y": r(a, 5).filter(lambda x: True)}).cardinality(),
    "card_unknown_finite": lambda a: a.Dataset.zip(
        (r(a, 3), r(a, 5).filter(lambda x: True))).cardinality(),
    "card_unknown_empty": lambda a: a.Dataset.zip(
        (r(a, 0), r(a, 5).filter(lambda x: True))).cardinality(),
    "card_empty_infinite": lambda a: a.Dataset.zip((r(a, 0), r(a, 2).repeat())),
    "card_take_of_infinite": lambda a: a.Dataset.zip(
        (r(a, 2).repeat().take(4), r(a, 2).repeat())),
    "stops_at_shortest_unknown": lambda a: a.Dataset.zip(
        (r(a, 10).filter(lambda x: x % 3 == 0), r(a, 10, 20))),
    # Errors.
    "no_args": lambda a: a.Dataset.zip(),
    "empty_tuple": lambda a: a.Dataset.zip(()),
    "empty_dict": lambda a: a.Dataset.zip({}),
    "datasets_kw_empty": lambda a: a.Dataset.zip(datasets=()),
    "datasets_kw_none": lambda a: a.Dataset.zip(datasets=None),
    "both_args_and_kw": lambda a: a.Dataset.zip(r(a, 2), datasets=(r(a, 2),)),
    "leaf_int": lambda a: a.Dataset.zip((r(a, 3), 1)),
    "leaf_positional_int": lambda a: a.Dataset.zip(r(a, 3), 1),
    "leaf_array_in_dict": lambda a: a.Dataset.zip({"x": r(a, 3), "y": np.arange(3)}),
    "leaf_none": lambda a: a.Dataset.zip((r(a, 3), None)),
    "list": lambda a: a.Dataset.zip([r(a, 3), r(a, 3)]),
    "list_in_tuple": lambda a: a.Dataset.zip((r(a, 3), [r(a, 3)])),
    "list_in_dict": lambda a: a.Dataset.zip({"x": [r(a, 3), r(a, 3)]}),
    "positional_list": lambda a: a.Dataset.zip(r(a, 3), [r(a, 3)]),
    # What follows a zip.
    "map_dict_arg": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 10, 15)})
        .map(lambda d: d["x"] + d["y"]),
    "map_tuple_args": lambda a: a.Dataset.zip(r(a, 3), r(a, 10, 15))
        .map(lambda x, y: x * y),
    "map_nested_args": lambda a: a.Dataset.zip((r(a, 3), (r(a, 3), r(a, 3))))
        .map(lambda x, yz: x + yz[0] + yz[1]),
    "map_one_tuple_arg": lambda a: a.Dataset.zip((r(a, 3),)).map(lambda x: x + 1),
    "batch_dict": lambda a: a.Dataset.zip({"y": r(a, 5), "x": r(a, 10, 15)}).batch(2),
    "batch_dict_drop": lambda a: a.Dataset.zip({"y": r(a, 5), "x": r(a, 10, 15)})
        .batch(2, drop_remainder=True),
    "batch_nested_dict": lambda a: a.Dataset.zip(
        {"t": (r(a, 3), floats(a, 3).map(lambda x: {"v": x * 1.5})), "u": r(a, 3)})
        .batch(2),
    "batch_then_unbatch": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 3)})
        .batch(2).unbatch(),
    "batch_card_infinite": lambda a: a.Dataset.zip(
        {"x": r(a, 3).repeat(), "y": r(a, 2).repeat()}).batch(2).cardinality(),
    "shuffle_dict": lambda a: a.Dataset.zip({"x": r(a, 4), "y": r(a, 4)})
        .shuffle(4, seed=1).map(lambda d: d["x"] - d["y"]),
    # Distributed over two mirrored CPU replicas.
    "dist_dict": lambda a: _dist(a, a.Dataset.zip({"b": r(a, 8), "a": r(a, 10, 18)})
                                 .batch(4)),
    "dist_dict_drop": lambda a: _dist(a, a.Dataset.zip({"b": r(a, 6), "a": r(a, 10, 16)})
                                      .batch(4, drop_remainder=True)),
    "dist_nested": lambda a: _dist(a, a.Dataset.zip(
        ({"x": r(a, 4), "y": (r(a, 4), floats(a, 4).map(lambda v: v * 0.5))}, r(a, 4)))
        .batch(4)),
    "dist_short_last": lambda a: _dist(a, a.Dataset.zip({"x": r(a, 5), "y": r(a, 5)})
                                       .batch(4)),
    "dist_unbatched": lambda a: _dist(a, a.Dataset.zip({"x": r(a, 4), "y": r(a, 4)})),
    "namedtuple": lambda a: a.Dataset.zip(Pair(r(a, 2), r(a, 5, 7))),
    "namedtuple_map": lambda a: a.Dataset.zip(Pair(r(a, 2), r(a, 5, 7)))
        .map(lambda p: p.right - p.left),
    "windows": lambda a: a.Dataset.zip({"w": r(a, 5).window(2), "v": r(a, 3)}),
    "ordered_dict": lambda a: a.Dataset.zip(
        collections.OrderedDict([("b", r(a, 2)), ("a", r(a, 2))])),
    "empty_part_dict": lambda a: a.Dataset.zip((r(a, 2), {})),
    "empty_part_tuple": lambda a: a.Dataset.zip((r(a, 2), ())),
    # enumerate with zip.
    "enumerate_dict": lambda a: a.Dataset.zip({"y": r(a, 3), "x": r(a, 10, 13)})
        .enumerate(),
    "enumerate_start": lambda a: a.Dataset.zip((r(a, 2), r(a, 2))).enumerate(start=5),
    "enumerate_name": lambda a: r(a, 2).enumerate(name="e"),
    "enumerate_negative_start": lambda a: r(a, 2).enumerate(start=-3),
    "zip_of_enumerates": lambda a: a.Dataset.zip(
        {"e": r(a, 3).enumerate(), "f": r(a, 10, 12).enumerate(7)}),
    "enumerate_map_args": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 3)})
        .enumerate().map(lambda i, d: d["x"] + d["y"] * 10 + i * 100),
    "enumerate_batch": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 3)})
        .enumerate().batch(2),
    "enumerate_infinite": lambda a: a.Dataset.zip({"x": r(a, 3).repeat()}).enumerate(),
    "enumerate_unknown": lambda a: a.Dataset.zip(
        {"x": r(a, 5).filter(lambda x: x > 1)}).enumerate(),
    # map returning dicts, then zip.
    "map_dict_key_order": lambda a: r(a, 3).map(lambda x: {"b": x, "a": x + 1}),
    "map_dict_nested": lambda a: r(a, 2).map(lambda x: {"o": {"z": x, "y": (x, x * 2)}}),
    "map_dict_list_value": lambda a: r(a, 2).map(lambda x: {"v": [x, x + 1]}),
    "map_dict_scalar_python": lambda a: r(a, 2).map(lambda x: {"v": x, "c": 3}),
    "map_dict_then_zip": lambda a: a.Dataset.zip(
        r(a, 3).map(lambda x: {"v": x}), r(a, 3).map(lambda x: {"w": x * 2, "v": -x})),
    "zip_then_map_dict": lambda a: a.Dataset.zip({"x": r(a, 3), "y": r(a, 3)})
        .map(lambda d: {"s": d["x"] + d["y"], "d": d}),
    "zip_then_map_merge": lambda a: a.Dataset.zip(
        r(a, 2).map(lambda x: {"p": x}), r(a, 2).map(lambda x: {"q": x * 3}))
        .map(lambda d1, d2: {**d2, **d1}),
    "map_dict_then_batch": lambda a: r(a, 5).map(lambda x: {"k": x, "j": (x, x)}).batch(2),
    "map_dict_empty": lambda a: r(a, 2).map(lambda x: {}),
    "map_tuple_empty": lambda a: r(a, 2).map(lambda x: ()),
    "map_dict_of_empty": lambda a: r(a, 2).map(lambda x: {"x": ()}),
    "map_dict_empty_part": lambda a: r(a, 2).map(lambda x: (x, {})),
    "from_tensors_empty_dict": lambda a: a.Dataset.from_tensors({}),
    "map_dict_unbatch": lambda a: r(a, 4).batch(2).map(lambda x: {"a": x, "b": x * 2})
        .unbatch(),
    # padded_batch of dicts.
    "padded_dict_default": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3, 2)), "y": r(a, 3)}).padded_batch(2),
    "padded_dict_shapes": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3, 2)), "y": r(a, 3)}).padded_batch(
        2, padded_shapes={"x": [4], "y": []},
        padding_values={"x": np.int64(-1), "y": np.int64(0)}),
    "padded_dict_none_dim": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3, 2)), "y": r(a, 3)}).padded_batch(
        2, padded_shapes={"x": [None], "y": []}, drop_remainder=True),
    "padded_dict_python_value": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [4], "y": []}, padding_values={"x": -1, "y": 0}),
    "padded_dict_scalar_value": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [4], "y": []}, padding_values=np.int64(-1)),
    "padded_dict_only_values": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padding_values={"x": np.int64(-7), "y": np.int64(0)}),
    "padded_dict_missing_key": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(2, padded_shapes={"x": [4]}),
    "padded_dict_extra_key": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [4], "y": [], "z": []}),
    "padded_dict_as_tuple": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(2, padded_shapes=([4], [])),
    "padded_dict_values_missing_key": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [4], "y": []}, padding_values={"x": np.int64(-1)}),
    "padded_dict_too_small": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [2], "y": []}),
    "padded_dict_wrong_rank": lambda a: a.Dataset.zip(
        {"x": a.ragged((1, 3)), "y": r(a, 2)}).padded_batch(
        2, padded_shapes={"x": [4, 1], "y": []}),
    "padded_dict_nested": lambda a: a.Dataset.zip(
        (a.ragged((2, 1, 3)), {"v": r(a, 3), "w": a.ragged((1, 1, 2))})).padded_batch(
        2, padded_shapes=([3], {"v": [], "w": [None]}),
        padding_values=(np.int64(9), {"v": np.int64(0), "w": np.int64(-2)})),
    "padded_dict_strings": lambda a: a.Dataset.zip(
        {"s": a.Dataset.from_tensor_slices(np.array([b"a", b"bc", b"d"])),
         "x": a.ragged((2, 1, 3))}).padded_batch(2),
    "padded_dict_map": lambda a: r(a, 1, 4).map(lambda x: {"n": x}).padded_batch(2),
    "padded_dict_card": lambda a: a.Dataset.zip({"x": r(a, 5), "y": r(a, 7)})
        .padded_batch(2, padded_shapes={"x": [], "y": []}),
    "padded_dict_wrong_keys": lambda a: a.Dataset.zip({"x": r(a, 2), "y": r(a, 2)})
        .padded_batch(2, padded_shapes={"x": [], "z": []}),
    "padded_list_for_tuple": lambda a: a.Dataset.zip((r(a, 2), r(a, 2)))
        .padded_batch(2, padded_shapes=[[], []]),
    "padded_values_tuple_for_dict": lambda a: a.Dataset.zip({"x": r(a, 2), "y": r(a, 2)})
        .padded_batch(2, padding_values=(np.int64(1), np.int64(2))),
    "padded_values_wrong_keys": lambda a: a.Dataset.zip({"x": r(a, 2), "y": r(a, 2)})
        .padded_batch(2, padding_values={"x": np.int64(1), "z": np.int64(2)}),
    "padded_shapes_dict_for_plain": lambda a: r(a, 2).padded_batch(
        2, padded_shapes={"x": []}),
    "padded_shapes_dict_for_tuple": lambda a: a.Dataset.zip((r(a, 2),)).padded_batch(
        2, padded_shapes={"x": []}),
    "dist_padded_dict": lambda a: _dist(a, a.Dataset.zip(
        {"x": a.ragged((1, 3, 2, 1)), "y": r(a, 4)}).padded_batch(
        4, padded_shapes={"x": [3], "y": []}, drop_remainder=True)),
}


def _dist(api, ds):
    s = api.strategy()
    return ("dist", s, s.experimental_distribute_dataset(ds))


# --- running them ---------------------------------------------------------------------

def run(which: str, names=None) -> dict:
    api = Api(which)
    out = {}
    for name, case in CASES.items():
        if names and name not in names:
            continue
        try:
            out[name] = describe(api, case(api))
        except Exception as e:  # noqa: BLE001
            out[name] = error(e)
    return out


# Differences on purpose (each described in docs/), not reported by --compare.
KNOWN = {
    "dist_unbatched": "TensorFlow fails inside its rebatching (IndexError); gpustrat "
                      "raises a ValueError that says to batch before distributing",
    "map_dict_scalar_python": "a Python int returned by a function is int64 (NumPy's "
                              "rule), where TensorFlow makes it int32",
    "padded_dict_python_value": "a padding value converts when it is exact (-1 for "
                                "int64), where TensorFlow needs the component's dtype",
    "padded_dict_too_small": "an element larger than its padded shape is a ValueError "
                             "naming both, where TensorFlow raises DataLossError",
    "padded_list_for_tuple": "padded shapes for a tuple may be a list, where TensorFlow "
                             "needs a tuple",
}
# gpustrat's stand-ins for TensorFlow's exception types.
ERRORS = {"InvalidArgumentError": "ValueError"}


def differences(tf_out: dict, gs_out: dict) -> list[str]:
    def same(a, b):
        if isinstance(a, dict) and "error" in a:
            return isinstance(b, dict) and b.get("error") == ERRORS.get(a["error"],
                                                                       a["error"])
        if isinstance(a, dict) and list(a) == ["PerReplica"] and not (
                isinstance(b, dict) and list(b) == ["PerReplica"]):
            # A distributed dataset's element_spec: TensorFlow wraps each leaf in a
            # PerReplicaSpec of one spec per replica; gpustrat gives that spec.
            return all(same(s, b) for s in a["PerReplica"])
        if isinstance(a, dict) and isinstance(b, dict):
            return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list) and isinstance(b, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a == b
    return [f"{name}:\n  tf: {json.dumps(tf_out[name])}\n  gs: {json.dumps(gs_out.get(name))}"
            for name in tf_out
            if name not in KNOWN and not same(tf_out[name], gs_out.get(name))]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("which", choices=("tf", "gs"))
    p.add_argument("--compare", help="TensorFlow's JSON to compare gpustrat's answers with")
    p.add_argument("cases", nargs="*", help="only these cases")
    args = p.parse_args(argv)
    out = run(args.which, args.cases)
    if not args.compare:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    with open(args.compare) as f:
        diffs = differences(json.load(f), out)
    print("\n".join(diffs) or "no differences")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
