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
the buffer. The grid is 1-D over the buffer's elements: thread ``g`` (in a grid-stride
loop) finds the tensor holding buffer element ``g`` by a binary search over the starts
(the last tensor ``k`` with ``starts[k] <= g``; empty tensors are skipped by that rule)
and copies one element. Consecutive threads copy consecutive elements of one tensor
(coalesced), and every block has work whatever the mix of sizes: a 2-D grid of
tensors x elements, sized by the largest tensor, would launch K times the blocks of the
largest tensor, most of them idle (ResNet-50's 161 gradients, 256 threads a block:
1,483,776 blocks of which 99,851 have work; the 1-D grid needs 99,833 and launches
65,536, the cap of ``launch_config``, whose threads take 1.5 elements each). A thread's
elements increase along its loop, so its previous tensor bounds the next search from
below. The search costs about ``log2(K)`` loads from a table that stays in L1, well
within the arithmetic a memory-bound copy leaves idle. Unpack is the same walk with
source and destination exchanged.
"""

from __future__ import annotations

import math

import numpy as np

from . import _launch

# numba.cuda, bound on first launch (see split.py for why it is a module global).
cuda = None


# --- kernels ---------------------------------------------------------------------------

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


def _pack_copy(win, table, out):
    """out[g] = win[offsets[k] + g - starts[k]] for every element g of the buffer."""
    last = table.shape[1] - 1
    total = table[2, last] + table[1, last]
    k = 0
    for g in range(cuda.grid(1), total, cuda.gridsize(1)):
        k = _tensor_at(table, g, k)
        out[g] = win[table[0, k] + g - table[2, k]]


def _pack_scaled(win, table, out, scale):
    """out[g] = win[offsets[k] + g - starts[k]] * scale."""
    last = table.shape[1] - 1
    total = table[2, last] + table[1, last]
    k = 0
    for g in range(cuda.grid(1), total, cuda.gridsize(1)):
        k = _tensor_at(table, g, k)
        out[g] = win[table[0, k] + g - table[2, k]] * scale


def _unpack_copy(buf, table, win):
    """win[offsets[k] + g - starts[k]] = buf[g] for every element g of the buffer."""
    last = table.shape[1] - 1
    total = table[2, last] + table[1, last]
    k = 0
    for g in range(cuda.grid(1), total, cuda.gridsize(1)):
        k = _tensor_at(table, g, k)
        win[table[0, k] + g - table[2, k]] = buf[g]


def _unpack_scaled(buf, table, win, scale):
    """win[offsets[k] + g - starts[k]] = buf[g] * scale."""
    last = table.shape[1] - 1
    total = table[2, last] + table[1, last]
    k = 0
    for g in range(cuda.grid(1), total, cuda.gridsize(1)):
        k = _tensor_at(table, g, k)
        win[table[0, k] + g - table[2, k]] = buf[g] * scale


#: dtypes the kernels are compiled for (scaled variants: the floating ones).
DTYPES = ("float16", "float32", "float64", "int8", "uint8", "int32", "uint32",
          "int64", "uint64")
SCALED_DTYPES = ("float16", "float32", "float64")
_kernels = _launch.LazyKernels(globals(), device_functions=("_tensor_at",))


def launch_config(total: int, threads: int | None = None):
    """``(grid, block)`` of a pack or unpack of ``total`` elements: 1-D, one thread per
    element up to ``_launch.MAX_USEFUL_GRID_X`` blocks (then a grid-stride loop)."""
    return _launch.launch_config_1d(total, threads or _launch.env_threads())


def ptx_signatures():
    """``(python_function, signature)`` for every specialisation, for PTX tests."""
    from numba import types  # noqa: PLC0415
    _kernels.bind()
    table = types.Array(types.int64, 2, "C")
    out = []
    for name in DTYPES:
        t = getattr(types, name)
        arr = types.Array(t, 1, "C")
        out.append((_pack_copy, (arr, table, arr)))
        out.append((_unpack_copy, (arr, table, arr)))
        if name in SCALED_DTYPES:
            out.append((_pack_scaled, (arr, table, arr, t)))
            out.append((_unpack_scaled, (arr, table, arr, t)))
    return out


# --- layout ----------------------------------------------------------------------------

def layout(shapes):
    """``(sizes, starts, total)`` of tensors of ``shapes`` packed back to back."""
    sizes = np.array([math.prod(s) for s in shapes], dtype=np.int64)
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
        if np.dtype(t.dtype) != dtype:
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
    for k, t in enumerate(tensors):
        _launch.check_kernel_input(t, f"tensor {k}")
    dtype = _check_tensors(tensors)
    sizes, starts, total = layout([t.shape for t in tensors])
    s = _scale_value(scale, dtype)
    with _launch.device_context(*tensors, *(() if out is None else (out,))):
        if out is None:
            out = _launch.empty(tensors[0], (total,), dtype, stream)
        else:
            _launch.check_kernel_input(out, "out")
            _check_buffer(out, total, "out")
        if total:
            win, offsets = _launch.window(tensors, dtype)
            nstream = _launch.launch_stream(stream, like=tensors[0])
            table = _launch.to_kernel_array(np.stack([offsets, sizes, starts]),
                                            tensors[0], nstream)
            grid, block = launch_config(total, threads)
            dst = _launch.kernel_arg(out, nstream)
            if s is None:
                _kernels["_pack_copy"][grid, block, nstream](win, table, dst)
            else:
                _kernels["_pack_scaled"][grid, block, nstream](win, table, dst, s)
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
    shapes = [tuple(int(d) for d in s) for s in shapes]
    sizes, starts, total = layout(shapes)
    _check_buffer(buffer, total, "buffer")
    s = _scale_value(scale, dtype)
    with _launch.device_context(buffer, *(out or ())):
        if out is None:
            out = [_launch.empty(buffer, shape, dtype, stream) for shape in shapes]
        else:
            out = list(out)
            if [tuple(o.shape) for o in out] != shapes:
                raise ValueError(f"out has shapes {[tuple(o.shape) for o in out]}, "
                                 f"expected {shapes}")
            for k, o in enumerate(out):
                _launch.check_kernel_input(o, f"out[{k}]")
        if total:
            win, offsets = _launch.window(out, dtype)
            nstream = _launch.launch_stream(stream, like=buffer)
            table = _launch.to_kernel_array(np.stack([offsets, sizes, starts]),
                                            buffer, nstream)
            grid, block = launch_config(total, threads)
            src = _launch.kernel_arg(buffer, nstream)
            if s is None:
                _kernels["_unpack_copy"][grid, block, nstream](src, table, win)
            else:
                _kernels["_unpack_scaled"][grid, block, nstream](src, table, win, s)
    return out


def pack_reference(tensors, out=None, scale=None, stream=None, threads=None):
    """NumPy reference of :func:`pack`."""
    tensors = [np.asarray(t) for t in tensors]
    dtype = _check_tensors(tensors)
    sizes, starts, total = layout([t.shape for t in tensors])
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
