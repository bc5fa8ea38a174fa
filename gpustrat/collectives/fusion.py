"""Tensor fusion: many small all-reduces in one step become a few large ones.

Words:
- *bucket*: tensors of one dtype whose total size is at most the bucket size (a tensor
  larger than that is a bucket of its own). Tensors are bucketed by dtype, in order
  of first appearance, then greedily in their given order, so every worker (with the
  same shapes and dtypes) forms the same buckets and issues the same collectives in
  the same order.
- *fusion buffer*: one 1-D array per local replica holding a bucket's tensors back to
  back (``gpustrat.kernels.pack``). One ``comm.all_reduce`` per bucket replaces one per
  tensor, paying the per-collective cost (Python, MPI latency, NCCL launch) once.
- *arena* (host): the fusion buffers of one call's buckets of one dtype are consecutive
  slices of one pooled array per replica, reused by the next call once none of its
  results is referenced, so a warm step allocates (and page-faults) nothing.

The reduction itself is the communicator's, applied to the fusion buffer: every
element is reduced exactly as the tensor it came from would have been (MEAN divides
by the number of replicas in the communicator, integer MEAN gives floats), so fused
and separate reductions return the same values. GPU tensors are packed and unpacked by
the Numba kernels (one launch per bucket and replica each way); host tensors by NumPy.

The bucket size is ``bucket_bytes`` or the ``GPUSTRAT_FUSION_BUCKET_BYTES``
environment variable (default 64 MiB, as Horovod's fusion threshold).
"""

from __future__ import annotations

import operator
import sys
import threading

import os
from typing import Sequence

import numpy as np

from gpustrat.collectives.base import Communicator
from gpustrat.devices import array_module, device_of, is_gpu_array
from gpustrat.reduce_util import ReduceOp

ENV_BUCKET_BYTES = "GPUSTRAT_FUSION_BUCKET_BYTES"
DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


def bucket_bytes_from_env() -> int:
    """``GPUSTRAT_FUSION_BUCKET_BYTES`` (a positive integer; default 64 MiB)."""
    raw = os.environ.get(ENV_BUCKET_BYTES, "").strip()
    if not raw:
        return DEFAULT_BUCKET_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{ENV_BUCKET_BYTES}={raw!r} is not a positive number of bytes: "
                         f"unset it for the default {DEFAULT_BUCKET_BYTES}")
    return value


def plan_buckets(sizes: Sequence[int], dtypes: Sequence[np.dtype],
                 bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets.

    Args:
        sizes: element count of each tensor.
        dtypes: dtype of each tensor.
        bucket_bytes: the most bytes a bucket holds (unless one tensor alone is larger).
    Returns:
        Lists of tensor indices: one dtype per bucket, indices increasing within it,
        buckets of a dtype in order, dtypes in order of first appearance.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    n = len(sizes)
    if n == 0:
        return []
    d0 = dtypes[0]
    if list(dtypes).count(d0) == n:  # one dtype: the common case, kept cheap
        return _greedy(range(n), sizes, d0.itemsize, bucket_bytes)
    groups: dict = {}
    for j, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(j)
    return [b for dtype, idx in groups.items()
            for b in _greedy(idx, [sizes[j] for j in idx], dtype.itemsize, bucket_bytes)]


def _greedy(indices, sizes, itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Cut ``indices`` (with element counts ``sizes``) into consecutive buckets."""
    indices = list(indices)
    if sum(sizes) * itemsize <= bucket_bytes:
        return [indices]
    cap = bucket_bytes // itemsize if itemsize else bucket_bytes
    buckets: list[list[int]] = []
    cut, fill = 0, 0
    for k, size in enumerate(sizes):
        if fill + size > cap and k > cut:
            buckets.append(indices[cut:k])
            cut, fill = k, 0
        fill += size
    buckets.append(indices[cut:])
    return buckets


# The checks' common all-good case runs in C (map/set, whole-list compares); only a
# failure walks the tensors in Python, to name the first one that is wrong.

def _check_counts(comm: Communicator, tensors) -> None:
    """Every tensor has one value per local replica."""
    n = comm.num_local
    if set(map(len, tensors)) != {n}:
        j, row = next((j, row) for j, row in enumerate(tensors) if len(row) != n)
        raise ValueError(f"tensor {j} has {len(row)} replica values but the "
                         f"communicator has {n} local replicas: pass tensors[j][i] "
                         "for every tensor j and local replica i")


def _check_layouts(comm: Communicator, tensors, shapes0: list, dtypes0: list) -> None:
    """Every replica's value of a tensor has replica 0's shape and dtype (``shapes0``,
    ``dtypes0``)."""
    for i in range(1, comm.num_local):
        column = list(map(operator.itemgetter(i), tensors))
        if list(map(_SHAPE, column)) == shapes0 and list(map(_DTYPE, column)) == dtypes0:
            continue
        for j, t in enumerate(column):
            if t.shape != shapes0[j] or t.dtype != dtypes0[j]:
                raise ValueError(
                    f"tensor {j}: replica 0 has shape {shapes0[j]} dtype {dtypes0[j]} but "
                    f"replica {i} has shape {t.shape} dtype {t.dtype}; every replica must "
                    "contribute the same shape and dtype")


def _as_arrays(tensors):
    return [[t if hasattr(t, "shape") and hasattr(t, "dtype") else np.asarray(t)
             for t in row] for row in tensors]


def fused_all_reduce(comm: Communicator, tensors: Sequence[Sequence], op,
                     bucket_bytes: int | None = None) -> list[list]:
    """All-reduce many tensors with one collective per bucket.

    Args:
        comm: any :class:`~gpustrat.collectives.base.Communicator`.
        tensors: ``tensors[j][i]`` is tensor ``j`` of local replica ``i``, on replica
            ``i``'s device; shapes and dtypes equal over replicas (and workers).
        op: a :class:`~gpustrat.reduce_util.ReduceOp` or its name.
        bucket_bytes: bucket size; None reads ``GPUSTRAT_FUSION_BUCKET_BYTES``.
    Returns:
        ``out[j][i]``: the reduction of tensor ``j`` on local replica ``i`` (what
        ``comm.all_reduce([tensors[j][i] for i ...], op)[i]`` returns): views of the
        bucket's reduced buffer (disjoint, so one can be updated in place without
        touching another), on the host and on GPUs alike.
    Raises:
        ValueError: a tensor with the wrong number of replica values, or replicas
            disagreeing on its shape or dtype.
    """
    out: list = [None] * len(tensors)  # out[j]: tensor j's results, one per replica
    for bucket, bucket_shapes, reduced in _reduced_buckets(comm, tensors, op, bucket_bytes):
        per_replica = [_unpack_views(r, bucket_shapes) for r in reduced]
        # map/zip run in C: one list per tensor without a Python-level loop body.
        per_tensor = list(map(list, zip(*per_replica)))
        lo, hi = bucket[0], bucket[-1] + 1
        if hi - lo == len(bucket):
            out[lo:hi] = per_tensor
        else:
            for j, results in zip(bucket, per_tensor):
                out[j] = results
    return out


class KnownLayout:
    """The shapes and dtypes of a list of tensors that a caller has checked on every
    local replica (``tensors[j][i]`` has ``shapes[j]`` and ``dtypes[j]``), and their
    bucket plan per bucket size, worked out once: a training loop reduces the same
    layout every step, so passing one to :func:`fused_all_reduce_flat` skips the
    per-call checks and planning."""

    __slots__ = ("shapes", "dtypes", "sizes", "_plans")

    def __init__(self, shapes: Sequence, dtypes: Sequence):
        self.shapes = list(shapes)
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.sizes = [int(np.prod(sh, dtype=np.int64)) for sh in self.shapes]
        self._plans: dict = {}

    def plan(self, bucket_bytes: int) -> tuple[list, dict]:
        """``(buckets, elements per dtype)`` for this bucket size."""
        hit = self._plans.get(bucket_bytes)
        if hit is None:
            hit = self._plans[bucket_bytes] = _plan_with_arenas(
                self.sizes, self.dtypes, bucket_bytes)
        return hit


def _plan_with_arenas(sizes, dtypes, bucket_bytes: int) -> tuple[list, dict]:
    plan = plan_buckets(sizes, dtypes, int(bucket_bytes))
    arena_elems: dict = {}
    for bucket in plan:
        d = dtypes[bucket[0]]
        arena_elems[d] = arena_elems.get(d, 0) + sum(sizes[j] for j in bucket)
    return plan, arena_elems


def fused_all_reduce_flat(comm: Communicator, tensors: Sequence[Sequence], op,
                          bucket_bytes: int | None = None,
                          layout: KnownLayout | None = None) -> list[tuple[list, list]]:
    """:func:`fused_all_reduce`, giving each bucket's reduced fusion buffers instead of
    one result per tensor: for code that works on the tensors of a bucket as one flat
    array (an optimizer updating all its variables with a few large operations).

    Returns:
        ``[(indices, buffers), ...]`` per bucket, in order: the tensor indices it holds
        and one 1-D reduced buffer per local replica, holding those tensors flattened,
        back to back. The buffers are the caller's; host buffers are slices of a pooled
        arena that a later call reuses once nothing refers to them.

    ``layout``: the tensors' :class:`KnownLayout`, when the caller has checked them
    (then they are not checked again, and the buckets are planned once per layout).
    """
    return [(bucket, reduced) for bucket, _, reduced in
            _reduced_buckets(comm, tensors, op, bucket_bytes, layout)]


def _reduced_buckets(comm: Communicator, tensors, op, bucket_bytes, layout=None):
    """Yield ``(bucket, shapes of its tensors, reduced buffers)`` for each bucket."""
    op = ReduceOp.from_value(op)
    if bucket_bytes is None:
        bucket_bytes = bucket_bytes_from_env()
    if not tensors:
        return
    if layout is not None:
        shapes, dtypes, sizes = layout.shapes, layout.dtypes, layout.sizes
        plan, arena_elems = layout.plan(bucket_bytes)
    else:
        _check_counts(comm, tensors)
        try:
            first = list(map(_FIRST, tensors))
            shapes = list(map(_SHAPE, first))
            dtypes = list(map(_DTYPE, first))
            sizes = list(map(_SIZE, first))
        except AttributeError:  # Python scalars or lists among the values
            tensors = _as_arrays(tensors)
            first = list(map(_FIRST, tensors))
            shapes = list(map(_SHAPE, first))
            dtypes = list(map(_DTYPE, first))
            sizes = list(map(_SIZE, first))
        _check_layouts(comm, tensors, shapes, dtypes)
        # Host buckets of one dtype are consecutive slices of one arena per replica
        # (see _host_arena), so a call with many buckets allocates nothing once warm.
        plan, arena_elems = _plan_with_arenas(sizes, dtypes, bucket_bytes)
    n_local = comm.num_local
    arenas: dict = {}
    offsets: dict = {}
    for bucket in plan:
        lo, hi = bucket[0], bucket[-1] + 1
        contiguous = hi - lo == len(bucket)
        rows = tensors[lo:hi] if contiguous else [tensors[j] for j in bucket]
        total = sum(sizes[lo:hi]) if contiguous else sum(sizes[j] for j in bucket)
        dtype = dtypes[lo]
        start = offsets.get(dtype, 0)
        offsets[dtype] = start + total
        buffers = []
        for i in range(n_local):
            parts = list(map(operator.itemgetter(i), rows))
            if is_gpu_array(parts[0]):
                buffers.append(_pack_gpu(parts))
                continue
            arena = arenas.get((dtype, i))
            if arena is None:
                arena = arenas[dtype, i] = _host_arena(arena_elems[dtype], dtype, i)
            buffers.append(_pack_host(parts, arena[start:start + total]))
        # The packed buffers are ours: the backend may reduce in them, and the results
        # are views of them.
        reduced = comm.all_reduce_inplace(buffers, op)
        yield bucket, (shapes[lo:hi] if contiguous else [shapes[j] for j in bucket]), reduced


# --- host: NumPy ------------------------------------------------------------------------

_pool = threading.local()
# C-level getters: the per-tensor bookkeeping of 1,000 tensors is a map, not a loop.
_FIRST = operator.itemgetter(0)
_SIZE = operator.attrgetter("size")
_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def _host_arena(total: int, dtype, replica: int) -> np.ndarray:
    """``total`` elements for one call's buckets of ``dtype`` on local replica ``replica``:
    the previous call's arena when nothing refers to it any more.

    Results are views of the arena, and a view keeps a reference to it, so an arena
    whose only references are this pool's is free to overwrite. Reusing it saves the
    page faults of fresh memory (about 0.4 ms per 4 MB here), on every bucket of every
    step once the first step has run. The pool is per thread: two threads fusing at
    once never share an arena.
    """
    buffers = getattr(_pool, "buffers", None)
    if buffers is None:
        buffers = _pool.buffers = {}
    key = (np.dtype(dtype), replica)
    buf = buffers.get(key)
    # References: the dict entry, `buf`, and getrefcount's argument.
    if buf is None or buf.size < total or sys.getrefcount(buf) > 3:
        buf = np.empty(total, dtype)
        buffers[key] = buf
    return buf[:total]


def _pack_host(tensors, out: np.ndarray) -> np.ndarray:
    """Copy ``tensors``, flattened, one after the other into ``out`` (their total size)."""
    # axis=None flattens every input in C; with out= given, concatenate skips its
    # own result-type and shape pass over the inputs (half the time for 1,000 tensors).
    np.concatenate(tensors, axis=None, out=out)
    return out


def _unpack_views(buffer, shapes) -> list:
    """Views of ``buffer`` (NumPy or CuPy), one per shape; runs of one shape are cut in one reshape (fast for the
    common case of many same-shaped tensors)."""
    parts: list = []
    start = 0
    k = 0
    n = len(shapes)
    while k < n:
        shape = shapes[k]
        run = k + 1
        while run < n and shapes[run] == shape:
            run += 1
        count = run - k
        size = 1
        for d in shape:
            size *= d
        block = buffer[start:start + count * size]
        if count == 1:
            parts.append(block.reshape(shape))
        else:
            parts.extend(block.reshape((count,) + tuple(shape)))
        start += count * size
        k = run
    return parts


# --- GPU: the pack kernels ----------------------------------------------------------------

def _pack_gpu(tensors):
    from gpustrat.kernels.pack import pack  # noqa: PLC0415 - imports Numba
    xp = array_module(tensors[0])
    with device_of(tensors[0]).activate():
        tensors = [t if t.flags.c_contiguous else xp.ascontiguousarray(t) for t in tensors]
        return pack(tensors)

