"""The stand-in backend's ``cupy.cuda``: devices, streams and events that count what
is asked of them (see :mod:`gpustrat.testing.standin`).

As in CuPy, the current device and each device's current stream are per thread, and
entering a stream needs its device to be current.
"""

from __future__ import annotations

import types

def make_cuda(cp):
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

    class _NullOfCurrentDevice:
        """``Stream.null``: the current device's null stream."""

        def __get__(self, obj, cls):
            return null_stream(model.current_device())

    Stream.null = _NullOfCurrentDevice()

    def alloc(nbytes):
        """``cupy.cuda.alloc``: a ``MemoryPointer`` to a pool block of the current device."""
        return cp._new((int(nbytes),), "u1").data

    def get_current_stream(device_id=-1):
        device = model.current_device() if device_id is None or device_id < 0 else device_id
        stack = model.stacks().get(device)
        return stack[-1] if stack else null_stream(device)

    def _sync_copy(dst, src, size, kind):
        model.count("copies")
        model.host_sync("cudaMemcpy")

    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: model.num_devices,
        getDevice=model.current_device,
        setDevice=lambda i: Device(i).use(),
        getDeviceProperties=lambda i: {"name": b"gpustrat stand-in (no device)",
                                       "major": 9, "minor": 0, "multiProcessorCount": 132,
                                       "totalGlobalMem": 80 << 30},
        deviceSynchronize=lambda: model.host_sync("deviceSynchronize"),
        memGetInfo=lambda: (80 << 30, 80 << 30),
        memcpyAsync=lambda dst, src, size, kind, stream: model.count("copies"),
        memsetAsync=lambda ptr, value, size, stream: model.count("copies"),
        memcpy=_sync_copy,
        runtimeGetVersion=lambda: 13000,
        driverGetVersion=lambda: 13000)
    return types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event,
        get_current_stream=get_current_stream, runtime=runtime, alloc=alloc,
        MemoryPointer=cp._MemoryPointer, UnownedMemory=cp._Unowned,
        # CuPy's kernel-argument objects (CIntptr, CNumpyArray): made without a device.
        function=cp._real.cuda.function,
        get_elapsed_time=lambda start, stop: 0.0,
        is_available=lambda: True)
