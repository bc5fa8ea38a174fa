"""The CuPy API surface gpustrat uses, running on the sanitizer's asynchronous model.

Arrays live in pool blocks of :class:`~gpustrat.testing.sanitizer.Sanitizer`; every
operation on them is an op queued on the calling thread's current stream of the
current device, with its reads and writes checked. What CuPy does synchronously
(``get``, ``item``, ``set`` from pageable memory, ``synchronize``) is a host
synchronization here too, and counted. Where CuPy and this fake differ, the fake is
stricter: operands on a device other than the current one are reported, and the
legacy default stream does not synchronize with other streams.
"""

from __future__ import annotations

import threading
import types

import numpy as np

from gpustrat.testing.fake_cuda import make_cuda
from gpustrat.testing.sanitizer import Sanitizer, SanitizerError


def _extent(off: int, shape, strides, itemsize: int) -> tuple[int, int]:
    if any(s == 0 for s in shape):
        return off, off
    lo = hi = off
    for n, st in zip(shape, strides):
        if st >= 0:
            hi += (n - 1) * st
        else:
            lo += (n - 1) * st
    return lo, hi + itemsize


def _c_strides(shape, itemsize: int) -> tuple:
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


class FakeCupy:
    """A module-like object: ``fake.ndarray``, ``fake.empty``, ``fake.cuda.Stream``, ...

    Built by :func:`gpustrat.testing.sanitize`; ``fake.san`` is its model.
    """

    def __init__(self, san: Sanitizer):
        self.san = san
        self._tls = threading.local()
        self._null = {}
        self._pinned: list = []
        fake = self
        self.ndarray = _make_ndarray(fake)
        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                     "uint8", "uint16", "uint32", "uint64", "bool_", "complex64",
                     "complex128"):
            setattr(self, name, getattr(np, name))
        self.dtype = np.dtype
        self.cuda = make_cuda(fake)
        self.cupyx = types.SimpleNamespace(empty_pinned=self.empty_pinned,
                                           zeros_pinned=self.zeros_pinned)

    # --- thread state: current device, current stream per device --------------------------

    def _devs(self) -> list:
        d = getattr(self._tls, "devs", None)
        if d is None:
            d = self._tls.devs = [0]
        return d

    def _nvtx(self) -> list:
        """This thread's open NVTX ranges (``cuda.nvtx.RangePush``), innermost last."""
        r = getattr(self._tls, "nvtx", None)
        if r is None:
            r = self._tls.nvtx = []
        return r

    def _stacks(self) -> dict:
        s = getattr(self._tls, "streams", None)
        if s is None:
            s = self._tls.streams = {}
        return s

    def current_device(self) -> int:
        return self._devs()[-1]

    def null_stream(self, device: int):
        s = self._null.get(device)
        if s is None:
            s = self._null[device] = self.cuda.Stream(null=True, _device=device)
        return s

    def current_stream(self, device: int | None = None):
        device = self.current_device() if device is None or device < 0 else device
        stack = self._stacks().get(device)
        return stack[-1] if stack else self.null_stream(device)

    # --- issuing ------------------------------------------------------------------------------

    def _issue(self, what, run, reads=(), writes=(), stream=None, count="launches"):
        s = (stream or self.current_stream())._s
        return self.san.enqueue(s, what, run, [a._range() for a in reads],
                                [a._range() for a in writes], count=count)

    def _check_device(self, arrays, what: str) -> None:
        dev = self.current_device()
        for a in arrays:
            if isinstance(a, self.ndarray) and a.device.id != dev:
                self.san.report("device", f"{what} reads an array on gpu:{a.device.id} while "
                                f"gpu:{dev} is the current device")

    def _alloc(self, shape, dtype, device=None, stream=None):
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        dtype = np.dtype(dtype)
        device = self.current_device() if device is None else device
        stream = stream or self.current_stream(device)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        mem = _Memory(self.san, self.san.alloc(device, nbytes, stream._s))
        return self.ndarray(mem, 0, shape, dtype)

    def _host_block(self, host: np.ndarray):
        """The pinned buffer holding ``host``, as a sanitizer block, or None (pageable)."""
        ptr = host.__array_interface__["data"][0]
        for blk in self._pinned:
            base = blk.buf.__array_interface__["data"][0]
            if base <= ptr < base + blk.nbytes:
                return blk, ptr - base
        return None

    def _from_host(self, out, host: np.ndarray, stream, staged: bool, what: str):
        """Queue a host-to-device copy into ``out``. ``staged``: CuPy copies the bytes to
        its own pinned buffer first (``asarray``). Otherwise, from pinned memory the bytes
        are read when the copy runs (the host must not overwrite them before); from
        pageable memory they are taken now, which CUDA does by a stream synchronization
        first."""
        host = np.ascontiguousarray(host, dtype=out.dtype).reshape(out.shape)
        found = None if staged else self._host_block(host)
        s = stream or self.current_stream()     # as CuPy: the current device's
        if found is None:
            if not staged:
                self.san.synchronize_stream(s._s, f"pageable host-to-device copy ({what})")
            data = host.copy()
            reads = []
        else:
            blk, off = found
            # The host wrote these bytes just before: that write must come after every
            # earlier device read of them.
            self.san.host_access("host write of pinned memory",
                                 writes=[(blk, off, off + host.nbytes)])
            data = host
            reads = [(blk, off, off + host.nbytes)]

        out_np = out._raw()

        def run():
            out_np()[...] = data
        self.san.enqueue(s._s, what, run, reads, [out._range()], count="copies")
        return out

    # --- creation -------------------------------------------------------------------------

    def empty(self, shape, dtype=float, order="C"):
        return self._alloc(shape, dtype)

    def empty_like(self, a, dtype=None):
        return self._alloc(a.shape, dtype or a.dtype)

    def full(self, shape, fill_value, dtype=None):
        out = self._alloc(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
        out_np = out._raw()
        self._issue("fill", lambda: out_np().fill(fill_value), writes=[out])
        return out

    def zeros(self, shape, dtype=float):
        return self.full(shape, 0, dtype)

    def ones(self, shape, dtype=float):
        return self.full(shape, 1, dtype)

    def zeros_like(self, a, dtype=None):
        return self.zeros(a.shape, dtype or a.dtype)

    def arange(self, *args, dtype=None):
        return self.asarray(np.arange(*args, dtype=dtype))

    def asarray(self, x, dtype=None):
        if isinstance(x, self.ndarray):
            return x if dtype is None or np.dtype(dtype) == x.dtype else x.astype(dtype)
        if hasattr(x, "__cuda_array_interface__"):
            return self._from_interface(x)
        host = np.asarray(x, dtype=dtype)
        out = self._alloc(host.shape, host.dtype)
        # CuPy stages through pinned memory: asynchronous, the bytes taken now.
        self._from_host(out, host, None, True, "host-to-device copy (asarray)")
        out._shadow = host.copy()
        return out

    array = asarray

    def _from_interface(self, x):
        cai = x.__cuda_array_interface__
        blk, off = self.san.block_at(int(cai["data"][0]))
        dtype = np.dtype(cai["typestr"])
        owner = getattr(x, "owner", None)
        mem = owner._mem if isinstance(owner, self.ndarray) else _Memory(self.san, blk, owned=False)
        return self.ndarray(mem, off, tuple(cai["shape"]), dtype, cai.get("strides"))

    def ascontiguousarray(self, x, dtype=None):
        if x.flags.c_contiguous and (dtype is None or np.dtype(dtype) == x.dtype):
            return x
        return x.astype(dtype or x.dtype)

    def asnumpy(self, x, stream=None):
        return x.get(stream=stream) if isinstance(x, self.ndarray) else np.asarray(x)

    def moveaxis(self, a, src, dst):
        return a._view_of(np.moveaxis, src, dst)

    def concatenate(self, arrays, axis=0):
        return _compute(self, "concatenate", lambda *xs: np.concatenate(xs, axis=axis),
                        list(arrays))

    def broadcast_to(self, a, shape):
        return a._view_of(np.broadcast_to, tuple(shape))

    def sqrt(self, a):
        return _compute(self, "sqrt", np.sqrt, [a])

    def maximum(self, a, b, out=None):
        return _compute(self, "maximum", np.maximum, [a, b], out=out)

    def where(self, cond, a, b):
        return _compute(self, "where", np.where, [cond, a, b])

    def minimum(self, a, b, out=None):
        return _compute(self, "minimum", np.minimum, [a, b], out=out)

    def square(self, a):
        return _compute(self, "square", np.square, [a])

    def abs(self, a):
        return _compute(self, "abs", np.abs, [a])

    def clip(self, a, lo, hi):
        return _compute(self, "clip", lambda x: np.clip(x, lo, hi), [a])

    def sum(self, a, axis=None, dtype=None):
        return a.sum(axis=axis, dtype=dtype)

    def stack(self, arrays, axis=0):
        return _compute(self, "stack", lambda *xs: np.stack(xs, axis=axis), list(arrays))

    def ones_like(self, a, dtype=None):
        return self.full(a.shape, 1, a.dtype if dtype is None else dtype)

    def empty_pinned(self, shape, dtype=float):
        dtype = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        raw = np.zeros(max(n, 1), np.uint8)
        from gpustrat.testing.sanitizer import Block  # noqa: PLC0415
        self._pinned.append(Block(0, raw.nbytes, -1, self.san.host, raw))
        return raw[:n].view(dtype).reshape(shape)

    def zeros_pinned(self, shape, dtype=float):
        return self.empty_pinned(shape, dtype)

    def from_dlpack(self, x):
        raise TypeError("the sanitizer's CuPy does not import DLPack capsules")


class _Memory:
    """Owns a pool block; the block goes back to its stream's arena when the last array
    referring to it is gone (CuPy's ``MemoryPointer`` lifetime)."""

    def __init__(self, san, blk, owned: bool = True):
        self.san, self.blk, self.owned = san, blk, owned

    def __del__(self):
        if self.owned:
            try:
                self.san.free(self.blk)
            except Exception:  # interpreter shutdown
                pass


def _compute(fake, what, fn, operands, out=None):
    """An array operation: shape and dtype from NumPy on dummies now, values when it runs."""
    arrays = [o for o in operands if isinstance(o, fake.ndarray)]
    fake._check_device(arrays, what)
    dummies = [np.zeros(o.shape, o.dtype) if isinstance(o, fake.ndarray) else o
               for o in operands]
    with np.errstate(all="ignore"):
        shaped = np.asarray(fn(*dummies))
    if out is None:
        out = fake._alloc(shaped.shape, shaped.dtype)

    raws = [o._raw() if isinstance(o, fake.ndarray) else (lambda o=o: o) for o in operands]
    out_np = out._raw()

    def run():
        with np.errstate(all="ignore"):
            out_np()[...] = fn(*[r() for r in raws])
    fake._issue(what, run, reads=arrays, writes=[out])
    return out


def _element_as_view(a: np.ndarray, key):
    """``a[key]``, where an element is a 0-d view as CuPy's (NumPy's is a scalar)."""
    v = a[key]
    if not isinstance(v, np.ndarray):
        v = a[(key if isinstance(key, tuple) else (key,)) + (Ellipsis,)]
    return v


def _make_ndarray(fake: FakeCupy):
    class ndarray:
        def __init__(self, mem, off, shape, dtype, strides=None):
            self._mem, self._off = mem, int(off)
            self.shape = tuple(int(s) for s in shape)
            self.dtype = np.dtype(dtype)
            self.strides = (tuple(int(s) for s in strides) if strides is not None
                            else _c_strides(self.shape, self.dtype.itemsize))
            self.device = fake.cuda.Device(mem.blk.device)
            self.data = _MemoryPointer(fake, mem, self._off)

        # --- geometry
        ndim = property(lambda self: len(self.shape))
        size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))
        itemsize = property(lambda self: self.dtype.itemsize)
        nbytes = property(lambda self: self.size * self.dtype.itemsize)

        @property
        def flags(self):
            c = self.strides == _c_strides(self.shape, self.dtype.itemsize) or self.size <= 1
            return types.SimpleNamespace(c_contiguous=c, f_contiguous=False)

        def _range(self):
            lo, hi = _extent(self._off, self.shape, self.strides, self.dtype.itemsize)
            return self._mem.blk, lo, hi

        def _np(self):
            return np.ndarray(self.shape, self.dtype, buffer=self._mem.blk.buf,
                              offset=self._off, strides=self.strides)

        def _raw(self):
            """A view factory holding the block, not the array: a queued op does not keep
            the memory of its operands alive (CUDA does not either)."""
            blk, off, shape, dtype, strides = (self._mem.blk, self._off, self.shape,
                                               self.dtype, self.strides)
            return lambda: np.ndarray(shape, dtype, buffer=blk.buf, offset=off,
                                      strides=strides)

        def _view_of(self, fn, *args):
            v = fn(self._np(), *args)
            base = self._mem.blk.buf.__array_interface__["data"][0]
            off = v.__array_interface__["data"][0] - base
            if v.size == 0:
                off = min(max(off, 0), self._mem.blk.nbytes)
            elif not np.shares_memory(v, self._mem.blk.buf):
                raise SanitizerError("advanced indexing is not modelled by the fake CuPy")
            return ndarray(self._mem, off, v.shape, v.dtype, v.strides)

        @property
        def __cuda_array_interface__(self):
            s = fake.current_stream()
            return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                    "data": (self.data.ptr, False),
                    "strides": None if self.flags.c_contiguous else self.strides,
                    "stream": s.ptr or 1}

        def __len__(self):
            return self.shape[0]

        def __repr__(self):
            return f"fake cupy.ndarray(shape={self.shape}, dtype={self.dtype}, gpu:{self.device.id})"

        def __array__(self, *a, **k):
            raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                            "Please use `.get()` to construct a NumPy array explicitly.")

        # --- views
        def __getitem__(self, key):
            if isinstance(key, ndarray):      # a gather: one device op
                return _compute(fake, "take", lambda a, i: a[i], [self, key])
            return self._view_of(_element_as_view, key)

        def reshape(self, *shape):
            shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
            if self.flags.c_contiguous:
                return self._view_of(lambda a: a.reshape(shape))
            return self.copy().reshape(shape)

        def ravel(self):
            return self.reshape(-1)

        def view(self, dtype):
            return self._view_of(lambda a: a.view(dtype))

        def transpose(self, *axes):
            return self._view_of(lambda a: a.transpose(*axes))

        T = property(lambda self: self.transpose())

        # --- copies
        def copy(self):
            return self.astype(self.dtype)

        def astype(self, dtype, copy=True):
            if not copy and np.dtype(dtype) == self.dtype:
                return self
            # (np.ascontiguousarray would make a 0-d array 1-d.)
            return _compute(fake, "astype", lambda a: np.array(a, dtype=dtype, order="C"),
                            [self])

        def get(self, stream=None, out=None, blocking=True):
            # As CuPy: the current stream of the *current* device, whatever the array's.
            s = stream or fake.current_stream()
            host = np.empty(self.shape, self.dtype)
            src = self._raw()

            def run():
                host[...] = src()
            fake.san.enqueue(s._s, "device-to-host copy (get)", run, [self._range()],
                             count="copies")
            fake.san.synchronize_stream(s._s, "get")
            if out is not None:
                out[...] = host
                return out
            return host

        def set(self, arr, stream=None):
            if not isinstance(arr, np.ndarray):
                raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
            if arr.dtype != self.dtype or arr.shape != self.shape:
                raise ValueError(f"set: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
            fake._from_host(self, arr, stream, False, "host-to-device copy (set)")

        def item(self):
            return self.get().item()

        def __float__(self):
            return float(self.item())

        def __int__(self):
            return int(self.item())

        def __bool__(self):
            return bool(self.item())

        def __setitem__(self, key, value):
            target = self[key]
            vals = value if isinstance(value, ndarray) else np.asarray(value)
            dst = target._raw()
            src = vals._raw() if isinstance(vals, ndarray) else (lambda: vals)

            def run():
                dst()[...] = src()
            fake._check_device([vals], "setitem")
            fake._issue("setitem", run, reads=[vals] if isinstance(vals, ndarray) else [],
                        writes=[target])

        # --- arithmetic and reductions
        def _reduce(self, name, axis=None, dtype=None, keepdims=False, out=None):
            fn = getattr(np, name)
            kw = {"axis": axis, "keepdims": keepdims}
            if dtype is not None:
                kw["dtype"] = dtype
            if out is None:
                return _compute(fake, name, lambda a: fn(a, **kw), [self])
            # As CuPy: the result goes into ``out`` (same device, the result's shape),
            # cast to its dtype; ``out`` is returned.
            if not isinstance(out, ndarray):
                raise TypeError(f"{name}: out must be a cupy.ndarray, got "
                                f"{type(out).__name__}")
            fake._check_device([self, out], name)
            shape = np.asarray(fn(np.zeros(self.shape, self.dtype), **kw)).shape
            if out.shape != shape:
                raise ValueError(f"{name}: out has shape {out.shape}, the result {shape}")
            return _compute(fake, name, lambda a: fn(a, **kw), [self], out=out)

        def sum(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("sum", axis, dtype, keepdims, out)

        def mean(self, axis=None, dtype=None, keepdims=False):
            return self._reduce("mean", axis, dtype, keepdims)

        def max(self, axis=None, keepdims=False):
            return self._reduce("max", axis, None, keepdims)

        def min(self, axis=None, keepdims=False):
            return self._reduce("min", axis, None, keepdims)

        def argmax(self, axis=None):
            return _compute(fake, "argmax", lambda a: np.argmax(a, axis=axis), [self])

    def binary(fn, reflected=False, inplace=False):
        def method(self, other):
            ops = [other, self] if reflected else [self, other]
            if inplace:
                return _compute(fake, fn.__name__, lambda a, b: fn(a, b).astype(a.dtype),
                                ops, out=self)
            return _compute(fake, fn.__name__, fn, ops)
        return method

    for name, fn in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                     ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                     ("pow", np.power), ("mod", np.mod), ("and", np.bitwise_and),
                     ("or", np.bitwise_or), ("lshift", np.left_shift),
                     ("rshift", np.right_shift)):
        setattr(ndarray, f"__{name}__", binary(fn))
        setattr(ndarray, f"__r{name}__", binary(fn, reflected=True))
        setattr(ndarray, f"__i{name}__", binary(fn, inplace=True))
    for name, fn in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less),
                     ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal)):
        setattr(ndarray, f"__{name}__", binary(fn))
    ndarray.__neg__ = lambda self: _compute(fake, "negative", np.negative, [self])
    ndarray.__hash__ = object.__hash__
    # kernels/_launch.py and devices.py recognise CuPy arrays by their class's module.
    ndarray.__module__ = "cupy._core.core"
    return ndarray


class _MemoryPointer:
    """``ndarray.data``: the memory and an offset in it, as CuPy's ``MemoryPointer``. It
    holds no reference to its array (a cycle would leave the block to the garbage
    collector, which frees it at a moment and in a thread of its own choosing)."""

    def __init__(self, fake, mem, off: int):
        self._fake, self.mem, self._off = fake, mem, off

    @property
    def ptr(self) -> int:
        return self.mem.blk.addr + self._off

    @property
    def device_id(self) -> int:
        return self.mem.blk.device

    def __add__(self, offset: int):
        return _MemoryPointer(self._fake, self.mem, self._off + int(offset))

    def memset_async(self, value: int, size: int, stream=None):
        fake = self._fake
        s = stream or fake.current_stream()
        blk, off = fake.san.block_at(self.ptr, size)

        def run():
            blk.buf[off:off + size] = value
        fake.san.enqueue(s._s, "memset", run, [], [(blk, off, off + size)],
                         count="copies")

    def copy_from_device_async(self, src, size, stream=None):
        fake = self._fake
        s = stream or fake.current_stream()
        dst_blk, dst_off = fake.san.block_at(self.ptr, size)
        src_blk, src_off = fake.san.block_at(src.ptr, size)

        def run():
            dst_blk.buf[dst_off:dst_off + size] = src_blk.buf[src_off:src_off + size]
        fake.san.enqueue(s._s, "device-to-device copy", run,
                         [(src_blk, src_off, src_off + size)],
                         [(dst_blk, dst_off, dst_off + size)], count="copies")
