"""Element structures: normalising user values and fast flatten/pack plans.

Words:
    element: one item a dataset yields: a leaf, or a nested structure (tuples, lists,
        dicts, namedtuples; see :mod:`gpustrat.nest`) of leaves.
    leaf: a NumPy array, a NumPy scalar (``numpy.generic``), a CuPy array, or a byte
        string (``bytes``, the scalar form of ``tf.string``). Python numbers given by
        users become NumPy scalars, Python ``str`` becomes UTF-8 ``bytes``; a list is
        always an array, not a structure, even when it holds tuples
        (``from_tensor_slices([(1, 2), (3, 4)])`` has the two elements ``[1 2]`` and
        ``[3 4]``, as in ``tf.data``); a list of strings is an object array of bytes.
    plan: a pair of functions ``(flatten, pack)`` made once for a given structure, so
        that the per-element work of batching, slicing and checking does not walk the
        structure generically each time. A single leaf and a flat tuple of leaves, the
        common cases, get plans that cost one Python call.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gpustrat import devices, nest


def to_leaf(x: Any) -> Any:
    """A user value as a leaf: arrays pass through, Python scalars become NumPy scalars."""
    if isinstance(x, (np.ndarray, np.generic)) or devices.is_gpu_array(x):
        return x
    if isinstance(x, bytes):
        return x
    if isinstance(x, str):
        return x.encode()
    if isinstance(x, list) and x and _all_text(x):
        # Strings as tf.string does: an object array of bytes.
        return _bytes_array(x)
    arr = np.asarray(x)
    if arr.dtype == object:
        if isinstance(x, list):
            raise ValueError(f"a list is one array (as in tf.data), but {x!r} cannot be "
                             "made into an array of numbers or strings; use a tuple or a "
                             "dict for a structure")
        raise TypeError(f"{type(x).__name__} {x!r} cannot be a component of a dataset "
                        "element; components are arrays, numbers or strings (in tuples, "
                        "dicts or namedtuples)")
    return arr[()] if arr.ndim == 0 else arr


def _all_text(x) -> bool:
    return all(_all_text(v) if isinstance(v, (list, tuple)) else isinstance(v, (bytes, str))
               for v in x)


def _bytes_array(x: list) -> np.ndarray:
    def enc(v):
        return [enc(u) for u in v] if isinstance(v, (list, tuple)) else (
            v.encode() if isinstance(v, str) else bytes(v))
    encoded = enc(x)
    probe = np.array(encoded, dtype=object)
    if probe.ndim == 1:
        return probe
    out = np.empty(probe.shape, dtype=object)
    out[...] = probe
    return out


def normalize(element: Any) -> Any:
    """``element`` with every leaf converted by :func:`to_leaf` (structure kept)."""
    t = type(element)
    if t is np.ndarray or isinstance(element, np.generic):
        return element
    if not isinstance(element, (tuple, dict)):
        return to_leaf(element)
    if isinstance(element, dict):
        return type(element)((k, normalize(v)) for k, v in element.items()) \
            if t is not dict else {k: normalize(v) for k, v in element.items()}
    if nest.is_namedtuple(element):
        return t(*[normalize(v) for v in element])
    return tuple(normalize(v) for v in element)


def has_component(element: Any) -> bool:
    """Whether a structure holds at least one leaf. An element must (as in tf.data,
    which refuses ``{}``, ``()`` and ``{"x": ()}`` but takes ``(x, {})``)."""
    if isinstance(element, dict):
        return any(has_component(v) for v in element.values())
    if isinstance(element, tuple):
        return any(has_component(v) for v in element)
    return True


def check_has_component(element: Any, what: str) -> None:
    """ValueError naming ``what`` when ``element`` has no leaf at all."""
    if not has_component(element):
        raise ValueError(f"{what} gave the element {element!r}, which has no component: "
                         "a dataset element needs at least one array, number or string")


def make_plan(structure: Any) -> tuple[Callable[[Any], Any], Callable[[Any], Any]]:
    """``(flatten, pack)`` functions specialised for elements shaped like ``structure``.

    ``flatten(element)`` returns a sequence of leaves; ``pack(leaves)`` rebuilds an
    element from a sequence of leaves.
    """
    if not nest.is_nested(structure):
        return _single_flatten, _single_pack
    if type(structure) is tuple and not any(nest.is_nested(v) for v in structure):
        return _identity, tuple
    if type(structure) is dict and not any(nest.is_nested(v) for v in structure.values()):
        # Leaves in sorted key order (as nest.flatten), elements in the user's key
        # order (as nest.pack_sequence_as and tf.data).
        keys = sorted(structure)
        order = [(k, keys.index(k)) for k in structure]
        return (lambda e: [e[k] for k in keys]), (lambda leaves: {k: leaves[i]
                                                                 for k, i in order})
    return nest.flatten, (lambda leaves: nest.pack_sequence_as(structure, leaves))


def _single_flatten(element):
    return (element,)


def _single_pack(leaves):
    return leaves[0]


def _identity(x):
    return x


def call_with_element(fn: Callable, element: Any) -> Any:
    """Call a user function on an element the ``tf.data`` way.

    A plain tuple element is unpacked into positional arguments (``map(lambda x, y:
    ...)``); anything else, namedtuples and dicts included, is passed as one argument.
    """
    if type(element) is tuple:
        return fn(*element)
    return fn(element)


def stack(leaves: list, where: str = "batch") -> Any:
    """Stack leaves of equal shape along a new first axis (NumPy or CuPy).

    Raises:
        ValueError: the leaves' shapes differ; the message names both shapes.
    """
    first = leaves[0]
    if isinstance(first, bytes):
        out = np.empty(len(leaves), dtype=object)
        out[:] = leaves
        return out
    if isinstance(first, np.generic):
        try:
            return np.array(leaves)
        except ValueError:
            pass
    xp = devices.array_module(first)
    try:
        return xp.stack(leaves)
    except ValueError:
        shapes = {tuple(np.shape(v)) for v in leaves}
        raise ValueError(f"{where}: cannot stack elements of different shapes "
                         f"{sorted(shapes)} into one batch; use padded_batch, which pads "
                         "them to a common shape, or make the shapes equal (with map) "
                         "before batching") from None


def leading_dim(leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    if shape is None:
        shape = np.shape(leaf)
    if len(shape) == 0:
        raise ValueError("component is a scalar but a leading (batch) dimension is "
                         "needed here; every component must have rank >= 1")
    return int(shape[0])
