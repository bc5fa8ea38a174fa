"""``cupy.cuda`` of the sanitizer's CuPy: devices, streams, events, the runtime.

As in CuPy, the current device and the current stream of each device are per thread;
entering a stream requires its device to be current; ``Stream.record``,
``wait_event``, ``synchronize`` and ``Event.done``/``synchronize`` map onto the
sanitizer's record, wait, host synchronization and query. Stream capture
(``Stream.begin_capture``/``end_capture``/``is_capturing``, ``cuda.graph.Graph.launch``)
and private memory pools (``MemoryPool``, ``set_allocator``, ``using_allocator``,
``get_allocator``) map onto the sanitizer's capture model and pools.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import types

from gpustrat.testing import sanitizer as _san
from gpustrat.testing.sanitizer import EventState

_pool_ids = itertools.count(1)


def make_cuda(fake):
    """The ``cupy.cuda`` namespace of ``fake`` (a :class:`~gpustrat.testing.fake_cupy.FakeCupy`)."""
    san = fake.san

    class Device:
        def __init__(self, device=None):
            self.id = fake.current_device() if device is None else int(device)
            if not 0 <= self.id < san.num_devices:
                raise RuntimeError(f"cudaErrorInvalidDevice: gpu:{self.id} does not exist")

        def __enter__(self):
            fake._devs().append(self.id)
            return self

        def __exit__(self, *exc):
            fake._devs().pop()

        def use(self):
            fake._devs()[-1] = self.id

        def synchronize(self):
            san.synchronize_device(self.id)

        def __eq__(self, other):
            return isinstance(other, Device) and other.id == self.id

        def __hash__(self):
            return self.id

    class Event:
        def __init__(self, block=False, disable_timing=False, interprocess=False):
            self._state = EventState()
            self.ptr = id(self._state)
            self.device_id = fake.current_device()

        def record(self, stream=None):
            stream = stream or fake.current_stream()
            # As CUDA: the event and the stream must be of one device, whichever is
            # current; a null stream (handle 0) is the current device's.
            dev = fake.current_device() if stream.ptr == 0 else stream.device_id
            if dev != self.device_id:
                raise RuntimeError(f"cudaErrorInvalidResourceHandle: an event made on "
                                   f"device {self.device_id} recorded on a stream of "
                                   f"device {dev}")
            san.record(stream._s, self._state)

        @property
        def done(self):
            return san.query_event(self._state)

        def synchronize(self):
            san.synchronize_event(self._state)

    class Stream:
        def __init__(self, null=False, non_blocking=False, ptr=0, _device=None):
            dev = fake.current_device() if _device is None else _device
            self._s = san.null_stream(dev) if null else san.new_stream(dev)
            if not null:
                self._s.blocking = not non_blocking
            self.ptr, self.device_id = self._s.ptr, dev

        def begin_capture(self, mode=None):
            san.begin_capture(self._s, _san.CAPTURE_RELAXED if mode is None else int(mode))

        def end_capture(self):
            return Graph(san.end_capture(self._s))

        def is_capturing(self):
            return san.capture_status(self._s)

        def _check_device(self):
            cur = fake.current_device()
            if cur != self.device_id:
                raise RuntimeError(f"The device that the stream is created on "
                                   f"({self.device_id}) and the current device ({cur}) differ")

        def __enter__(self):
            self._check_device()
            fake._stacks().setdefault(self.device_id, []).append(self)
            return self

        def __exit__(self, *exc):
            fake._stacks()[self.device_id].pop()

        def use(self):
            self._check_device()
            stack = fake._stacks().setdefault(self.device_id, [])
            if stack:
                stack[-1] = self
            else:
                stack.append(self)
            return self

        def record(self, event=None):
            event = event or Event()
            event.record(self)
            return event

        def wait_event(self, event):
            san.wait(self._s, event._state)

        def synchronize(self):
            san.synchronize_stream(self._s)

        @property
        def done(self):
            ev = EventState()
            san.record(self._s, ev)
            return san.query_event(ev)

        def __eq__(self, other):
            return getattr(other, "_s", None) is self._s

        def __hash__(self):
            return hash(self._s.id)

        def __repr__(self):
            return f"<fake Stream {self._s.name} (device {self.device_id})>"

    class ExternalStream(Stream):
        def __init__(self, ptr, device_id=-1):
            dev = fake.current_device() if device_id < 0 else device_id
            self._s = san.stream_of_handle(int(ptr), dev)
            self.ptr, self.device_id = self._s.ptr, self._s.device

    def get_current_stream(device_id=-1):
        return fake.current_stream(device_id)

    class Graph:
        """``cupy.cuda.graph.Graph``: what ``end_capture`` returns."""

        def __init__(self, graph):
            self._g = graph

        def launch(self, stream=None):
            san.launch(self._g, (stream or fake.current_stream())._s)

        def upload(self, stream=None):
            pass

    class MemoryPool:
        """``cupy.cuda.MemoryPool``: a private pool (its blocks are reused only by
        allocations from it); pass ``pool.malloc`` to ``set_allocator``/``using_allocator``."""

        def __init__(self, allocator=None, _default=False):
            self.id = 0 if _default else next(_pool_ids)
            self._blocks: list = []

        def malloc(self, size):
            raise TypeError("the sanitizer's MemoryPool.malloc is not called directly: "
                            "make it the allocator (set_allocator/using_allocator)")

        def used_bytes(self):
            return sum(b.nbytes for b in self._blocks if not b.free)

        def total_bytes(self):
            return sum(b.nbytes for b in self._blocks)

        def free_all_blocks(self, stream=None):
            pass

    allocators = {"global": None}
    local = threading.local()

    def set_allocator(allocator=None):
        allocators["global"] = allocator

    def get_allocator():
        a = getattr(local, "allocator", None)
        return a if a is not None else allocators["global"]

    @contextlib.contextmanager
    def using_allocator(allocator=None):
        previous = getattr(local, "allocator", None)
        local.allocator = allocator
        try:
            yield
        finally:
            local.allocator = previous

    def pool_of_current_allocator():
        """The private pool the current allocator draws from, or None (the default)."""
        a = get_allocator()
        owner = getattr(a, "__self__", None)
        return owner if isinstance(owner, MemoryPool) and owner.id else None

    default_pool = MemoryPool(_default=True)
    fake.get_default_memory_pool = lambda: default_pool

    fake._pool_of_current_allocator = pool_of_current_allocator

    runtime = types.SimpleNamespace(
        CUDARuntimeError=_san.CUDARuntimeError,
        streamCaptureModeGlobal=_san.CAPTURE_GLOBAL,
        streamCaptureModeThreadLocal=_san.CAPTURE_THREAD_LOCAL,
        streamCaptureModeRelaxed=_san.CAPTURE_RELAXED,
        getDeviceCount=lambda: san.num_devices,
        getDevice=fake.current_device,
        getDeviceProperties=lambda i: {"name": b"gpustrat sanitizer (no device)"},
        deviceSynchronize=lambda: san.synchronize_device(fake.current_device()))
    def range_push(message, id_color=-1):
        with san.lock:
            san.counters["nvtx_ranges"] += 1
        fake._nvtx().append(message)

    def range_pop():
        if not fake._nvtx():
            raise RuntimeError("nvtx.RangePop without a range open on this thread")
        fake._nvtx().pop()

    nvtx = types.SimpleNamespace(RangePush=range_push, RangePop=range_pop)
    return types.SimpleNamespace(
        Device=Device, Stream=Stream, ExternalStream=ExternalStream, Event=Event, nvtx=nvtx,
        get_current_stream=get_current_stream, runtime=runtime,
        graph=types.SimpleNamespace(Graph=Graph), MemoryPool=MemoryPool,
        set_allocator=set_allocator, get_allocator=get_allocator,
        using_allocator=using_allocator,
        get_elapsed_time=lambda start, stop: 0.0,
        is_available=lambda: True)
