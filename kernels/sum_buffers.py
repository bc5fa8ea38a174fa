"""Element-wise sum of K same-shaped buffers on one device, in one launch.

Used when several replicas share one GPU: their buffers are summed on the device
before (or instead of) a collective between devices.

Algorithm: a window (see ``kernels/_launch.py``) spans the K buffers, and a table
holds each buffer's element offset in it. Each thread takes elements ``j`` in a
grid-stride loop, four per pass (each buffer's four loads issued together), and adds ``buffer[0][j] + buffer[1][j] + ... + buffer[K-1][j]`` in
that order, in the buffers' dtype, so the result is bit-for-bit the one of summing the
buffers one after the other on the host (what the host communicator does). Integer
sums wrap around as NumPy's do.
"""

from __future__ import annotations

import numpy as np

from . import _launch

# numba.cuda, bound on first launch (see split.py for why it is a module global).
cuda = None


def _sum_kernel(win, offsets, out):
    """out[j] = win[offsets[0] + j] + ... + win[offsets[K-1] + j]."""
    n = out.shape[0]
    step = cuda.gridDim.x * cuda.blockDim.x
    j = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    # Four elements per pass, their loads of each buffer issued together: one load in
    # flight per thread leaves a GPU's memory idle.
    while j + 3 * step < n:
        o = offsets[0]
        a0 = win[o + j]
        a1 = win[o + j + step]
        a2 = win[o + j + 2 * step]
        a3 = win[o + j + 3 * step]
        for k in range(1, offsets.shape[0]):
            o = offsets[k]
            b0 = win[o + j]
            b1 = win[o + j + step]
            b2 = win[o + j + 2 * step]
            b3 = win[o + j + 3 * step]
            a0 = a0 + b0
            a1 = a1 + b1
            a2 = a2 + b2
            a3 = a3 + b3
        out[j] = a0
        out[j + step] = a1
        out[j + 2 * step] = a2
        out[j + 3 * step] = a3
        j += 4 * step
    while j < n:
        acc = win[offsets[0] + j]
        for k in range(1, offsets.shape[0]):
            acc = acc + win[offsets[k] + j]
        out[j] = acc
        j += step


def launch_config(count: int, threads: int | None = None):
    """``(grid, block)`` of a sum of ``count`` elements: four elements per thread (the
    kernel's pass), up to ``_launch.MAX_USEFUL_GRID_X`` blocks (then a grid-stride
    loop)."""
    return _launch.launch_config_1d(-(-int(count) // 4), threads or _launch.env_threads())


DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint32", "uint64")
_kernels = _launch.LazyKernels(globals())



def ptx_signatures():
    """``(python_function, signature)`` for every specialisation, for PTX tests."""
    from numba import types  # noqa: PLC0415
    _kernels.bind()
    offsets = types.Array(types.int64, 1, "C")
    return [(_sum_kernel, (types.Array(getattr(types, d), 1, "C"), offsets,
                           types.Array(getattr(types, d), 1, "C")))
            for d in DTYPES]


def _check(buffers):
    if len(buffers) == 0:
        raise ValueError("sum_buffers needs at least one buffer")
    shape, dtype = tuple(buffers[0].shape), np.dtype(buffers[0].dtype)
    for k, b in enumerate(buffers):
        if tuple(b.shape) != shape or np.dtype(b.dtype) != dtype:
            raise ValueError(f"buffer {k} has shape {tuple(b.shape)} dtype "
                             f"{np.dtype(b.dtype)} but buffer 0 has shape {shape} dtype "
                             f"{dtype}: sum_buffers adds same-shaped buffers")
    return shape, dtype


def sum_buffers(buffers, out=None, stream=None, threads=None):
    """``buffers[0] + ... + buffers[K-1]`` into a new (or the given) buffer.

    Args:
        buffers: K C-contiguous device arrays of one shape and dtype, on one device.
        out: the result array (same shape and dtype, same device; may be one of
            ``buffers``: each element is read before it is written); new if None.
            A strided (non-contiguous) CuPy or NumPy ``out`` gets the sum through a
            contiguous temporary, copied into it on the launch stream.
        stream: CuPy or Numba stream (None: current CuPy stream / Numba default).
        threads: threads per block.
    Returns:
        The sum, on the buffers' device.
    """
    for k, b in enumerate(buffers):
        _launch.check_kernel_input(b, f"buffer {k}")
    shape, dtype = _check(buffers)
    count = int(np.prod(shape, dtype=np.int64))
    with _launch.device_context(*buffers, *(() if out is None else (out,))):
        if out is None:
            out = _launch.empty(buffers[0], shape, dtype, stream)
        else:
            _launch.check_kernel_input(out, "out")
            _check([buffers[0], out])
        # The kernel writes a flat view; reshape() of a strided array would be a copy,
        # and the sum would land in that copy and be lost.
        target = out
        if count and not _launch.is_c_contiguous(out):
            if not (isinstance(out, np.ndarray) or _launch._cupy_of(out) is not None):
                raise ValueError(f"out (shape {tuple(out.shape)}) is not C-contiguous: "
                                 "pass a contiguous out, or a CuPy array")
            target = _launch.empty(out, shape, dtype, stream)
        if count:
            win, offsets = _launch.window(buffers, dtype)
            nstream = _launch.launch_stream(stream, like=buffers[0])
            table = _launch.to_kernel_array(offsets, buffers[0], nstream)
            grid, block = launch_config(count, threads)
            flat = _launch.kernel_arg(target.reshape(count), nstream)
            _kernels["_sum_kernel"][grid, block, nstream](win, table, flat)
            if target is not out:
                _copy_into(out, target, nstream)
    return out


def _copy_into(out, result, nstream) -> None:
    """``out[...] = result`` on the launch's stream (so after the kernel)."""
    if isinstance(out, np.ndarray):
        np.copyto(out, result)
        return
    cp = _launch._cupy_of(out)
    with _launch.cupy_stream(cp, nstream):
        out[...] = result


def sum_buffers_reference(buffers, out=None, stream=None, threads=None):
    """NumPy reference of :func:`sum_buffers` (same order of additions)."""
    buffers = [np.asarray(b) for b in buffers]
    shape, dtype = _check(buffers)
    acc = buffers[0].copy()
    for b in buffers[1:]:
        np.add(acc, b, out=acc)
    if out is None:
        return acc
    np.copyto(out, acc)
    return out
