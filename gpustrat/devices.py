"""Devices and the array backend: the one layer that knows NumPy from CuPy.

Words:
- *device*: where arrays live. ``gpu:K`` is CUDA device K and holds CuPy arrays;
  ``cpu:K`` is a logical CPU device in host memory and holds NumPy arrays. Any number
  of logical CPU devices may be named, which is how multi-replica logic runs without
  GPUs.
- *backend*: the array module of a device (``numpy`` or ``cupy``) with the device's
  context and streams.

Everything above this module asks it for the array module, the device context, the
stream, and for moving arrays between host and devices. CuPy is imported lazily, the
first time a GPU is asked for; nothing here runs at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import sys
import threading
from dataclasses import dataclass

import numpy as np

_SPEC = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu)(?::(\d+))?$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class Device:
    """A device: ``kind`` is ``"cpu"`` or ``"gpu"``, ``index`` its number."""

    kind: str
    index: int

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.index}"

    @property
    def is_gpu(self) -> bool:
        return self.kind == "gpu"

    @property
    def xp(self):
        """The array module holding this device's arrays."""
        return cupy() if self.is_gpu else np

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Device('{self.name}')"

    def activate(self):
        """Context manager making this device current (a no-op for CPU devices)."""
        if self.is_gpu:
            return cupy().cuda.Device(self.index)
        return contextlib.nullcontext()


def parse_device(spec) -> Device:
    """Parse ``"GPU:0"``, ``"/gpu:0"``, ``"gpu:0"``, ``"/device:GPU:0"`` (likewise CPU).

    A task prefix such as ``/job:worker/replica:0/task:1/device:CPU:0`` is accepted and
    ignored; a bare ``"cpu"``/``"gpu"`` means index 0.
    """
    if isinstance(spec, Device):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a device is named by a string such as 'gpu:0' or 'cpu:1', "
                        f"got {spec!r} of type {type(spec).__name__}")
    m = _SPEC.match(spec.strip())
    if not m:
        raise ValueError(
            f"malformed device name {spec!r}: use 'gpu:K' or 'cpu:K' "
            "(also accepted: 'GPU:K', '/gpu:K', '/device:GPU:K')")
    return Device(m.group(1).lower(), int(m.group(2) or 0))


# --- CuPy, lazily -----------------------------------------------------------------

_cupy_lock = threading.Lock()
_cupy_mod = None
_cupy_error: Exception | None = None


@dataclass
class Backend:
    """The GPU libraries gpustrat calls: ``cupy``, ``cupyx``, ``cupy.cuda.nccl`` and
    ``numba.cuda``. :func:`use_backend` swaps them for a test backend (the stream-ordering
    sanitizer of ``gpustrat.testing``) for every thread at once."""

    cupy: object
    cupyx: object = None
    nccl: object = None
    numba_cuda: object = None


_backend: Backend | None = None

#: While ``gs.function`` captures a step as CUDA graphs: what the capture offers the
#: layers that send host data to a GPU or watch device work (see
#: :mod:`gpustrat.capture`); None otherwise.
capture_state = None
#: Held while a capture begins or :func:`use_backend` changes the GPU libraries, and by
#: a thread that records events on streams it did not issue the work on (the NCCL
#: watchdog), which records nothing while a capture is on (an event recorded on a stream
#: being captured would become part of the graph) nor under other libraries than the
#: work's.
capture_lock = threading.Lock()


@contextlib.contextmanager
def use_backend(backend: Backend):
    """Make ``backend`` the GPU libraries of this process inside the block (tests)."""
    global _backend
    previous = _backend
    with capture_lock:        # (see capture_lock)
        _backend = backend
        gpu_count.cache_clear()
        _marks.clear()            # events belong to the GPU libraries that made them
        _free_events.clear()
    try:
        yield backend
    finally:
        with capture_lock:
            _backend = previous
            gpu_count.cache_clear()
            _marks.clear()
            _free_events.clear()


def current_backend():
    """The :class:`Backend` of :func:`use_backend` in force, or None (the real CuPy)."""
    return _backend


def cupy():
    """The cupy module; raise a clear RuntimeError if it cannot be imported."""
    global _cupy_mod, _cupy_error
    if _backend is not None:
        return _backend.cupy
    if _cupy_mod is None and _cupy_error is None:
        with _cupy_lock:
            if _cupy_mod is None and _cupy_error is None:
                try:
                    import cupy as cp  # noqa: PLC0415 - lazy by design
                    _cupy_mod = cp
                except Exception as e:  # ImportError, or a broken CUDA install
                    _cupy_error = e
    if _cupy_mod is None:
        raise RuntimeError(
            f"CuPy is needed for GPU devices but could not be imported ({_cupy_error}); "
            "install the cuda13 or cuda12 extra (pip install -e '.[cuda13]'), or use CPU "
            "devices") from _cupy_error
    return _cupy_mod


def cupyx():
    """The cupyx module (pinned host memory)."""
    if _backend is not None:
        return _backend.cupyx
    cupy()
    import cupyx as cx  # noqa: PLC0415
    return cx


def nccl_library():
    """``cupy.cuda.nccl`` (raises ImportError where CuPy has none)."""
    if _backend is not None:
        if _backend.nccl is None:
            raise ImportError("this backend has no NCCL")
        return _backend.nccl
    cupy()
    return importlib.import_module("cupy.cuda.nccl")


def numba_cuda():
    """``numba.cuda``, imported on first use (the kernels' launch layer)."""
    if _backend is not None and _backend.numba_cuda is not None:
        return _backend.numba_cuda
    from numba import cuda  # noqa: PLC0415 - numba is optional
    return cuda


def kernels_simulated() -> bool:
    """True when Numba runs kernels in its CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    if _backend is not None and _backend.numba_cuda is not None:
        return False
    from numba import config  # noqa: PLC0415 - numba is optional
    return bool(config.ENABLE_CUDASIM)


def _loaded_cupy():
    # The CuPy already in use, without importing it (host-only programs never do).
    return _backend.cupy if _backend is not None else sys.modules.get("cupy")


@functools.lru_cache(maxsize=None)
def gpu_count() -> int:
    """Number of visible CUDA devices, as CuPy sees them (Numba's CUDA simulator does not
    count); 0 when CuPy or a driver is missing."""
    try:
        cp = cupy()
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def default_devices() -> list[Device]:
    """Every visible GPU, else ``cpu:0``."""
    n = gpu_count()
    return [Device("gpu", i) for i in range(n)] if n else [Device("cpu", 0)]


def resolve_devices(devices) -> list[Device]:
    """Parse and check a list of device names: GPUs exist, no device twice."""
    if devices is None:
        return default_devices()
    if isinstance(devices, (str, Device)):
        devices = [devices]
    parsed = [parse_device(d) for d in devices]
    if not parsed:
        raise ValueError("devices is empty: name at least one device, or pass None "
                         "for the default (every visible GPU, else cpu:0)")
    seen: dict[Device, int] = {}
    for i, d in enumerate(parsed):
        if d in seen:
            raise ValueError(f"device {d.name} is listed twice (positions {seen[d]} and {i}) "
                             f"in {[str(x) for x in devices]}: each replica needs its own device")
        seen[d] = i
    gpus = [d for d in parsed if d.is_gpu]
    if gpus:
        n = gpu_count()
        if n == 0:
            raise RuntimeError(
                f"GPU device(s) {[d.name for d in gpus]} were asked for but no GPU is visible "
                "(CuPy missing or no CUDA device): use CPU devices such as 'cpu:0', 'cpu:1'")
        bad = [d.name for d in gpus if d.index >= n]
        if bad:
            raise ValueError(f"device(s) {bad} do not exist: only {n} GPU(s) are visible "
                             f"(gpu:0 .. gpu:{n - 1})")
    return parsed


# --- arrays ---------------------------------------------------------------------------

def gpu_array_type():
    """``cupy.ndarray``, or None while CuPy was never imported (then no value is a GPU
    array, and nothing needs checking)."""
    cp = _loaded_cupy()
    return None if cp is None else cp.ndarray


def is_gpu_array(x) -> bool:
    cp = _loaded_cupy()
    return cp is not None and isinstance(x, cp.ndarray)


def is_array(x) -> bool:
    return isinstance(x, np.ndarray) or is_gpu_array(x)


def array_module(x):
    """``cupy`` for CuPy arrays, else ``numpy``."""
    return _loaded_cupy() if is_gpu_array(x) else np


def device_of(x) -> Device | None:
    """The device holding ``x``: ``gpu:K`` for CuPy arrays, None for host data."""
    if is_gpu_array(x):
        return Device("gpu", int(x.device.id))
    return None


def on_device_of(x):
    """Context manager making ``x``'s device current (nothing for host data): array
    operations on ``x`` then run on that device, on its current stream."""
    d = device_of(x)
    return d.activate() if d is not None else contextlib.nullcontext()


def to_host(x) -> np.ndarray:
    """Any array-like (CuPy, NumPy, scalar, ``__dlpack__``, CUDA array interface) to NumPy."""
    if isinstance(x, np.ndarray):
        return x
    if is_gpu_array(x):
        # CuPy copies on the current device's current stream: make x's device current,
        # so the copy is ordered after the work queued there on x.
        with cupy().cuda.Device(x.device.id):
            return x.get()
    if hasattr(x, "__cuda_array_interface__"):
        return cupy().asarray(x).get()
    if hasattr(x, "__dlpack__") and not np.isscalar(x):
        try:
            return np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError):
            return cupy().from_dlpack(x).get()
    return np.asarray(x)


def to_host_async(x, out: np.ndarray | None = None) -> tuple[np.ndarray, object]:
    """A host copy of ``x`` that later updates of ``x`` do not change: ``(copy, event)``.

    A CuPy array is copied into ``out`` (page-locked host memory; a new one when ``out``
    is None or of another shape or dtype) on ``x``'s device's current stream of the
    calling thread, without waiting: the copy comes after the work queued there so far
    (the last update) and before the work queued later (the next update, which
    ``strategy.run`` orders after that stream). Read the copy only after
    ``event.synchronize()``. Host data is copied into ``out`` now, and ``event`` is
    None. Reusing ``out`` from one call to the next avoids allocating (and, for pinned
    memory, registering) the buffer again.
    """
    if is_gpu_array(x):
        cp = cupy()
        with cp.cuda.Device(x.device.id):
            stream = cp.cuda.get_current_stream()
            if out is None or out.shape != x.shape or out.dtype != x.dtype:
                out = pinned_empty(x.shape, x.dtype)
            x.get(stream=stream, out=out, blocking=False)
            return out, stream.record()
    host = np.asarray(to_host(x))
    if out is None or out.shape != host.shape or out.dtype != host.dtype:
        return np.array(host, copy=True), None
    np.copyto(out, host)
    return out, None


def to_device(x, device: Device, stream=None, copy: bool = False):
    """Place ``x`` on ``device``: no copy when it is already there (unless ``copy``).

    Host to GPU and GPU to GPU copies are issued on ``stream`` (the current stream if
    None); the result is ordered after them on that stream. A GPU array read on another
    stream than the one whose pool holds it (its device's current stream) is read after
    that stream's work so far, and that stream waits for the read (an event), so that
    the array's memory is not handed out again while the copy may still read it.
    """
    if not device.is_gpu:
        out = to_host(x)
        return out.copy() if copy and out is x else out
    cp = cupy()
    if capture_state is not None and not is_gpu_array(x) and \
            not hasattr(x, "__cuda_array_interface__"):
        # Host data in a captured step: a constant of the graphs, uploaded outside it.
        return capture_state.constant(x, device)
    if is_gpu_array(x) and x.device.id != device.index:
        return _peer_copy(cp, x, device, stream)
    with cp.cuda.Device(device.index):
        if is_gpu_array(x) and stream is not None:
            # x was written on this device's current stream: what runs on ``stream``
            # next (the copy, or the caller's own use of x) must come after it.
            wait_for_current(device, stream)
        ctx = stream if stream is not None else contextlib.nullcontext()
        if is_gpu_array(x):
            if not copy:
                return x
            with ctx:
                out = x.copy()
            if stream is not None:
                _current_waits_for(stream)
            return out
        with ctx:
            if hasattr(x, "__cuda_array_interface__") or (
                    hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)
                    and _dlpack_on_gpu(x)):
                return to_device(cp.asarray(x) if hasattr(x, "__cuda_array_interface__")
                                 else cp.from_dlpack(x), device, stream, copy)
            # CuPy stages the bytes through its pinned buffers and copies asynchronously
            # on the current stream; ndarray.set from pageable memory would make the
            # host wait for the stream first.
            return cp.asarray(to_host(x))


def _peer_copy(cp, x, device: Device, stream):
    """Copy CuPy array ``x`` to another GPU on ``stream`` (the destination's current
    stream if None), ordered after the work queued on x's device's current stream; that
    stream in turn waits for the copy, so x's memory is not reused before it is read."""
    src_dev = x.device.id
    with cp.cuda.Device(src_dev):
        src_stream = cp.cuda.get_current_stream()
        src = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        ready = mark(src_stream, src_dev)
    with cp.cuda.Device(device.index):
        dst_stream = stream if stream is not None else cp.cuda.get_current_stream()
        with stream if stream is not None else contextlib.nullcontext():
            out = cp.empty(x.shape, x.dtype)
        dst_stream.wait_event(ready)
        out.data.copy_from_device_async(src.data, src.nbytes, dst_stream)
        copied = mark(dst_stream, device.index)
    with cp.cuda.Device(src_dev):
        src_stream.wait_event(copied)
    return out


def _current_waits_for(stream) -> None:
    """Make the current stream of the current device wait for the work queued so far on
    ``stream`` (a stream of that device): memory of the current stream's pool that
    ``stream`` reads is then reused only after the read."""
    cp = cupy()
    current = cp.cuda.get_current_stream()
    if current.ptr != stream.ptr:
        current.wait_event(mark(stream, int(cp.cuda.Device().id)))


def _dlpack_on_gpu(x) -> bool:
    try:
        dev_type, _ = x.__dlpack_device__()
    except Exception:
        return False
    return int(dev_type) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


# --- events: timing-free, made once ------------------------------------------------------
#
# A stream that waits for another's work so far needs an event recorded there and
# waited for at once: CUDA's wait takes the event's state at the moment of the wait, so
# one event per stream, recorded again each time, serves every such wait. An event
# polled later (the NCCL watchdog's) is one of its own, taken from a free list and given
# back once it was seen complete. None of them keeps timing (cudaEventDisableTiming).

_marks: dict = {}          # (device id, stream handle) -> the stream's reused event
_free_events: dict = {}    # device id -> events seen complete, to record again


def mark(stream, device_id: int):
    """``stream``'s work so far, as its reused timing-free event (to be waited for now,
    not kept). ``device_id``: the stream's device, which must be current."""
    key = (device_id, stream.ptr)
    ev = _marks.get(key)
    if ev is None:
        ev = _marks[key] = cupy().cuda.Event(disable_timing=True)
    stream.record(ev)
    return ev


def _reused_event(device_id: int):
    """An event of GPU ``device_id`` from the free list, or None (several threads take
    from it: the NCCL watchdog as well as the callers)."""
    free = _free_events.get(device_id)
    if free:
        try:
            return free.pop()
        except IndexError:       # another thread took the last one
            pass
    return None


def kept_event(stream, device_id: int):
    """A timing-free event recorded on ``stream`` now, to keep and poll; give it back
    with :func:`release_events` once it was seen complete. ``device_id`` must be
    current."""
    ev = _reused_event(device_id)
    if ev is None:
        ev = cupy().cuda.Event(disable_timing=True)
    stream.record(ev)
    return ev


def kept_events(streams, device_ids) -> list:
    """:func:`kept_event` on each of ``streams`` (``streams[i]`` of GPU
    ``device_ids[i]``), whichever device is current. CUDA records an event on a stream
    of another device than the current one, so a reused event on a stream of its own
    needs no device switch; a new event is made on its device, and a null stream
    (handles 0 and 1) is the current device's, so those switch. A per-thread default
    stream (handle 2) is the calling thread's."""
    cp = cupy()
    out = []
    for s, dev in zip(streams, device_ids):
        ev = _reused_event(dev) if s.ptr > 2 else None
        if ev is not None:
            s.record(ev)
        else:
            with cp.cuda.Device(dev):
                ev = kept_event(s, dev)
        out.append(ev)
    return out


PER_THREAD_STREAM = 2    # cudaStreamPerThread: a handle whose stream depends on the thread


def release_events(events, device_ids) -> None:
    """Give back events of :func:`kept_event` that completed (None entries skipped)."""
    for ev, dev in zip(events, device_ids):
        if ev is not None:
            free = _free_events.setdefault(dev, [])
            if len(free) < 1024:   # (the watchdog gives back in bursts)
                free.append(ev)


def new_stream(device: Device):
    """A non-blocking stream on a GPU device; None for CPU devices."""
    if not device.is_gpu:
        return None
    cp = cupy()
    with cp.cuda.Device(device.index):
        return cp.cuda.Stream(non_blocking=True)


def wait_for_current(device: Device, stream) -> None:
    """Make ``stream`` (on GPU ``device``) wait, without a host wait, for the work queued
    so far on the calling thread's current stream of ``device``. Nothing to do when
    ``stream`` is that stream, or for CPU devices."""
    if not device.is_gpu or stream is None:
        return
    cp = cupy()
    with cp.cuda.Device(device.index):
        current = cp.cuda.get_current_stream()
        if current.ptr != stream.ptr:
            stream.wait_event(mark(current, device.index))


def join_streams_into_current(devices, streams) -> None:
    """Make the calling thread's current stream of each GPU ``devices[i]`` wait for
    ``streams[i]``, and its current stream of the current device wait for all of them:
    CuPy's ``get()`` copies on the current device's stream, whichever device the array
    is on. Events only: no host wait."""
    if not any(d.is_gpu and s is not None for d, s in zip(devices, streams)):
        return
    cp = cupy()
    events: list = [None] * len(devices)
    for i, (d, s) in enumerate(zip(devices, streams)):
        if d.is_gpu and s is not None:
            with cp.cuda.Device(d.index):
                events[i] = mark(s, d.index)
                current = cp.cuda.get_current_stream()
                if current.ptr != s.ptr:
                    current.wait_event(events[i])
    if capture_state is None:
        # (Not while capturing: one graph per device has no edge to another device;
        # the replay joins the devices after its launch.)
        here = int(cp.cuda.Device().id)
        current = cp.cuda.get_current_stream()
        for d, ev in zip(devices, events):
            if ev is not None and d.index != here:
                current.wait_event(ev)


@contextlib.contextmanager
def current_stream(device: Device, stream):
    """Make ``stream`` the calling thread's current stream of ``device`` inside the block,
    whichever device is current (CuPy keeps one current stream per device and thread)."""
    if not device.is_gpu or stream is None:
        yield
        return
    cp = cupy()
    with cp.cuda.Device(device.index):
        stream.__enter__()
    try:
        yield
    finally:
        with cp.cuda.Device(device.index):
            stream.__exit__(None, None, None)


def synchronize(device: Device, stream=None) -> None:
    if device.is_gpu:
        cp = cupy()
        with cp.cuda.Device(device.index):
            (stream or cp.cuda.get_current_stream()).synchronize()


def pinned_empty(shape, dtype) -> np.ndarray:
    """A page-locked host array (for fast asynchronous host-to-device copies)."""
    return cupyx().empty_pinned(shape, dtype)


# --- the timeline's device times and NVTX ranges (gpustrat.timeline) ----------------------

def timing_events(devices) -> list:
    """One CUDA event recorded on the calling thread's current stream of each GPU in
    ``devices`` (None for CPU devices): a timestamp in stream order, no host wait."""
    cp = _loaded_cupy()
    out: list = []
    for d in devices:
        if not d.is_gpu or cp is None:
            out.append(None)
            continue
        with cp.cuda.Device(d.index):
            out.append(cp.cuda.get_current_stream().record())
    return out


def elapsed_ms(start, end, wait: bool = False) -> float | None:
    """Milliseconds of device time between two :func:`timing_events`, or None while
    ``end`` has not completed (a query: no host wait) unless ``wait`` (then the host
    waits for it: only when a trace is written)."""
    if start is None or end is None:
        return None
    if not end.done:
        if not wait:
            return None
        end.synchronize()
    return float(_loaded_cupy().cuda.get_elapsed_time(start, end))


def nvtx_push(name: str) -> bool:
    """Open an NVTX range named ``name`` on this thread (Nsight Systems shows it), where
    CuPy is in use; whether one was opened."""
    cp = _loaded_cupy()
    if cp is None:
        return False
    try:
        cp.cuda.nvtx.RangePush(name)
    except AttributeError:  # a CuPy built without NVTX
        return False
    return True


def nvtx_pop() -> None:
    """Close this thread's innermost NVTX range (opened by :func:`nvtx_push`)."""
    cp = _loaded_cupy()
    if cp is not None:
        cp.cuda.nvtx.RangePop()
