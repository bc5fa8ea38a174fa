"""Counting stand-ins over real CuPy arrays: the host cost of a GPU path, without a GPU.

The stand-in backend swaps CuPy, ``cupyx``, ``cupy.cuda.nccl`` and ``numba.cuda`` for
objects that need no driver and count what a program asks of the GPU:

- *arrays* are real ``cupy.ndarray`` objects (of a subclass) over device addresses
  that no memory backs: shape, strides, views, slicing and reshapes run CuPy's own
  code at CuPy's cost. Values are not computed and never read: an array operation
  (``+``, ``*=``, ``astype``, ``sum``, ``sqrt``, ``where``, ...) counts a launch and
  returns an array of the result's shape and dtype; what the host reads back
  (``get``, ``item``, ``float``) is zeros.
- *memory* comes from a pool per device over a made-up address range: a freed block
  is handed out again for the same rounded size, as CuPy's pool does.
- *the driver's objects*: ``cupy.cuda.Device`` (a context manager; entries counted),
  ``Stream``, ``Event`` (creations, records, waits, queries, and whether the event
  was made with timing), the current stream of each device per thread, pinned host
  memory (NumPy arrays), ``cupy.cuda.nccl`` (communicators whose calls are counted)
  and the ``numba.cuda`` surface gpustrat's kernels launch through (launches counted).

What makes the host wait for the GPU is a *host synchronization*, counted with the
place it was asked for (:attr:`StandIn.sync_sites`): ``get`` (blocking), ``item``,
``float``/``int``/``bool`` of an array, ``cupy.asnumpy``, ``set`` from pageable memory,
``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``, Numba's
``to_device`` and a synchronizing Numba import of an array.

Not modelled: the GPU's time, values, ordering (the stream-ordering sanitizer,
:func:`gpustrat.testing.sanitize`, checks that), and the host cost inside Numba's own
dispatcher and inside the CUDA driver (a launch here costs what CuPy's argument
handling and the counting cost, a custom kernel launch next to nothing).

:func:`gpustrat.testing.stand_in` makes the backend current inside a ``with`` block.
It needs the real CuPy package (for ``cupy.ndarray``); where ``import cupy`` fails,
the CuPy 14 and NCCL folders that ``python tests/conformance/install_cupy.py`` installs
under the checkout's ``.conformance/`` (or ``$GPUSTRAT_CONFORMANCE_DIR``) are put on
``sys.path``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import types
from pathlib import Path

import numpy as np

#: What :meth:`StandIn.counts` counts.
COUNTERS = ("host_syncs", "launches", "kernel_launches", "copies", "nccl_calls",
            "nccl_groups", "event_creations", "timing_events", "event_records",
            "event_waits", "event_queries", "stream_creations", "device_enters",
            "allocations", "pinned_allocations")
#: The pool's granularity, as CuPy's (sizes are rounded up to 512 bytes).
ROUND = 512
#: Where each device's made-up addresses begin (device K at (K + 1) << ADDRESS_SHIFT).
ADDRESS_SHIFT = 40
ENV_CONFORMANCE_DIR = "GPUSTRAT_CONFORMANCE_DIR"


# --- the real CuPy --------------------------------------------------------------------

def _conformance_dirs() -> list[Path]:
    root = os.environ.get(ENV_CONFORMANCE_DIR)
    root = Path(root) if root else Path(__file__).resolve().parents[2] / ".conformance"
    return [root / "cupy14", root / "nccl"]


def real_cupy():
    """The real ``cupy`` module: imported, else from the checkout's ``.conformance``.

    Raises:
        RuntimeError: CuPy cannot be imported from either place (how to install it).
    """
    try:
        import cupy  # noqa: PLC0415
        if not hasattr(cupy, "ndarray") or not hasattr(cupy.cuda, "UnownedMemory"):
            raise ImportError(f"the cupy imported from {getattr(cupy, '__file__', '?')} "
                              "is not the CuPy package")
        return cupy
    except ImportError as first:
        dirs = _conformance_dirs()
        if not all(d.is_dir() for d in dirs) or "cupy" in sys.modules:
            raise RuntimeError(
                f"the stand-in backend needs the real CuPy package (for cupy.ndarray), "
                f"but import cupy failed ({first}) and {dirs[0]} or {dirs[1]} is missing: "
                "run python tests/conformance/install_cupy.py (it installs CuPy 14 and "
                "NCCL under .conformance/ without a GPU), or put such folders on the path "
                f"(PYTHONPATH={os.pathsep.join(str(d) for d in dirs)}, or "
                f"{ENV_CONFORMANCE_DIR}=the folder holding cupy14/ and nccl/)") from first
        for d in reversed(dirs):
            if str(d) not in sys.path:
                sys.path.insert(0, str(d))
        importlib.invalidate_caches()
        try:
            import cupy  # noqa: PLC0415
        except ImportError as second:
            raise RuntimeError(f"CuPy under {dirs[0]} does not import ({second}): reinstall "
                               "it with python tests/conformance/install_cupy.py") from second
        return cupy


# --- the model: counters, threads' current device and streams, the pool -----------------

def _site(depth: int = 3) -> str:
    """The innermost ``depth`` callers outside this module and contextlib (where a
    host synchronization was asked for, and who asked), innermost first."""
    f = sys._getframe(1)
    out = []
    while f is not None and len(out) < depth:
        name = f.f_code.co_filename
        if not name.endswith("standin.py") and "contextlib" not in name:
            out.append(f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})")
        f = f.f_back
    return " < ".join(out) or "?"


class _Block:
    """An allocation of the pool: back to its free list when the last array is gone."""

    __slots__ = ("pool", "addr", "size", "device", "__weakref__")

    def __init__(self, pool, addr: int, size: int, device: int):
        self.pool, self.addr, self.size, self.device = pool, addr, size, device

    def __del__(self):
        try:
            self.pool.setdefault((self.device, self.size), []).append(self.addr)
        except Exception:  # interpreter shutdown
            pass


class StandIn:
    """The stand-in GPUs: counters, per-thread device and stream state, the pool.

    Args:
        num_devices: GPUs the stand-in shows.
    """

    def __init__(self, num_devices: int = 4):
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {num_devices}")
        self.num_devices = int(num_devices)
        self._tls = threading.local()
        self._all_counters: list[dict] = []
        self._lock = threading.Lock()
        #: (thread, what, site) of every host synchronization.
        self.sync_sites: list[tuple[str, str, str]] = []
        self._free: dict = {}
        self._top = {d: (d + 1) << ADDRESS_SHIFT for d in range(self.num_devices)}
        self._next_stream = 0x5000
        self._pinned: list[np.ndarray] = []
        self.cupy = None          # set by stand_in()

    # --- counting
    def _c(self) -> dict:
        try:
            return self._tls.c
        except AttributeError:
            c = self._tls.c = dict.fromkeys(COUNTERS, 0)
            with self._lock:
                self._all_counters.append(c)
            return c

    def count(self, what: str, n: int = 1) -> None:
        self._c()[what] += n

    def host_sync(self, what: str) -> None:
        self._c()["host_syncs"] += 1
        self.sync_sites.append((threading.current_thread().name, what, _site()))

    def counts(self) -> dict:
        """Every counter, summed over the threads."""
        out = dict.fromkeys(COUNTERS, 0)
        with self._lock:
            for c in self._all_counters:
                for k, v in c.items():
                    out[k] += v
        return out

    def reset(self) -> None:
        """Set every counter to zero and forget the sync sites."""
        with self._lock:
            for c in self._all_counters:
                for k in c:
                    c[k] = 0
        self.sync_sites.clear()

    @contextlib.contextmanager
    def measure(self):
        """``with standin.measure() as c:`` -- ``c`` holds the counts of the block (and
        ``c["sync_sites"]``, where its host synchronizations were asked for)."""
        before = self.counts()
        sites = len(self.sync_sites)
        out: dict = {}
        yield out
        after = self.counts()
        out.update({k: after[k] - before[k] for k in COUNTERS})
        out["sync_sites"] = self.sync_sites[sites:]

    # --- thread state
    def devs(self) -> list:
        try:
            return self._tls.devs
        except AttributeError:
            d = self._tls.devs = [0]
            return d

    def current_device(self) -> int:
        return self.devs()[-1]

    def stacks(self) -> dict:
        try:
            return self._tls.streams
        except AttributeError:
            s = self._tls.streams = {}
            return s

    def new_stream_ptr(self) -> int:
        with self._lock:
            self._next_stream += 0x10
            return self._next_stream

    # --- memory
    def alloc(self, device: int, nbytes: int) -> _Block:
        """A block of at least ``nbytes`` on ``device``: a freed one of the same rounded
        size when there is one (as CuPy's pool), else fresh addresses."""
        self._c()["allocations"] += 1
        size = -(-int(nbytes) // ROUND) * ROUND or ROUND
        free = self._free.get((device, size))
        if free:
            try:
                return _Block(self._free, free.pop(), size, device)
            except IndexError:   # another thread took the last one
                pass
        with self._lock:
            addr = self._top[device]
            self._top[device] = addr + size
        return _Block(self._free, addr, size, device)

    def pinned(self, shape, dtype) -> np.ndarray:
        self._c()["pinned_allocations"] += 1
        a = np.zeros(shape, dtype)
        self._pinned.append(a)
        return a

    def is_pinned(self, a: np.ndarray) -> bool:
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        return any(base is p for p in self._pinned)


# --- shapes and dtypes of results, without computing them -------------------------------

_DUMMY_SCALARS = {bool: True, int: 1, float: 1.0, complex: 1j}


def _operand_key(o):
    if isinstance(o, np.ndarray):
        return ("a", o.shape, o.dtype)
    cls = type(o)
    if cls in _DUMMY_SCALARS:
        return cls
    if isinstance(o, np.generic):
        return ("s", o.dtype)
    if hasattr(o, "shape") and hasattr(o, "dtype"):   # a CuPy array
        return ("a", tuple(o.shape), np.dtype(o.dtype))
    return ("v", repr(o))


def _dummy(key, o):
    if isinstance(key, tuple):
        if key[0] == "a":
            return np.zeros((), key[2])
        if key[0] == "s":
            return key[1].type(1)
        return o
    return _DUMMY_SCALARS[key]


def _shapes(keys) -> list:
    return [k[1] for k in keys if isinstance(k, tuple) and k[0] == "a"]


_elementwise_cache: dict = {}
_binary_cache: dict = {}


def _elementwise_result(fn, name: str, operands, dtype=None):
    """``(shape, dtype)`` of ``fn(*operands)`` for a NumPy ufunc-like ``fn``."""
    keys = tuple(_operand_key(o) for o in operands)
    ck = (name, keys, dtype)
    hit = _elementwise_cache.get(ck)
    if hit is None:
        shape = np.broadcast_shapes(*_shapes(keys))
        with np.errstate(all="ignore"):
            kw = {} if dtype is None else {"dtype": dtype}
            out = np.asarray(fn(*[_dummy(k, o) for k, o in zip(keys, operands)], **kw))
        hit = _elementwise_cache[ck] = (shape, out.dtype)
    return hit


_reduce_cache: dict = {}


def _reduction_result(name: str, shape: tuple, dtype: np.dtype, axis, out_dtype, keepdims):
    ck = (name, shape, dtype, axis if not isinstance(axis, list) else tuple(axis),
          out_dtype, keepdims)
    hit = _reduce_cache.get(ck)
    if hit is None:
        nd = len(shape)
        if axis is None:
            axes = set(range(nd))
        else:
            axes = {int(a) % nd if nd else 0 for a in (axis if isinstance(axis, (tuple, list))
                                                       else (axis,))}
        if keepdims:
            rshape = tuple(1 if i in axes else n for i, n in enumerate(shape))
        else:
            rshape = tuple(n for i, n in enumerate(shape) if i not in axes)
        kw = {} if out_dtype is None else {"dtype": out_dtype}
        with np.errstate(all="ignore"):
            rdtype = np.asarray(getattr(np, name)(np.ones((1,), dtype), **kw)).dtype
        hit = _reduce_cache[ck] = (rshape, rdtype)
    return hit


def _matmul_shape(a: tuple, b: tuple) -> tuple:
    if not a or not b:
        raise ValueError("matmul: a 0-d operand")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul: shapes {a} and {b} are not aligned")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _is_basic_index(key) -> bool:
    if isinstance(key, tuple):
        return all(k is None or k is Ellipsis or type(k) in (int, slice) or
                   isinstance(k, (np.integer,)) for k in key)
    return key is None or key is Ellipsis or type(key) in (int, slice) or \
        isinstance(key, np.integer)


# --- the backend ------------------------------------------------------------------------

def build(model: StandIn):
    """The stand-in ``cupy``, ``cupyx``, ``cupy.cuda.nccl`` and ``numba.cuda`` of
    ``model``: ``(cupy, cupyx, nccl, numba_cuda)``."""
    real = real_cupy()
    cp = _StandInCupy(model, real)
    model.cupy = cp
    return cp, cp.cupyx, _StandInNccl(model, cp), _StandInNumbaCuda(model, cp)


class _StandInCupy:
    """A module-like stand-in for ``cupy``: ``cp.ndarray`` is a subclass of the real one."""

    def __init__(self, model: StandIn, real):
        self.model = model
        self.real = real
        self.ndarray = _make_ndarray(self, real)
        self._MemoryPointer = _make_memory_pointer(self, real)
        self._Unowned = real.cuda.UnownedMemory
        self.cuda = _make_cuda(self)
        self.cupyx = types.SimpleNamespace(empty_pinned=self.empty_pinned,
                                           zeros_pinned=self.empty_pinned)
        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                     "uint8", "uint16", "uint32", "uint64", "bool_", "complex64",
                     "complex128", "intp", "integer", "floating", "inexact", "number",
                     "newaxis", "inf", "nan", "pi", "e"):
            setattr(self, name, getattr(np, name))
        self.dtype = np.dtype
        self.result_type = np.result_type
        self.can_cast = np.can_cast
        self.promote_types = np.promote_types
        self.__name__ = "cupy (gpustrat stand-in)"
        self.__version__ = real.__version__

    def __getattr__(self, name):
        fn = getattr(np, name, None)
        if isinstance(fn, np.ufunc):
            def ufunc(*args, out=None, dtype=None, **kw):
                return self._elementwise(fn, name, args, out=out, dtype=dtype)
            ufunc.__name__ = name
            setattr(self, name, ufunc)
            return ufunc
        raise AttributeError(f"the stand-in CuPy has no {name!r}: add it to "
                             "gpustrat/testing/standin.py (what it launches, what it returns)")

    # --- arrays
    def _new(self, shape, dtype, device: int | None = None):
        """A fresh array on ``device`` (the current one): one pool allocation."""
        if type(shape) is not tuple:
            shape = tuple(shape) if isinstance(shape, (list, tuple)) else (int(shape),)
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        model = self.model
        try:
            tls = model._tls
            c, devs = tls.c, tls.devs
        except AttributeError:
            c, devs = model._c(), model.devs()
        if device is None:
            device = devs[-1]
        n = dtype.itemsize
        for k in shape:
            n *= k
        # The pool (StandIn.alloc, inlined: this is every array operation's cost).
        c["allocations"] += 1
        size = -(-n // ROUND) * ROUND or ROUND
        free = model._free.get((device, size))
        addr = None
        if free:
            try:
                addr = free.pop()
            except IndexError:
                pass
        if addr is None:
            with model._lock:
                addr = model._top[device]
                model._top[device] = addr + size
        blk = _Block(model._free, addr, size, device)
        return self.ndarray(shape, dtype, self._MemoryPointer(self._Unowned(addr, size, blk,
                                                                            device), 0))

    def _launch(self, n: int = 1) -> None:
        try:
            self.model._tls.c["launches"] += n
        except AttributeError:
            self.model._c()["launches"] += n

    def _elementwise(self, fn, name, operands, out=None, dtype=None):
        shape, rdtype = _elementwise_result(fn, name, operands, dtype)
        self._launch()
        if out is not None:
            if isinstance(out, tuple):
                out = out[0]
            if tuple(out.shape) != shape and np.broadcast_shapes(out.shape, shape) != out.shape:
                raise ValueError(f"{name}: out has shape {out.shape}, the result {shape}")
            return out
        return self._new(shape, rdtype)

    def _binary(self, fn, name, a, b, inplace=False):
        """``a <op> b`` where one of them is an array of this backend (the hot path)."""
        nd = self.ndarray
        ka = (a.shape, a.dtype) if type(a) is nd else _operand_key(a)
        kb = (b.shape, b.dtype) if type(b) is nd else _operand_key(b)
        ck = (name, ka, kb)
        hit = _binary_cache.get(ck)
        if hit is None:
            shape, rdtype = _elementwise_result(fn, name, (a, b))
            if inplace and shape != a.shape:
                raise ValueError(f"non-broadcastable output operand with shape {a.shape} "
                                 f"doesn't match the broadcast shape {shape}")
            hit = _binary_cache[ck] = (shape, rdtype)
        try:
            self.model._tls.c["launches"] += 1
        except AttributeError:
            self.model._c()["launches"] += 1
        if inplace:
            return a
        return self._new(hit[0], hit[1])

    def _copy(self, x, dtype=None):
        self._launch()
        return self._new(x.shape, x.dtype if dtype is None else dtype)

    def empty(self, shape, dtype=float, order="C"):
        return self._new(shape, dtype)

    def zeros(self, shape, dtype=float, order="C"):
        out = self._new(shape, dtype)
        self.model.count("copies")    # a memset
        return out

    def ones(self, shape, dtype=float):
        return self.full(shape, 1, dtype)

    def full(self, shape, fill_value, dtype=None):
        dtype = np.asarray(fill_value).dtype if dtype is None else dtype
        self._launch()
        return self._new(shape, dtype)

    def empty_like(self, a, dtype=None, shape=None):
        return self._new(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)

    def zeros_like(self, a, dtype=None, shape=None):
        return self.zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)

    def ones_like(self, a, dtype=None, shape=None):
        return self.full(a.shape if shape is None else shape, 1,
                         a.dtype if dtype is None else dtype)

    def full_like(self, a, fill_value, dtype=None, shape=None):
        return self.full(a.shape if shape is None else shape, fill_value,
                         a.dtype if dtype is None else dtype)

    def arange(self, *args, dtype=None):
        return self.asarray(np.arange(*args, dtype=dtype))

    def asarray(self, x, dtype=None, order=None):
        if isinstance(x, self.real.ndarray):
            if dtype is None or np.dtype(dtype) == x.dtype:
                return x
            return x.astype(dtype)
        if hasattr(x, "__cuda_array_interface__"):
            return self._from_interface(x.__cuda_array_interface__, x)
        host = np.asarray(x, dtype=dtype)
        out = self._new(host.shape, host.dtype)
        # As CuPy: staged through its pinned buffers, asynchronous on the current stream.
        self.model.count("copies")
        return out

    array = asarray

    def _from_interface(self, cai, owner):
        dtype = np.dtype(cai["typestr"])
        ptr = int(cai["data"][0])
        device = (ptr >> ADDRESS_SHIFT) - 1
        if not 0 <= device < self.model.num_devices:
            raise ValueError(f"address {ptr:#x} is no stand-in device memory")
        nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * dtype.itemsize
        mem = self._Unowned(ptr, nbytes, owner, device)
        return self.ndarray(tuple(cai["shape"]), dtype, self._MemoryPointer(mem, 0),
                            strides=cai.get("strides"))

    def ascontiguousarray(self, x, dtype=None):
        if isinstance(x, self.real.ndarray) and x._c_contiguous and \
                (dtype is None or np.dtype(dtype) == x.dtype):
            return x
        if not isinstance(x, self.real.ndarray):
            return self.asarray(np.ascontiguousarray(x, dtype=dtype))
        return self._copy(x, dtype)

    def asnumpy(self, x, stream=None, order="C", out=None, blocking=True):
        if isinstance(x, self.real.ndarray):
            return x.get(stream=stream, out=out, blocking=blocking)
        return np.asarray(x)

    def get_array_module(self, *args):
        return self if any(isinstance(a, self.real.ndarray) for a in args) else np

    def concatenate(self, arrays, axis=0, out=None, dtype=None):
        arrays = list(arrays)
        first = tuple(arrays[0].shape)
        ax = axis % len(first)
        shape = first[:ax] + (sum(a.shape[ax] for a in arrays),) + first[ax + 1:]
        rdtype = dtype or np.result_type(*[a.dtype for a in arrays])
        self._launch()
        return out if out is not None else self._new(shape, rdtype)

    def stack(self, arrays, axis=0, out=None):
        arrays = list(arrays)
        return self.concatenate([a.reshape(a.shape[:axis % (a.ndim + 1)] + (1,) +
                                           a.shape[axis % (a.ndim + 1):]) for a in arrays],
                                axis=axis, out=out)

    def moveaxis(self, a, source, destination):
        src = [s % a.ndim for s in (source if isinstance(source, (tuple, list)) else [source])]
        dst = [d % a.ndim for d in (destination if isinstance(destination, (tuple, list))
                                    else [destination])]
        order = [n for n in range(a.ndim) if n not in src]
        for d, s in sorted(zip(dst, src)):
            order.insert(d, s)
        return a.transpose(order)

    def broadcast_to(self, a, shape):
        return self.real.broadcast_to(a, tuple(shape))

    def where(self, cond, x=None, y=None):
        if x is None:
            return cond.nonzero()
        return self._elementwise(np.where, "where", (cond, x, y))

    def clip(self, a, a_min, a_max, out=None):
        return self._elementwise(np.clip, "clip", (a, a_min, a_max), out=out)

    def sum(self, a, axis=None, dtype=None, out=None, keepdims=False):
        return a.sum(axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def mean(self, a, axis=None, dtype=None, out=None, keepdims=False):
        return a.mean(axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def take(self, a, indices, axis=None):
        return a.take(indices, axis=axis)

    def matmul(self, a, b, out=None):
        return a.__matmul__(b) if out is None else out

    dot = matmul

    def from_dlpack(self, x):
        raise TypeError("the stand-in CuPy does not import DLPack capsules")

    def empty_pinned(self, shape, dtype=float, order="C"):
        return self.model.pinned(shape, dtype)

    def get_default_memory_pool(self):
        return _Pool(self.model)

    def get_default_pinned_memory_pool(self):
        return _Pool(self.model)


class _Pool:
    def __init__(self, model):
        self.model = model

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return sum(top - ((d + 1) << ADDRESS_SHIFT) for d, top in self.model._top.items())

    def free_all_blocks(self, stream=None):
        pass

    def n_free_blocks(self):
        return sum(len(v) for v in self.model._free.values())


def _make_memory_pointer(cp: _StandInCupy, real):
    model = cp.model

    class MemoryPointer(real.cuda.MemoryPointer):
        """CuPy's ``MemoryPointer`` whose asynchronous copies are counted, not made."""

        def copy_from_device_async(self, src, size, stream=None):
            model.count("copies")

        def copy_from_host_async(self, mem, size, stream=None):
            model.count("copies")

        def copy_to_host_async(self, mem, size, stream=None):
            model.count("copies")

        def copy_from_device(self, src, size):
            model.count("copies")

        def copy_from_host(self, mem, size):
            model.count("copies")
            model.host_sync("copy_from_host")

        def copy_to_host(self, mem, size):
            model.count("copies")
            model.host_sync("copy_to_host")

        def memset_async(self, value, size, stream=None):
            model.count("copies")

        def memset(self, value, size):
            model.count("copies")
            model.host_sync("memset")

    return MemoryPointer


def _make_ndarray(cp: _StandInCupy, real):
    model = cp.model
    base = real.ndarray

    class ndarray(base):
        """A real ``cupy.ndarray`` whose operations count a launch instead of running."""

        # --- the CUDA Array Interface (CuPy's asks the driver for the current stream)
        @property
        def __cuda_array_interface__(self):
            ptr = self.data.ptr
            s = cp.cuda.get_current_stream()
            return {"shape": self.shape, "typestr": self.dtype.str, "descr": [("", self.dtype.str)],
                    "version": 3, "data": (ptr, False),
                    "strides": None if self._c_contiguous else self.strides,
                    "stream": s.ptr or 1}

        def __array__(self, *args, **kw):
            raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                            "Please use `.get()` to construct a NumPy array explicitly.")

        def __repr__(self):
            return (f"stand-in cupy.ndarray(shape={self.shape}, dtype={self.dtype}, "
                    f"gpu:{self.data.device_id})")

        __str__ = __repr__

        # --- reading back: host synchronizations
        def get(self, stream=None, order="C", out=None, blocking=True):
            model.count("copies")
            if blocking:
                model.host_sync("get")
            if out is not None:
                return out
            return np.zeros(self.shape, self.dtype)

        def set(self, arr, stream=None):
            if not isinstance(arr, np.ndarray):
                raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
            if arr.dtype != self.dtype or arr.shape != self.shape:
                raise ValueError(f"set: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
            model.count("copies")
            if stream is None or not model.is_pinned(arr):
                model.host_sync("set (a copy from pageable host memory)")

        def item(self):
            model.count("copies")
            model.host_sync("item")
            return np.zeros((), self.dtype).item()

        def tolist(self):
            return self.get().tolist()

        def __float__(self):
            return float(self.item())

        def __int__(self):
            return int(self.item())

        def __bool__(self):
            if self.size != 1:
                raise ValueError("The truth value of an array with more than one element "
                                 "is ambiguous.")
            return bool(self.item())

        def __complex__(self):
            return complex(self.item())

        def __index__(self):
            return int(self.item())

        # --- copies and views
        def copy(self, order="C"):
            return cp._copy(self)

        def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
            if not copy and np.dtype(dtype) == self.dtype:
                return self
            return cp._copy(self, dtype)

        def fill(self, value):
            cp._launch()

        def reshape(self, *shape, order="C"):
            if self._c_contiguous:
                return base.reshape(self, *shape)
            return cp._copy(self).reshape(*shape)

        def ravel(self, order="C"):
            return self.reshape(-1)

        def flatten(self, order="C"):
            return cp._copy(self).reshape(-1)

        def __getitem__(self, key):
            if _is_basic_index(key):
                return base.__getitem__(self, key)
            cp._launch()      # a gather
            keys = key if isinstance(key, tuple) else (key,)
            dummy_keys = tuple(np.zeros(k.shape, k.dtype) if isinstance(k, base) else k
                               for k in keys)
            if any(np.asarray(k).dtype == np.bool_ for k in dummy_keys
                   if not (k is None or k is Ellipsis or isinstance(k, slice))):
                model.host_sync("boolean-mask indexing (the result's size)")
            shape = np.lib.stride_tricks.as_strided(
                np.zeros(1, np.bool_), self.shape, (0,) * self.ndim)[dummy_keys].shape
            return cp._new(shape, self.dtype)

        def __setitem__(self, key, value):
            cp._launch()

        def take(self, indices, axis=None):
            cp._launch()
            ishape = tuple(getattr(indices, "shape", np.shape(indices)))
            if axis is None:
                shape = ishape
            else:
                ax = axis % self.ndim
                shape = self.shape[:ax] + ishape + self.shape[ax + 1:]
            return cp._new(shape, self.dtype)

        # --- reductions
        def _reduce(self, name, axis=None, dtype=None, out=None, keepdims=False):
            shape, rdtype = _reduction_result(name, self.shape, self.dtype, axis,
                                              None if dtype is None else np.dtype(dtype),
                                              keepdims)
            cp._launch()
            if out is not None:
                if tuple(out.shape) != shape:
                    raise ValueError(f"{name}: out has shape {out.shape}, the result {shape}")
                return out
            return cp._new(shape, rdtype)

        def sum(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("sum", axis, dtype, out, keepdims)

        def prod(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("prod", axis, dtype, out, keepdims)

        def mean(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("mean", axis, dtype, out, keepdims)

        def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            return self._reduce("var", axis, dtype, out, keepdims)

        def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            return self._reduce("std", axis, dtype, out, keepdims)

        def max(self, axis=None, out=None, keepdims=False):
            return self._reduce("max", axis, None, out, keepdims)

        def min(self, axis=None, out=None, keepdims=False):
            return self._reduce("min", axis, None, out, keepdims)

        def any(self, axis=None, out=None, keepdims=False):
            return self._reduce("any", axis, None, out, keepdims)

        def all(self, axis=None, out=None, keepdims=False):
            return self._reduce("all", axis, None, out, keepdims)

        def argmax(self, axis=None, out=None, keepdims=False):
            return self._reduce("argmax", axis, None, out, keepdims)

        def argmin(self, axis=None, out=None, keepdims=False):
            return self._reduce("argmin", axis, None, out, keepdims)

        def clip(self, min=None, max=None, out=None):
            return cp._elementwise(np.clip, "clip", (self, min, max), out=out)

        def nonzero(self):
            model.host_sync("nonzero (the result's size)")
            cp._launch()
            return tuple(cp._new((0,), np.int64) for _ in range(self.ndim))

        def dot(self, b, out=None):
            return self.__matmul__(b) if out is None else out

        # --- arithmetic
        def __matmul__(self, other):
            cp._launch()
            return cp._new(_matmul_shape(self.shape, tuple(other.shape)),
                           np.result_type(self.dtype, other.dtype))

        def __rmatmul__(self, other):
            cp._launch()
            return cp._new(_matmul_shape(tuple(other.shape), self.shape),
                           np.result_type(self.dtype, other.dtype))

        def __neg__(self):
            return cp._elementwise(np.negative, "negative", (self,))

        def __pos__(self):
            return cp._copy(self)

        def __abs__(self):
            return cp._elementwise(np.absolute, "absolute", (self,))

        def __invert__(self):
            return cp._elementwise(np.invert, "invert", (self,))

        __hash__ = base.__hash__

        # NumPy's functions and ufuncs called on these arrays.
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            if method != "__call__":
                return NotImplemented
            return cp._elementwise(ufunc, ufunc.__name__, inputs, out=kwargs.get("out"),
                                   dtype=kwargs.get("dtype"))

        def __array_function__(self, func, types, args, kwargs):
            fn = getattr(cp, func.__name__, None)
            if fn is None:
                return NotImplemented
            return fn(*args, **kwargs)

    def binary(fn, name, reflected=False, inplace=False):
        if inplace:
            def method(self, other):
                return cp._binary(fn, name, self, other, inplace=True)
        elif reflected:
            def method(self, other):
                return cp._binary(fn, name, other, self)
        else:
            def method(self, other):
                return cp._binary(fn, name, self, other)
        return method

    for name, fn in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                     ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                     ("pow", np.power), ("mod", np.mod), ("and", np.bitwise_and),
                     ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                     ("lshift", np.left_shift), ("rshift", np.right_shift)):
        setattr(ndarray, f"__{name}__", binary(fn, name))
        setattr(ndarray, f"__r{name}__", binary(fn, name, reflected=True))
        setattr(ndarray, f"__i{name}__", binary(fn, name, inplace=True))
    for name, fn in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less),
                     ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal)):
        setattr(ndarray, f"__{name}__", binary(fn, name))
    # kernels/_launch.py and devices.py recognise CuPy arrays by their class's module.
    ndarray.__module__ = "cupy._core.core"
    ndarray.__qualname__ = ndarray.__name__ = "ndarray"
    return ndarray


# --- cupy.cuda ------------------------------------------------------------------------------

def _make_cuda(cp: _StandInCupy):
    model = cp.model

    class Device:
        """``cupy.cuda.Device``: entering it makes it the thread's current device."""

        def __init__(self, device=None):
            self.id = model.current_device() if device is None else int(device)
            if not 0 <= self.id < model.num_devices:
                raise RuntimeError(f"cudaErrorInvalidDevice: gpu:{self.id} does not exist "
                                   f"(the stand-in shows {model.num_devices})")

        def __enter__(self):
            devs = model.devs()
            devs.append(self.id)
            model._c()["device_enters"] += 1
            return self

        def __exit__(self, *exc):
            model.devs().pop()

        def use(self):
            model.devs()[-1] = self.id

        def synchronize(self):
            model.host_sync(f"Device({self.id}).synchronize")

        compute_capability = "90"

        def __eq__(self, other):
            return getattr(other, "id", None) == self.id

        def __hash__(self):
            return self.id

        def __repr__(self):
            return f"<stand-in CUDA Device {self.id}>"

    _streams_by_ptr: dict = {}
    _null: dict = {}

    class Event:
        """``cupy.cuda.Event``: creations (with or without timing), records, queries."""

        def __init__(self, block=False, disable_timing=False, interprocess=False):
            c = model._c()
            c["event_creations"] += 1
            if not disable_timing:
                c["timing_events"] += 1
            self.ptr = id(self)
            self.disable_timing = disable_timing

        def record(self, stream=None):
            model._c()["event_records"] += 1

        @property
        def done(self):
            model._c()["event_queries"] += 1
            return True

        def query(self):
            return self.done

        def synchronize(self):
            model.host_sync("Event.synchronize")

    class Stream:
        """``cupy.cuda.Stream``: the thread's current stream of its device inside ``with``."""

        def __init__(self, null=False, non_blocking=False, ptr=0, priority=None,
                     _device=None):
            dev = model.current_device() if _device is None else _device
            self.device_id = dev
            if null:
                self.ptr = 0
            else:
                self.ptr = model.new_stream_ptr()
                model._c()["stream_creations"] += 1
                _streams_by_ptr[self.ptr] = dev

        @staticmethod
        def from_external(obj):
            _, handle = obj.__cuda_stream__()
            return ExternalStream(handle)

        def _check_device(self):
            cur = model.current_device()
            if cur != self.device_id:
                raise RuntimeError(f"The device that the stream is created on "
                                   f"({self.device_id}) and the current device ({cur}) differ")

        def __enter__(self):
            self._check_device()
            stacks = model.stacks()
            stack = stacks.get(self.device_id)
            if stack is None:
                stack = stacks[self.device_id] = []
            stack.append(self)
            return self

        def __exit__(self, *exc):
            model.stacks()[self.device_id].pop()

        def use(self):
            self._check_device()
            stack = model.stacks().setdefault(self.device_id, [])
            if stack:
                stack[-1] = self
            else:
                stack.append(self)
            return self

        def record(self, event=None):
            if event is None:
                event = Event()
            event.record(self)
            return event

        def wait_event(self, event):
            model._c()["event_waits"] += 1

        def synchronize(self):
            model.host_sync("Stream.synchronize")

        @property
        def done(self):
            model._c()["event_queries"] += 1
            return True

        def query(self):
            return self.done

        def __eq__(self, other):
            return getattr(other, "ptr", None) == self.ptr and \
                getattr(other, "device_id", None) == self.device_id

        def __hash__(self):
            return hash((self.ptr, self.device_id))

        def __repr__(self):
            return f"<stand-in Stream {self.ptr:#x} (device {self.device_id})>"

    class ExternalStream(Stream):
        def __init__(self, ptr, device_id=-1):
            ptr = int(ptr)
            self.ptr = 0 if ptr in (0, 1) else ptr
            self.device_id = (_streams_by_ptr.get(ptr, model.current_device())
                              if device_id < 0 else int(device_id))

    def null_stream(device: int):
        s = _null.get(device)
        if s is None:
            s = _null[device] = Stream(null=True, _device=device)
        return s

    def get_current_stream(device_id=-1):
        device = model.current_device() if device_id is None or device_id < 0 else device_id
        stack = model.stacks().get(device)
        return stack[-1] if stack else null_stream(device)

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: model.num_devices,
        getDevice=model.current_device,
        setDevice=lambda i: Device(i).use(),
        getDeviceProperties=lambda i: {"name": b"gpustrat stand-in (no device)",
                                       "major": 9, "minor": 0, "multiProcessorCount": 132,
                                       "totalGlobalMem": 80 << 30},
        deviceSynchronize=lambda: model.host_sync("deviceSynchronize"),
        memGetInfo=lambda: (80 << 30, 80 << 30),
        runtimeGetVersion=lambda: 13000,
        driverGetVersion=lambda: 13000)
    return types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
        get_current_stream=get_current_stream, runtime=runtime,
        MemoryPointer=cp._MemoryPointer, UnownedMemory=cp._Unowned,
        get_elapsed_time=lambda start, stop: 0.0,
        is_available=lambda: True)


# --- cupy.cuda.nccl -------------------------------------------------------------------------

class _StandInNccl:
    """``cupy.cuda.nccl``: communicators whose calls are counted (and never wait)."""

    available = True
    NCCL_INT8 = NCCL_CHAR = 0
    NCCL_UINT8 = 1
    NCCL_INT32 = NCCL_INT = 2
    NCCL_UINT32 = 3
    NCCL_INT64 = 4
    NCCL_UINT64 = 5
    NCCL_FLOAT16 = NCCL_HALF = 6
    NCCL_FLOAT32 = NCCL_FLOAT = 7
    NCCL_FLOAT64 = NCCL_DOUBLE = 8
    NCCL_BFLOAT16 = 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)

    class NcclError(RuntimeError):
        pass

    def __init__(self, model: StandIn, cp: _StandInCupy):
        self.model, self.cupy = model, cp
        self._ids = 0
        nccl = self

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                if not isinstance(commId, (bytes, tuple)):
                    raise TypeError(f"commId must be bytes or a tuple, got "
                                    f"{type(commId).__name__}")
                self.n, self.rank = int(ndev), int(rank)
                self.dev = model.current_device()
                self.aborted = False

            @staticmethod
            def initAll(devices):
                uid = nccl.get_unique_id()
                comms = []
                for r, d in enumerate(devices):
                    with cp.cuda.Device(d):
                        comms.append(NcclCommunicator(len(devices), uid, r))
                return comms

            def _call(self):
                if self.aborted:
                    raise nccl.NcclError("ncclInvalidUsage: the communicator was aborted")
                model._c()["nccl_calls"] += 1

            def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
                self._call()

            def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
                self._call()

            def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
                self._call()

            def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
                self._call()

            def bcast(self, buff, count, datatype, root, stream):
                self._call()

            def allGather(self, sendbuf, recvbuf, count, datatype, stream):
                self._call()

            def send(self, sendbuf, count, datatype, peer, stream):
                self._call()

            def recv(self, recvbuf, count, datatype, peer, stream):
                self._call()

            def check_async_error(self):
                pass

            def abort(self):
                self.aborted = True

            def destroy(self):
                self.aborted = True

            def rank_id(self):
                return self.rank

            def size(self):
                return self.n

            def device_id(self):
                return self.dev

        self.NcclCommunicator = NcclCommunicator

    def get_version(self):
        return 22703

    def get_build_version(self):
        return 22703

    def get_unique_id(self):
        self._ids += 1
        return self._ids.to_bytes(8, "little") + bytes(120)

    def groupStart(self):
        self.model._c()["nccl_groups"] += 1

    def groupEnd(self):
        pass


# --- numba.cuda -----------------------------------------------------------------------------

class _NumbaStream:
    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = int(handle)

    def __int__(self):
        return self.handle

    def __repr__(self):
        return f"<stand-in numba stream {self.handle:#x}>"


# kernels/_launch.py recognises Numba streams by their class's module.
_NumbaStream.__module__ = "numba.cuda.cudadrv.driver"


class _DeviceArray:
    """A Numba device array over an address range (what launches take)."""

    __slots__ = ("ptr", "shape", "dtype", "owner", "_mem")

    def __init__(self, ptr, shape, dtype, owner=None):
        self.ptr, self.shape, self.dtype, self.owner = int(ptr), tuple(shape), np.dtype(dtype), owner

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                "data": (self.ptr, False), "strides": None, "stream": None}

    def copy_to_host(self, ary=None, stream=0):
        raise NotImplementedError


class _Kernel:
    def __init__(self, cuda, name: str):
        self.cuda, self.__name__ = cuda, name

    def __getitem__(self, config):
        c = self.cuda.model._c

        def launch(*args):
            c()["kernel_launches"] += 1
            c()["launches"] += 1
        return launch


class _GpuContext:
    """``with numba.cuda.gpus[i]:`` makes device ``i`` Numba's current device."""

    __slots__ = ("cuda", "i")

    def __init__(self, cuda, i: int):
        self.cuda, self.i = cuda, i

    def __enter__(self):
        self.cuda._devs().append(self.i)

    def __exit__(self, *exc):
        self.cuda._devs().pop()


class _Gpus:
    def __init__(self, cuda):
        self.cuda = cuda

    def __getitem__(self, i):
        return _GpuContext(self.cuda, int(i))

    def __len__(self):
        return self.cuda.model.num_devices


class _StandInNumbaCuda:
    """``numba.cuda`` as far as kernels/_launch.py uses it; launches are counted."""

    #: kernels/_launch.py binds nothing into the kernel modules for a test backend.
    is_fake = True

    def __init__(self, model: StandIn, cp: _StandInCupy):
        self.model, self.cupy = model, cp
        self._tls = threading.local()
        self.gpus = _Gpus(self)
        self._streams: dict = {}

    def _devs(self):
        try:
            return self._tls.devs
        except AttributeError:
            d = self._tls.devs = [0]
            return d

    def jit(self, fn=None, device=False, **kw):
        if device:
            return fn if fn is not None else (lambda f: f)
        if fn is None:
            return lambda f: _Kernel(self, f.__name__)
        return _Kernel(self, fn.__name__)

    def is_available(self):
        return True

    def default_stream(self):
        return _NumbaStream(0)

    def legacy_default_stream(self):
        return _NumbaStream(1)

    def per_thread_default_stream(self):
        return _NumbaStream(2)

    def external_stream(self, ptr):
        s = self._streams.get(ptr)
        if s is None:
            s = self._streams[ptr] = _NumbaStream(ptr)
        return s

    def from_cuda_array_interface(self, desc, owner=None, sync=True):
        if sync and desc.get("stream"):
            self.model.host_sync("Numba import of an array (sync=True)")
        return _DeviceArray(desc["data"][0], desc["shape"], desc["typestr"], owner)

    def as_cuda_array(self, obj, sync=True):
        return self.from_cuda_array_interface(obj.__cuda_array_interface__, obj, sync)

    def device_array(self, shape, dtype=np.float64, stream=0):
        dtype = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        blk = self.model.alloc(self._devs()[-1], int(np.prod(shape)) * dtype.itemsize)
        arr = _DeviceArray(blk.addr, shape, dtype)
        arr._mem = blk
        return arr

    def to_device(self, host, stream=0):
        """cuMemAlloc and a synchronous copy (cuMemFree later): a host wait."""
        host = np.asarray(host)
        arr = self.device_array(host.shape, host.dtype)
        self.model.count("copies")
        self.model.host_sync("numba.cuda.to_device")
        return arr

    def synchronize(self):
        self.model.host_sync("numba.cuda.synchronize")
