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

The reduction itself is the communicator's, applied to the fusion buffer: every
element is reduced exactly as the tensor it came from would have been (MEAN divides
by the number of replicas in the communicator, integer MEAN gives floats), so fused
and separate reductions return the same values. GPU tensors are packed and unpacked by
the Numba kernels (one launch per bucket and replica each way); host tensors by NumPy.

The bucket size is ``bucket_bytes`` or the ``GPUSTRAT_FUSION_BUCKET_BYTES``
environment variable (default 64 MiB, as Horovod's fusion threshold).
"""

from __future__ import annotations

import os
import weakref
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


def _check(comm: Communicator, tensors) -> None:
    n = comm.num_local
    for j, row in enumerate(tensors):
        if len(row) != n:
            raise ValueError(f"tensor {j} has {len(row)} replica values but the "
                             f"communicator has {n} local replicas: pass tensors[j][i] "
                             "for every tensor j and local replica i")
        if n == 1:
            continue
        t0 = row[0]
        s0, d0 = t0.shape, t0.dtype
        for i in range(1, n):
            t = row[i]
            if t.shape != s0 or t.dtype != d0:
                raise ValueError(
                    f"tensor {j}: replica 0 has shape {s0} dtype {d0} but replica {i} has "
                    f"shape {t.shape} dtype {t.dtype}; every replica must contribute the "
                    "same shape and dtype")


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
        ``comm.all_reduce([tensors[j][i] for i ...], op)[i]`` returns). Host results
        are views of the bucket's reduced buffer (disjoint, so one can be updated in
        place without touching another); GPU results are separate arrays.
    Raises:
        ValueError: a tensor with the wrong number of replica values, or replicas
            disagreeing on its shape or dtype.
    """
    op = ReduceOp.from_value(op)
    if bucket_bytes is None:
        bucket_bytes = bucket_bytes_from_env()
    if not tensors:
        return []
    try:
        _check(comm, tensors)
        first = [row[0] for row in tensors]
        sizes = [t.size for t in first]
        dtypes = [t.dtype for t in first]
    except AttributeError:  # Python scalars or lists among the values
        tensors = _as_arrays(tensors)
        _check(comm, tensors)
        first = [row[0] for row in tensors]
        sizes = [t.size for t in first]
        dtypes = [t.dtype for t in first]
    plan = plan_buckets(sizes, dtypes, int(bucket_bytes))
    n_local = comm.num_local
    # results[i][j]: tensor j's result on replica i (transposed at the end).
    results: list[list] = [[None] * len(tensors) for _ in range(n_local)]
    staging = _staging(comm)
    for bucket in plan:
        lo, hi = bucket[0], bucket[-1] + 1
        contiguous = hi - lo == len(bucket)
        rows = tensors[lo:hi] if contiguous else [tensors[j] for j in bucket]
        total = sum(sizes[lo:hi]) if contiguous else sum(sizes[j] for j in bucket)
        buffers = []
        for i in range(n_local):
            parts = [row[i] for row in rows]
            if is_gpu_array(parts[0]):
                buffers.append(_pack_gpu(parts))
            else:
                buffers.append(_pack_host(parts, total, staging, i))
        reduced = comm.all_reduce(buffers, op)
        shapes = [row[0].shape for row in rows]
        for i, r in enumerate(reduced):
            parts = _unpack_gpu(r, shapes) if is_gpu_array(r) else _unpack_host(r, shapes)
            if contiguous:
                results[i][lo:hi] = parts
            else:
                for j, part in zip(bucket, parts):
                    results[i][j] = part
    return [list(per_tensor) for per_tensor in zip(*results)]


# --- host: NumPy ------------------------------------------------------------------------

# Host fusion buffers are kept per communicator and reused from call to call: a fresh
# multi-megabyte array costs a page fault per 4 KiB page on first touch (more than the
# copy itself), and the communicator never keeps its input buffers past the call.
_staging_by_comm: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _staging(comm) -> dict:
    try:
        return _staging_by_comm.setdefault(comm, {})
    except TypeError:  # a communicator that cannot be weakly referenced
        return {}


def _pack_host(tensors, total: int, staging: dict, replica: int) -> np.ndarray:
    if len(tensors) == 1:
        return np.ascontiguousarray(tensors[0]).reshape(-1)
    dtype = tensors[0].dtype
    key = (replica, dtype)
    buf = staging.get(key)
    if buf is None or buf.size < total:
        buf = np.empty(total, dtype)
        staging[key] = buf
    out = buf[:total]
    # axis=None flattens every input in C, without a Python reshape per tensor.
    np.concatenate(tensors, axis=None, out=out)
    return out


def _unpack_host(buffer: np.ndarray, shapes) -> list:
    """Views of ``buffer``; runs of one shape are cut in one reshape (fast for the
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


def _unpack_gpu(buffer, shapes) -> list:
    from gpustrat.kernels.pack import unpack  # noqa: PLC0415 - imports Numba
    with device_of(buffer).activate():
        return unpack(buffer, shapes)
