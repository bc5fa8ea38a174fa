"""Strategies and distributed input on real GPUs: CuPy per-replica values on their own
devices, host batches placed through pinned staging, device-resident batches sliced on
their device, the seeds' mixed ["GPU:0", "CPU:0"] strategy. Skipped without a GPU; a
failure when GPUSTRAT_TEST_GPU=1."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_skip import require_gpus  # noqa: E402

import gpustrat as gs  # noqa: E402
from gpustrat import devices  # noqa: E402
from gpustrat.data import Dataset  # noqa: E402

pytestmark = pytest.mark.gpu


def test_default_devices_are_every_gpu_and_run_places_values():
    n = require_gpus(1)
    cp = devices.cupy()
    s = gs.MirroredStrategy()
    assert [d.name for d in s.local_devices] == [f"gpu:{i}" for i in range(n)]
    ids = s.experimental_distribute_values_from_function(
        lambda ctx: cp.full((3,), ctx.replica_id_in_sync_group, dtype=cp.float32))
    for i, v in enumerate(s.experimental_local_results(ids)):
        assert isinstance(v, cp.ndarray) and v.device.id == i

    def step(v):
        assert cp.cuda.Device().id == v.device.id  # the replica's device is current
        return gs.get_replica_context().all_reduce("sum", v * 2)
    out = s.run(step, args=(ids,))
    total = 2 * sum(range(n))
    for i, v in enumerate(s.experimental_local_results(out)):
        assert v.device.id == i
        np.testing.assert_allclose(cp.asnumpy(v), [total] * 3)


def test_distributed_dataset_from_host_lands_on_each_gpu():
    n = require_gpus(1)
    cp = devices.cupy()
    s = gs.MirroredStrategy()
    data = np.arange(4 * n * 6, dtype=np.float32).reshape(4 * n, 6)
    got = []
    for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(2 * n + 1)):
        for i, piece in enumerate(s.experimental_local_results(x)):
            assert isinstance(piece, cp.ndarray) and piece.device.id == i
            got.append(cp.asnumpy(piece))
        doubled = s.run(lambda v: v * 2, args=(x,))
        np.testing.assert_allclose(cp.asnumpy(s.reduce("sum", doubled, axis=0)),
                                   2 * np.concatenate([p for p in got[-n:]]).sum(axis=0))
    np.testing.assert_array_equal(np.concatenate(got), data)


def test_device_resident_batches_and_no_fetch_option():
    n = require_gpus(1)
    cp = devices.cupy()
    s = gs.MirroredStrategy()
    with cp.cuda.Device(0):
        data = cp.arange(8 * n, dtype=cp.float64).reshape(4 * n, 2)
    pieces = []
    for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(4 * n)):
        for i, p in enumerate(s.experimental_local_results(x)):
            assert p.device.id == i
            pieces.append(cp.asnumpy(p))
    np.testing.assert_array_equal(np.concatenate(pieces), cp.asnumpy(data))
    host = gs.InputOptions(experimental_fetch_to_device=False)
    for x in s.experimental_distribute_dataset(Dataset.range(4).batch(4), host):
        assert all(isinstance(p, np.ndarray) for p in s.experimental_local_results(x))


def test_seed_mixed_gpu_and_cpu_strategy():
    require_gpus(1)
    s = gs.MirroredStrategy(devices=["GPU:0", "CPU:0"])
    it = iter(s.experimental_distribute_dataset(Dataset.range(9).batch(4)))
    got = []
    while True:
        opt = it.get_next_as_optional()
        if not opt.has_value():
            break
        res = s.run(lambda v: v, args=(opt.get_value(),))
        got.append([np.asarray(gs.devices.to_host(p)).tolist()
                    for p in s.experimental_local_results(res)])
    assert got == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    out = s.run(lambda: gs.get_replica_context().all_reduce(
        "sum", float(gs.get_replica_context().replica_id_in_sync_group)))
    # A Python number in gives a Python number out, on every replica.
    assert s.experimental_local_results(out) == (1.0, 1.0)
