"""Cross-replica ``reduce`` and ``gather`` of per-replica values.

- ``axis=None``: element-wise over replicas; shapes must match exactly.
- ``axis=k``: each replica first reduces along ``k``; SUM then sums over replicas, and
  MEAN divides the total sum by the total count of examples along ``k``, so a partial
  batch split 4 + 2 weighs every example the same. Empty per-replica batches add
  nothing (MAX and MIN skip them).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gpustrat.collectives.base import Communicator
from gpustrat.devices import array_module as _xp, to_host
from gpustrat.distribute.collective_ops import as_array
from gpustrat.reduce_util import ReduceOp


_HINT_AXIS_NONE = ("A partial batch gives workers different row counts: pass axis=0 to "
                   "reduce over the batch dimension as well")
_HINT_AXIS = "Sizes may differ only along the reduced axis (shown as '*')"


def _shapes(arrays) -> str:
    return ", ".join(f"replica {i}: {tuple(a.shape)}" for i, a in enumerate(arrays))


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
_NAMES_AXIS_NONE = {id(op): f"reduce({op.name}, axis=None)" for op in ReduceOp}
_NAMES_AXIS: dict = {}


def _arrays(comps: Sequence[Any], devices) -> list:
    if len(comps) == 1 and type(comps[0]) is np.ndarray and not devices[0].is_gpu:
        return [comps[0]]  # the common case, one host array: nothing to convert
    return [as_array(c, d) for c, d in zip(comps, devices)]


def reduce_components(comm: Communicator, op: ReduceOp, comps: Sequence[Any],
                      axis: int | None) -> Any:
    """Reduce one leaf given as one component per local replica."""
    arrays = _arrays(comps, comm.devices)
    if axis is None:
        first = arrays[0]
        if len(arrays) > 1 and any(a.shape != first.shape for a in arrays[1:]):
            raise ValueError(
                f"cannot reduce per-replica values of different shapes with axis=None "
                f"({_shapes(arrays)}); partial batches give such shapes: pass axis=0 to "
                "reduce over the batch dimension as well")
        # Between workers too: a reduction of mismatched buffers would combine unrelated
        # bytes (or break the MPI library) instead of failing. Over MPI this check
        # rides in the header of the reduce itself.
        comm.agree_layout(first.shape, first.dtype, _NAMES_AXIS_NONE[id(op)], _HINT_AXIS_NONE)
        return comm.reduce(arrays, op)
    if len(arrays) == 1 and op is not ReduceOp.MEAN:
        a = arrays[0]
        if a.ndim and -a.ndim <= axis < a.ndim and a.shape[axis] == 1 and \
                a.dtype.kind != "b":
            # One array of one row: see the general case below, written out.
            ax = axis % a.ndim
            rest = a.shape[:ax] + a.shape[ax + 1:]
            name = _NAMES_AXIS.get((id(op), axis))
            if name is None:
                name = _NAMES_AXIS[(id(op), axis)] = f"reduce({op.name}, axis={axis})"
            comm.agree_layout(a.shape[:ax] + ("*",) + rest[ax:], a.dtype, name, _HINT_AXIS)
            return comm.reduce([a.reshape(rest)], op)
    ndim = arrays[0].ndim
    if ndim == 0:
        raise ValueError(f"cannot reduce along axis {axis}: the per-replica values are "
                         "scalars; use axis=None")
    ax = _normalize_axis(axis, ndim)
    rest = [a.shape[:ax] + a.shape[ax + 1:] for a in arrays]
    if any(r != rest[0] or a.ndim != ndim for r, a in zip(rest, arrays)):
        raise ValueError(f"per-replica values differ in shape outside axis {axis}: "
                         f"{_shapes(arrays)}")
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
        return comm.reduce([a.sum(axis=ax, dtype=dtype) for a in arrays], ReduceOp.SUM)
    if op is ReduceOp.MEAN:
        return _mean_along_axis(comm, arrays, ax)
    parts = []
    for a in arrays:
        xp = _xp(a)
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
        rest = a.shape[:ax] + a.shape[ax + 1:]
        buf = xp.empty(int(np.prod(rest, dtype=np.int64)) + 1, dtype=dtype)
        a.sum(axis=ax, dtype=dtype, out=buf[:-1].reshape(rest))  # no copy to append to
        buf[-1] = a.shape[ax]
        parts.append(buf)
    total = comm.reduce(parts, ReduceOp.SUM)
    out_shape = arrays[0].shape[:ax] + arrays[0].shape[ax + 1:]
    count = float(to_host(total[-1:])[0])
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total[:-1] / count
    out_dtype = arrays[0].dtype if np.issubdtype(arrays[0].dtype, np.inexact) else np.float64
    return mean.reshape(out_shape).astype(out_dtype, copy=False)


def gather_components(comm: Communicator, comps: Sequence[Any], axis: int) -> Any:
    """Concatenate one leaf's components from every replica in sync along ``axis``."""
    arrays = _arrays(comps, comm.devices)
    if arrays[0].ndim == 0:
        raise ValueError("gather needs per-replica values with at least one dimension; "
                         "got scalars")
    ax = _normalize_axis(axis, arrays[0].ndim)
    rest = [a.shape[:ax] + a.shape[ax + 1:] for a in arrays]
    if any(r != rest[0] or a.ndim != arrays[0].ndim for r, a in zip(rest, arrays)):
        raise ValueError(f"gather along axis {axis} needs shapes that differ only along "
                         f"that axis: {_shapes(arrays)}")
    return comm.all_gather(arrays, ax)[0]
