"""NCCL communicator, fusion and the host-staged path on real GPUs (every visible GPU
is a replica). Skipped without a GPU and NCCL; a failure when GPUSTRAT_TEST_GPU=1."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_skip import require_gpus, require_nccl, require_real_gpus  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mpi_util import assert_mpi_ok  # noqa: E402

# Results are ordered on their own device's stream: read them there (to_host).
from gpustrat.devices import Device, to_host  # noqa: E402
from gpustrat.reduce_util import ReduceOp  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def comm():
    n = require_nccl(1)
    from gpustrat.collectives.nccl import NcclCommunicator
    c = NcclCommunicator([Device("gpu", i) for i in range(n)])
    yield c
    c.close()


def host_values(n, shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(-20, 20, shape).astype(dtype) for _ in range(n)]


def on_devices(values):
    from gpustrat.devices import cupy as _cupy
    cupy = _cupy()
    out = []
    for i, v in enumerate(values):
        with cupy.cuda.Device(i):
            out.append(cupy.asarray(v))
    return out


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("op", list(ReduceOp))
def test_all_reduce_matches_host(comm, dtype, op):
    from gpustrat.collectives.host import HostCommunicator
    vals = host_values(comm.num_local, (1001,), dtype)
    want = HostCommunicator([Device("cpu", i) for i in range(comm.num_local)]).all_reduce(
        vals, op)[0]
    got = comm.all_reduce(on_devices(vals), op)
    for i, g in enumerate(got):
        assert g.device.id == i and g.dtype == want.dtype
        np.testing.assert_allclose(to_host(g), want, rtol=1e-3 if dtype == np.float16 else 1e-6)


def test_gather_broadcast_reduce_scatter(comm):
    n = comm.num_local
    parts = [np.arange(i + 1, dtype=np.float32) + 10 * i for i in range(n)]  # sizes differ
    want = np.concatenate(parts)
    for g in comm.all_gather(on_devices(parts), axis=0):
        np.testing.assert_array_equal(to_host(g), want)
    vals = host_values(n, (4, 3), np.float32, seed=3)
    for g in comm.broadcast(on_devices(vals), root=n - 1):
        np.testing.assert_array_equal(to_host(g), vals[n - 1])
    vals = host_values(n, (2 * n, 3), np.float32, seed=4)
    total = sum(vals)
    for i, g in enumerate(comm.reduce_scatter(on_devices(vals), "sum")):
        np.testing.assert_array_equal(to_host(g), total[2 * i:2 * i + 2])


def test_unsupported_dtype_is_a_clear_error(comm):
    vals = [np.ones(3, np.complex64)] * comm.num_local
    with pytest.raises(TypeError, match="NCCL cannot reduce dtype complex64 with MAX"):
        comm.all_reduce(on_devices(vals), "max")
    vals = [np.ones(3, np.longdouble)] * comm.num_local
    with pytest.raises(TypeError, match="NCCL cannot reduce dtype float128"):
        comm.all_reduce(on_devices(vals), "sum")


WIRE_DTYPES = [np.bool_, np.int16, np.uint16, np.complex64, np.complex128]


def wire_values(n, shape, dtype, seed=0):
    # Booleans of both values; 16-bit integers near their limits, so that sums wrap;
    # complex numbers with distinct real and imaginary parts.
    rng = np.random.default_rng(seed)
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        return [rng.integers(0, 2, shape).astype(bool) for _ in range(n)]
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return [rng.integers(info.min, info.max, shape, endpoint=True).astype(dtype)
                for _ in range(n)]
    return [(rng.integers(-20, 20, shape) + 1j * rng.integers(-20, 20, shape)).astype(dtype)
            for _ in range(n)]


@pytest.mark.parametrize("dtype", WIRE_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", list(ReduceOp))
def test_dtypes_without_an_nccl_type_reduce_as_on_the_host(comm, dtype, op):
    # NCCL has no bool, int16, uint16 or complex type: they reduce through uint8,
    # int32/uint32 and floats of twice the length, to the host communicator's results
    # exactly (wraparound of 16-bit sums included).
    from gpustrat.collectives.host import HostCommunicator
    vals = wire_values(comm.num_local, (2 * comm.num_local, 3), dtype,
                       seed=list(ReduceOp).index(op))
    host = HostCommunicator([Device("cpu", i) for i in range(comm.num_local)])
    if np.dtype(dtype).kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
        with pytest.raises(TypeError, match=f"dtype {np.dtype(dtype)} with {op.name}"):
            comm.all_reduce(on_devices(vals), op)
        return
    want = host.all_reduce(vals, op)[0]
    for how in ("all_reduce", "all_reduce_inplace"):
        got = getattr(comm, how)(on_devices(vals), op)
        for i, g in enumerate(got):
            assert g.device.id == i and g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(to_host(g), want, err_msg=how)
    parts = host.reduce_scatter(vals, op)
    for i, g in enumerate(comm.reduce_scatter(on_devices(vals), op)):
        assert g.device.id == i and g.dtype == parts[i].dtype
        np.testing.assert_array_equal(to_host(g), parts[i])


def test_fusion_through_nccl(comm):
    from gpustrat.collectives.fusion import fused_all_reduce
    n = comm.num_local
    tensors = [on_devices(host_values(n, s, d, seed=k)) for k, (s, d) in enumerate(
        [((300,), np.float32), ((2, 3), np.float32), ((7,), np.int64), ((0,), np.float32)])]
    fused = fused_all_reduce(comm, tensors, "sum", bucket_bytes=1024)
    for row, f in zip(tensors, fused):
        for g, w in zip(f, comm.all_reduce(row, "sum")):
            np.testing.assert_array_equal(to_host(g), to_host(w))


def test_staged_communicator_on_gpus():
    n = require_gpus(1)
    from gpustrat.collectives.host import HostCommunicator
    from gpustrat.collectives.staged import StagedCommunicator
    devices = [Device("gpu", i) for i in range(n)]
    comm = StagedCommunicator(devices, HostCommunicator(devices))
    vals = host_values(n, (5,), np.float32)
    for i, g in enumerate(comm.all_reduce(on_devices(vals), "mean")):
        assert g.device.id == i
        np.testing.assert_allclose(to_host(g), sum(vals) / n)


NCCL_ACROSS_WORKERS = r"""
import numpy as np, cupy
from gpustrat.collectives.mpi import MpiWorkerGroup
from gpustrat.collectives.nccl import NcclCommunicator
from gpustrat.devices import Device
g = MpiWorkerGroup()
with cupy.cuda.Device(g.rank):
    c = NcclCommunicator([Device("gpu", g.rank)], g)
    out = c.all_reduce([cupy.full(7, g.rank + 1, cupy.float32)], "sum")[0]
    assert (out.get() == sum(range(1, g.size + 1))).all()
    parts = c.all_gather([cupy.arange(g.rank + 1, dtype=cupy.int64)], 0)[0].get()
    assert parts.tolist() == [k for r in range(g.size) for k in range(r + 1)], parts
    c.close()
print(f"OK rank {g.rank}", flush=True)
"""


@pytest.mark.mpi
def test_nccl_across_two_workers():
    require_real_gpus(2)
    require_nccl(2)
    assert_mpi_ok(2, NCCL_ACROSS_WORKERS, timeout=300, expect_lines=2)
