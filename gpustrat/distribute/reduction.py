"""Cross-replica ``reduce`` and ``gather`` of per-replica values.

- ``axis=None``: element-wise over replicas; shapes must match exactly.
- ``axis=k``: each replica first reduces along ``k``; SUM then sums over replicas, and
  MEAN divides the total sum by the total count of examples along ``k``, so a partial
  batch split 4 + 2 weighs every example the same. Empty per-replica batches add
  nothing (MAX and MIN skip them).

Only numbers are combined: integer, floating and complex arrays and Python numbers.
Strings, None and other objects are a TypeError naming the leaf; booleans can be
gathered and reduced with MAX (any) and MIN (all), not with SUM or MEAN; complex
numbers with SUM and MEAN, not with MAX or MIN (they have no order).
"""

from __future__ import annotations

import operator

from typing import Any, Sequence

import numpy as np

from gpustrat import nest
from gpustrat.collectives.base import Communicator
from gpustrat.devices import array_module as _xp, gpu_array_type, on_device_of
from gpustrat.distribute.collective_ops import as_array
from gpustrat.reduce_util import ReduceOp


HINT_AXIS_NONE = ("A partial batch gives workers different row counts: pass axis=0 to "
                   "reduce over the batch dimension as well")
_HINT_AXIS = "Sizes may differ only along the reduced axis (shown as '*')"


#: dtype names (as ``collective_ops.leaf_signature`` gives them: a NumPy dtype name or
#: a Python type name) of the leaves every collective takes.
_NUMBER_NAMES = frozenset(
    [np.dtype(c).name for c in np.typecodes["AllInteger"] + np.typecodes["AllFloat"]]
    + ["int", "float", "complex", "bfloat16"])
#: Those that MAX and MIN take: numbers with an order (no complex).
_REAL_NAMES = frozenset(n for n in _NUMBER_NAMES if "complex" not in n)
_ORDERED = (ReduceOp.MAX, ReduceOp.MIN)
_DEVICE_ID = operator.attrgetter("data.device_id")   # (no Device object made)
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
#: The native-order integer and floating dtypes (kinds ``i``, ``u``, ``f``).
_NUMBER_DTYPES = frozenset(np.dtype(c) for c in np.typecodes["AllInteger"] + np.typecodes["Float"])


def check_leaf(x: Any, op: ReduceOp | None, what: str, where: str) -> None:
    """Raise TypeError unless leaf ``x`` can be reduced with ``op`` (gathered when
    ``op`` is None) by the call ``what``, saying what it is, ``where`` it came from and
    what to do."""
    dtype = getattr(x, "dtype", None)
    if isinstance(dtype, np.dtype):
        kind = dtype.kind
        if kind in "iuf":  # the common case, before anything costs (dtype.name does)
            return
        if kind == "V" and dtype.name == "bfloat16":  # ml_dtypes' bfloat16: kind "V"
            kind = "f"
        shown = f"an array of dtype {dtype}"
    elif isinstance(x, bool):
        kind, shown = "b", f"the bool {x}"
    elif isinstance(x, complex):
        kind, shown = "c", f"the complex {x}"
    elif isinstance(x, (int, float)):
        return
    elif hasattr(x, "__array__") or hasattr(x, "__cuda_array_interface__") or \
            hasattr(x, "__dlpack__"):
        return  # another library's array, whose dtype is not NumPy's: not inspected
    else:
        kind, shown = "O", f"{type(x).__name__} {_short_repr(x)}"
    if kind in "iuf" or (kind == "c" and op not in _ORDERED) or \
            (kind == "b" and op not in (ReduceOp.SUM, ReduceOp.MEAN)):
        return
    if op is not None:
        what = f"{what}({op.name})"
    if kind == "c":
        raise TypeError(f"{what}: {op.name} of complex numbers is not defined ({shown}, "
                        f"{where}): they have no order; reduce the real and imaginary "
                        "parts, or the absolute value")
    if x is None:
        raise TypeError(f"{what}: a None leaf ({where}) cannot be reduced or gathered over "
                        "replicas; leave it out of the structure or give it a value")
    if kind == "b":
        raise TypeError(f"{what}: {op.name} of booleans is not defined ({shown}, {where}); "
                        "cast to an integer dtype to count them (x.astype(np.int32)), or "
                        "use MAX (any) or MIN (all)")
    raise TypeError(f"{what}: {shown} ({where}) is not a number; only integer, floating "
                    "and complex arrays and Python numbers can be reduced or gathered over "
                    "replicas: leave it out of the structure, or pass the numbers it "
                    "stands for")


def check_leaves(signature: tuple, value: Any, op: ReduceOp | None, what: str,
                 replica: int) -> None:
    """:func:`check_leaf` for every leaf of one replica's ``value``, whose
    ``leaf_signature`` is ``signature``; leaves of a number dtype cost one lookup."""
    names = _REAL_NAMES if op in _ORDERED else _NUMBER_NAMES
    if all(dtype in names for _, dtype in signature[2]):
        return
    for leaf in nest.flatten(value):
        check_leaf(leaf, op, what, f"replica {replica}")


def _short_repr(x: Any, limit: int = 40) -> str:
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


def _shapes(arrays) -> str:
    return ", ".join(f"replica {i}: {tuple(a.shape)}" for i, a in enumerate(arrays))


def check_axis(axis: Any, call: str, none_ok: bool) -> int | None:
    """``axis`` as an int (NumPy integers accepted), or None where ``none_ok``; else a
    TypeError naming ``call`` and the value."""
    if axis is None and none_ok:
        return None
    if not isinstance(axis, bool):
        try:
            return operator.index(axis)
        except TypeError:
            pass
    allowed = "an integer, or None (reduce across replicas only)" if none_ok else \
        "an integer"
    raise TypeError(f"{call}: axis must be {allowed}, got {axis!r} "
                    f"({type(axis).__name__})")


def _shared(comm: Communicator, error: Exception) -> Exception:
    """``error``, found in this worker's replicas' values before a collective that the
    other workers may already wait in: told to them first (``share_error``), so that
    every worker raises."""
    if comm.num_workers > 1:
        comm.share_error(error)
    return error


def _check_dtypes(comm: Communicator, arrays: list) -> None:
    """The local replicas' arrays of a reduction have one dtype (else told, and
    raised)."""
    if len(arrays) > 1 and len(set(map(_DTYPE, arrays))) > 1:
        raise _shared(comm, ValueError(
            f"cannot reduce per-replica values of different dtypes "
            f"({', '.join(f'replica {i}: {a.dtype}' for i, a in enumerate(arrays))}): "
            "cast them to one dtype first"))


def _normalize_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for per-replica values of rank {ndim}")
    return axis % ndim


def _identity(op: ReduceOp, dtype) -> Any:
    big = np.inf if np.issubdtype(dtype, np.inexact) else (
        np.iinfo(dtype).max if np.issubdtype(dtype, np.integer) else True)
    small = -np.inf if np.issubdtype(dtype, np.inexact) else (
        np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else False)
    return small if op is ReduceOp.MAX else big


# Keyed by id(op): hashing an Enum member runs Python code, an id does not.
NAMES_AXIS_NONE = {id(op): f"reduce({op.name}, axis=None)" for op in ReduceOp}
_NAMES_AXIS: dict = {}
_MEAN = ReduceOp.MEAN  # a module global: reading an Enum member runs Python code


def _arrays(comps: Sequence[Any], devices) -> list:
    if len(comps) == 1 and type(comps[0]) is np.ndarray and not devices[0].is_gpu:
        return [comps[0]]  # the common case, one host array: nothing to convert
    return [as_array(c, d) for c, d in zip(comps, devices)]


def _on_their_gpus(comps: Sequence[Any], devices) -> bool:
    """Whether ``comps`` are CuPy arrays of numbers (integer or floating), each on its
    replica's GPU: nothing to check or move, found with C-level passes."""
    array = gpu_array_type()
    return (array is not None and devices[0].is_gpu and set(map(type, comps)) == {array}
            and list(map(_DEVICE_ID, comps)) == [d.index for d in devices]
            and set(map(_DTYPE, comps)) <= _NUMBER_DTYPES)


def reduce_components(comm: Communicator, op: ReduceOp, comps: Sequence[Any],
                      axis: int | None) -> Any:
    """Reduce one leaf given as one component per local replica."""
    if _on_their_gpus(comps, comm.devices):
        return _reduce_arrays(comm, op, list(comps), axis)
    for i, c in enumerate(comps):
        if type(c) is not np.ndarray or c.dtype.kind not in "iuf":  # else nothing to check
            check_leaf(c, op, "strategy.reduce", f"component {i}")
    return _reduce_arrays(comm, op, _arrays(comps, comm.devices), axis)


def reduce_host_array(comm: Communicator, op: ReduceOp, a: np.ndarray, axis: int | None
                      ) -> Any:
    """:func:`reduce_components` of one host array of numbers (dtype kind ``b``, ``i``,
    ``u``, ``f`` or ``c``; the caller checked) on a communicator with one CPU replica."""
    if a.dtype.kind in "bc":
        check_leaf(a, op, "strategy.reduce", "component 0")   # bool MAX/MIN, complex not
    if axis is None:
        return comm.reduce_named(a, op, NAMES_AXIS_NONE[id(op)], HINT_AXIS_NONE)
    if op is not _MEAN and a.dtype.kind != "b":
        one_row = _ONE_ROW.get((a.shape, axis, id(op)))
        if one_row is not None:  # see _reduce_arrays: one row, reduced as a view
            rest, shown, name = one_row
            return comm.reduce_named(a.reshape(rest), op, name, _HINT_AXIS, shown)
    return _reduce_arrays(comm, op, [a], axis)


# (shape, axis, id(op)) -> (the other axes, the layout shown, the call's name) of one
# array with one row along the axis: a training loop reduces the same few.
_ONE_ROW: dict = {}


def _reduce_arrays(comm: Communicator, op: ReduceOp, arrays: list, axis: int | None) -> Any:
    if axis is None:
        first = arrays[0]
        _check_dtypes(comm, arrays)
        if len(arrays) > 1 and len(set(map(_SHAPE, arrays))) > 1:
            raise _shared(comm, ValueError(
                f"cannot reduce per-replica values of different shapes with axis=None "
                f"({_shapes(arrays)}); partial batches give such shapes: pass axis=0 to "
                "reduce over the batch dimension as well"))
        # Between workers too: a reduction of mismatched buffers would combine unrelated
        # bytes (or break the MPI library) instead of failing. Over MPI this check
        # rides in the header of the reduce itself.
        comm.agree_layout(first.shape, first.dtype, NAMES_AXIS_NONE[id(op)], HINT_AXIS_NONE)
        return comm.reduce_checked(arrays, op)
    if len(arrays) == 1 and op is not _MEAN:
        a = arrays[0]
        if a.ndim and -a.ndim <= axis < a.ndim and a.shape[axis] == 1 and \
                a.dtype.kind != "b":
            # One array of one row: see the general case below, written out (and
            # remembered for reduce_host_array).
            ax = axis % a.ndim
            rest = a.shape[:ax] + a.shape[ax + 1:]
            name = _NAMES_AXIS.get((id(op), axis))
            if name is None:
                name = _NAMES_AXIS[(id(op), axis)] = f"reduce({op.name}, axis={axis})"
            shown = a.shape[:ax] + ("*",) + rest[ax:]
            if len(_ONE_ROW) < 1024:
                _ONE_ROW[(a.shape, axis, id(op))] = (rest, shown, name)
            comm.agree_layout(shown, a.dtype, name, _HINT_AXIS)
            return comm.reduce([a.reshape(rest)], op)
    ndim = arrays[0].ndim
    if ndim == 0:
        raise ValueError(f"cannot reduce along axis {axis}: the per-replica values are "
                         "scalars; use axis=None")
    ax = _normalize_axis(axis, ndim)
    rest = [a.shape[:ax] + a.shape[ax + 1:] for a in arrays]
    if any(r != rest[0] or a.ndim != ndim for r, a in zip(rest, arrays)):
        raise _shared(comm, ValueError(f"per-replica values differ in shape outside axis "
                                       f"{axis}: {_shapes(arrays)}"))
    _check_dtypes(comm, arrays)
    # Sizes along the axis may differ between workers; the other axes and dtype may not.
    shown = tuple("*" if i == ax else n for i, n in enumerate(arrays[0].shape))
    name = _NAMES_AXIS.get((id(op), axis))
    if name is None:
        name = _NAMES_AXIS[(id(op), axis)] = f"reduce({op.name}, axis={axis})"
    comm.agree_layout(shown, arrays[0].dtype, name, _HINT_AXIS)
    if op is not ReduceOp.MEAN and arrays[0].dtype.kind != "b" and \
            all(a.shape[ax] == 1 for a in arrays):
        # One row each (a batch of one, a leading axis of size 1): that row is its own
        # SUM, MAX and MIN, so the arrays go to the collective as views, not copies
        # (booleans excluded: their SUM along an axis counts, in integers).
        return comm.reduce([a.reshape(rest[0]) for a in arrays], op)
    if op is ReduceOp.SUM:
        # NumPy widens small integers in sum(); TensorFlow's reduce_sum keeps the dtype.
        dtype = arrays[0].dtype if np.issubdtype(arrays[0].dtype, np.integer) else None
        parts = []
        for a in arrays:
            with on_device_of(a):   # on the array's device and its current stream
                parts.append(a.sum(axis=ax, dtype=dtype))
        return comm.reduce(parts, ReduceOp.SUM)
    if op is ReduceOp.MEAN:
        return _mean_along_axis(comm, arrays, ax)
    parts = []
    for a in arrays:
        xp = _xp(a)
        with on_device_of(a):
            if a.shape[ax] == 0:
                parts.append(xp.full(rest[0], _identity(op, a.dtype), dtype=a.dtype))
            else:
                parts.append(a.max(axis=ax) if op is ReduceOp.MAX else a.min(axis=ax))
    return comm.reduce(parts, op)


def _mean_along_axis(comm: Communicator, arrays, ax: int):
    # One collective for sums and counts: the count rides at the end of the sum buffer.
    dtype = np.result_type(arrays[0].dtype, np.float32)
    if np.dtype(dtype).itemsize < 8 and np.issubdtype(arrays[0].dtype, np.integer):
        dtype = np.float64
    parts = []
    for a in arrays:
        xp = _xp(a)
        with on_device_of(a):
            rest = a.shape[:ax] + a.shape[ax + 1:]
            buf = xp.empty(int(np.prod(rest, dtype=np.int64)) + 1, dtype=dtype)
            a.sum(axis=ax, dtype=dtype, out=buf[:-1].reshape(rest))  # no copy to append to
            buf[-1] = a.shape[ax]
            parts.append(buf)
    total = comm.reduce(parts, ReduceOp.SUM)
    out_shape = arrays[0].shape[:ax] + arrays[0].shape[ax + 1:]
    out_dtype = arrays[0].dtype if np.issubdtype(arrays[0].dtype, np.inexact) else np.float64
    with np.errstate(invalid="ignore", divide="ignore"), on_device_of(total):
        # Divided by the count where it is, in the sums' dtype: no host read of it.
        mean = total[:-1] / total[-1]
        return mean.reshape(out_shape).astype(out_dtype, copy=False)


def gather_host_array(comm: Communicator, a: np.ndarray, axis: int) -> Any:
    """:func:`gather_components` of one host array of numbers (the caller checked) on a
    communicator with one CPU replica."""
    if a.ndim == 0:
        raise ValueError("gather needs per-replica values with at least one dimension; "
                         "got scalars")
    if type(axis) is not int or not -a.ndim <= axis < a.ndim:
        axis = _normalize_axis(axis, a.ndim)
    return comm.gather([a], axis)


def gather_components(comm: Communicator, comps: Sequence[Any], axis: int) -> Any:
    """Concatenate one leaf's components from every replica in sync along ``axis``."""
    for i, c in enumerate(comps):
        if type(c) is not np.ndarray or c.dtype.kind not in "iufc":  # else nothing to check
            check_leaf(c, None, "strategy.gather", f"component {i}")
    arrays = _arrays(comps, comm.devices)
    if arrays[0].ndim == 0:
        raise ValueError("gather needs per-replica values with at least one dimension; "
                         "got scalars")
    ax = _normalize_axis(axis, arrays[0].ndim)
    if len(arrays) == 1:  # one array: no shapes to compare
        return comm.gather(arrays, ax)
    rest = [a.shape[:ax] + a.shape[ax + 1:] for a in arrays]
    if any(r != rest[0] or a.ndim != arrays[0].ndim for r, a in zip(rest, arrays)):
        raise _shared(comm, ValueError(f"gather along axis {axis} needs shapes that differ "
                                       f"only along that axis: {_shapes(arrays)}"))
    return comm.gather(arrays, ax)
