"""Every CuPy, NCCL and Numba entry point of the GPU path, called against the real
installed packages with the argument types gpustrat passes.

Run as a script (by ``test_real_cupy.py``, in a child whose ``PYTHONPATH`` selects
one CuPy install) it prints one JSON object: for each entry point, whether the call
returned or what it raised. On a machine without a GPU a call may fail for lack of a
device (``CUDARuntimeError``, ``CUDADriverError``, ``NcclError``,
``CudaSupportError``); a ``TypeError`` or ``AttributeError`` means gpustrat calls the
package in a way this version does not accept.

Imported (by the parent test) it only defines the table: ``ENTRY_POINTS`` maps each
entry point's name, as gpustrat's source spells it with the module written out
(``cupy.cuda.Device``, ``cupy.cuda.nccl.get_unique_id``, ``numba.cuda.compile_ptx``),
to the probe that calls it; ``COVERED_ELSEWHERE`` names those checked by another test.
"""

from __future__ import annotations

import contextlib
import json
import sys
import traceback
import warnings

import numpy as np

ENTRY_POINTS: dict = {}

#: Kernel intrinsics and the decorator: compiled to PTX for sm_80 and sm_90 with the
#: real numba-cuda by ``tests/kernels/test_kernels_ptx.py`` (needs no device).
COVERED_ELSEWHERE = {
    "numba.cuda.jit": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.grid": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.gridsize": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.blockIdx": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.blockDim": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.threadIdx": "tests/kernels/test_kernels_ptx.py",
    "numba.cuda.gridDim": "tests/kernels/test_kernels_ptx.py",
}


def entry(*names):
    """Register a probe for the entry points ``names`` (one call may cover several)."""
    def register(fn):
        for name in names:
            ENTRY_POINTS[name] = fn
        return fn
    return register


# --- plumbing: a CuPy array without a device ----------------------------------------------

def fake_array(cp, shape=(4, 8), dtype=np.float32, ptr=0x10000):
    """A ``cupy.ndarray`` over an address that is never dereferenced: CuPy builds it
    without touching a device (``UnownedMemory`` with an explicit device id)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    mem = cp.cuda.UnownedMemory(ptr, nbytes, None, 0)
    return cp.ndarray(shape, dtype, cp.cuda.MemoryPointer(mem, 0))


def fake_event(cp):
    """A ``cupy.cuda.Event`` object holding the null event handle (creating a real
    one needs a device)."""
    ev = cp.cuda.Event.__new__(cp.cuda.Event)
    ev.ptr = 0
    return ev


# --- CuPy: devices and streams --------------------------------------------------------------

@entry("cupy.cuda.runtime.getDeviceCount")
def _(cp, nccl, cuda):
    return cp.cuda.runtime.getDeviceCount()


@entry("cupy.cuda.Device")
def _(cp, nccl, cuda):
    with cp.cuda.Device(1):         # devices.py, nccl.py: ``with cp.cuda.Device(index)``
        pass


@entry("cupy.cuda.Stream")
def _(cp, nccl, cuda):
    return cp.cuda.Stream(non_blocking=True)    # devices.new_stream


@entry("cupy.cuda.get_current_stream")
def _(cp, nccl, cuda):
    return cp.cuda.get_current_stream().ptr


@entry("cupy.cuda.ExternalStream", "cupy.cuda.Stream.from_external")
def _(cp, nccl, cuda):
    from gpustrat.kernels._launch import external_cupy_stream
    s = external_cupy_stream(cp, 12345)     # a launch's raw cudaStream_t
    assert s.ptr == 12345
    with s:
        pass


@entry("cupy.cuda.Stream.record")
def _(cp, nccl, cuda):
    return cp.cuda.Stream.null.record()


@entry("cupy.cuda.Stream.wait_event")
def _(cp, nccl, cuda):
    cp.cuda.Stream.null.wait_event(fake_event(cp))


@entry("cupy.cuda.Stream.synchronize")
def _(cp, nccl, cuda):
    cp.cuda.Stream.null.synchronize()


@entry("cupy.cuda.Event")
def _(cp, nccl, cuda):
    # devices.mark and kept_event: timing-free events, recorded again and again.
    ev = cp.cuda.Event(disable_timing=True)
    cp.cuda.Stream.null.record(ev)


@entry("cupy.cuda.Event.done")
def _(cp, nccl, cuda):
    return fake_event(cp).done


@entry("cupy.cuda.get_elapsed_time")
def _(cp, nccl, cuda):
    return cp.cuda.get_elapsed_time(fake_event(cp), fake_event(cp))


@entry("cupy.cuda.nvtx.RangePush", "cupy.cuda.nvtx.RangePop")
def _(cp, nccl, cuda):
    cp.cuda.nvtx.RangePush("gpustrat probe")
    cp.cuda.nvtx.RangePop()


# --- CuPy: stream capture and private pools (gpustrat/capture.py) ------------------------

def fake_stream(cp):
    """A ``cupy.cuda.Stream`` holding a handle that is never dereferenced (creating a
    real one needs a device): ``ExternalStream`` or, where CuPy deprecates it,
    ``Stream.from_external``."""
    from gpustrat.kernels._launch import external_cupy_stream
    return external_cupy_stream(cp, 0x5000)


@entry("cupy.cuda.Stream.begin_capture")
def _(cp, nccl, cuda):
    fake_stream(cp).begin_capture()               # relaxed mode, CuPy's default


@entry("cupy.cuda.Stream.end_capture")
def _(cp, nccl, cuda):
    return fake_stream(cp).end_capture()


@entry("cupy.cuda.Stream.is_capturing")
def _(cp, nccl, cuda):
    return fake_stream(cp).is_capturing()


@entry("cupy.cuda.graph.Graph.launch")
def _(cp, nccl, cuda):
    # A Graph is only made by end_capture; its launch takes the stream positionally.
    graph = cp.cuda.graph.Graph.__new__(cp.cuda.graph.Graph)
    graph.launch(fake_stream(cp))


@entry("cupy.cuda.runtime.getDevice")
def _(cp, nccl, cuda):
    return cp.cuda.runtime.getDevice()


@entry("cupy.cuda.MemoryPool")
def _(cp, nccl, cuda):
    pool = cp.cuda.MemoryPool()
    pool.malloc(1024)                             # capture.py's allocator


@entry("cupy.cuda.get_allocator", "cupy.cuda.set_allocator", "cupy.get_default_memory_pool")
def _(cp, nccl, cuda):
    previous = cp.cuda.get_allocator() or cp.get_default_memory_pool().malloc
    cp.cuda.set_allocator(cp.cuda.MemoryPool().malloc)
    cp.cuda.set_allocator(previous)


@entry("cupy.cuda.using_allocator")
def _(cp, nccl, cuda):
    with cp.cuda.using_allocator(cp.cuda.MemoryPool().malloc):
        cp.empty((3,), np.float32)


# --- CuPy: arrays ---------------------------------------------------------------------------

@entry("cupy.empty")
def _(cp, nccl, cuda):
    return cp.empty((3, 2), np.dtype(np.float32))


@entry("cupy.zeros")
def _(cp, nccl, cuda):
    return cp.zeros((3, 2), np.float32)


@entry("cupy.full")
def _(cp, nccl, cuda):
    return cp.full(3, np.float32(0), dtype=np.float32)


@entry("cupy.asarray")
def _(cp, nccl, cuda):
    return cp.asarray(np.arange(6, dtype=np.int64).reshape(2, 3))


@entry("cupy.stack", "cupy.concatenate")
def _(cp, nccl, cuda):
    x = fake_array(cp)
    cp.stack([x, x])
    return cp.concatenate([x[:1], x[1:]])


@entry("cupy.arange", "cupy.take")
def _(cp, nccl, cuda):
    # A function's element spec is probed on inputs resized by take(arange(n) % rows).
    index = cp.arange(5) % 4
    return cp.take(fake_array(cp), index, axis=0)


@entry("cupy.moveaxis")
def _(cp, nccl, cuda):
    assert cp.moveaxis(fake_array(cp), 1, 0).shape == (8, 4)


@entry("cupy.ascontiguousarray")
def _(cp, nccl, cuda):
    x = fake_array(cp)
    assert cp.ascontiguousarray(x) is x
    return cp.ascontiguousarray(x.T)


@entry("cupy.tanh")
def _(cp, nccl, cuda):
    return cp.tanh(fake_array(cp))


@entry("cupy.from_dlpack")
def _(cp, nccl, cuda):
    return cp.from_dlpack(fake_array(cp))


@entry("cupy.ndarray", "cupy.ndarray.device.id", "cupy.ndarray.data.ptr",
       "cupy.ndarray.flags.c_contiguous")
def _(cp, nccl, cuda):
    x = fake_array(cp)
    assert isinstance(x, cp.ndarray)
    assert (x.device.id, x.data.ptr, x.flags.c_contiguous) == (0, 0x10000, True)
    assert not x.T.flags.c_contiguous


@entry("cupy.ndarray.get", "cupy.ndarray.set")
def _(cp, nccl, cuda):
    x = fake_array(cp)
    x.set(np.zeros((4, 8), np.float32), stream=cp.cuda.Stream.null)
    return x.get()


@entry("cupy.cuda.MemoryPointer.copy_from_device_async")
def _(cp, nccl, cuda):
    x, y = fake_array(cp), fake_array(cp, ptr=0x20000)
    y.data.copy_from_device_async(x.data, x.nbytes, cp.cuda.Stream.null)


@entry("cupy.cuda.MemoryPointer.__add__", "cupy.cuda.MemoryPointer.memset_async",
       "cupy.cuda.MemoryPointer.device_id")
def _(cp, nccl, cuda):
    # kernels.split zero-fills the rows past a piece's data; the launchers read the
    # device of an array from its memory.
    x = fake_array(cp)
    assert x.data.device_id == 0
    tail = x.data + 16
    assert tail.ptr == x.data.ptr + 16
    tail.memset_async(0, 16, cp.cuda.Stream.null)


@entry("cupy.ndarray.__setitem__", "cupy.ndarray.__itruediv__", "cupy.ndarray.__truediv__")
def _(cp, nccl, cuda):
    x, y = fake_array(cp), fake_array(cp, ptr=0x20000)
    y.T[...] = x.T
    x /= 4
    return x / 4


@entry("cupy.broadcast_to", "cupy.int64")
def _(cp, nccl, cuda):
    # metrics.py: sample weights broadcast to the values; labels compared as int64.
    w = fake_array(cp, (4,)).reshape(4, 1)
    assert cp.broadcast_to(w, (4, 8)).shape == (4, 8)
    return fake_array(cp, (4,), np.int32).astype(cp.int64)


@entry("cupy.maximum")
def _(cp, nccl, cuda):
    # optimizers/adam.py: AMSGrad's running maximum, in place.
    vhat, v = fake_array(cp, (8,)), fake_array(cp, (8,), ptr=0x20000)
    return cp.maximum(vhat, v, out=vhat)


@entry("cupy.sqrt")
def _(cp, nccl, cuda):
    return cp.sqrt(fake_array(cp, (8,)))         # optimizers/adam.py: sqrt(v)


@entry("cupy.sort", "cupy.argsort", "cupy.int32")
def _(cp, nccl, cuda):
    # metrics: top-k accuracy sorts the scores; AUC's rank of each score
    scores = fake_array(cp, (4, 5))
    kth = cp.sort(scores, axis=-1)[:, 2]
    return cp.argsort(cp.argsort(-scores, axis=-1), axis=-1), kth.astype(cp.int32)


@entry("cupy.searchsorted", "cupy.bincount", "cupy.cumsum", "cupy.clip", "cupy.ones")
def _(cp, nccl, cuda):
    # metrics/confusion.py: thresholds' buckets, counted and accumulated
    pred = cp.clip(fake_array(cp, (8,)), 0.0, 1.0)
    below = cp.searchsorted(fake_array(cp, (3,)), pred, side="left")
    counts = cp.bincount(below, weights=cp.ones((8,), np.float32), minlength=4)
    return cp.cumsum(counts.reshape(1, -1), axis=1)


@entry("cupy.exp", "cupy.log", "cupy.sign", "cupy.isfinite")
def _(cp, nccl, cuda):
    # metrics (a sigmoid, AUC's interpolation), Lion's sign, the loss scale's check
    x = fake_array(cp, (8,))
    return 1 / (1 + cp.exp(-x)), cp.log(x), cp.sign(x), cp.isfinite(x).all()


@entry("cupy.square", "cupy.abs", "cupy.minimum", "cupy.sum", "cupy.ones_like")
def _(cp, nccl, cuda):
    # optimizers: RMSprop/Adagrad/Adadelta/Nadam square the gradient, Adamax takes its
    # absolute value; clipping.py sums squares into a norm and scales by a minimum.
    g = fake_array(cp, (8,))
    norm = cp.sum(cp.square(g))
    scale = cp.minimum(cp.ones_like(norm), norm)
    return cp.abs(g) * scale


@entry("cupy.float32", "cupy.uint32")
def _(cp, nccl, cuda):
    # optimizers/bfloat16.py: float32 values reinterpreted as uint32 bit patterns and
    # back (views: no device work).
    x = fake_array(cp, (8,))
    u = cp.ascontiguousarray(x, dtype=cp.float32).view(cp.uint32)
    assert u.dtype == np.uint32 and u.data.ptr == x.data.ptr
    f = u.view(cp.float32)
    assert f.dtype == np.float32 and f.data.ptr == x.data.ptr


@entry("cupy.uint16")
def _(cp, nccl, cuda):
    return fake_array(cp, (8,), np.uint32).astype(cp.uint16)   # the rounded bit patterns


@entry("cupy.where")
def _(cp, nccl, cuda):
    # optimizers/bfloat16.py: a NaN's pattern chosen element-wise (x != x is the mask).
    nan = fake_array(cp, (8,), np.bool_)
    return cp.where(nan, cp.uint16(0x7FC0), fake_array(cp, (8,), np.uint16, ptr=0x20000))


# --- NCCL -----------------------------------------------------------------------------------

@entry("cupy.cuda.nccl.available", "cupy.cuda.nccl.get_version",
       "cupy.cuda.nccl.get_build_version")
def _(cp, nccl, cuda):
    assert nccl.available is True
    return int(nccl.get_version()), int(nccl.get_build_version())


@entry("cupy.cuda.nccl.get_unique_id")
def _(cp, nccl, cuda):
    from gpustrat.collectives.rendezvous import unique_id_bytes
    uid = nccl.get_unique_id()
    return f"{type(uid).__name__} of {len(unique_id_bytes(uid))} bytes"


@entry("cupy.cuda.nccl.NcclCommunicator")
def _(cp, nccl, cuda):
    """gpustrat's multi-worker constructor path, with the id from the real
    ``get_unique_id`` in the form this CuPy takes."""
    from gpustrat.collectives.rendezvous import new_communicator, unique_id_bytes
    return new_communicator(nccl, 2, unique_id_bytes(nccl.get_unique_id()), 0)


@entry("gpustrat.collectives.nccl.NcclCommunicator(workers=2)")
def _(cp, nccl, cuda):
    """gpustrat's whole multi-worker constructor, as worker 0 of 2: the real
    ``get_unique_id``, the rendezvous, and the real constructor inside a group
    (``cupy.cuda.Device`` is made a no-op so the call gets past entering the device)."""
    from gpustrat.collectives.base import LocalWorkerGroup
    from gpustrat.collectives.nccl import NcclCommunicator
    from gpustrat.devices import Device

    class FirstOfTwo(LocalWorkerGroup):
        size = 2

        def allgather(self, obj):
            return [obj, obj]

    real = cp.cuda.Device
    cp.cuda.Device = lambda index: contextlib.nullcontext()
    try:
        return NcclCommunicator([Device("gpu", 0)], FirstOfTwo(), timeout=5)
    finally:
        cp.cuda.Device = real


@entry("cupy.cuda.nccl.NcclCommunicator.initAll")
def _(cp, nccl, cuda):
    return nccl.NcclCommunicator.initAll([0, 1])


@entry("cupy.cuda.nccl.groupStart", "cupy.cuda.nccl.groupEnd")
def _(cp, nccl, cuda):
    nccl.groupStart()
    nccl.groupEnd()


def null_comm(nccl):
    """A communicator object holding no NCCL communicator: its methods reach NCCL,
    which refuses the null handle (NCCL_ERROR_INVALID_ARGUMENT)."""
    return nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)


@entry("cupy.cuda.nccl.NcclCommunicator.allReduce")
def _(cp, nccl, cuda):
    # nccl.py: c.allReduce(send.data.ptr, recv.data.ptr, count, dt, op, stream.ptr)
    null_comm(nccl).allReduce(0x10000, 0x20000, 4, int(nccl.NCCL_FLOAT32),
                              int(nccl.NCCL_SUM), 0)


@entry("cupy.cuda.nccl.NcclCommunicator.reduce")
def _(cp, nccl, cuda):
    # nccl.py (strategy.reduce): c.reduce(send, recv, count, dt, op, root, stream.ptr)
    null_comm(nccl).reduce(0x10000, 0x20000, 4, int(nccl.NCCL_FLOAT32),
                           int(nccl.NCCL_SUM), 0, 0)


@entry("cupy.cuda.nccl.NcclCommunicator.reduceScatter")
def _(cp, nccl, cuda):
    null_comm(nccl).reduceScatter(0x10000, 0x20000, 2, int(nccl.NCCL_FLOAT32),
                                  int(nccl.NCCL_AVG), 0)


@entry("cupy.cuda.nccl.NcclCommunicator.broadcast")
def _(cp, nccl, cuda):
    null_comm(nccl).broadcast(0x10000, 0x20000, 16, int(nccl.NCCL_INT8), 1, 0)


@entry("cupy.cuda.nccl.NcclCommunicator.allGather")
def _(cp, nccl, cuda):
    null_comm(nccl).allGather(0x10000, 0x20000, 16, int(nccl.NCCL_INT8), 0)


@entry("cupy.cuda.nccl.NcclCommunicator.check_async_error")
def _(cp, nccl, cuda):
    null_comm(nccl).check_async_error()


@entry("cupy.cuda.nccl.NcclCommunicator.abort", "cupy.cuda.nccl.NcclCommunicator.destroy")
def _(cp, nccl, cuda):
    c = null_comm(nccl)
    c.abort()
    c.destroy()


# --- Numba ----------------------------------------------------------------------------------

@entry("numba.cuda.compile_ptx")
def _(cp, nccl, cuda):
    # A launch's compilation (_launch.Kernel.ptx), with the real numba-cuda: the PTX
    # of a pack kernel for sm_90 (no device needed, but libNVVM: without it
    # tests/kernels/test_kernels_ptx.py skips too, and says why).
    from numba.cuda.cudadrv import nvvm
    from gpustrat.kernels import pack
    try:
        nvvm.NVVM()
    except Exception as e:  # NvvmSupportError: no CUDA toolkit here
        return f"not compiled: no libNVVM ({type(e).__name__})"
    ptx, entry = pack.specialisations()[0].ptx((9, 0))
    assert ".target sm_90" in ptx and f".entry {entry}(" in ptx
    return entry


@entry("cupy.cuda.Device.compute_capability")
def _(cp, nccl, cuda):
    return cp.cuda.Device(0).compute_capability        # _launch.compute_capability


@entry("cupy.cuda.runtime.getDevice")
def _(cp, nccl, cuda):
    return cp.cuda.runtime.getDevice()                  # the launchers' current device


@entry("cupy.RawModule", "cupy.RawModule.get_function")
def _(cp, nccl, cuda):
    # A launch's module: PTX from a file (_launch.Kernel.function; a kernel of the
    # same form as Numba's, written here so that no libNVVM is needed); loading it is
    # what needs a device.
    from gpustrat.kernels import _launch
    ptx = (".version 7.0\n.target sm_80\n.address_size 64\n\n"
           ".visible .entry probe(\n\t.param .u64 probe_param_0\n)\n{\n\tret;\n}\n")
    return cp.RawModule(path=_launch._ptx_file(ptx)).get_function("probe")


@entry("cupy.cuda.function", "cupy.cuda.function.CIntptr",
       "cupy.cuda.function.CNumpyArray")
def _(cp, nccl, cuda):
    # The launch arguments of a plan: int64 words as CIntptr, other scalars (a float16
    # scale) as CNumpyArray, made without a device.
    from gpustrat.kernels import _launch
    sig = (_launch.Arg(np.dtype(np.float16), 1), _launch.Arg(np.dtype(np.int64)),
           _launch.Arg(np.dtype(np.float16)))
    args = _launch.cupy_args(cp, _launch.flatten(sig, [(0x10000, (8,)), 3, 0.5]))
    assert [type(a).__name__ for a in args] == ["CIntptr"] * 8 + ["CNumpyArray"]
    assert all(isinstance(a, cp.cuda.function.CPointer) for a in args)
    return len(args)


# --- gpustrat's launchers, with real CuPy arrays --------------------------------------------

def fake_tensors(cp):
    from gpustrat.kernels import _launch
    tensors = [fake_array(cp, (3,), ptr=0x10000), fake_array(cp, (5, 2), ptr=0x20000)]
    assert all(_launch._is_cupy(t) for t in tensors)
    return tensors


@entry("gpustrat.kernels.pack.pack")
def _(cp, nccl, cuda):
    from gpustrat.kernels.pack import pack
    pack(fake_tensors(cp), out=fake_array(cp, (13,), ptr=0x30000))


@entry("gpustrat.kernels.pack.unpack")
def _(cp, nccl, cuda):
    from gpustrat.kernels.pack import unpack
    unpack(fake_array(cp, (13,), ptr=0x30000), [(3,), (5, 2)], out=fake_tensors(cp))


@entry("gpustrat.kernels.split.split")
def _(cp, nccl, cuda):
    from gpustrat.kernels.split import split
    split(fake_array(cp, (6, 3)), 4, pad_to=2)


@entry("gpustrat.kernels.split.split (gather)")
def _(cp, nccl, cuda):
    from gpustrat.kernels.split import split
    split(fake_array(cp, (6, 3)), 4, index=fake_array(cp, (6,), np.int64, ptr=0x20000),
          check_index=False)


# --- running --------------------------------------------------------------------------------

#: Exceptions CuPy swallowed during the current call (Cython ``except``-less
#: functions report them through ``sys.unraisablehook`` and go on with a default).
_swallowed: list = []


def outcome(fn, cp, nccl, cuda) -> dict:
    _swallowed.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn(cp, nccl, cuda)
            out = {"outcome": "returned", "value": repr(value)[:120]}
        except BaseException as e:  # reported to the parent, judged there
            t = type(e)
            out = {"outcome": "raised", "type": f"{t.__module__}.{t.__qualname__}",
                   "message": str(e)[:300],
                   "traceback": "".join(traceback.format_exception(e))[-1500:]}
    out["warnings"] = sorted({f"{w.category.__name__}: {str(w.message)[:160]}"
                              for w in caught
                              if not issubclass(w.category, ResourceWarning)})
    out["swallowed"] = sorted(set(_swallowed))
    return out


def _record_unraisable(unraisable) -> None:
    t = type(unraisable.exc_value)
    # Objects made without a device complain in __del__ (AttributeError on a field
    # __init__ never set): that is teardown, not the call.
    where = getattr(unraisable.object, "__name__", repr(unraisable.object))
    if "__del__" not in str(where) and "__dealloc__" not in str(where):
        _swallowed.append(f"{t.__module__}.{t.__qualname__}")


def main() -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # CuPy's preload notes; NCCL's absence shows below
        import cupy as cp
        from cupy.cuda import nccl
    from numba import cuda
    try:
        gpus = int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # the expected answer here: no driver, no device
        gpus = 0
    if gpus:
        # The probes hand CuPy made-up device addresses, which a real device would
        # dereference: on a GPU machine tests/gpu runs the real calls instead.
        print(json.dumps({"cupy": cp.__version__, "gpus": gpus}))
        return 0
    report = {"cupy": cp.__version__, "nccl_available": bool(nccl.available),
              "nccl_constants": {n: int(getattr(nccl, n)) for n in dir(nccl)
                                 if n.startswith("NCCL_") and isinstance(
                                     getattr(nccl, n), int)},
              "entries": {}}
    sys.unraisablehook = _record_unraisable
    for name, fn in ENTRY_POINTS.items():
        report["entries"][name] = outcome(fn, cp, nccl, cuda)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
