"""The stand-in backend's ``cupy.cuda.nccl`` and ``numba.cuda``: communicators and
kernel launches that are counted and never wait (see :mod:`gpustrat.testing.standin`).
"""

from __future__ import annotations

import threading

import numpy as np

# --- cupy.cuda.nccl -------------------------------------------------------------------------

class StandInNccl:
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

    def __init__(self, model, cp):
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
                if model.launch_s:
                    model.spin()

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
        model = self.cuda.model

        def launch(*args):
            c = model._c()
            c["kernel_launches"] += 1
            c["launches"] += 1
            if model.launch_s or model.numba_launch_s:
                model.spin(model.launch_s + model.numba_launch_s)
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


class StandInNumbaCuda:
    """``numba.cuda`` as far as kernels/_launch.py uses it; launches are counted."""

    #: kernels/_launch.py binds nothing into the kernel modules for a test backend.
    is_fake = True

    def __init__(self, model, cp):
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

    def compile_ptx(self, pyfunc, sig, cc=None, **kw):
        """A one-entry PTX naming the kernel (the launch loads it through the stand-in
        ``cupy.RawModule``, whose kernels count their launches)."""
        return f".visible .entry {pyfunc.__name__}(\n)\n{{\n}}\n", None

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
