"""An asynchronous save's GPU snapshot, checked without a GPU against the fake ``cupy``
of tests/test_gpu_logic_fakes.py: the device-to-host copy is queued on the array's
device's current stream (after the last update, before the next) and the writer waits
for its event, not the training loop."""

import sys
from pathlib import Path

import numpy as np

from gpustrat import devices

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from test_gpu_logic_fakes import fake_cupy  # noqa: E402, F401 - the fixture


def test_gpu_copy_is_queued_on_the_current_stream_of_the_arrays_device(fake_cupy,  # noqa: F811
                                                                         monkeypatch):
    cp = fake_cupy
    pinned = []
    monkeypatch.setattr(devices, "pinned_empty",
                        lambda shape, dtype: pinned.append(shape) or np.empty(shape, dtype))
    x = cp.ndarray((4, 3), np.float32, device_id=1)
    with cp.cuda.Device(0), cp.cuda.Device(1), cp.Stream("train1", 1):
        with cp.cuda.Device(0):          # whichever device is current: x's device counts
            out, event = devices.to_host_async(x)
    assert out.shape == (4, 3) and out.dtype == np.float32 and pinned == [(4, 3)]
    # x's device (1) is made current, the copy is queued without a host wait on its
    # current stream, then the event the writer waits for.
    assert cp.log == [("get", 1, 1, "train1", False), ("record", "train1", 1)]
    assert event.name == "ev:train1"
    cp.log.clear()
    with cp.cuda.Device(1), cp.Stream("train2", 1):
        again, _ = devices.to_host_async(x, out)
    assert again is out and pinned == [(4, 3)]          # the next save reuses the buffer
    assert cp.log == [("get", 1, 1, "train2", False), ("record", "train2", 1)]


def test_host_copy_is_taken_at_once_into_the_reused_buffer():
    x = np.arange(6, dtype=np.float32)
    out, event = devices.to_host_async(x)
    assert event is None and out is not x
    x += 1
    np.testing.assert_array_equal(out, np.arange(6))
    again, _ = devices.to_host_async(x, out)
    assert again is out
    np.testing.assert_array_equal(out, np.arange(1, 7))
    other, _ = devices.to_host_async(np.zeros(2), out)     # another shape: a new buffer
    assert other is not out and other.shape == (2,)
