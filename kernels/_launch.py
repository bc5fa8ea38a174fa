"""Launch plumbing shared by the kernels: grid and block shapes, streams, arrays.

Words:
- *launch config*: ``(grid, block)``: 2-D for split (pieces x rows by words), 1-D for
  pack, unpack and sum (elements). Every kernel walks its problem with grid-stride
  loops, so any grid is correct and the grid only decides the speed.
- *window*: one 1-D device array whose extent covers several separate allocations of
  the same dtype on one device, so that a single launch can read or write many tensors
  through a table of element offsets (the way NCCL-style fusion kernels take a pointer
  table; Numba has no kernel argument type for a table of pointers).

Numba is imported inside functions only, so that ``import gpustrat.kernels`` and the
pure helpers of the kernel modules work where Numba is not installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

#: Threads per block unless a launcher is told otherwise; a multiple of the warp
#: size, small enough that every SM holds several blocks.
DEFAULT_THREADS = 256
#: CUDA's limit on ``gridDim.y`` (``gridDim.x`` goes to 2**31 - 1).
MAX_GRID_Y = 65535
MAX_GRID_X = 2**31 - 1
#: Blocks beyond this many along x add nothing for a memory-bound copy: the
#: grid-stride loop covers the rest.
MAX_USEFUL_GRID_X = 1 << 16


class LazyKernels:
    """The ``@cuda.jit`` kernels of one kernel module, compiled on first launch.

    Kernel bodies refer to the module-global name ``cuda``; it is bound to
    ``numba.cuda`` on first use, so that the module imports where Numba is missing.

    Args:
        module_globals: the kernel module's ``globals()``.
        device_functions: names of module-level functions that kernels call; on first
            use each name is rebound to ``cuda.jit(device=True, inline="always")`` of
            it (before any kernel is compiled, since Numba reads globals then).
            Inlined at Numba's IR level, a device function compiles to PTX without a
            GPU; numba-cuda compiles a called one for the current device's compute
            capability, which needs a driver.
    """

    def __init__(self, module_globals: dict, device_functions: tuple = ()):
        self._globals = module_globals
        self._device_functions = tuple(device_functions)
        self._jitted: dict = {}

    def bind(self):
        """``numba.cuda`` (or the test backend's), bound to the module's ``cuda`` name
        for the kernel bodies, with the module's device functions compiled inline."""
        cuda = _cuda()
        if self._globals.get("cuda") is None and not getattr(cuda, "is_fake", False):
            for name in self._device_functions:
                self._globals[name] = cuda.jit(device=True, inline="always")(
                    self._globals[name])
            self._globals["cuda"] = cuda
        return cuda

    def __getitem__(self, name: str):
        cuda = self.bind()
        key = (id(cuda), name)
        kernel = self._jitted.get(key)
        if kernel is None:
            kernel = self._jitted[key] = cuda.jit(self._globals[name])
        return kernel


def _cuda():
    from gpustrat.devices import numba_cuda  # noqa: PLC0415
    return numba_cuda()


def simulating() -> bool:
    """True when Numba runs kernels in its CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from gpustrat.devices import kernels_simulated  # noqa: PLC0415
    return kernels_simulated()


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def launch_config_2d(rows: int, cols: int, threads: int = DEFAULT_THREADS):
    """Grid and block for a rows x cols problem walked with grid-stride loops.

    The block is ``threads`` threads, shaped so that its x extent covers a short row
    (``min(threads, next_pow2(cols))``, at least one warp when rows are long) and the
    rest of the block takes further rows: a batch of scalar labels (one column) still
    fills every thread, and a long row is read by consecutive threads (coalesced).

    Returns:
        ``((grid_x, grid_y), (block_x, block_y))``.
    """
    if threads < 1 or threads > 1024:
        raise ValueError(f"threads per block must be in 1..1024, got {threads}")
    rows, cols = max(int(rows), 1), max(int(cols), 1)
    bx = min(threads, next_pow2(cols))
    by = max(threads // bx, 1)
    gx = min(-(-cols // bx), MAX_USEFUL_GRID_X)
    gy = min(-(-rows // by), MAX_GRID_Y)
    return (gx, gy), (bx, by)


def launch_config_1d(n: int, threads: int = DEFAULT_THREADS):
    """Grid and block for ``n`` independent elements walked with a grid-stride loop."""
    if threads < 1 or threads > 1024:
        raise ValueError(f"threads per block must be in 1..1024, got {threads}")
    return min(-(-max(int(n), 1) // threads), MAX_USEFUL_GRID_X), threads


def numba_stream(stream=None, like=None):
    """The Numba stream to launch on.

    Args:
        stream: None (the current CuPy stream when ``like`` is a CuPy array, else
            Numba's default stream), a Numba stream, a CuPy stream (anything with a
            ``.ptr``), or a raw ``cudaStream_t`` integer.
        like: an array of the launch, to find the current CuPy stream.
    """
    cuda = _cuda()
    if simulating():
        # The simulator runs launches synchronously and has no external streams.
        return stream if _is_numba_stream(stream) else cuda.default_stream()
    if stream is None:
        xp = _cupy_of(like)
        if xp is None:
            return cuda.default_stream()
        stream = xp.cuda.get_current_stream()
    if _is_numba_stream(stream):
        return stream
    ptr = int(stream.ptr) if hasattr(stream, "ptr") else int(stream)
    # CuPy's null stream (ptr 0) is the legacy default stream, which is Numba's default
    # stream only while NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM is off: name it exactly.
    if ptr == 0:
        return cuda.legacy_default_stream()
    if getattr(cuda, "is_fake", False):
        return cuda.external_stream(ptr)
    # A wrapper names the handle only: one per handle serves every launch on it.
    nstream = _external_streams.get(ptr)
    if nstream is None:
        if len(_external_streams) >= 64:
            _external_streams.clear()
        nstream = _external_streams[ptr] = cuda.external_stream(ptr)
    return nstream


_external_streams: dict = {}


def _is_numba_stream(stream) -> bool:
    if stream is None:
        return False
    mod = type(stream).__module__
    return mod.startswith("numba.cuda") or mod.startswith("numba_cuda")


def _cupy_of(x):
    from gpustrat.devices import array_module, is_gpu_array  # noqa: PLC0415
    return array_module(x) if x is not None and is_gpu_array(x) else None


def device_context(*arrays, devices=()):
    """Numba's context, and CuPy's current device, for the device holding ``arrays``
    (all on one device; ``devices``: the device ids of more CuPy arrays, as
    :func:`describe` gives them).

    CuPy and Numba share the primary context, but Numba launches on *its* current
    device, so a launch for ``gpu:3`` must be made inside ``cuda.gpus[3]``; and CuPy's
    current stream, which a launch with ``stream=None`` uses, is ``gpu:3``'s only while
    ``gpu:3`` is CuPy's current device.
    """
    from gpustrat.devices import Device  # noqa: PLC0415
    # The device of a CuPy array is its memory's (an int: cheaper than ``x.device``
    # for the hundreds of tensors of a fusion bucket).
    ids = set(devices)
    ids.update(a.data.device_id for a in arrays if _is_cupy(a))
    if len(ids) > 1:
        raise ValueError(f"one launch reads and writes one device, but the arrays are on "
                         f"{sorted(f'gpu:{i}' for i in ids)}: copy them to one device "
                         "first")
    if not ids or simulating():
        return contextlib.nullcontext()
    cuda = _cuda()
    device = Device("gpu", int(ids.pop()))
    stack = contextlib.ExitStack()
    stack.enter_context(cuda.gpus[device.index])
    # CuPy's current stream is per device: the launch stream (numba_stream), the
    # stream the arguments export (kernel_arg) and the table upload must be this
    # device's, not those of whichever device the caller had current.
    stack.enter_context(device.activate())
    return stack


def check_kernel_input(x, what: str):
    """Device arrays (or, under the simulator, NumPy arrays) pass; host data on a real
    GPU is a TypeError rather than a silent round trip through host memory."""
    if _is_cupy(x) or hasattr(x, "__cuda_array_interface__"):
        return x
    if isinstance(x, np.ndarray) and simulating():
        return x
    raise TypeError(
        f"{what} must be a device array (CuPy, Numba, or anything with "
        f"__cuda_array_interface__), got {type(x).__name__}: move it with "
        "gpustrat.devices.to_device, or use the module's *_reference function on host data")


def empty(like, shape, dtype, stream=None):
    """An uninitialised array of the same kind and device as ``like``, for a launch on
    ``stream`` (any kind :func:`numba_stream` takes). CuPy arrays come from the pool
    arena of the launch stream: CuPy hands a freed block out again only to work on the
    stream it was allocated for, which then runs after the launch that wrote it."""
    shape = tuple(int(s) for s in shape)
    cp = _cupy_of(like)
    if cp is not None:
        from gpustrat.devices import device_of  # noqa: PLC0415
        with device_of(like).activate(), _pool_stream(cp, stream):
            return cp.empty(shape, dtype)
    if isinstance(like, np.ndarray):
        return np.empty(shape, dtype)
    cuda = _cuda()
    return cuda.device_array(shape, dtype,
                             stream=stream if _is_numba_stream(stream) else 0)


def _pool_stream(cp, stream):
    """A context making ``stream`` (CuPy, Numba or a raw handle) CuPy's current stream."""
    if stream is None:
        return contextlib.nullcontext()
    if hasattr(stream, "ptr") and hasattr(stream, "__enter__"):
        return stream
    return cupy_stream(cp, stream)


def order_after_current(cp, nstream) -> None:
    """Make the launch stream ``nstream`` wait (an event, no host wait) for CuPy's current
    stream of the current device, where the launch's CuPy inputs were written."""
    current = cp.cuda.get_current_stream()
    if stream_handle(nstream) != stream_handle(current):
        external_cupy_stream(cp, stream_handle(nstream)).wait_event(current.record())


def _is_cupy(x) -> bool:
    # Cheaper than building __cuda_array_interface__ (a dict per call) for each of the
    # hundreds of tensors of a fusion bucket; the answer is kept per type.
    kind = type(x)
    answer = _cupy_types.get(kind)
    if answer is None:
        answer = _cupy_types[kind] = kind.__module__.startswith("cupy")
    return answer


_cupy_types: dict = {}


def data_ptr(x) -> int:
    """The address of ``x``'s first element (device or host)."""
    if _is_cupy(x):
        return int(x.data.ptr)
    if isinstance(x, np.ndarray):
        return int(x.ctypes.data)
    if hasattr(x, "__cuda_array_interface__"):
        return int(x.__cuda_array_interface__["data"][0])
    return int(x.__array_interface__["data"][0])


def is_c_contiguous(x) -> bool:
    flags = getattr(x, "flags", None)
    if flags is not None:
        return bool(flags["C_CONTIGUOUS"] if not hasattr(flags, "c_contiguous")
                    else flags.c_contiguous)
    cai = x.__cuda_array_interface__
    return cai.get("strides") is None


def word_dtype(row_bytes: int, *ptrs: int) -> np.dtype:
    """The widest unsigned word (8, 4, 2 or 1 bytes) dividing ``row_bytes`` and every
    address in ``ptrs``: rows of any dtype are then copied a word at a time."""
    for size in (8, 4, 2, 1):
        if row_bytes % size == 0 and all(p % size == 0 for p in ptrs):
            return np.dtype(f"u{size}")
    return np.dtype("u1")


class _HostInterface:
    """An ``__array_interface__`` exporter for a raw host address range."""

    def __init__(self, ptr: int, n: int, dtype: np.dtype):
        self.__array_interface__ = {"data": (ptr, False), "shape": (n,),
                                    "typestr": dtype.str, "version": 3}


class Described(NamedTuple):
    """What a launch needs of a list of arrays, read once (:func:`describe`)."""

    ptrs: np.ndarray        # int64 addresses
    sizes: np.ndarray       # int64 element counts
    devices: set            # the device ids of the CuPy arrays among them
    all_host: bool          # every array a NumPy array (the simulator)


def describe(arrays, dtype, what: str = "tensor") -> Described:
    """Check every array once (a device array, of ``dtype``, C-contiguous, aligned to
    its item size) and read its address, size and device, in one pass: a fusion
    bucket holds hundreds of arrays, and each attribute read costs Python time."""
    dtype = np.dtype(dtype)
    if len(arrays) and len({type(a) for a in arrays}) == 1 and _is_cupy(arrays[0]) \
            and hasattr(arrays[0], "_c_contiguous"):
        return _describe_cupy(arrays, dtype, what)
    ptrs, sizes, devices = [], [], set()
    all_host = True
    for k, a in enumerate(arrays):
        if _is_cupy(a):
            contiguous = a.flags.c_contiguous
            data = a.data
            ptrs.append(data.ptr)
            devices.add(data.device_id)
            all_host = False
        else:
            check_kernel_input(a, f"{what} {k}")
            contiguous = is_c_contiguous(a)
            ptrs.append(data_ptr(a))
            all_host = all_host and isinstance(a, np.ndarray)
        if a.dtype != dtype:
            raise TypeError(f"{what} {k} has dtype {np.dtype(a.dtype)}, expected {dtype}: "
                            "one launch handles one dtype (bucket tensors by dtype)")
        if not contiguous:
            raise ValueError(f"{what} {k} (shape {tuple(a.shape)}) is not C-contiguous")
        sizes.append(a.size)
    ptrs = np.array(ptrs, dtype=np.int64)
    _check_aligned(ptrs, dtype, what)
    return Described(ptrs, np.array(sizes, dtype=np.int64), devices, all_host)


def _describe_cupy(arrays, dtype: np.dtype, what: str) -> Described:
    """:func:`describe` for a list of CuPy arrays of one type: each attribute is read by
    a comprehension over the list, and contiguity from the flag that ``flags`` copies
    (building a ``flags`` object per array took half the time for 1,000 arrays)."""
    datas = [a.data for a in arrays]
    ptrs = np.array([d.ptr for d in datas], dtype=np.int64)
    devices = {d.device_id for d in datas}
    wrong_dtype = next((k for k, a in enumerate(arrays)
                        if a.dtype is not dtype and a.dtype != dtype), None)
    contiguous = [a._c_contiguous for a in arrays]
    strided = None if all(contiguous) else contiguous.index(False)
    if wrong_dtype is not None or strided is not None:
        # The first array with something wrong, its dtype checked before its layout
        # (as the general path does).
        k = min(i for i in (wrong_dtype, strided) if i is not None)
        a = arrays[k]
        if a.dtype != dtype:
            raise TypeError(f"{what} {k} has dtype {np.dtype(a.dtype)}, expected {dtype}: "
                            "one launch handles one dtype (bucket tensors by dtype)")
        raise ValueError(f"{what} {k} (shape {tuple(a.shape)}) is not C-contiguous")
    _check_aligned(ptrs, dtype, what)
    return Described(ptrs, np.array([a.size for a in arrays], dtype=np.int64), devices,
                     False)


def _check_aligned(ptrs: np.ndarray, dtype: np.dtype, what: str) -> None:
    misaligned = np.flatnonzero(ptrs % dtype.itemsize)
    if len(misaligned):
        k = int(misaligned[0])
        raise ValueError(f"{what} {k} at address {int(ptrs[k]):#x} is not aligned to its "
                         f"item size {dtype.itemsize}")


def window(arrays, dtype, described: Described | None = None):
    """A 1-D array of ``dtype`` spanning every array in ``arrays``, and the element
    offset of each array in it.

    All arrays must be C-contiguous, of ``dtype``, on one device, and aligned to the
    item size (every allocator does so; :func:`describe` checks, unless its answer
    for these arrays is passed as ``described``). The window is only a descriptor: the
    kernels touch the ranges of the arrays themselves, never the gaps between
    allocations. The caller keeps ``arrays`` alive while the window is in use.

    Returns:
        ``(window_array, offsets)`` with ``offsets`` a host int64 array.
    """
    dtype = np.dtype(dtype)
    d = described if described is not None else describe(arrays, dtype)
    ptrs, sizes = d.ptrs, d.sizes
    base = int(ptrs.min()) if len(ptrs) else 0
    end = int((ptrs + sizes * dtype.itemsize).max()) if len(ptrs) else 0
    n = max((end - base) // dtype.itemsize, 1)
    offsets = (ptrs - base) // dtype.itemsize
    if d.all_host:
        win = np.asarray(_HostInterface(base, n, dtype))
        if simulating():
            # The simulator copies NumPy arguments in and back out around a launch,
            # which for a window would write stale bytes over the gaps between
            # allocations: hand it a wrapper it treats as device memory instead.
            from numba.cuda.simulator.cudadrv.devicearray import (  # noqa: PLC0415
                FakeCUDAArray)
            win = FakeCUDAArray(win)
    else:
        desc = {"shape": (n,), "strides": None, "typestr": dtype.str,
                "data": (base, False), "version": 3}
        first = arrays[0]
        if _is_cupy(first):
            win = _numba_view(first.data.device_id, desc)
        else:
            win = _cuda().from_cuda_array_interface(desc, owner=None, sync=False)
    return win, offsets


def stream_handle(stream) -> int:
    """The ``cudaStream_t`` value of a Numba or CuPy stream, as the CUDA Array Interface
    writes it: 1 for the legacy default stream, 2 for the per-thread default stream."""
    if _is_numba_stream(stream):
        return int(stream)  # Numba: the handle; CU_STREAM_LEGACY is 1
    ptr = int(stream.ptr) if hasattr(stream, "ptr") else int(stream)
    return ptr if ptr else 1  # CuPy's null stream is the legacy default stream


#: Numba views of recent device ranges, by (device, address, shape, strides, dtype):
#: building one costs more than a kernel launch, and a training step passes the same
#: ranges every step (CuPy's pool hands the same addresses back). A view owns nothing:
#: the caller's array keeps the memory alive, as with a fresh view.
VIEW_CACHE_SIZE = 256
_views: OrderedDict = OrderedDict()
_views_lock = threading.Lock()


def _numba_view(device_id: int, desc: dict, owner=None):
    """A Numba device array over the range ``desc`` (a CUDA Array Interface dict)
    describes, imported without synchronising, from the cache when the same range was
    viewed before. ``owner`` keeps the memory alive for an uncached view (the
    sanitizer's, which tracks each view's memory)."""
    cuda = _cuda()
    if getattr(cuda, "is_fake", False):
        return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)
    key = (device_id, desc["data"][0], tuple(desc["shape"]),
           None if desc.get("strides") is None else tuple(desc["strides"]), desc["typestr"])
    with _views_lock:
        view = _views.get(key)
        if view is not None:
            _views.move_to_end(key)
            return view
    view = cuda.from_cuda_array_interface(desc, owner=None, sync=False)
    with _views_lock:
        _views[key] = view
        while len(_views) > VIEW_CACHE_SIZE:
            _views.popitem(last=False)
    return view


def kernel_arg(x, nstream):
    """``x`` as an argument of a launch on the Numba stream ``nstream``.

    Numba imports a CuPy (``__cuda_array_interface__``) argument with
    ``from_cuda_array_interface(sync=True)``: under version 3 of the interface it then
    synchronizes the stream the exporter names, CuPy's current stream, so the host
    would wait for the GPU at every launch, once per array argument. The launchers
    order the launch stream after that stream with an event instead
    (:func:`launch_stream`), so arguments are imported without the wait.
    """
    if not _is_cupy(x) or simulating():
        return x
    return _numba_view(x.data.device_id, x.__cuda_array_interface__, owner=x)


def launch_stream(stream=None, like=None):
    """The Numba stream to launch on (:func:`numba_stream`), ordered after CuPy's current
    stream where ``like`` is a CuPy array: that is where a launch's CuPy inputs were
    written, and what a synchronizing import would have waited for."""
    nstream = numba_stream(stream, like)
    cp = _cupy_of(like)
    if cp is not None and not simulating():
        order_after_current(cp, nstream)
    return nstream


#: Device copies of recent host tables, by (device, stream, dtype, shape, bytes): a
#: training step launches the same layouts every step, and CuPy's memory pool hands
#: the same addresses back, so in a warm step no table is uploaded. A table is only
#: used on the stream it was uploaded on: CuPy's pool reuses a freed (evicted) block
#: for that stream's later work only, which runs after every kernel that read it.
TABLE_CACHE_SIZE = 64
_tables: OrderedDict = OrderedDict()
_tables_lock = threading.Lock()


def clear_table_cache() -> None:
    """Forget the cached tables and views (a new backend, or memory given back)."""
    with _tables_lock:
        _tables.clear()
    with _views_lock:
        _views.clear()


def to_kernel_array(host: np.ndarray, like, stream=None):
    """A small host table (offsets, sizes) as an argument of a launch next to ``like``.

    Args:
        host: the table.
        like: an array of the launch (its kind and device decide where the table goes).
        stream: the launch's Numba stream (:func:`numba_stream`).

    CuPy launches get the table from CuPy's memory pool, uploaded on the launch stream
    (so it is ordered before the kernel and its memory is reused only after it), and
    cached: see ``TABLE_CACHE_SIZE``. Numba's ``to_device`` would allocate with
    ``cuMemAlloc`` per launch and free with ``cuMemFree``, which synchronizes the device.
    """
    if isinstance(like, np.ndarray) or simulating():
        return host
    cp = _cupy_of(like)
    if cp is None:
        cuda = _cuda()
        return cuda.to_device(host, stream=stream if stream is not None else 0)
    from gpustrat.devices import device_of  # noqa: PLC0415
    device = device_of(like)
    host = np.ascontiguousarray(host)
    key = (device.index, None if stream is None else stream_handle(stream),
           host.dtype.str, host.shape, host.tobytes())
    with _tables_lock:
        view = _tables.get(key)
        if view is not None:
            _tables.move_to_end(key)
    if view is None:
        from gpustrat import devices as _devices  # noqa: PLC0415
        if _devices.capture_state is not None:
            # In a step gs.function captures: uploaded outside the capture (an upload
            # inside would be replayed from CuPy's reused staging buffer).
            table = _devices.capture_state.constant(host, device)
        else:
            with device.activate(), cupy_stream(cp, stream):
                table = cp.asarray(host)
        # Uploaded on the launch stream: ordered before the kernel, no host wait needed.
        # The view owns the table: a launch holding it keeps the memory even when the
        # cache drops the table meanwhile (another thread's launches on a shared stream
        # could otherwise be given that memory before this kernel is queued).
        view = _cuda().from_cuda_array_interface(table.__cuda_array_interface__,
                                                 owner=table, sync=False)
        with _tables_lock:
            _tables[key] = view
            while len(_tables) > TABLE_CACHE_SIZE:
                _tables.popitem(last=False)
    return view


def cupy_stream(cp, nstream):
    """A context making CuPy work on the Numba stream ``nstream`` (nothing to do when
    it is CuPy's current stream already)."""
    if nstream is None:
        return contextlib.nullcontext()
    handle = stream_handle(nstream)
    if handle == stream_handle(cp.cuda.get_current_stream()):
        return contextlib.nullcontext()
    return external_cupy_stream(cp, handle)


class _StreamHandle:
    """A raw ``cudaStream_t`` speaking the CUDA stream protocol."""

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __cuda_stream__(self):
        return (0, self.handle)


def external_cupy_stream(cp, handle: int):
    """A CuPy stream object for the raw ``cudaStream_t`` ``handle``: through
    ``Stream.from_external`` where CuPy has it (14 and later, which deprecate
    ``ExternalStream``), else ``ExternalStream`` (CuPy 13)."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None:
        return from_external(_StreamHandle(handle))
    return cp.cuda.ExternalStream(handle)


def env_threads(default: int = DEFAULT_THREADS) -> int:
    """Threads per block from ``GPUSTRAT_KERNEL_THREADS`` (tuning only)."""
    raw = os.environ.get("GPUSTRAT_KERNEL_THREADS", "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"GPUSTRAT_KERNEL_THREADS={raw!r} is not an integer "
                         "(threads per block, 32..1024)") from None
    if not 1 <= value <= 1024:
        raise ValueError(f"GPUSTRAT_KERNEL_THREADS={value} is out of range 1..1024")
    return value
