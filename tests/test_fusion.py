"""Tensor fusion (gpustrat.collectives.fusion) through the host and MPI communicators:
fused results equal separate all-reduces exactly, buckets follow dtype and size."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gpustrat.collectives.fusion import (DEFAULT_BUCKET_BYTES, bucket_bytes_from_env,
                                         fused_all_reduce, plan_buckets)
from gpustrat.collectives.host import HostCommunicator
from gpustrat.devices import Device
from gpustrat.reduce_util import ReduceOp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

SHAPES_DTYPES = [((3,), np.float32), ((), np.float64), ((2, 5), np.int32), ((0,), np.float32),
                 ((7,), np.float16), ((4, 1), np.int64), ((129,), np.float32),
                 ((1,), np.int32), ((2, 2, 2), np.float64)]


class CountingHost(HostCommunicator):
    """A host communicator that records the buffers of every all-reduce (fusion calls
    the in-place form on its own packed buffers)."""

    def __init__(self, devices):
        super().__init__(devices)
        self.calls = []

    def all_reduce(self, buffers, op):
        self.calls.append([(b.shape, b.dtype) for b in buffers])
        return super().all_reduce(buffers, op)

    def all_reduce_inplace(self, buffers, op):
        self.calls.append([(b.shape, b.dtype) for b in buffers])
        return super().all_reduce_inplace(buffers, op)


def comm_of(n):
    return CountingHost([Device("cpu", i) for i in range(n)])


def values(n_replicas, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.integers(-50, 50, shape) * (1 if np.dtype(dt).kind == "i" else 0.25)
              ).astype(dt) for _ in range(n_replicas)] for shape, dt in SHAPES_DTYPES]


@pytest.mark.parametrize("n_replicas", [1, 2, 3])
@pytest.mark.parametrize("op", list(ReduceOp))
@pytest.mark.parametrize("bucket_bytes", [8, 64, 1 << 20])
def test_fused_equals_separate(n_replicas, op, bucket_bytes):
    comm = comm_of(n_replicas)
    tensors = values(n_replicas)
    fused = fused_all_reduce(comm, tensors, op, bucket_bytes=bucket_bytes)
    assert len(fused) == len(tensors)
    for j, row in enumerate(tensors):
        want = HostCommunicator(comm.devices).all_reduce(row, op)
        assert len(fused[j]) == n_replicas
        for got, w in zip(fused[j], want):
            assert got.shape == w.shape and got.dtype == w.dtype, (j, got.dtype, w.dtype)
            np.testing.assert_array_equal(got, w)


def test_buckets_one_dtype_each_and_at_most_bucket_bytes():
    comm = comm_of(2)
    tensors = values(2)
    fused_all_reduce(comm, tensors, "sum", bucket_bytes=64)
    plan = plan_buckets([int(np.prod(s)) for s, _ in SHAPES_DTYPES],
                        [np.dtype(d) for _, d in SHAPES_DTYPES], 64)
    assert len(comm.calls) == len(plan)
    for call, bucket in zip(comm.calls, plan):
        (shape0, dt0), (shape1, dt1) = call
        assert shape0 == shape1 and dt0 == dt1 and len(shape0) == 1
        assert {np.dtype(SHAPES_DTYPES[j][1]) for j in bucket} == {dt0}
        nbytes = shape0[0] * dt0.itemsize
        assert nbytes <= 64 or len(bucket) == 1
    # Every tensor is in exactly one bucket.
    assert sorted(j for b in plan for j in b) == list(range(len(SHAPES_DTYPES)))
    # Large buckets: one collective per dtype.
    comm = comm_of(2)
    fused_all_reduce(comm, tensors, "sum", bucket_bytes=1 << 20)
    assert len(comm.calls) == len({d for _, d in SHAPES_DTYPES})


def test_plan_buckets_greedy_in_order():
    f4, f8 = np.dtype("f4"), np.dtype("f8")
    assert plan_buckets([10, 10, 10, 10], [f4] * 4, 80) == [[0, 1], [2, 3]]
    assert plan_buckets([100, 1, 1, 1], [f4] * 4, 8) == [[0], [1, 2], [3]]
    assert plan_buckets([1, 2, 3], [f4, f8, f4], 1 << 10) == [[0, 2], [1]]
    assert plan_buckets([], [], 10) == []
    with pytest.raises(ValueError, match="positive"):
        plan_buckets([1], [f4], 0)


def test_1000_tensors_one_collective_and_mean():
    comm = comm_of(2)
    rng = np.random.default_rng(1)
    tensors = [[rng.integers(-9, 9, 1000).astype(np.float32) for _ in range(2)]
               for _ in range(1000)]
    fused = fused_all_reduce(comm, tensors, ReduceOp.MEAN, bucket_bytes=64 << 20)
    assert len(comm.calls) == 1 and comm.calls[0][0][0] == (1_000_000,)
    for j in (0, 1, 500, 999):
        want = (tensors[j][0] + tensors[j][1]) / np.float32(2)
        for got in fused[j]:
            np.testing.assert_array_equal(got, want)


def test_results_are_independent_and_survive_later_calls():
    comm = comm_of(2)
    tensors = [[np.full(4, i + 1.0, np.float32) for i in range(2)] for _ in range(3)]
    first = fused_all_reduce(comm, tensors, "sum")
    first[0][0][:] = -1           # in place on one result ...
    np.testing.assert_array_equal(first[1][0], [3, 3, 3, 3])   # ... leaves the others
    np.testing.assert_array_equal(first[0][1], [3, 3, 3, 3])
    other = [[np.full(4, 10.0, np.float32)] * 2 for _ in range(3)]
    fused_all_reduce(comm, other, "sum")   # reuses the packing buffers
    np.testing.assert_array_equal(first[2][0], [3, 3, 3, 3])
    # Inputs are never modified.
    np.testing.assert_array_equal(tensors[0][0], [1, 1, 1, 1])


def test_buckets_share_one_arena_that_is_reused_only_when_free():
    """Every bucket of a dtype is a slice of one arena per replica; a later call reuses
    the arena only once no result of the earlier call refers to it."""
    comm = comm_of(2)
    rng = np.random.default_rng(3)
    # 10 float32 tensors of 40 bytes and 2 int64 ones: 3 float32 buckets of 120 bytes.
    tensors = [[rng.integers(-9, 9, 10).astype(np.float32) for _ in range(2)]
               for _ in range(9)]
    tensors += [[np.arange(3, dtype=np.int64) + i for i in range(2)] for _ in range(2)]

    def arena_of(x):
        return x.base if x.base is not None else x

    first = fused_all_reduce(comm, tensors, "sum", bucket_bytes=120)
    assert len(comm.calls) == 4   # float32 in 3 buckets, int64 in 1
    for i in range(2):
        arenas = {id(arena_of(first[j][i])) for j in range(9)}
        assert len(arenas) == 1, f"replica {i}: float32 buckets in {len(arenas)} buffers"
        assert arena_of(first[9][i]) is not arena_of(first[0][i])   # one per dtype
    assert arena_of(first[0][0]) is not arena_of(first[0][1])       # one per replica
    held = arena_of(first[4][1])
    second = fused_all_reduce(comm, tensors, "max", bucket_bytes=120)
    assert arena_of(second[4][1]) is not held      # first's results still alive
    want = tensors[4][0] + tensors[4][1]
    np.testing.assert_array_equal(first[4][1], want)
    np.testing.assert_array_equal(second[4][1], np.maximum(*tensors[4]))
    del first, held, second
    third = fused_all_reduce(comm, tensors, "sum", bucket_bytes=120)
    kept = [[x.copy() for x in row] for row in third]
    reused = id(arena_of(third[4][1]))   # the pool keeps it alive: the id stays valid
    del third
    fourth = fused_all_reduce(comm, tensors, "sum", bucket_bytes=120)
    assert id(arena_of(fourth[4][1])) == reused   # nothing referred to it any more
    for out in (kept, fourth):
        for j in range(len(tensors)):
            for i in range(2):
                np.testing.assert_array_equal(out[j][i], tensors[j][0] + tensors[j][1])


def test_python_scalars_and_empty_input():
    comm = comm_of(2)
    out = fused_all_reduce(comm, [[1.5, 2.5], [np.int64(3), np.int64(4)]], "sum")
    assert out[0][0] == 4.0 and out[1][1] == 7
    assert fused_all_reduce(comm, [], "sum") == []


def test_errors_name_the_tensor_and_replica():
    comm = comm_of(2)
    with pytest.raises(ValueError, match="tensor 1 has 1 replica values but the "
                                         "communicator has 2"):
        fused_all_reduce(comm, [[np.zeros(2)] * 2, [np.zeros(2)]], "sum")
    with pytest.raises(ValueError, match=r"tensor 0: replica 0 has shape \(2,\) .* "
                                         r"replica 1 has shape \(3,\)"):
        fused_all_reduce(comm, [[np.zeros(2), np.zeros(3)]], "sum")
    with pytest.raises(ValueError, match="unknown reduce op"):
        fused_all_reduce(comm, [[np.zeros(2)] * 2], "prod")


def test_bucket_bytes_from_env(monkeypatch):
    monkeypatch.delenv("GPUSTRAT_FUSION_BUCKET_BYTES", raising=False)
    assert bucket_bytes_from_env() == DEFAULT_BUCKET_BYTES == 64 * 1024 * 1024
    monkeypatch.setenv("GPUSTRAT_FUSION_BUCKET_BYTES", "4096")
    assert bucket_bytes_from_env() == 4096
    comm = comm_of(1)
    fused_all_reduce(comm, [[np.zeros(1024, np.float32)]] * 3, "sum")  # 4 KiB each
    assert len(comm.calls) == 3
    monkeypatch.setenv("GPUSTRAT_FUSION_BUCKET_BYTES", "-5")
    with pytest.raises(ValueError, match="GPUSTRAT_FUSION_BUCKET_BYTES='-5'"):
        bucket_bytes_from_env()


def test_bench_fusion_quick_runs_and_pays_off():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks import bench_fusion
    res = bench_fusion.main(["--quick", "--mpi", "0", "--replicas", "1",
                             "--tensors", "300", "--repeats", "5"])
    (row,) = res["rows"]
    assert row["tensors"] == 300 and row["elements"] == 1000
    assert row["separate_ms"] > 0 and row["fused_ms"] > 0
    # The 5x target is for the full run (benchmarks/bench_fusion.py); a busy CI
    # machine only has to show that fusing is faster at all.
    assert row["speedup"] > 1.0, row


MPI_FUSION = r"""
import numpy as np
from gpustrat.collectives.fusion import fused_all_reduce
from gpustrat.collectives.mpi import MpiCommunicator, MpiWorkerGroup
from gpustrat.devices import Device
from gpustrat.reduce_util import ReduceOp

g = MpiWorkerGroup()
W, r = g.size, g.rank
for L in (1, 2):
    comm = MpiCommunicator([Device("cpu", i) for i in range(L)], g)
    rng = np.random.default_rng(100 * r)
    shapes = [((3,), np.float32), ((2, 4), np.int32), ((), np.float64), ((0,), np.float32),
              ((257,), np.float32), ((5,), np.int64), ((6,), np.float16)]
    tensors = [[rng.integers(-20, 20, s).astype(d) for _ in range(L)] for s, d in shapes]
    for op in ReduceOp:
        for bucket in (16, 1 << 20):
            fused = fused_all_reduce(comm, tensors, op, bucket_bytes=bucket)
            for j, row in enumerate(tensors):
                want = comm.all_reduce(row, op)
                for i in range(L):
                    got = fused[j][i]
                    assert got.shape == want[i].shape and got.dtype == want[i].dtype, (j, i)
                    np.testing.assert_array_equal(got, want[i])
    # SUM against the closed form: each rank's arrays come from its own seed.
    total = sum(np.random.default_rng(100 * k).integers(-20, 20, 3).astype(np.float32)
                for k in range(W))
    if L == 1:
        out = fused_all_reduce(comm, [[np.random.default_rng(100 * r).integers(-20, 20, 3)
                                       .astype(np.float32)]], "sum")
        np.testing.assert_array_equal(out[0][0], total)
    comm.close()
print(f"OK rank {r}", flush=True)
g.close()
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_fused_equals_separate_over_mpi(n):
    assert_mpi_ok(n, MPI_FUSION, timeout=180, expect_lines=n)
