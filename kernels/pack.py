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
from typing import NamedTuple

import numpy as np

from gpustrat import devices as _devices

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


def signature(name: str, dtype) -> tuple:
    """The arguments of kernel ``name`` for tensors of ``dtype`` (:class:`_launch.Arg`)."""
    t, table = np.dtype(dtype), _launch.Arg(np.dtype(np.int64), 2)
    arr, chunk = _launch.Arg(t, 1), _launch.Arg(np.dtype(np.int64))
    return (arr, table, arr, chunk) + ((_launch.Arg(t),) if "scaled" in name else ())


def specialisations() -> list:
    """Every kernel specialisation the launchers use (:class:`_launch.Kernel`)."""
    return [_kernels.specialise(name, *signature(name, dtype)) for dtype in DTYPES
            for name in ("_pack_copy", "_unpack_copy")
            + (("_pack_scaled", "_unpack_scaled") if dtype in SCALED_DTYPES else ())]


def ptx_signatures():
    """``(python_function, signature)`` for every specialisation, for PTX tests."""
    _kernels.bind()
    return [(_kernels.python_function(k.name), k.numba_signature())
            for k in specialisations()]


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

#: Plans of recent layouts (see ``kernels/_launch.py``): a training step packs the
#: same tensors, at the same addresses, every step.
_pack_plans = _launch.Plans()
_unpack_plans = _launch.Plans()
_PTR, _SIZE = operator.attrgetter("data.ptr"), operator.attrgetter("size")
_DTYPE = operator.attrgetter("dtype")


class _Plan(NamedTuple):
    """A pack or unpack of one layout on one device and stream, ready to launch."""

    device: int
    dtype: np.dtype
    total: int
    function: object        # CuPy's RawKernel (None: nothing to move)
    grid: tuple
    block: tuple
    args: tuple             # CuPy's argument objects; the buffer's address at ``slot``
    slot: int
    table: object           # the device table the arguments point to (kept alive)


def _same_kind(cp, arrays) -> bool:
    """The arrays are contiguous and of one dtype (what a plan's key does not say)."""
    return _launch.all_c_contiguous(arrays) and len(set(map(_DTYPE, arrays))) == 1


def _plan(cp, name, described, dtype, device, buffer, scale, threads) -> _Plan:
    """The plan of a pack (``name`` ``_pack_*``) or unpack of the tensors ``described``
    into or out of a buffer (``buffer``: ``(ptr, shape)`` of a pack's given ``out``;
    None: the buffer's address is given at each launch, :func:`_launch_plan`), made
    on the launch stream and device."""
    sizes, starts, total = _layout_sizes(described.sizes)
    grid, block, chunk = launch_config(total, threads)
    if not total:
        return _Plan(device, dtype, 0, None, (), (), (), 0, None)
    base, n, offsets = _launch.window_extent(described, dtype)
    table = _launch.upload(cp, np.stack([offsets, sizes, starts]), device,
                           _launch.stream_handle(cp.cuda.get_current_stream()))
    kernel = _kernels.specialise(name, *signature(name, dtype))
    buf = buffer if buffer is not None else (0, (total,))
    win, tab = (base, (n,)), (int(table.data.ptr), table.shape)
    values = [win, tab, buf] if name.startswith("_pack") else [buf, tab, win]
    values.append(chunk)
    if scale is not None:
        values.append(scale)
    args = _launch.cupy_args(cp, _launch.flatten(kernel.signature, values))
    slot = _launch.data_slot(kernel.signature, 2 if name.startswith("_pack") else 0)
    return _Plan(device, dtype, total, kernel.function(cp, device), (grid, 1, 1),
                 (block, 1, 1), args, slot, table)


def _launch_plan(cp, plan: _Plan, buffer) -> None:
    args = plan.args
    if buffer is not None:
        args = args[:plan.slot] + (_launch.word(cp, buffer.data.ptr),) + args[plan.slot + 1:]
    plan.function(plan.grid, plan.block, args)


def pack(tensors, out=None, scale=None, stream=None, threads=None):
    """Copy ``tensors`` (one dtype, one device) back to back into one 1-D buffer.

    Args:
        tensors: device arrays (CuPy, or any ``__cuda_array_interface__`` exporter;
            NumPy under the simulator), C-contiguous.
        out: a 1-D buffer of at least the total size to write into; a new one if None.
        scale: optional factor applied to every element (floating dtypes only).
        stream: CuPy or Numba stream or raw handle (None: the current CuPy stream).
        threads: threads per block.
    Returns:
        The fusion buffer (``out`` when given).

    A layout launched before (the same addresses, sizes, dtype, ``out``, ``scale``,
    device and stream) reuses its plan: one pass over the tensors' addresses and sizes,
    and one launch.
    """
    if len(tensors) == 0:
        raise ValueError("nothing to pack: pass at least one tensor")
    if _launch.simulating():
        return _pack_simulated(tensors, out, scale, threads)
    if len(set(map(type, tensors))) != 1 or not _launch._is_cupy(tensors[0]):
        _launch.check_kernel_input(tensors[0], "tensor 0")
        tensors = [_launch.as_cupy(_launch.check_kernel_input(t, f"tensor {k}"))
                   for k, t in enumerate(tensors)]
    first = tensors[0]
    cp = _devices.cupy()
    device = first.data.device_id
    if out is not None:
        out = _launch.as_cupy(_launch.check_kernel_input(out, "out"))
    out_key = None if out is None else (out.data.ptr, out.shape, out.strides, out.dtype)
    key = (device, _launch.launch_handle(cp, stream, device), tuple(map(_PTR, tensors)),
           tuple(map(_SIZE, tensors)), _launch.dtype_key(first.dtype), scale, threads,
           out_key)
    plan = _pack_plans.get(key)
    if plan is not None and not _same_kind(cp, tensors):
        plan = None
    with _launch.on_device(cp, device), _launch.launch_stream(cp, stream):
        if plan is None:
            plan = _pack_plans.put(key, _pack_plan(cp, tensors, out, scale, threads, device))
        if out is None:
            out = cp.empty(plan.total, plan.dtype)
        if plan.function is not None:
            _launch_plan(cp, plan, out if out_key is None else None)
    return out


def _pack_plan(cp, tensors, out, scale, threads, device) -> _Plan:
    """Check a new layout (every tensor and ``out``) and plan its pack."""
    dtype = np.dtype(tensors[0].dtype)
    described = _launch.describe(tensors, dtype)
    if described.devices != {device}:
        raise ValueError(f"one launch reads and writes one device, but the tensors are on "
                         f"{sorted(f'gpu:{i}' for i in described.devices)}: copy them to "
                         "one device first")
    s = _scale_value(scale, dtype)
    total = int(described.sizes.sum())
    buffer = None
    if out is not None:
        _check_out(out, total, dtype, device, "out")
        buffer = (int(out.data.ptr), (int(out.shape[0]),))
    return _plan(cp, "_pack_copy" if s is None else "_pack_scaled", described, dtype,
                 device, buffer, s, threads)


def _check_out(buffer, total: int, dtype: np.dtype, device: int, what: str) -> None:
    _launch.check_kernel_input(buffer, what)
    _check_buffer(buffer, total, what)
    if not _launch._is_cupy(buffer) or buffer.data.device_id != device:
        raise ValueError(f"{what} must be a CuPy array on gpu:{device}, the tensors' device")
    if buffer.dtype != dtype or not buffer.flags.c_contiguous:
        raise TypeError(f"{what} must be a contiguous {dtype} array, got "
                        f"{np.dtype(buffer.dtype)} with strides {buffer.strides}")


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
    if _launch.simulating():
        return _unpack_simulated(buffer, shapes, out, scale, threads)
    buffer = _launch.as_cupy(buffer)
    cp = _devices.cupy()
    dtype, device = np.dtype(buffer.dtype), buffer.data.device_id
    if out is None:
        shapes = [tuple(map(operator.index, s)) for s in shapes]
        with _launch.on_device(cp, device), _launch.launch_stream(cp, stream):
            out = [cp.empty(shape, dtype) for shape in shapes]
    else:
        if len(set(map(type, out))) != 1 or not _launch._is_cupy(out[0]):
            out = [_launch.as_cupy(o) for o in out]
        got = [o.shape for o in out]
        if got != shapes:  # shapes equal to the tensors' as given need no converting
            shapes = [tuple(map(operator.index, s)) for s in shapes]
            if [tuple(g) for g in got] != shapes:
                raise ValueError(f"out has shapes {[tuple(g) for g in got]}, "
                                 f"expected {shapes}")
    if buffer.ndim != 1 or not buffer.flags.c_contiguous:
        raise ValueError(f"buffer must be a contiguous 1-D array, got shape "
                         f"{tuple(buffer.shape)} strides {buffer.strides}")
    key = (device, _launch.launch_handle(cp, stream, device), int(buffer.shape[0]),
           _launch.dtype_key(dtype), tuple(map(_PTR, out)),
           tuple(map(_SIZE, out)), scale, threads)
    plan = _unpack_plans.get(key)
    if plan is not None and not _same_kind(cp, out):
        plan = None
    with _launch.on_device(cp, device), _launch.launch_stream(cp, stream):
        if plan is None:
            plan = _unpack_plans.put(key, _unpack_plan(cp, buffer, out, scale, threads,
                                                       device))
        if plan.function is not None:
            _launch_plan(cp, plan, buffer)
    return out


def _unpack_plan(cp, buffer, out, scale, threads, device) -> _Plan:
    dtype = np.dtype(buffer.dtype)
    described = _launch.describe(out, dtype, what="out")
    if described.devices - {device}:
        raise ValueError(f"one launch reads and writes one device, but buffer is on "
                         f"gpu:{device} and out on "
                         f"{sorted(f'gpu:{i}' for i in described.devices)}")
    _check_buffer(buffer, int(described.sizes.sum()), "buffer")
    s = _scale_value(scale, dtype)
    # The buffer's address is given at each launch: a step's fusion buffer is new.
    return _plan(cp, "_unpack_copy" if s is None else "_unpack_scaled", described, dtype,
                 device, None, s, threads)


# --- the simulator: Numba's dispatcher on NumPy arrays -----------------------------------

def _pack_simulated(tensors, out, scale, threads):
    dtype = np.dtype(_launch.check_kernel_input(tensors[0], "tensor 0").dtype)
    described = _launch.describe(tensors, dtype)
    sizes, starts, total = _layout_sizes(described.sizes)
    s = _scale_value(scale, dtype)
    if out is None:
        out = np.empty(total, dtype)
    else:
        _launch.check_kernel_input(out, "out")
        _check_buffer(out, total, "out")
    if total:
        base, n, offsets = _launch.window_extent(described, dtype)
        win, table = _launch.host_window(base, n, dtype), np.stack([offsets, sizes, starts])
        grid, block, chunk = launch_config(total, threads)
        if s is None:
            _kernels["_pack_copy"][grid, block](win, table, out, chunk)
        else:
            _kernels["_pack_scaled"][grid, block](win, table, out, chunk, s)
    return out


def _unpack_simulated(buffer, shapes, out, scale, threads):
    dtype = np.dtype(buffer.dtype)
    if out is None:
        shapes = [tuple(map(operator.index, s)) for s in shapes]
        out = [np.empty(shape, dtype) for shape in shapes]
    else:
        out = list(out)
        got = [tuple(o.shape) for o in out]
        shapes = [tuple(map(operator.index, s)) for s in shapes]
        if got != shapes:
            raise ValueError(f"out has shapes {got}, expected {shapes}")
    described = _launch.describe(out, dtype, what="out")
    sizes, starts, total = _layout_sizes(described.sizes)
    _check_buffer(buffer, total, "buffer")
    s = _scale_value(scale, dtype)
    if total:
        base, n, offsets = _launch.window_extent(described, dtype)
        win, table = _launch.host_window(base, n, dtype), np.stack([offsets, sizes, starts])
        grid, block, chunk = launch_config(total, threads)
        if s is None:
            _kernels["_unpack_copy"][grid, block](buffer, table, win, chunk)
        else:
            _kernels["_unpack_scaled"][grid, block](buffer, table, win, chunk, s)
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
