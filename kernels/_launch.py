"""Launch plumbing shared by the kernels: compiled kernels, launch plans, grids, streams.

Words:
- *launch config*: ``(grid, block)``: 3-D for split (words x rows x pieces), 1-D for
  pack and unpack (chunks of the buffer).
- *window*: the 1-D extent ``base .. base + n`` elements that covers several separate
  allocations of one dtype on one device, so that a single launch can read or write
  many tensors through a table of element offsets from ``base`` (the way NCCL-style
  fusion kernels take a pointer table; Numba has no kernel argument type for a table
  of pointers).
- *specialisation* (:class:`Kernel`): one ``@cuda.jit`` kernel for one signature (its
  arguments' dtypes and ranks). On a GPU it is compiled once per process and compute
  capability to PTX by Numba (``numba.cuda.compile_ptx``), loaded by CuPy
  (``cupy.RawModule``) and launched through CuPy's ``RawKernel``, its arguments laid
  out as Numba's kernel ABI takes them: an array is the words ``meminfo, parent,
  nitems, itemsize, data, shape..., strides...``, a scalar its value. Numba's
  dispatcher (argument typing, device-array wrappers, ctypes) is not on the path.
- *plan* (:class:`Plans`): what the launches of one layout need, built once: the
  grid, the kernel's arguments as CuPy's argument objects, the tables uploaded to
  the device. A launcher keeps its plans keyed by the layout (addresses, sizes,
  dtype, device, stream) and on a hit skips every check: a training step launches
  the same layouts every step, and CuPy's pool hands the same addresses back.

Under Numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the launchers call the
kernels through Numba's dispatcher on NumPy arrays instead (the simulator runs Python,
not PTX). Numba is imported inside functions only, so that ``import gpustrat.kernels``
and the pure helpers of the kernel modules work where Numba is not installed.
"""

from __future__ import annotations

import contextlib
import operator
import os
import re
import threading
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from gpustrat import devices as _devices

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
        self.module = module_globals["__name__"]
        self._device_functions = tuple(device_functions)
        self._jitted: dict = {}
        self._specialised: dict = {}

    def python_function(self, name: str):
        """The kernel ``name`` as written (what Numba compiles)."""
        return self._globals[name]

    def specialise(self, name: str, *signature: Arg) -> "Kernel":
        """The :class:`Kernel` of ``name`` for ``signature`` (made once)."""
        key = (name, signature)
        kernel = self._specialised.get(key)
        if kernel is None:
            kernel = self._specialised[key] = Kernel(self, name, signature)
        return kernel

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
    return _devices.kernels_simulated()


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


def _is_numba_stream(stream) -> bool:
    if stream is None:
        return False
    mod = type(stream).__module__
    return mod.startswith("numba.cuda") or mod.startswith("numba_cuda")


def _cupy_of(x):
    from gpustrat.devices import array_module, is_gpu_array  # noqa: PLC0415
    return array_module(x) if x is not None and is_gpu_array(x) else None


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


def as_cupy(x):
    """``x`` as a CuPy array: itself, or a view of another ``__cuda_array_interface__``
    exporter (a Numba device array), which CuPy imports without copying. GPU launches
    go through CuPy, and their outputs are CuPy arrays."""
    if _is_cupy(x):
        return x
    return _devices.cupy().asarray(x)


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


_C_CONTIGUOUS = operator.attrgetter("_c_contiguous")


def all_c_contiguous(arrays) -> bool:
    """Every array of a list of one type is C-contiguous; CuPy's arrays answer from the
    flag that ``flags`` copies (building a ``flags`` object per array costs more)."""
    if arrays and hasattr(arrays[0], "_c_contiguous"):
        return all(map(_C_CONTIGUOUS, arrays))
    return all(is_c_contiguous(a) for a in arrays)


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


def window_extent(described: Described, dtype) -> tuple[int, int, np.ndarray]:
    """``(base, n, offsets)``: the window over the arrays :func:`describe` read (their
    lowest address, the elements up to the end of the highest, each array's element
    offset from ``base``). All arrays must be of ``dtype`` and aligned to its item
    size (:func:`describe` checks). The kernels touch the ranges of the arrays
    themselves, never the gaps between allocations; the caller keeps the arrays
    alive while a launch over the window may run."""
    dtype = np.dtype(dtype)
    ptrs, sizes = described.ptrs, described.sizes
    base = int(ptrs.min()) if len(ptrs) else 0
    end = int((ptrs + sizes * dtype.itemsize).max()) if len(ptrs) else 0
    return base, max((end - base) // dtype.itemsize, 1), (ptrs - base) // dtype.itemsize


def host_window(base: int, n: int, dtype):
    """The window over host (NumPy) arrays as an argument of a simulated launch."""
    win = np.asarray(_HostInterface(base, n, np.dtype(dtype)))
    # The simulator copies NumPy arguments in and back out around a launch, which for
    # a window would write stale bytes over the gaps between allocations: hand it a
    # wrapper it treats as device memory instead.
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray  # noqa: PLC0415
    return FakeCUDAArray(win)


def stream_handle(stream) -> int:
    """The ``cudaStream_t`` value of a Numba or CuPy stream, as the CUDA Array Interface
    writes it: 1 for the legacy default stream, 2 for the per-thread default stream."""
    if _is_numba_stream(stream):
        return int(stream)  # Numba: the handle; CU_STREAM_LEGACY is 1
    ptr = int(stream.ptr) if hasattr(stream, "ptr") else int(stream)
    return ptr if ptr else 1  # CuPy's null stream is the legacy default stream


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


# --- compiled kernels, launched through CuPy ---------------------------------------------

class Arg(NamedTuple):
    """One argument of a kernel's signature: an array of ``dtype`` with ``ndim``
    dimensions (C-contiguous), or a scalar of ``dtype`` when ``ndim`` is 0."""

    dtype: np.dtype
    ndim: int = 0


def flatten(signature, values) -> list:
    """The kernel parameters of a launch, in order, as NumPy scalars of their sizes.

    ``values`` follow ``signature`` (a tuple of :class:`Arg`): an array is given as
    ``(ptr, shape)`` and becomes the ``5 + 2 * ndim`` int64 words of Numba's array ABI
    (meminfo and parent 0, the element count, the item size, the address, the shape,
    the C strides in bytes); a scalar becomes its value in the signature's dtype (a
    float16 as its two bytes, as Numba passes it).
    """
    if len(values) != len(signature):
        raise TypeError(f"the kernel takes {len(signature)} arguments, got {len(values)}")
    out: list = []
    for arg, value in zip(signature, values):
        if not arg.ndim:
            out.append(arg.dtype.type(value))
            continue
        ptr, shape = value
        shape = tuple(int(n) for n in shape)
        if len(shape) != arg.ndim:
            raise ValueError(f"an argument of rank {arg.ndim} got shape {shape}")
        strides, acc = [], arg.dtype.itemsize
        for n in reversed(shape):
            strides.append(acc)
            acc *= max(n, 1)
        size = int(np.prod(shape, dtype=np.int64))
        out.extend(np.int64(v) for v in (0, 0, size, arg.dtype.itemsize, int(ptr), *shape,
                                         *reversed(strides)))
    return out


def cupy_args(cp, params) -> tuple:
    """``params`` (:func:`flatten`) as CuPy's kernel-argument objects, made once per plan:
    CuPy hands each to the driver as it is (an int64 word as ``CIntptr``, any other
    scalar as ``CNumpyArray`` over its bytes), where a NumPy scalar would be converted
    again at every launch."""
    fn = cp.cuda.function
    return tuple(fn.CIntptr(int(p)) if p.dtype == np.int64 else fn.CNumpyArray(np.array(p))
                 for p in params)


def word(cp, value: int):
    """One int64 kernel parameter (an address that changes between launches)."""
    return cp.cuda.function.CIntptr(int(value))


def data_slot(signature, k: int) -> int:
    """The index, among the flattened parameters, of array argument ``k``'s address."""
    slot = 0
    for arg in signature[:k]:
        slot += 5 + 2 * arg.ndim if arg.ndim else 1
    return slot + 4


_compile_lock = threading.Lock()
_ptx: dict = {}             # (backend, module, kernel, signature, cc) -> (ptx, entry)
_ptx_dir: list = []         # this process's directory of PTX files for CuPy to load
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(")


def compute_capability(cp, device_id: int) -> tuple[int, int]:
    """The compute capability of CuPy's ``device_id``, as ``(major, minor)``."""
    cc = str(cp.cuda.Device(device_id).compute_capability)      # e.g. "90"
    return int(cc[:-1]), int(cc[-1])


def image(cuda, ptx: str, cc: tuple[int, int]) -> tuple[object, str]:
    """``(image, kind)``: what CuPy loads for ``ptx`` on compute capability ``cc``. The
    cubin Numba's own linker makes of it, as for Numba's own launches (with nvJitLink
    where it is installed, no driver compiles the PTX, so a driver older than the
    NVVM that wrote it still runs it), else the PTX itself, which the driver compiles
    when the module is loaded."""
    if getattr(cuda, "is_fake", False):
        return ptx, "ptx"
    import warnings  # noqa: PLC0415
    try:
        from numba.cuda.cudadrv import driver  # noqa: PLC0415
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "nvjitlink is not available": the driver
            linker = driver._Linker(cc=tuple(cc), lto=False)
            linker.add_ptx(ptx.encode())
            return bytes(linker.complete()), "cubin"
    except Exception:  # no nvJitLink and no driver to link with: the PTX as it is
        return ptx, "ptx"


def _ptx_file(ptx, kind: str = "ptx") -> str:
    """A file holding a module image (``ptx`` text, or cubin bytes; CuPy's RawModule
    loads modules from files), in a directory of this process removed at exit."""
    import atexit  # noqa: PLC0415
    import hashlib  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    if not _ptx_dir:
        path = tempfile.mkdtemp(prefix="gpustrat-ptx-")
        atexit.register(shutil.rmtree, path, True)
        _ptx_dir.append(path)
    data = ptx.encode() if isinstance(ptx, str) else bytes(ptx)
    name = os.path.join(_ptx_dir[0], f"{hashlib.sha1(data).hexdigest()[:20]}.{kind}")
    if not os.path.exists(name):
        with open(name + ".tmp", "wb") as f:
            f.write(data)
        os.replace(name + ".tmp", name)
    return name


class Kernel:
    """One specialisation of a kernel module's ``@cuda.jit`` kernel ``name`` for
    ``signature`` (a tuple of :class:`Arg`), launched through CuPy.

    ``function(cp, device)`` gives CuPy's ``RawKernel`` of it, compiled to PTX by Numba
    once per process and compute capability, linked to a cubin as Numba links its
    own kernels (:func:`image`) and loaded once per device; a launch is
    ``function(grid, block, args)`` on CuPy's current stream, ``args`` the parameters
    :func:`flatten` lays out, as :func:`cupy_args` makes them.
    """

    def __init__(self, kernels: "LazyKernels", name: str, signature):
        self.kernels, self.name, self.signature = kernels, name, tuple(signature)
        self._functions: dict = {}

    def numba_signature(self) -> tuple:
        from numba import from_dtype, types  # noqa: PLC0415
        return tuple(types.Array(from_dtype(a.dtype), a.ndim, "C") if a.ndim
                     else from_dtype(a.dtype) for a in self.signature)

    def ptx(self, cc: tuple[int, int]) -> tuple[str, str]:
        """``(ptx, entry name)`` of this specialisation for compute capability ``cc``."""
        cuda = self.kernels.bind()
        key = (cuda, self.kernels.module, self.name, self.signature, tuple(cc))
        with _compile_lock:
            got = _ptx.get(key)
            if got is None:
                # The sanitizer's stand-in (no Numba needed) takes the signature as is.
                sig = self.signature if getattr(cuda, "is_fake", False) else \
                    self.numba_signature()
                ptx, _ = cuda.compile_ptx(self.kernels.python_function(self.name), sig,
                                          cc=tuple(cc))
                found = _ENTRY.search(ptx)
                if found is None:
                    raise RuntimeError(f"Numba's PTX for {self.name} has no kernel entry")
                got = _ptx[key] = (ptx, found.group(1))
        return got

    def function(self, cp, device_id: int):
        """CuPy's ``RawKernel`` of this specialisation on ``device_id``, which must be
        CuPy's current device (CuPy loads a module into the current device's context)."""
        key = (cp, device_id)
        fn = self._functions.get(key)
        if fn is None:
            cc = compute_capability(cp, device_id)
            ptx, entry = self.ptx(cc)
            path = _ptx_file(*image(self.kernels.bind(), ptx, cc))
            fn = self._functions[key] = cp.RawModule(path=path).get_function(entry)
            _caches.add(self)
        return fn

    def clear(self) -> None:
        self._functions.clear()


def dtype_key(dtype):
    """``dtype`` in a plan's key: its type number for NumPy's built-in types (hashing a
    dtype costs more than a dict lookup), else the dtype itself (records of one size
    differ by their fields)."""
    return dtype.num if dtype.isbuiltin == 1 else dtype


class Plans:
    """A launcher's launch plans, by layout key; past ``size`` plans the least recently
    used is dropped (with the device tables it owns, which go back to the pool arena of
    the stream they were uploaded on, for that stream's later work only)."""

    def __init__(self, size: int = 64):
        self.size = size
        self._plans: OrderedDict = OrderedDict()
        _caches.add(self)

    def get(self, key):
        plan = self._plans.get(key)
        if plan is not None:
            with contextlib.suppress(KeyError):   # dropped meanwhile by another thread
                self._plans.move_to_end(key)
        return plan

    def put(self, key, plan):
        self._plans[key] = plan
        while len(self._plans) > self.size:
            with contextlib.suppress(KeyError):
                self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


_caches: set = set()


def clear_table_cache() -> None:
    """Forget every launch plan and loaded kernel (a new backend, or memory given back)."""
    for cache in list(_caches):
        cache.clear()
    with _compile_lock:
        _ptx.clear()


#: Device tables by content, device and stream: layouts that differ only by where
#: their tensors start (the same sizes, the same gaps) share one table.
_tables = Plans()


def upload(cp, host: np.ndarray, device: int, handle: int):
    """A small host table as a device array on ``device``, copied on CuPy's current
    stream, whose handle is ``handle`` (the launch stream: ordered before the kernels
    that read it, its memory reused only after them); CuPy stages the bytes, so no
    host wait. A table of the same content uploaded on that stream before is reused."""
    host = np.ascontiguousarray(host)
    key = (device, handle, host.dtype.str, host.shape, host.tobytes())
    table = _tables.get(key)
    if table is None:
        from gpustrat import devices as _devices  # noqa: PLC0415
        if _devices.capture_state is not None:
            # In a step gs.function captures: uploaded outside the capture (an upload
            # inside would be replayed from CuPy's reused staging buffer), and kept
            # with the graphs rather than here.
            return _devices.capture_state.constant(host, _devices.Device("gpu", device))
        table = _tables.put(key, cp.asarray(host))
    return table


def on_device(cp, device: int):
    """A context making CuPy's device ``device`` current, where it is not already
    (CuPy launches on the current device, and loads modules into its context)."""
    if cp.cuda.runtime.getDevice() == device:
        return contextlib.nullcontext()
    return cp.cuda.Device(device)


def launch_stream(cp, stream):
    """A context for a launch on ``stream`` (a CuPy or Numba stream, or a raw handle):
    None is CuPy's current stream, as it is; another stream first waits (an event, no
    host wait) for the current one, where the launch's inputs were written, then is
    made CuPy's current stream, so the launch and its outputs' memory belong to it."""
    if stream is None:
        return contextlib.nullcontext()
    order_after_current(cp, stream)
    return _pool_stream(cp, stream)


def launch_handle(cp, stream, device: int) -> int:
    """The handle of the stream a launch on ``device`` uses: ``stream``'s, or (None)
    that of CuPy's current stream of ``device``."""
    return stream_handle(cp.cuda.get_current_stream(device) if stream is None else stream)
