"""Pack many small tensors into one contiguous fusion buffer, and unpack it, in one
launch each.

Words:
- *fusion buffer*: a 1-D array holding tensors ``0 .. K-1`` back to back (tensor ``k``
  at element ``starts[k]``, ``sizes[k]`` elements), so that one collective replaces K.
- *scale*: an optional factor applied on the way (``x * scale``), to average while
  packing (pre-scale by ``1 / num_replicas``) or while unpacking (post-scale).
  Floating dtypes only; the product is rounded once, in the tensors' dtype.

Algorithm: the K tensors are separate allocations on one device. The launcher builds a
*window* (see ``kernels/_launch.py``), one 1-D array spanning all of them, plus a
``(3, K)`` int64 table of each tensor's offset in the window, its size and its start in
the buffer. The grid is 1-D over the buffer: block ``b`` moves the *chunk* of elements
``b * chunk .. (b + 1) * chunk - 1`` (``chunk = threads * UNROLL * PASSES``), so every
block has work whatever the mix of sizes (a 2-D grid of tensors x elements, sized by
the largest tensor, would launch K times the blocks of the largest tensor, most of
them idle: ResNet-50's 161 gradients, 256 threads a block, 1,483,776 blocks of which
99,851 have work). Thread ``t`` of a block takes elements ``t``, ``t + threads``, ... of
its chunk (consecutive threads, consecutive elements: coalesced). It finds the tensor
holding its first element by a binary search over the starts (the last tensor ``k``
with ``starts[k] <= g``; empty tensors are skipped by that rule), once per launch,
then walks forward: its elements increase, so the next element's tensor is the same
one or a later one, found by comparing with where the next tensor starts. Each pass
issues the loads of ``UNROLL`` elements before their stores: one load in flight per
thread leaves the memory system idle (a copy needs tens of kilobytes in flight per
multiprocessor). Unpack is the same walk with source and destination exchanged.
"""

from __future__ import annotations

import math
import operator

import numpy as np

from . import _launch

# numba.cuda, bound on first launch (see split.py for why it is a module global).
cuda = None


# --- kernels ---------------------------------------------------------------------------

#: Elements of the buffer each thread moves per pass, loads first: one load per thread
#: in flight leaves a GPU's memory idle (a copy needs tens of kilobytes in flight per
#: multiprocessor), four keep it busy.
UNROLL = 4
#: Passes of one block over its chunk of the buffer.
PASSES = 8


def _tensor_at(table, g, lo):
    """The tensor ``k >= lo`` holding buffer element ``g``: the last ``k`` with
    ``starts[k] <= g`` (a device function)."""
    hi = table.shape[1] - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if table[2, mid] <= g:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _next_start(table, k, total):
    """Where the tensor after ``k`` starts in the buffer (``total`` after the last)."""
    if k < table.shape[1] - 1:
        return table[2, k + 1]
    return total


def _walk(table, g, k, nxt, shift, total):
    """Tensor ``k`` (its successor starting at ``nxt``; ``shift`` = its window offset
    minus its buffer start) walked forward to the tensor holding element ``g``."""
    while g >= nxt:
        k += 1
        nxt = _next_start(table, k, total)
        shift = table[0, k] - table[2, k]
    return k, nxt, shift


def _walk4(table, g, step, k, nxt, shift, total):
    """:func:`_walk` over elements ``g``, ``g + step``, ``g + 2 step``, ``g + 3 step``;
    returns the walk's state and the four elements' window offsets."""
    k, nxt, shift = _walk(table, g, k, nxt, shift, total)
    a0 = shift + g
    k, nxt, shift = _walk(table, g + step, k, nxt, shift, total)
    a1 = shift + g + step
    k, nxt, shift = _walk(table, g + 2 * step, k, nxt, shift, total)
    a2 = shift + g + 2 * step
    k, nxt, shift = _walk(table, g + 3 * step, k, nxt, shift, total)
    a3 = shift + g + 3 * step
    return k, nxt, shift, a0, a1, a2, a3


def _chunk_start(table, chunk, block, thread):
    """Thread ``thread`` of block ``block``: its first element, its block's end, the
    buffer's size, and the tensor holding that element (``k``, ``nxt``, ``shift`` as
    :func:`_walk` takes them)."""
    last = table.shape[1] - 1
    total = table[2, last] + table[1, last]
    start = block * chunk
    end = min(start + chunk, total)
    g = start + thread
    k = _tensor_at(table, min(g, total - 1), 0)
    return g, end, total, k, _next_start(table, k, total), table[0, k] - table[2, k]


def _pack_copy(win, table, out, chunk):
    """out[g] = win[offsets[k] + g - starts[k]] for every element g of the buffer."""
    g, end, total, k, nxt, shift = _chunk_start(table, chunk, cuda.blockIdx.x,
                                                  cuda.threadIdx.x)
    step = cuda.blockDim.x
    while g + (UNROLL - 1) * step < end:
        k, nxt, shift, a0, a1, a2, a3 = _walk4(table, g, step, k, nxt, shift, total)
        v0 = win[a0]
        v1 = win[a1]
        v2 = win[a2]
        v3 = win[a3]
        out[g] = v0
        out[g + step] = v1
        out[g + 2 * step] = v2
        out[g + 3 * step] = v3
        g += UNROLL * step
    while g < end:
        k, nxt, shift = _walk(table, g, k, nxt, shift, total)
        out[g] = win[shift + g]
        g += step


def _pack_scaled(win, table, out, chunk, scale):
    """out[g] = win[offsets[k] + g - starts[k]] * scale."""
    g, end, total, k, nxt, shift = _chunk_start(table, chunk, cuda.blockIdx.x,
                                                  cuda.threadIdx.x)
    step = cuda.blockDim.x
    while g + (UNROLL - 1) * step < end:
        k, nxt, shift, a0, a1, a2, a3 = _walk4(table, g, step, k, nxt, shift, total)
        v0 = win[a0]
        v1 = win[a1]
        v2 = win[a2]
        v3 = win[a3]
        out[g] = v0 * scale
        out[g + step] = v1 * scale
        out[g + 2 * step] = v2 * scale
        out[g + 3 * step] = v3 * scale
        g += UNROLL * step
    while g < end:
        k, nxt, shift = _walk(table, g, k, nxt, shift, total)
        out[g] = win[shift + g] * scale
        g += step


def _unpack_copy(buf, table, win, chunk):
    """win[offsets[k] + g - starts[k]] = buf[g] for every element g of the buffer."""
    g, end, total, k, nxt, shift = _chunk_start(table, chunk, cuda.blockIdx.x,
                                                  cuda.threadIdx.x)
    step = cuda.blockDim.x
    while g + (UNROLL - 1) * step < end:
        v0 = buf[g]
        v1 = buf[g + step]
        v2 = buf[g + 2 * step]
        v3 = buf[g + 3 * step]
        k, nxt, shift, a0, a1, a2, a3 = _walk4(table, g, step, k, nxt, shift, total)
        win[a0] = v0
        win[a1] = v1
        win[a2] = v2
        win[a3] = v3
        g += UNROLL * step
    while g < end:
        k, nxt, shift = _walk(table, g, k, nxt, shift, total)
        win[shift + g] = buf[g]
        g += step


def _unpack_scaled(buf, table, win, chunk, scale):
    """win[offsets[k] + g - starts[k]] = buf[g] * scale."""
    g, end, total, k, nxt, shift = _chunk_start(table, chunk, cuda.blockIdx.x,
                                                  cuda.threadIdx.x)
    step = cuda.blockDim.x
    while g + (UNROLL - 1) * step < end:
        v0 = buf[g]
        v1 = buf[g + step]
        v2 = buf[g + 2 * step]
        v3 = buf[g + 3 * step]
        k, nxt, shift, a0, a1, a2, a3 = _walk4(table, g, step, k, nxt, shift, total)
        win[a0] = v0 * scale
        win[a1] = v1 * scale
        win[a2] = v2 * scale
        win[a3] = v3 * scale
        g += UNROLL * step
    while g < end:
        k, nxt, shift = _walk(table, g, k, nxt, shift, total)
        win[shift + g] = buf[g] * scale
        g += step


#: dtypes the kernels are compiled for (scaled variants: the floating ones).
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "uint32",
          "int64", "uint64")
SCALED_DTYPES = ("float16", "float32", "float64")
_kernels = _launch.LazyKernels(
    globals(), device_functions=("_tensor_at", "_next_start", "_walk", "_walk4",
                                 "_chunk_start"))


def launch_config(total: int, threads: int | None = None):
    """``(grid, block, chunk)`` of a pack or unpack of ``total`` elements: block ``b``
    moves buffer elements ``b * chunk .. (b + 1) * chunk - 1``, ``PASSES`` passes of
    ``UNROLL`` elements per thread, so ``grid = ceil(total / chunk)`` (at least 1)."""
    block = threads or _launch.env_threads()
    if block < 1 or block > 1024:
        raise ValueError(f"threads per block must be in 1..1024, got {block}")
    chunk = block * UNROLL * PASSES
    return max(-(-int(total) // chunk), 1), block, chunk


def ptx_signatures():
    """``(python_function, signature)`` for every specialisation, for PTX tests."""
    from numba import types  # noqa: PLC0415
    _kernels.bind()
    table = types.Array(types.int64, 2, "C")
    out = []
    for name in DTYPES:
        t = getattr(types, name)
        arr = types.Array(t, 1, "C")
        out.append((_pack_copy, (arr, table, arr, types.int64)))
        out.append((_unpack_copy, (arr, table, arr, types.int64)))
        if name in SCALED_DTYPES:
            out.append((_pack_scaled, (arr, table, arr, types.int64, t)))
            out.append((_unpack_scaled, (arr, table, arr, types.int64, t)))
    return out


# --- layout ----------------------------------------------------------------------------

def layout(shapes):
    """``(sizes, starts, total)`` of tensors of ``shapes`` packed back to back."""
    return _layout_sizes(np.array([math.prod(s) for s in shapes], dtype=np.int64))


def _layout_sizes(sizes):
    """``(sizes, starts, total)`` of tensors of ``sizes`` elements packed back to back."""
    starts = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1], out=starts[1:])
    return sizes, starts, int(sizes.sum())


def _scale_value(scale, dtype: np.dtype):
    if scale is None:
        return None
    if dtype.kind != "f":
        raise TypeError(f"a scale factor needs a floating dtype, got {dtype}: scale "
                        "after converting, or reduce integer tensors without scaling")
    return dtype.type(scale)


def _check_tensors(tensors):
    if len(tensors) == 0:
        raise ValueError("nothing to pack: pass at least one tensor")
    dtype = np.dtype(tensors[0].dtype)
    for k, t in enumerate(tensors):
        if t.dtype != dtype:
            raise TypeError(f"tensor {k} has dtype {np.dtype(t.dtype)} but tensor 0 has "
                            f"{dtype}: a fusion buffer holds one dtype (bucket by dtype)")
    return dtype


def _check_buffer(buffer, total: int, what: str):
    if buffer.ndim != 1 or int(buffer.shape[0]) < total:
        raise ValueError(f"{what} must be 1-D with at least {total} elements, got shape "
                         f"{tuple(buffer.shape)}")


# --- launchers -------------------------------------------------------------------------

def pack(tensors, out=None, scale=None, stream=None, threads=None):
    """Copy ``tensors`` (one dtype, one device) back to back into one 1-D buffer.

    Args:
        tensors: device arrays (CuPy, Numba; NumPy under the simulator), C-contiguous.
        out: a 1-D buffer of at least the total size to write into; a new one if None.
        scale: optional factor applied to every element (floating dtypes only).
        stream: CuPy or Numba stream (None: current CuPy stream / Numba default).
        threads: threads per block.
    Returns:
        The fusion buffer (``out`` when given).
    """
    if len(tensors) == 0:
        raise ValueError("nothing to pack: pass at least one tensor")
    dtype = np.dtype(_launch.check_kernel_input(tensors[0], "tensor 0").dtype)
    described = _launch.describe(tensors, dtype)
    sizes, starts, total = _layout_sizes(described.sizes)
    s = _scale_value(scale, dtype)
    with _launch.device_context(*(() if out is None else (out,)),
                                devices=described.devices):
        if out is None:
            out = _launch.empty(tensors[0], (total,), dtype, stream)
        else:
            _launch.check_kernel_input(out, "out")
            _check_buffer(out, total, "out")
        if total:
            win, offsets = _launch.window(tensors, dtype, described)
            nstream = _launch.launch_stream(stream, like=tensors[0])
            table = _launch.to_kernel_array(np.stack([offsets, sizes, starts]),
                                            tensors[0], nstream)
            grid, block, chunk = launch_config(total, threads)
            dst = _launch.kernel_arg(out, nstream)
            if s is None:
                _kernels["_pack_copy"][grid, block, nstream](win, table, dst, chunk)
            else:
                _kernels["_pack_scaled"][grid, block, nstream](win, table, dst, chunk, s)
    return out


def unpack(buffer, shapes, out=None, scale=None, stream=None, threads=None):
    """Copy a fusion buffer back into tensors of ``shapes`` (the inverse of :func:`pack`).

    Args:
        buffer: the 1-D fusion buffer on a device.
        shapes: the tensors' shapes, in packing order.
        out: tensors to write into (C-contiguous, ``buffer``'s dtype and device); new
            ones if None.
        scale: optional factor applied on the way (floating dtypes only).
    Returns:
        The list of tensors.
    """
    _launch.check_kernel_input(buffer, "buffer")
    dtype = np.dtype(buffer.dtype)
    described = None
    if out is None:
        shapes = [tuple(map(operator.index, s)) for s in shapes]
        sizes, starts, total = layout(shapes)
    else:
        out = list(out)
        got = [o.shape for o in out]
        if got != shapes:  # shapes equal to the tensors' as given need no converting
            shapes = [tuple(map(operator.index, s)) for s in shapes]
            if [tuple(g) for g in got] != shapes:
                raise ValueError(f"out has shapes {[tuple(g) for g in got]}, "
                                 f"expected {shapes}")
        described = _launch.describe(out, dtype, what="out")
        sizes, starts, total = _layout_sizes(described.sizes)
    _check_buffer(buffer, total, "buffer")
    s = _scale_value(scale, dtype)
    with _launch.device_context(buffer, devices=() if described is None
                                else described.devices):
        if out is None:
            out = [_launch.empty(buffer, shape, dtype, stream) for shape in shapes]
        if total:
            win, offsets = _launch.window(out, dtype, described)
            nstream = _launch.launch_stream(stream, like=buffer)
            table = _launch.to_kernel_array(np.stack([offsets, sizes, starts]),
                                            buffer, nstream)
            grid, block, chunk = launch_config(total, threads)
            src = _launch.kernel_arg(buffer, nstream)
            if s is None:
                _kernels["_unpack_copy"][grid, block, nstream](src, table, win, chunk)
            else:
                _kernels["_unpack_scaled"][grid, block, nstream](src, table, win, chunk, s)
    return out


def pack_reference(tensors, out=None, scale=None, stream=None, threads=None):
    """NumPy reference of :func:`pack`."""
    tensors = [np.asarray(t) for t in tensors]
    dtype = _check_tensors(tensors)
    sizes, starts, total = _layout_sizes(
        np.fromiter((t.size for t in tensors), np.int64, len(tensors)))
    s = _scale_value(scale, dtype)
    if out is None:
        out = np.empty(total, dtype)
    else:
        _check_buffer(out, total, "out")
    np.concatenate([t.reshape(-1) for t in tensors], out=out[:total])
    if s is not None:
        np.multiply(out[:total], s, out=out[:total])
    return out


def unpack_reference(buffer, shapes, out=None, scale=None, stream=None, threads=None):
    """NumPy reference of :func:`unpack`."""
    buffer = np.asarray(buffer)
    dtype = buffer.dtype
    shapes = [tuple(int(d) for d in s) for s in shapes]
    sizes, starts, total = layout(shapes)
    _check_buffer(buffer, total, "buffer")
    s = _scale_value(scale, dtype)
    if out is None:
        out = [np.empty(shape, dtype) for shape in shapes]
    for o, shape, start, size in zip(out, shapes, starts, sizes):
        src = buffer[start:start + size].reshape(shape)
        if s is None:
            np.copyto(o, src)
        else:
            np.multiply(src, s, out=o)
    return list(out)
