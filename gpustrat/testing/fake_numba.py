"""The ``numba.cuda`` surface ``kernels/_launch.py`` uses, and the kernels' effects.

A GPU launch of one of gpustrat's kernels is compiled by Numba to PTX
(``compile_ptx``), loaded by CuPy (``cupy.RawModule(path=...).get_function(entry)``)
and called with Numba's flattened argument words as CuPy's argument objects
(``cupy.cuda.function.CIntptr``, ``CNumpyArray``). This module fakes both halves: its
``compile_ptx`` writes a stand-in PTX naming the kernel, and it gives the fake CuPy it
is built with the ``RawModule``, the argument classes and ``Device.compute_capability``
the launch needs. A launch is then an op on CuPy's current stream whose reads and
writes are those of the kernel (decoded from the argument words, which must follow
Numba's array layout, and, for the window kernels, from the offset table the host
uploaded with ``cupy.asarray``), and whose effect is the kernel's, computed with NumPy
when the op runs. Importing an array with ``sync=True`` synchronizes the stream the
exporter names, as Numba does, and is counted as a host synchronization.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from gpustrat.testing.sanitizer import Sanitizer, SanitizerError


class _NumbaStream:
    def __init__(self, handle: int):
        self.handle = int(handle)

    def __int__(self):
        return self.handle

    def __repr__(self):
        return f"<fake numba stream {self.handle:#x}>"


# kernels/_launch.py recognises Numba streams by their class's module.
_NumbaStream.__module__ = "numba.cuda.cudadrv.driver"


class DeviceArray:
    """A device array imported from a pointer (``from_cuda_array_interface``)."""

    def __init__(self, san: Sanitizer, ptr: int, shape, dtype, strides=None, owner=None):
        self.san, self.ptr = san, int(ptr)
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.owner = owner
        size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = size * self.dtype.itemsize
        if strides is not None and tuple(strides) != _c(self.shape, self.dtype.itemsize):
            raise SanitizerError("strided device arrays are not modelled in kernel launches")

    @property
    def blk(self):
        # Resolved on use: a window spans several blocks and is only read through
        # its table (``_span``).
        return self.san.block_at(self.ptr, self.nbytes)[0]

    @property
    def off(self):
        return self.san.block_at(self.ptr, self.nbytes)[1]

    def host_values(self) -> np.ndarray:
        """What the host uploaded into this array (the offset tables)."""
        shadow = getattr(self.owner, "_shadow", None)
        if shadow is None:
            shadow = getattr(self, "_shadow", None)
        if shadow is None:
            blk, off = self.san.block_at(self.ptr, self.nbytes)
            memory, at, values = getattr(blk, "upload", (lambda: None, None, None))
            if memory() is not None and at == off and values.nbytes == self.nbytes:
                shadow = values
        if shadow is None:
            raise SanitizerError("a kernel's table must be a host upload to be modelled")
        return np.asarray(shadow).reshape(self.shape)

    def rng(self):
        blk, off = self.san.block_at(self.ptr, self.nbytes)
        return blk, off, off + self.nbytes

    def np(self) -> np.ndarray:
        blk, off = self.san.block_at(self.ptr, self.nbytes)
        return np.ndarray(self.shape, self.dtype, buffer=blk.buf, offset=off)

    def copy_to_host(self):
        self.san.synchronize_device(self.blk.device)
        return self.np().copy()


def _c(shape, itemsize):
    out, acc = [], itemsize
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _span(san, base: DeviceArray, offset: int, n: int):
    """``(block, lo, hi)`` of elements ``offset .. offset + n`` of ``base``'s dtype."""
    isz = base.dtype.itemsize
    blk, lo = san.block_at(base.ptr + offset * isz, n * isz)
    return blk, lo, lo + n * isz


def flat_view(blk, lo, hi, dtype):
    return np.ndarray(((hi - lo) // np.dtype(dtype).itemsize,), dtype, buffer=blk.buf, offset=lo)


# --- the kernels' effects: (reads, writes, run) from the launch arguments -------------------

def _raw(a: "DeviceArray"):
    """A view factory that holds the block, not the array: a queued op does not keep
    its arguments' memory alive (CUDA does not either)."""
    blk, lo, _ = a.rng()
    shape, dtype = a.shape, a.dtype
    return lambda: np.ndarray(shape, dtype, buffer=blk.buf, offset=lo)


def _split(san, src, out, rows, chunk, n, index=None):
    src_np, out_np = _raw(src), _raw(out)
    index_np = None if index is None else _raw(index)

    def run():
        s, o = src_np(), out_np()
        o = o.reshape(o.shape[0] // rows, rows, *o.shape[1:])
        idx = None if index_np is None else index_np()
        pieces = o.shape[0]
        o[...] = 0
        for p in range(pieces):
            count = max(0, min(chunk, n - p * chunk, rows))
            g = np.arange(p * chunk, p * chunk + count)
            o[p, :count] = s[g if idx is None else idx[g]]
    reads = [src.rng()] + ([] if index is None else [index.rng()])
    return reads, [out.rng()], run


def _windowed(san, win, table, other, scale, packing):
    """pack: win ranges -> other; unpack: other -> win ranges (table: offsets, sizes,
    starts)."""
    offsets, sizes, starts = (np.asarray(r, np.int64) for r in table.host_values())
    wins = [_span(san, win, int(o), int(m)) for o, m in zip(offsets, sizes) if m]
    bufs = [_span(san, other, int(s), int(m)) for s, m in zip(starts, sizes) if m]
    dtype = win.dtype

    def run():
        for w, b in zip(wins, bufs):
            src, dst = (w, b) if packing else (b, w)
            vals = flat_view(*src, dtype)
            flat_view(*dst, dtype)[...] = vals if scale is None else (vals * scale).astype(dtype)
    return (wins if packing else bufs) + [table.rng()], (bufs if packing else wins), run


EFFECTS = {
    "_gather_split_rows": lambda san, src, index, out, rows, chunk, n, zero: _split(
        san, src, out, rows, chunk, n, index),
    "_pack_copy": lambda san, win, table, out, chunk: _windowed(
        san, win, table, out, None, True),
    "_pack_scaled": lambda san, win, table, out, chunk, s: _windowed(
        san, win, table, out, s, True),
    "_unpack_copy": lambda san, buf, table, win, chunk: _windowed(
        san, win, table, buf, None, False),
    "_unpack_scaled": lambda san, buf, table, win, chunk, s: _windowed(
        san, win, table, buf, s, False),
}


class _Kernel:
    def __init__(self, cuda: "FakeNumbaCuda", name: str):
        self.cuda, self.name = cuda, name
        if name not in EFFECTS:
            raise SanitizerError(f"kernel {name} has no modelled effect: add it to "
                                 "gpustrat.testing.fake_numba.EFFECTS")

    def __getitem__(self, config):
        grid, block, stream = (tuple(config) + (0,))[:3]
        cuda = self.cuda

        def launch(*args):
            san = cuda.san
            dev = cuda.current_device()
            handle = int(stream) if stream is not None else 0
            s = san.stream_of_handle(handle, dev)
            reads, writes, run = EFFECTS[self.name](san, *args)
            for blk, _, _ in reads + writes:
                if blk.device != dev:
                    san.report("device", f"kernel {self.name} launched with Numba's current "
                               f"device gpu:{dev} touches memory of gpu:{blk.device}")
                    break
            if s.device != dev:
                san.report("device", f"kernel {self.name} launched on {s!r} from gpu:{dev}")
            san.enqueue(s, f"kernel {self.name}", run, reads, writes)
        return launch


class _CIntptr:
    """``cupy.cuda.function.CIntptr``: one pointer-sized kernel parameter."""

    def __init__(self, value: int):
        self.value = int(value)


class _CNumpyArray:
    """``cupy.cuda.function.CNumpyArray``: a kernel parameter of a NumPy scalar's bytes."""

    def __init__(self, a):
        self.a = np.asarray(a)


class _RawModule:
    """``cupy.RawModule(path=...)`` of a stand-in PTX from :meth:`FakeNumbaCuda.compile_ptx`."""

    def __init__(self, cuda: "FakeNumbaCuda", code=None, *, path=None, **options):
        if code is not None or path is None:
            raise SanitizerError("the sanitizer loads kernels from PTX files only "
                                 "(cupy.RawModule(path=...))")
        with open(path) as f:
            self.ptx = f.read()
        self.cuda = cuda

    def get_function(self, name: str):
        if f".entry {name}(" not in self.ptx or name not in self.cuda.compiled:
            raise SanitizerError(f"no kernel {name} in the module")
        return _RawKernel(self.cuda, *self.cuda.compiled[name])


def _words(args, n: int, what: str) -> list:
    got = args[:n]
    if len(got) < n or not all(isinstance(a, _CIntptr) for a in got):
        raise SanitizerError(f"{what}: expected {n} CIntptr words of Numba's array layout")
    return [a.value for a in got]


class _RawKernel:
    """``RawModule.get_function(entry)``: a launch of the kernel ``name`` compiled for
    ``signature`` (``_launch.Arg``s) on CuPy's current device and stream."""

    def __init__(self, cuda: "FakeNumbaCuda", name: str, signature):
        self.cuda, self.name, self.signature = cuda, name, signature

    def decode(self, args) -> list:
        """The launch's arguments from CuPy's argument objects: each array from the
        ``5 + 2 * ndim`` words of Numba's layout (checked), each scalar its value."""
        args, out = list(args), []
        for k, arg in enumerate(self.signature):
            what = f"kernel {self.name} argument {k}"
            if not arg.ndim:
                a = args.pop(0) if args else None
                if isinstance(a, _CIntptr):
                    value = np.int64(a.value)
                elif isinstance(a, _CNumpyArray):
                    value = a.a[()]
                else:
                    raise SanitizerError(f"{what}: expected a scalar of {arg.dtype}, got {a!r}")
                if value.dtype.itemsize != arg.dtype.itemsize:
                    raise SanitizerError(f"{what}: a scalar of {arg.dtype} is "
                                         f"{arg.dtype.itemsize} bytes, got {value.dtype}")
                out.append(value)
                continue
            words = _words(args, 5 + 2 * arg.ndim, what)
            del args[:5 + 2 * arg.ndim]
            meminfo, parent, nitems, itemsize, ptr = words[:5]
            shape, strides = words[5:5 + arg.ndim], words[5 + arg.ndim:]
            if (meminfo, parent, itemsize) != (0, 0, arg.dtype.itemsize) \
                    or nitems != int(np.prod(shape)) \
                    or tuple(strides) != _c(shape, arg.dtype.itemsize):
                raise SanitizerError(f"{what}: the words {words} are not Numba's layout of "
                                     f"a C-contiguous {arg.dtype} array of shape {shape}")
            out.append(DeviceArray(self.cuda.san, ptr, shape, arg.dtype))
        if args:
            raise SanitizerError(f"kernel {self.name} got {len(args)} arguments too many")
        return out

    def __call__(self, grid, block, args, shared_mem=0):
        cuda, cp = self.cuda, self.cuda.cupy
        dev, san = cp.current_device(), cuda.san
        values = self.decode(args)
        reads, writes, run = EFFECTS[self.name](san, *values)
        for blk, _, _ in reads + writes:
            if blk.device != dev:
                san.report("device", f"kernel {self.name} launched with CuPy's current "
                           f"device gpu:{dev} touches memory of gpu:{blk.device}")
                break
        san.enqueue(cp.current_stream()._s, f"kernel {self.name}", run, reads, writes)


class _Gpus:
    def __init__(self, cuda):
        self.cuda = cuda

    def __getitem__(self, i):
        return _GpuContext(self.cuda, int(i))


class _GpuContext:
    """``with numba.cuda.gpus[i]:`` makes device ``i`` current."""

    def __init__(self, cuda, i: int):
        self.cuda, self.i = cuda, i

    def __enter__(self):
        self.cuda._devs().append(self.i)

    def __exit__(self, *exc):
        self.cuda._devs().pop()

    def __len__(self):
        return self.cuda.san.num_devices


class FakeNumbaCuda:
    """``numba.cuda`` as far as kernels/_launch.py uses it."""

    is_fake = True

    def __init__(self, san: Sanitizer, fake_cupy):
        self.san, self.cupy = san, fake_cupy
        self._tls = threading.local()
        self.gpus = _Gpus(self)
        self.compiled: dict = {}    # entry -> (kernel name, signature)
        self._install_launch(fake_cupy)

    def _install_launch(self, cp) -> None:
        """Give the fake CuPy what a kernel launch uses of CuPy: ``RawModule``, the
        argument objects, a compute capability, and host tables that a launch can read
        back (``cupy.asarray`` of host data records what it uploaded on the block)."""
        cuda = self
        cp.RawModule = lambda code=None, **kw: _RawModule(cuda, code, **kw)
        cp.cuda.function = type("function", (), {"CIntptr": _CIntptr,
                                                 "CNumpyArray": _CNumpyArray})
        cp.cuda.Device.compute_capability = "90"
        upload = cp.asarray

        def asarray(x, dtype=None):
            out = upload(x, dtype)
            shadow = getattr(out, "_shadow", None)
            if shadow is not None:
                blk, lo, _ = out._range()
                blk.upload = (weakref.ref(out._mem), lo, shadow)
            return out
        cp.asarray = cp.array = asarray

    def compile_ptx(self, pyfunc, sig, cc=None, **kw):
        """A stand-in PTX for kernel ``pyfunc`` (``sig``: the launcher's ``_launch.Arg``
        tuple), and its entry remembered for ``RawModule.get_function``."""
        name = pyfunc.__name__
        if name not in EFFECTS:
            raise SanitizerError(f"kernel {name} has no modelled effect: add it to "
                                 "gpustrat.testing.fake_numba.EFFECTS")
        entry = f"_fake_{name}_{len(self.compiled)}"
        self.compiled[entry] = (name, tuple(sig))
        target = "" if cc is None else f".target sm_{cc[0]}{cc[1]}\n"
        params = ",\n".join(f"\t.param .u{8 * a.dtype.itemsize} {entry}_param_{k}"
                             for k, a in enumerate(sig))
        return (f"// gpustrat sanitizer: no device code\n{target}"
                f".visible .entry {entry}(\n{params}\n)\n{{\n}}\n", None)

    def _devs(self):
        d = getattr(self._tls, "devs", None)
        if d is None:
            d = self._tls.devs = [0]
        return d

    def current_device(self) -> int:
        return self._devs()[-1]

    def jit(self, fn=None, **kw):
        if fn is None:
            return lambda f: _Kernel(self, f.__name__)
        return _Kernel(self, fn.__name__)

    def is_available(self):
        return True

    def default_stream(self):
        return _NumbaStream(0)

    def legacy_default_stream(self):
        return _NumbaStream(1)

    def external_stream(self, ptr):
        return _NumbaStream(ptr)

    def from_cuda_array_interface(self, desc, owner=None, sync=True):
        exported = desc.get("stream")
        if sync and exported:
            s = self.san.stream_of_handle(int(exported), self.current_device())
            self.san.synchronize_stream(s, "Numba import of an array (sync=True)")
        return DeviceArray(self.san, desc["data"][0], desc["shape"], desc["typestr"],
                           desc.get("strides"), owner)

    def _new(self, shape, dtype):
        from gpustrat.testing.fake_cupy import _Memory  # noqa: PLC0415
        dtype = np.dtype(dtype)
        shape = tuple(shape) if isinstance(shape, (tuple, list)) else (int(shape),)
        dev = self.current_device()
        blk = self.san.alloc(dev, int(np.prod(shape)) * dtype.itemsize, self.san.null_stream(dev))
        arr = DeviceArray(self.san, blk.addr, shape, dtype)
        arr._mem = _Memory(self.san, blk)
        return arr

    def device_array(self, shape, dtype=np.float64, stream=0):
        return self._new(shape, dtype)

    def to_device(self, host, stream=0):
        """cuMemAlloc and a synchronous copy, then cuMemFree later: a host wait."""
        host = np.ascontiguousarray(host)
        arr = self._new(host.shape, host.dtype)
        self.san.synchronize_device(self.current_device())
        arr.np()[...] = host
        arr._shadow = host.copy()
        return arr
