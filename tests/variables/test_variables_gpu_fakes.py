"""Variables and optimizers with GPU components, checked without a GPU against a fake
``cupy`` whose arrays are NumPy arrays that remember their device. What is checked is
gpustrat's logic: every component is a CuPy array on its replica's device, updates write
it in place under that device's context, results come back on the right devices."""

from __future__ import annotations

import sys
import threading
import types

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices
from gpustrat.collectives import fusion
from gpustrat.collectives.host import HostCommunicator
from gpustrat.collectives.staged import StagedCommunicator
from gpustrat.devices import Device


def make_fake_cupy():
    """A module-like object: NumPy functions, arrays tagged with a device id, device
    contexts, streams that do nothing; ``writes`` logs in-place writes as
    (array's device, current device)."""
    tls = threading.local()
    writes: list = []

    def current() -> int:
        return getattr(tls, "devs", [0])[-1]

    class ndarray(np.ndarray):
        # NumPy 2 arrays have a read-only ``device`` (the array API's); CuPy's is a
        # cuda.Device with an ``id``.
        device = property(lambda self: self._dev)

        def __array_finalize__(self, obj):
            dev = getattr(obj, "_dev", None)
            self._dev = dev if dev is not None else types.SimpleNamespace(id=current())

        def get(self):
            return np.array(self.view(np.ndarray), copy=True)

        def set(self, host, stream=None):
            self.view(np.ndarray)[...] = host

        def _log(self):
            writes.append((self.device.id, current()))

        def __iadd__(self, other):
            self._log()
            return super().__iadd__(other)

        def __isub__(self, other):
            self._log()
            return super().__isub__(other)

        def __imul__(self, other):
            self._log()
            return super().__imul__(other)

        def __setitem__(self, key, value):
            self._log()
            super().__setitem__(key, value)

    def on_current(a):
        out = np.asarray(a).view(ndarray)
        out._dev = types.SimpleNamespace(id=current())
        return out

    class DeviceCtx:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            if not hasattr(tls, "devs"):
                tls.devs = [0]
            tls.devs.append(self.index)

        def __exit__(self, *exc):
            tls.devs.pop()

    class Stream:
        ptr = 7

        def __init__(self, *a, **k):
            pass

        def synchronize(self):
            pass

        def record(self):
            return None

        def wait_event(self, event):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    cp = types.SimpleNamespace(
        ndarray=ndarray, writes=writes,
        empty=lambda shape, dtype: on_current(np.empty(shape, dtype)),
        zeros=lambda shape, dtype=float: on_current(np.zeros(shape, dtype)),
        asarray=lambda a, dtype=None: a.astype(dtype) if isinstance(a, ndarray)
        and dtype is not None else (a if isinstance(a, ndarray) else
                                    on_current(np.asarray(a, dtype))),
        ascontiguousarray=lambda a, dtype=None: a if dtype is None else a.astype(dtype),
        concatenate=lambda parts: on_current(np.concatenate([np.asarray(p) for p in parts])),
        cuda=types.SimpleNamespace(
            Device=DeviceCtx, Stream=Stream, get_current_stream=lambda: Stream(),
            runtime=types.SimpleNamespace(getDeviceCount=lambda: 2)))
    for name in ("sqrt", "maximum", "float32", "uint32", "uint16", "int64", "zeros_like"):
        setattr(cp, name, getattr(np, name))
    return cp


@pytest.fixture
def gpus(monkeypatch):
    cp = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(devices, "_cupy_mod", cp)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    # The pack kernels are tested on their own (tests/kernels); here a NumPy stand-in.
    monkeypatch.setattr(fusion, "_pack_gpu", lambda ts: cp.concatenate(
        [t.reshape(-1) for t in ts]))
    monkeypatch.setattr(fusion, "_unpack_gpu", lambda buf, shapes: [
        p.reshape(s) for p, s in zip(np.split(buf, np.cumsum(
            [int(np.prod(s)) for s in shapes])[:-1]), shapes)])
    devs = [Device("gpu", 0), Device("gpu", 1)]
    comm = StagedCommunicator(devs, HostCommunicator([Device("cpu", 0), Device("cpu", 1)]))
    strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"], communicator=comm)
    yield cp, strategy
    strategy.close()


def test_components_are_cupy_arrays_on_their_devices(gpus):
    cp, strategy = gpus
    with strategy.scope():
        v = gs.Variable(np.arange(3.0, dtype=np.float32), aggregation="mean")
    comps = strategy.experimental_local_results(v)
    assert [c.device for c in comps] == ["gpu:0", "gpu:1"]
    assert [type(c._array) for c in comps] == [cp.ndarray] * 2
    assert [c._array.device.id for c in comps] == [0, 1]


def test_replica_update_writes_each_component_in_place_on_its_device(gpus):
    cp, strategy = gpus
    with strategy.scope():
        v = gs.Variable(np.zeros(2, np.float32), aggregation="sum")
    before = [c._array for c in strategy.experimental_local_results(v)]
    cp.writes.clear()

    def step():
        r = gs.get_replica_context().replica_id_in_sync_group
        return v.assign_add(cp.asarray(np.full(2, r + 1.0, np.float32)))
    strategy.run(step)
    after = [c._array for c in strategy.experimental_local_results(v)]
    assert all(a is b for a, b in zip(before, after))           # updated in place
    assert [a.get().tolist() for a in after] == [[3.0, 3.0]] * 2
    assert sorted(cp.writes) == [(0, 0), (1, 1)]                # under its own device


def test_sync_on_read_sum_reads_back_on_the_first_device(gpus):
    cp, strategy = gpus
    with strategy.scope():
        v = gs.Variable(np.zeros(2, np.float32), synchronization="on_read",
                        aggregation="sum")
    strategy.run(lambda: v.assign_add(cp.asarray(np.ones(2, np.float32))))
    with strategy.scope():
        total = v.read_value()
    assert isinstance(total, cp.ndarray) and total.device.id == 0
    assert total.get().tolist() == [2.0, 2.0]


def test_optimizer_step_keeps_slots_and_weights_on_each_device(gpus):
    cp, strategy = gpus
    with strategy.scope():
        w = gs.Variable(np.ones((2, 2), np.float32), name="w")
        b = gs.Variable(np.zeros(2, np.float32), name="b")
        opt = gs.optimizers.Adam(0.1)
    cp.writes.clear()

    def step():
        r = gs.get_replica_context().replica_id_in_sync_group
        g = cp.asarray(np.full((2, 2), r + 1.0, np.float32))
        opt.apply_gradients([(g, w), (g[0], b)])
    strategy.run(step)
    for var in (w, b):
        comps = strategy.experimental_local_results(var)
        assert [c._array.device.id for c in comps] == [0, 1]
        slot = strategy.experimental_local_results(opt.get_slot(var, "m"))
        assert [c._array.device.id for c in slot] == [0, 1]
        np.testing.assert_allclose(slot[1]._array.get(), slot[0]._array.get())
        np.testing.assert_allclose(slot[0]._array.get(), 0.1 * 3.0)   # (1 - beta_1) * sum
    # Adam's first step moves each weight by lr (times sign of the gradient).
    np.testing.assert_allclose(strategy.experimental_local_results(w)[1]._array.get(),
                               0.9, rtol=1e-5)
    assert all(arr == cur for arr, cur in cp.writes)            # every write on its device


def test_a_scalar_keeps_its_shape_on_a_gpu(gpus):
    # to_device once made 0-d host values 1-d (np.ascontiguousarray returns ndim >= 1),
    # so a scalar variable (an optimizer's iterations) was not a scalar on a GPU.
    cp, strategy = gpus
    out = devices.to_device(np.float32(2.5), Device("gpu", 1))
    assert out.shape == () and out.device.id == 1
    with strategy.scope():
        opt = gs.optimizers.SGD(0.1)
    assert [c.shape for c in strategy.experimental_local_results(opt.iterations)] == \
        [(), ()]
