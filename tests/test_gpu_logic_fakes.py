"""The GPU code paths' ordering logic, checked on a machine without a GPU against a
small fake ``cupy`` that records what is called, on which device and stream."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

from gpustrat import devices
from gpustrat.devices import Device


class FakeCupy:
    """Just enough of cupy for devices.py and runner.py; ``log`` records the calls."""

    def __init__(self):
        self.log: list = []
        self._tls = threading.local()
        fake = self

        class ndarray:
            def __init__(self, shape, dtype, device_id, contiguous=True):
                self.shape, self.dtype = tuple(shape), np.dtype(dtype)
                self.device = types.SimpleNamespace(id=device_id)
                self.flags = types.SimpleNamespace(c_contiguous=contiguous)
                self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
                self.data = MemoryPointer(self)

            @property
            def __cuda_array_interface__(self):
                # CuPy exports its current stream (1: the legacy default stream).
                ptr = get_current_stream().ptr
                return {"shape": self.shape, "typestr": self.dtype.str, "version": 3,
                        "data": (id(self), False), "strides": None,
                        "stream": fake.exported_stream if fake.exported_stream != "current"
                        else (ptr or 1)}

            def get(self, stream=None, order="C", out=None, blocking=True):
                fake.log.append(("get", self.device.id, fake.current_device(),
                                 (stream or get_current_stream()).name, blocking))
                return out if out is not None else np.zeros(self.shape, self.dtype)

        # kernels/_launch.py recognises CuPy arrays by their class's module.
        ndarray.__module__ = "cupy._core.core"

        class MemoryPointer:
            def __init__(self, arr):
                self.arr = arr

            @property
            def device_id(self):
                return self.arr.device.id

            def copy_from_device_async(self, src, size, stream=None):
                fake.log.append(("copy", src.arr.device.id, self.arr.device.id, size,
                                 stream.name, fake.current_device()))

        class Event:
            def __init__(self, name=None, disable_timing=False):
                self.name = name

        class Stream:
            count = 0

            def __init__(self, name=None, dev=None, non_blocking=False):
                if name is None:
                    Stream.count += 1
                    name = f"new{Stream.count}"
                self.name, self.ptr = name, hash(name) & 0xffff
                self.dev = fake.current_device() if dev is None else dev

            def record(self, event=None):
                fake.log.append(("record", self.name, fake.current_device()))
                event = event or Event()
                event.name = f"ev:{self.name}"
                return event

            def wait_event(self, event):
                fake.log.append(("wait", self.name, event.name, fake.current_device()))

            def synchronize(self):
                fake.log.append(("sync", self.name))

            def __enter__(self):
                fake._streams().setdefault(fake.current_device(), []).append(self)
                return self

            def __exit__(self, *exc):
                fake._streams()[fake.current_device()].pop()

        class DeviceCtx:
            def __init__(self, index=None):
                self.index = fake.current_device() if index is None else index
                self.id = self.index

            def __enter__(self):
                fake._devs().append(self.index)
                return self

            def __exit__(self, *exc):
                fake._devs().pop()

        def get_current_stream():
            dev = fake.current_device()
            stack = fake._streams().get(dev)
            return stack[-1] if stack else Stream(f"null{dev}", dev)

        def empty(shape, dtype):
            dev = fake.current_device()
            fake.log.append(("empty", dev, get_current_stream().name))
            return ndarray(shape, dtype, dev)

        def asarray(host):
            dev = fake.current_device()
            fake.log.append(("asarray", dev, get_current_stream().name, host.tolist()))
            return ndarray(host.shape, host.dtype, dev)

        class ExternalStream(Stream):
            def __init__(self, ptr):
                super().__init__(f"ext{ptr}")
                self.ptr = ptr

        def ascontiguousarray(x):
            fake.log.append(("ascontiguousarray", x.device.id, fake.current_device(),
                             get_current_stream().name))
            return ndarray(x.shape, x.dtype, fake.current_device())

        self.ndarray = ndarray
        self.Stream = Stream
        self.empty = empty
        self.ascontiguousarray = ascontiguousarray
        self.asarray = asarray
        self.exported_stream = "current"   # or a fixed value / None for the CAI "stream"
        self.cuda = types.SimpleNamespace(
            Device=DeviceCtx, Stream=Stream, Event=Event, get_current_stream=get_current_stream,
            ExternalStream=ExternalStream,
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 4))

    def _devs(self) -> list:
        if not hasattr(self._tls, "devs"):
            self._tls.devs = [0]
        return self._tls.devs

    def _streams(self) -> dict:
        if not hasattr(self._tls, "streams"):
            self._tls.streams = {}
        return self._tls.streams

    def current_device(self) -> int:
        return self._devs()[-1]


@pytest.fixture
def fake_cupy(monkeypatch):
    cp = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(devices, "_cupy_mod", cp)
    return cp


def test_peer_copy_is_ordered_after_the_source_stream_and_before_its_reuse(fake_cupy):
    cp = fake_cupy
    x = cp.ndarray((4, 3), np.float32, device_id=1)
    dst = cp.Stream("s2", 2)
    out = devices.to_device(x, Device("gpu", 2), stream=dst)
    assert out.device.id == 2 and out.shape == (4, 3) and out.dtype == np.float32
    assert cp.log == [
        ("record", "null1", 1),                  # x's producer stream, on device 1
        ("empty", 2, "s2"),                      # the result lives in s2's pool arena
        ("wait", "s2", "ev:null1", 2),           # the copy waits for x to be written
        ("copy", 1, 2, 48, "s2", 2),             # (src, size, stream), device 2 current
        ("record", "s2", 2),
        ("wait", "null1", "ev:s2", 1),           # x's memory is reused only after it
    ]


def test_peer_copy_of_a_strided_array_is_made_contiguous_on_its_own_device(fake_cupy):
    cp = fake_cupy
    x = cp.ndarray((5,), np.int64, device_id=3, contiguous=False)
    with cp.cuda.Device(3), cp.Stream("s3", 3):
        out = devices.to_device(x, Device("gpu", 0))
    assert out.device.id == 0
    assert cp.log[:2] == [("ascontiguousarray", 3, 3, "s3"), ("record", "s3", 3)]
    assert ("copy", 3, 0, 40, "null0", 0) in cp.log
    assert cp.log[-1] == ("wait", "s3", "ev:null0", 3)


def test_same_device_array_is_not_copied(fake_cupy):
    x = fake_cupy.ndarray((2,), np.float32, device_id=1)
    assert devices.to_device(x, Device("gpu", 1)) is x
    assert fake_cupy.log == []


def test_a_collective_is_combined_on_every_replicas_stream_without_a_host_wait(fake_cupy):
    from gpustrat.distribute.runner import ReplicaRunner
    cp = fake_cupy
    runner = ReplicaRunner([Device("gpu", 0), Device("gpu", 1)])
    names = [s.name for s in runner._streams]
    assert runner._streams[1].dev == 1

    def combine(values):
        # The combining thread queues device i's work on replica i's stream, after
        # replica i's own work (stream order: no event, no host wait).
        for i in (0, 1):
            with cp.cuda.Device(i):
                cp.log.append(("combine-current", i, cp.cuda.get_current_stream().name))
        return values

    def fn(i):
        # A replica's current stream, inside run, is its own.
        cp.log.append(("current", i, cp.cuda.get_current_stream().name))
        return runner.rendezvous.exchange(i, ("all_reduce",), i, combine)

    try:
        assert runner.call(fn, [(0,), (1,)], [{}, {}], lambda i: None, lambda: None) == [0, 1]
    finally:
        runner.close()
    log = cp.log
    assert ("current", 0, names[0]) in log and ("current", 1, names[1]) in log
    assert ("combine-current", 0, names[0]) in log and ("combine-current", 1, names[1]) in log
    assert not [e for e in log if e[0] == "sync"]
    # The caller's streams wait for the replica streams before run returns, and its
    # current device's stream (where CuPy's get() copies) for every replica stream.
    assert log[-5:] == [("record", names[0], 0), ("wait", "null0", f"ev:{names[0]}", 0),
                        ("record", names[1], 1), ("wait", "null1", f"ev:{names[1]}", 1),
                        ("wait", "null0", f"ev:{names[1]}", 0)]


def test_scatter_splits_on_the_batch_devices_stream_that_the_copies_wait_for(
        fake_cupy, monkeypatch):
    from gpustrat.kernels import split as split_mod
    cp = fake_cupy

    def fake_split(batch, n, index=None, pad_to=None, stream=None, check_index=True):
        cp.log.append(("split", cp.current_device(), stream,
                       cp.cuda.get_current_stream().name))
        pieces = [cp.ndarray((2, 3), np.float32, batch.device.id) for _ in range(n)]
        return split_mod.Split(pieces, [2] * n)
    monkeypatch.setattr(split_mod, "split", fake_split)
    batch = cp.ndarray((4, 3), np.float32, device_id=2)
    with cp.cuda.Device(2), cp.Stream("producer", 2):
        streams = [cp.Stream("r0", 0), cp.Stream("r1", 1)]
        with cp.cuda.Device(0):   # the caller's current device is another one
            # pad_to: the kernel path (a plain contiguous cut is views and copies).
            res = split_mod.scatter(batch, ["gpu:0", "gpu:1"], pad_to=2, streams=streams)
    assert [p.device.id for p in res.pieces] == [0, 1]
    # The kernel ran on the batch's device and its current stream (no stream forced)...
    assert cp.log[0] == ("split", 2, None, "producer")
    # ...and each copy, on its replica's stream, waits for that stream's work.
    copies = [e for e in cp.log if e[0] == "copy"]
    assert [(c[2], c[4]) for c in copies] == [(0, "r0"), (1, "r1")]
    assert ("record", "producer", 2) in cp.log
    assert all(e[0] != "record" or e[1] in ("producer", "r0", "r1") for e in cp.log)
    with pytest.raises(ValueError, match="2 streams for 3 devices"):
        split_mod.scatter(batch, ["gpu:0", "gpu:1", "gpu:2"], pad_to=2, streams=streams)


# --- second review: input ordering and the launch device --------------------------------------

def test_replica_streams_wait_for_the_callers_streams_before_running(fake_cupy):
    from gpustrat.distribute.runner import ReplicaRunner
    cp = fake_cupy
    runner = ReplicaRunner([Device("gpu", 0), Device("gpu", 1)])
    names = [s.name for s in runner._streams]

    def fn(i):
        cp.log.append(("fn", i))
        return i

    try:
        # The caller wrote the arguments on its own stream of device 1.
        with cp.cuda.Device(1), cp.Stream("caller1", 1):
            assert runner.call(fn, [(0,), (1,)], [{}, {}], lambda i: None,
                               lambda: None) == [0, 1]
    finally:
        runner.close()
    first_fn = cp.log.index(("fn", 0))
    # Replica streams are non-blocking: each waits for its device's caller stream
    # (an event, no host wait) before any replica reads the arguments.
    assert ("wait", names[0], "ev:null0", 0) in cp.log[:first_fn]
    assert ("wait", names[1], "ev:caller1", 1) in cp.log[:first_fn]
    assert ("record", "caller1", 1) in cp.log[:first_fn]


def test_a_piece_already_on_its_device_is_ordered_on_the_given_stream(fake_cupy, monkeypatch):
    from gpustrat.kernels import split as split_mod
    cp = fake_cupy

    def fake_split(batch, n, index=None, pad_to=None, stream=None, check_index=True):
        cp.log.append(("split", cp.current_device(), cp.cuda.get_current_stream().name))
        pieces = [cp.ndarray((2, 3), np.float32, batch.device.id) for _ in range(n)]
        return split_mod.Split(pieces, [2] * n)
    monkeypatch.setattr(split_mod, "split", fake_split)
    batch = cp.ndarray((4, 3), np.float32, device_id=0)
    streams = [cp.Stream("r0", 0), cp.Stream("r1", 1)]
    with cp.cuda.Device(0), cp.Stream("producer", 0):
        res = split_mod.scatter(batch, ["gpu:0", "gpu:1"], pad_to=2, streams=streams)
    assert res.pieces[0].device.id == 0
    k = cp.log.index(("split", 0, "r0"))
    # The split runs on piece 0's consumer stream r0 (its buffer then belongs to r0's
    # pool), after the batch's producer; the producer waits for r0 in turn (the batch
    # is reused after the split read it). Piece 0 is not copied.
    assert ("wait", "r0", "ev:producer", 0) in cp.log[:k]
    assert ("wait", "producer", "ev:r0", 0) in cp.log[k:]
    assert [e for e in cp.log if e[0] == "copy"] == [("copy", 0, 1, 24, "r1", 1)]
    # No wait at all when the stream given is the current one.
    n = len(cp.log)
    with cp.cuda.Device(0), cp.Stream("same", 0) as same:
        x = cp.ndarray((3,), np.float32, device_id=0)
        assert devices.to_device(x, Device("gpu", 0), stream=same) is x
    assert cp.log[n:] == []


def test_placement_orders_a_gpu_piece_by_an_event_on_its_copy_stream(fake_cupy):
    from gpustrat.distribute.placement import _Staging
    cp = fake_cupy
    staging = _Staging([Device("gpu", 0)])
    copy_stream = staging.streams[0].name
    x = cp.ndarray((2,), np.float32, device_id=0)
    placed, ready = staging.place([x])
    assert placed == [x] and ready[0].name == f"ev:{copy_stream}"
    # The copy stream waits for the producer (this thread's stream of device 0), then
    # records the event the consumer will wait for: no host wait.
    assert cp.log[-3:] == [("record", "null0", 0), ("wait", copy_stream, "ev:null0", 0),
                           ("record", copy_stream, 0)]


def test_split_makes_a_strided_batch_contiguous_on_the_launch_stream(fake_cupy):
    from gpustrat.kernels import split as split_mod
    cp = fake_cupy
    batch = cp.ndarray((6, 2), np.float32, device_id=1, contiguous=False)
    with cp.cuda.Device(1), cp.Stream("s1", 1) as current:
        explicit = cp.Stream("sx", 1)
        # Launching on another stream: the copy goes on that stream too, so the kernel
        # runs after it and the copy's memory is reused only after the kernel.
        out, _ = split_mod._prepare(batch, None, True, explicit)
        assert out.device.id == 1 and out is not batch
        # Launching on the current stream: nothing to switch.
        split_mod._prepare(batch, None, True, current)
    assert [e for e in cp.log if e[0] == "ascontiguousarray"] == [
        ("ascontiguousarray", 1, 1, f"ext{explicit.ptr}"),
        ("ascontiguousarray", 1, 1, "s1")]
