"""Device names, resolution and placement on host devices."""

import numpy as np
import pytest

from gpustrat.devices import (Device, default_devices, gpu_count, parse_device,
                              resolve_devices, to_device, to_host)


@pytest.mark.parametrize("spec,expected", [
    ("GPU:0", Device("gpu", 0)), ("/gpu:1", Device("gpu", 1)), ("gpu:2", Device("gpu", 2)),
    ("/device:GPU:3", Device("gpu", 3)), ("CPU:0", Device("cpu", 0)),
    ("/cpu:4", Device("cpu", 4)), ("cpu:7", Device("cpu", 7)),
    ("/device:CPU:1", Device("cpu", 1)), ("cpu", Device("cpu", 0)),
    ("/job:worker/replica:0/task:1/device:CPU:2", Device("cpu", 2)),
])
def test_every_spelling_parses(spec, expected):
    assert parse_device(spec) == expected
    assert parse_device(spec).name == f"{expected.kind}:{expected.index}"


@pytest.mark.parametrize("spec", ["tpu:0", "cpu:x", "gpu:-1", "", "cpu:0:1"])
def test_malformed_names_say_what_to_use(spec):
    with pytest.raises(ValueError, match="malformed device name"):
        parse_device(spec)


def test_non_string_device_is_a_type_error():
    with pytest.raises(TypeError, match="named by a string"):
        parse_device(3)


def test_any_number_of_logical_cpus():
    devs = resolve_devices([f"cpu:{i}" for i in range(9)])
    assert [d.index for d in devs] == list(range(9))


def test_same_device_twice_names_it():
    with pytest.raises(ValueError, match=r"cpu:1 is listed twice \(positions 0 and 2\)"):
        resolve_devices(["cpu:1", "cpu:0", "/device:CPU:1"])


def test_empty_device_list_is_an_error():
    with pytest.raises(ValueError, match="devices is empty"):
        resolve_devices([])


@pytest.mark.skipif(gpu_count() > 0, reason="checks the no-GPU error")
def test_gpu_without_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"\['gpu:0'\] were asked for but no GPU"):
        resolve_devices(["gpu:0"])


@pytest.mark.skipif(gpu_count() > 0, reason="default without GPU")
def test_default_devices_without_gpu_is_cpu0():
    assert default_devices() == [Device("cpu", 0)]


def test_host_placement_is_free_and_converts_inputs():
    a = np.arange(6.0)
    assert to_device(a, Device("cpu", 1)) is a
    assert to_device(a, Device("cpu", 1), copy=True) is not a
    np.testing.assert_array_equal(to_device(3, Device("cpu", 0)), np.asarray(3))

    class DL:  # an object exposing only the DLPack protocol
        def __init__(self, x):
            self.x = x

        def __dlpack__(self, **kw):
            return self.x.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self.x.__dlpack_device__()

    np.testing.assert_array_equal(to_host(DL(a)), a)
