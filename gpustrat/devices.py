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


def cupy():
    """The cupy module; raise a clear RuntimeError if it cannot be imported."""
    global _cupy_mod, _cupy_error
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

def is_gpu_array(x) -> bool:
    cp = sys.modules.get("cupy")
    return cp is not None and isinstance(x, cp.ndarray)


def is_array(x) -> bool:
    return isinstance(x, np.ndarray) or is_gpu_array(x)


def array_module(x):
    """``cupy`` for CuPy arrays, else ``numpy``."""
    return sys.modules["cupy"] if is_gpu_array(x) else np


def device_of(x) -> Device | None:
    """The device holding ``x``: ``gpu:K`` for CuPy arrays, None for host data."""
    if is_gpu_array(x):
        return Device("gpu", int(x.device.id))
    return None


def to_host(x) -> np.ndarray:
    """Any array-like (CuPy, NumPy, scalar, ``__dlpack__``, CUDA array interface) to NumPy."""
    if isinstance(x, np.ndarray):
        return x
    if is_gpu_array(x):
        return x.get()
    if hasattr(x, "__cuda_array_interface__"):
        return cupy().asarray(x).get()
    if hasattr(x, "__dlpack__") and not np.isscalar(x):
        try:
            return np.from_dlpack(x)
        except (RuntimeError, BufferError, TypeError):
            return cupy().from_dlpack(x).get()
    return np.asarray(x)


def to_device(x, device: Device, stream=None, copy: bool = False):
    """Place ``x`` on ``device``: no copy when it is already there (unless ``copy``).

    Host to GPU and GPU to GPU copies are issued on ``stream`` (the current stream if
    None); the result is ordered after them on that stream.
    """
    if not device.is_gpu:
        out = to_host(x)
        return out.copy() if copy and out is x else out
    cp = cupy()
    if is_gpu_array(x) and x.device.id != device.index:
        return _peer_copy(cp, x, device, stream)
    with cp.cuda.Device(device.index):
        if is_gpu_array(x) and stream is not None:
            # x was written on this device's current stream: what runs on ``stream``
            # next (the copy, or the caller's own use of x) must come after it.
            wait_for_current(device, stream)
        ctx = stream if stream is not None else contextlib.nullcontext()
        with ctx:
            if is_gpu_array(x):
                return x.copy() if copy else x
            if hasattr(x, "__cuda_array_interface__") or (
                    hasattr(x, "__dlpack__") and not isinstance(x, np.ndarray)
                    and _dlpack_on_gpu(x)):
                return to_device(cp.asarray(x) if hasattr(x, "__cuda_array_interface__")
                                 else cp.from_dlpack(x), device, stream, copy)
            host = to_host(x)
            # np.ascontiguousarray would turn a 0-d array into shape (1,).
            host = host if host.flags.c_contiguous else np.ascontiguousarray(host)
            out = cp.empty(host.shape, host.dtype)
            out.set(host, stream=stream)
            return out


def _peer_copy(cp, x, device: Device, stream):
    """Copy CuPy array ``x`` to another GPU on ``stream`` (the destination's current
    stream if None), ordered after the work queued on x's device's current stream; that
    stream in turn waits for the copy, so x's memory is not reused before it is read."""
    src_dev = x.device.id
    with cp.cuda.Device(src_dev):
        src_stream = cp.cuda.get_current_stream()
        src = x if x.flags.c_contiguous else cp.ascontiguousarray(x)
        ready = src_stream.record()
    with cp.cuda.Device(device.index):
        dst_stream = stream if stream is not None else cp.cuda.get_current_stream()
        with stream if stream is not None else contextlib.nullcontext():
            out = cp.empty(x.shape, x.dtype)
        dst_stream.wait_event(ready)
        out.data.copy_from_device_async(src.data, src.nbytes, dst_stream)
        copied = dst_stream.record()
    with cp.cuda.Device(src_dev):
        src_stream.wait_event(copied)
    return out


def _dlpack_on_gpu(x) -> bool:
    try:
        dev_type, _ = x.__dlpack_device__()
    except Exception:
        return False
    return int(dev_type) in (2, 3, 13)  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged


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
            stream.wait_event(current.record())


def synchronize(device: Device, stream=None) -> None:
    if device.is_gpu:
        cp = cupy()
        with cp.cuda.Device(device.index):
            (stream or cp.cuda.get_current_stream()).synchronize()


def pinned_empty(shape, dtype) -> np.ndarray:
    """A page-locked host array (for fast asynchronous host-to-device copies)."""
    from cupyx import empty_pinned  # noqa: PLC0415
    return empty_pinned(shape, dtype)
