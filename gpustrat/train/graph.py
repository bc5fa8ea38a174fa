"""The object graph of a checkpoint: which objects it saves, under which keys.

Words:
    savable: a ``gs.Variable``; an object that saves its own state
        (``_checkpoint_state()`` returns a state tree, ``_restore_checkpoint_state(tree)``
        takes it back; ``_checkpoint_per_worker`` says whether each worker has its own,
        as an input position, or all share one, as an optimizer); or a plain number, but
        only as a :class:`~gpustrat.train.checkpoint.Checkpoint`'s own entry. A shared
        one may check a restore before anything is written:
        ``_prepare_checkpoint_restore(tree)`` raises on a mismatch, else returns the
        function that writes; and may refer to variables by their keys (see
        :class:`VariableKeys`).
    node: what leads to savables without being one: a nested ``Checkpoint``, a dict,
        list or tuple, or a plain user object (one with a ``__dict__``, such as a model
        class, of a class from neither gpustrat nor the standard library), whose
        attributes are followed.
    key: the path from the root ``Checkpoint`` to a savable, its names joined by ``/``:
        a ``Checkpoint`` entry's name, a dict key, a list or tuple index, an attribute
        name (``"model/layers/0/kernel"``). ``%`` and ``/`` inside a name are written
        ``%25`` and ``%2F``.

The graph is walked in order (entries, dict keys and attributes in insertion order,
sequences by index). An object met again (a variable shared by two layers) or a cycle is
saved once, under the first key; restoring walks the same way, so the same structure
gives the same keys. Inside containers and plain objects, values that lead to no savable
(strings, arrays, functions, numbers; per-worker iterators of ParameterServerStrategy)
are not part of the graph: a plain object's numbers are its own business, as
TensorFlow tracks only trackable attributes. As a ``Checkpoint``'s own entry, an object
that saves nothing is a TypeError (a class may say why in ``_checkpoint_refused``).
"""

from __future__ import annotations

import sys
import types
from typing import Iterator

import numpy as np

from gpustrat.distribute.variables import Variable

NUMBER_TYPES = (bool, int, float, np.bool_, np.integer, np.floating)
_LEAF_TYPES = (str, bytes, bytearray, complex, type(None), np.ndarray, np.generic,
               types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, type)


class Entry:
    """One savable of the graph: its key, its kind, the object, and (for a number) the
    ``Checkpoint`` and name that hold it."""

    __slots__ = ("key", "kind", "obj", "owner", "name")

    def __init__(self, key: str, kind: str, obj, owner=None, name: str | None = None):
        self.key, self.kind, self.obj, self.owner, self.name = key, kind, obj, owner, name

    @property
    def category(self) -> str:
        """``"variable"``, ``"number"`` or ``"state"`` (anything saving its own state)."""
        return self.kind if self.kind in ("variable", "number") else "state"


class VariableKeys:
    """The variables of a graph by key, and each one's key (its first): what an object
    whose state refers to variables (an optimizer's slots) saves them by, so that the
    restoring program finds the same variables again by the same paths. Objects that
    want it say so with a class attribute ``_checkpoint_by_variable_keys = True``; their
    ``_checkpoint_state(keys)`` and ``_prepare_checkpoint_restore(state, keys)`` get it.
    """

    def __init__(self, entries: list):
        self._at = {e.key: e.obj for e in entries if e.kind == "variable"}
        self._key = {id(v): k for k, v in self._at.items()}

    def key_of(self, var) -> str | None:
        """``var``'s key, or None when the graph does not hold it."""
        return self._key.get(id(var))

    def variable_at(self, key: str):
        """The variable saved under ``key``, or None."""
        return self._at.get(key)

    def named(self, name: str) -> list:
        """The graph's variables called ``name``, with their keys: ``[(key, var)]``."""
        return [(k, v) for k, v in self._at.items() if v.name == name]


def state_of(obj, keys: VariableKeys):
    """``obj._checkpoint_state()``, given the graph's variable keys if it wants them."""
    if getattr(type(obj), "_checkpoint_by_variable_keys", False):
        return obj._checkpoint_state(keys)
    return obj._checkpoint_state()


def savable_kind(obj) -> str | None:
    """``"variable"``, ``"shared"``, ``"per_worker"``, or None when ``obj`` saves nothing
    by itself (numbers are told apart by the caller: only a Checkpoint holds them)."""
    if isinstance(obj, Variable):
        return "variable"
    if hasattr(obj, "_checkpoint_state") and hasattr(obj, "_restore_checkpoint_state"):
        return "per_worker" if getattr(obj, "_checkpoint_per_worker", False) else "shared"
    return None


def _is_checkpoint(obj) -> bool:
    return getattr(type(obj), "_is_gpustrat_checkpoint", False)


def _plain(obj) -> bool:
    """A user object whose attributes are followed: not gpustrat's own (a strategy or a
    dataset is no model container) nor the standard library's (a logger, a lock), not
    a leaf value."""
    if isinstance(obj, _LEAF_TYPES) or isinstance(obj, NUMBER_TYPES):
        return False
    top = (type(obj).__module__ or "").partition(".")[0]
    if top in ("gpustrat", "builtins") or top in sys.stdlib_module_names:
        return False
    return hasattr(obj, "__dict__")


def check_entry(name: str, obj) -> None:
    """Raise TypeError unless ``obj`` can be a ``Checkpoint``'s entry ``name``."""
    if isinstance(obj, NUMBER_TYPES) or savable_kind(obj) is not None or \
            _is_checkpoint(obj) or isinstance(obj, (dict, list, tuple)) or _plain(obj):
        return
    refused = getattr(type(obj), "_checkpoint_refused", None)
    if refused:  # a gpustrat object that explains why it is not saved
        raise TypeError(f"Checkpoint: cannot save {name}={type(obj).__name__}: {refused}")
    raise TypeError(f"Checkpoint: cannot save {name}={type(obj).__name__}: a checkpoint "
                    "holds gs.Variable, optimizers, metrics, dataset and distributed "
                    "iterators, plain numbers, nested Checkpoints, and dicts, lists, "
                    "tuples and plain objects whose items or attributes are those")


def check_positions(name: str, obj) -> None:
    """Raise ValueError when an iterator reachable from the entry ``name`` cannot save
    its position (a ``from_generator`` pipeline): at the moment it is given to the
    ``Checkpoint``, not at the first save after an epoch of training."""
    for e in walk({name: obj}, None, allow_empty=True):
        why = getattr(e.obj, "_position_unsaveable", None)
        why = why() if why is not None else None
        if why:
            raise ValueError(
                f"Checkpoint: cannot save {e.key}={type(e.obj).__name__}: {why}. Leave "
                "the iterator out of the Checkpoint to save the rest (a restored job "
                "then starts its input from the beginning of the epoch, in a new "
                "shuffle order: see docs/checkpoint.md), or build the pipeline from "
                "sources that save their position")


def escape(name) -> str:
    return str(name).replace("%", "%25").replace("/", "%2F")


def walk(objects: dict, root_owner, allow_empty: bool = False) -> list[Entry]:
    """The savables reachable from a ``Checkpoint``'s entries ``objects``, in order.

    Raises:
        TypeError: an entry of a ``Checkpoint`` (a nested one too) that is a container
            or plain object leading to no savable, with its key; unless ``allow_empty``
            (a restore: a model whose layers are made later gets their values then).
    """
    seen: dict[int, bool] = {id(root_owner): True}
    out: list[Entry] = []
    _walk_checkpoint(objects, root_owner, "", seen, out, allow_empty)
    return out


def _walk_checkpoint(objects: dict, owner, prefix: str, seen: dict, out: list,
                     allow_empty: bool) -> None:
    for name, obj in objects.items():
        key = prefix + escape(name)
        if isinstance(obj, NUMBER_TYPES):
            out.append(Entry(key, "number", obj, owner, name))
            continue
        if not _visit(obj, key, seen, out, allow_empty) and not _is_checkpoint(obj) \
                and not allow_empty:
            raise TypeError(
                f"Checkpoint: {key!r} ({type(obj).__name__}) holds no savable object "
                "(gs.Variable, optimizer, metric, iterator, Checkpoint, or a container "
                "or object holding them), so nothing of it would be saved; "
                "numbers are saved only as a Checkpoint's own entries, e.g. "
                "Checkpoint(step=3)")


def _visit(obj, key: str, seen: dict, out: list, allow_empty: bool) -> bool:
    """Add the savables reachable from ``obj``; whether any is reachable (saved here or
    under an earlier key)."""
    if id(obj) in seen:
        return seen[id(obj)]
    kind = savable_kind(obj)
    if kind is not None:
        seen[id(obj)] = True
        out.append(Entry(key, kind, obj))
        return True
    if _is_checkpoint(obj):
        seen[id(obj)] = True
        _walk_checkpoint(obj._objects, obj, key + "/", seen, out, allow_empty)
        return True
    seen[id(obj)] = False   # a cycle back here adds nothing
    found = False
    for name, value in _children(obj):
        found = _visit(value, f"{key}/{escape(name)}", seen, out, allow_empty) or found
    seen[id(obj)] = found
    return found


def _children(obj) -> Iterator[tuple]:
    """A node's (name, value) pairs; nothing for a value that is no node."""
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = list(enumerate(obj))
    elif _plain(obj):
        items = list(vars(obj).items())
    else:
        return
    # Containers of plain values can be long (a list of floats): only the values that
    # may lead to a savable are followed.
    for name, value in items:
        if not isinstance(value, _LEAF_TYPES) and not isinstance(value, NUMBER_TYPES):
            yield name, value
