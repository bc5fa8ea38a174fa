"""Nested structures: tuples, lists, dicts and namedtuples of leaves.

Everything else (arrays, scalars, None, per-replica values) is a *leaf*. Dicts are
walked in sorted key order, as ``tf.nest`` does, so that two dicts with the same keys
flatten the same way whatever their insertion order; packing gives a dict back in its
template's key order (as ``tf.nest`` does too).
"""

from __future__ import annotations

import collections
from typing import Any, Callable


def is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


def is_nested(x: Any) -> bool:
    return isinstance(x, (tuple, list, dict))


def _children(x):
    if isinstance(x, dict):
        return [x[k] for k in sorted(x)]
    return list(x)


def flatten(structure: Any) -> list:
    """The leaves of ``structure`` in a fixed order (dict keys sorted)."""
    if not is_nested(structure):
        return [structure]
    out: list = []
    stack = [structure]
    # Iterative walk; reversed children keep the left-to-right order.
    while stack:
        x = stack.pop()
        if is_nested(x):
            stack.extend(reversed(_children(x)))
        else:
            out.append(x)
    return out


def _rebuild(template, children):
    if isinstance(template, dict):
        # Children come in sorted key order; the result keeps the template's own key
        # order, as tf.nest does, so a user's dict reads back the way it was written.
        by_key = dict(zip(sorted(template), children))
        items = [(k, by_key[k]) for k in template]
        if type(template) is dict:
            return dict(items)
        if isinstance(template, collections.defaultdict):
            return type(template)(template.default_factory, items)
        return type(template)(items)
    if is_namedtuple(template):
        return type(template)(*children)
    if isinstance(template, tuple):
        return tuple(children)
    return list(children)


def pack_sequence_as(structure: Any, flat: list) -> Any:
    """Inverse of :func:`flatten`: put ``flat``'s leaves into ``structure``'s shape."""
    flat = list(flat)
    n = len(flatten(structure))
    if n != len(flat):
        raise ValueError(
            f"structure has {n} leaves but {len(flat)} values were given to pack into it")
    return _build(structure, iter(flat))


def _build(t, it):
    # A module-level function, not a closure calling itself: such a closure is a reference
    # cycle that would keep the leaves (device arrays) alive until the garbage collector
    # runs, in whichever thread it next runs in.
    if not is_nested(t):
        return next(it)
    return _rebuild(t, [_build(c, it) for c in _children(t)])


def assert_same_structure(a: Any, b: Any) -> None:
    """Raise ValueError naming the first place where ``a`` and ``b`` differ in shape."""

    def walk(x, y, path):
        if is_nested(x) != is_nested(y):
            raise ValueError(f"structures differ at {path or 'the top'}: "
                             f"{type(x).__name__} vs {type(y).__name__}")
        if not is_nested(x):
            return
        if isinstance(x, dict) != isinstance(y, dict):
            raise ValueError(f"structures differ at {path or 'the top'}: "
                             f"{type(x).__name__} vs {type(y).__name__}")
        if isinstance(x, dict):
            if sorted(x) != sorted(y):
                raise ValueError(f"dict keys differ at {path or 'the top'}: "
                                 f"{sorted(x)} vs {sorted(y)}")
            for k in sorted(x):
                walk(x[k], y[k], f"{path}[{k!r}]")
        else:
            if len(x) != len(y):
                raise ValueError(f"sequence lengths differ at {path or 'the top'}: "
                                 f"{len(x)} vs {len(y)}")
            for i, (cx, cy) in enumerate(zip(x, y)):
                walk(cx, cy, f"{path}[{i}]")

    walk(a, b, "")


def describe(structure: Any) -> str:
    """``structure``'s shape as text, each leaf a ``.``: dict keys (sorted), namedtuple
    names and fields (in order), list and tuple lengths; what two structures share when their leaves pair up
    alike (``{'a': ., 'b': [., .]}``)."""
    if not is_nested(structure):
        return "."
    if isinstance(structure, dict):
        return "{" + ", ".join(f"{k!r}: {describe(structure[k])}"
                               for k in sorted(structure)) + "}"
    if is_namedtuple(structure):
        fields = ", ".join(f"{f}={describe(c)}" for f, c in zip(structure._fields,
                                                               structure))
        return f"{type(structure).__name__}({fields})"
    inner = ", ".join(describe(c) for c in structure)
    if isinstance(structure, tuple):
        return f"({inner},)" if len(structure) == 1 else f"({inner})"
    return f"[{inner}]"


def map_structure(fn: Callable, *structures: Any) -> Any:
    """Apply ``fn`` leaf-wise over one or more structures of the same shape."""
    if not structures:
        raise ValueError("map_structure needs at least one structure")
    first = structures[0]
    for other in structures[1:]:
        assert_same_structure(first, other)
    flats = [flatten(s) for s in structures]
    return pack_sequence_as(first, [fn(*leaves) for leaves in zip(*flats)])
