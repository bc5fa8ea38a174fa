"""The NCCL layer's behaviour on machines without a GPU: imports, availability, the
dtype table, the deadline, the rendezvous, and the host-staged communicator."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpustrat.collectives import nccl
from gpustrat.collectives.base import LocalWorkerGroup, WorkerGroup
from gpustrat.collectives.host import HostCommunicator
from gpustrat.collectives.rendezvous import broadcast_unique_id
from gpustrat.collectives.staged import StagedCommunicator
from gpustrat.devices import Device
from gpustrat.errors import CollectiveTimeout

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tests"))
from mpi_util import assert_mpi_ok  # noqa: E402


def run_python(code: str, env=None) -> subprocess.CompletedProcess:
    child_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=child_env, timeout=120)


def test_imports_need_neither_cupy_nor_numba():
    proc = run_python(
        "import sys; sys.modules['cupy'] = None\n"
        "import gpustrat, gpustrat.collectives.nccl as n, gpustrat.collectives.fusion, "
        "gpustrat.collectives.staged, gpustrat.collectives.rendezvous, gpustrat.kernels\n"
        "assert not n.is_available()\n"
        "assert not any(m in sys.modules for m in ('numba', 'mpi4py'))\n"
        "print('OK')")
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr


def test_is_available_is_false_here_and_never_raises():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed: this checks the machine without it")
    except ImportError:
        pass
    assert nccl.is_available() is False


def test_dtype_table():
    assert nccl.nccl_dtype_name(np.float32) == "NCCL_FLOAT32"
    assert nccl.nccl_dtype_name("int64") == "NCCL_INT64"
    assert nccl.nccl_dtype_name(np.float16) == "NCCL_FLOAT16"
    for bad in (np.bool_, np.complex64, np.int16):
        with pytest.raises(TypeError, match=f"NCCL cannot reduce dtype {np.dtype(bad)}: "
                                            "supported dtypes are int8"):
            nccl.nccl_dtype_name(bad)
    from gpustrat.reduce_util import ReduceOp
    assert set(nccl.NCCL_OPS) == set(ReduceOp)


def test_communicator_without_cupy_is_a_clear_error():
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="CuPy is needed for GPU devices"):
        nccl.NcclCommunicator([Device("gpu", 0)])


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t

    def sleep(self, s):
        self.t += s


def test_deadline_aborts_and_raises():
    clock = FakeClock()
    aborted = []
    with pytest.raises(CollectiveTimeout, match=r"NCCL all_reduce\(SUM\) did not complete "
                                                r"within 0.5 s \(GPUSTRAT_TIMEOUT\)"):
        nccl.wait_for(lambda: False, 0.5, lambda: "NCCL all_reduce(SUM)",
                      on_timeout=lambda: aborted.append(True), clock=clock,
                      sleep=clock.sleep)
    assert aborted == [True]
    assert 0.5 < clock.t < 0.6


def test_deadline_async_error_aborts():
    aborted = []

    def check():
        raise RuntimeError("NCCL_ERROR_SYSTEM_ERROR: remote process exited")

    with pytest.raises(RuntimeError, match="failed on the device .*remote process exited"):
        nccl.wait_for(lambda: False, 10, lambda: "NCCL broadcast",
                      on_timeout=lambda: aborted.append(True), check=check)
    assert aborted == [True]


def test_deadline_returns_when_done():
    answers = [False] * 150 + [True]  # past the ~100 spinning polls into the sleeps
    polls = iter(answers)
    clock = FakeClock()
    nccl.wait_for(lambda: next(polls), 1.0, lambda: "x", on_timeout=pytest.fail,
                  clock=clock, sleep=clock.sleep)
    # It polled until done() said True, and not once more.
    assert next(polls, "exhausted") == "exhausted"
    # It slept between the later polls (no busy spin) yet stayed well within the deadline.
    assert 0 < clock.t < 1.0


class TwoWorkers(WorkerGroup):
    """Worker ``rank`` of a pretend pair whose broadcast carries root's value."""

    size = 2
    shared: dict = {}

    def __init__(self, rank):
        self.rank = rank

    def bcast(self, obj, root=0):
        if self.rank == root:
            TwoWorkers.shared["v"] = obj
        return TwoWorkers.shared["v"]

    def allgather(self, obj):
        raise AssertionError("not used")

    def allreduce_ints(self, values, op):
        raise AssertionError("not used")

    def barrier(self):
        pass


def test_rendezvous_creates_on_root_only():
    made = []

    def make():
        made.append(1)
        return tuple(range(128))

    assert broadcast_unique_id(LocalWorkerGroup(), make) == tuple(range(128))
    made.clear()
    root, other = TwoWorkers(0), TwoWorkers(1)
    assert broadcast_unique_id(root, make) == tuple(range(128))
    assert broadcast_unique_id(other, make) == tuple(range(128))
    assert made == [1]


def test_rendezvous_failure_reaches_every_worker():
    def broken():
        raise OSError("libnccl.so.2: cannot open shared object file")

    for w in (TwoWorkers(0), TwoWorkers(1)):
        with pytest.raises(RuntimeError, match="on worker 0 failed .*libnccl.so.2"):
            broadcast_unique_id(w, broken)


RENDEZVOUS_MPI = r"""
import os
from gpustrat.collectives.mpi import MpiWorkerGroup
from gpustrat.collectives.rendezvous import broadcast_unique_id
g = MpiWorkerGroup()
uid = broadcast_unique_id(g, lambda: tuple(os.urandom(128)))
every = g.allgather(uid)
assert len(uid) == 128 and all(u == uid for u in every)
print(f"OK rank {g.rank}", flush=True)
"""


@pytest.mark.mpi
def test_rendezvous_over_mpi():
    assert_mpi_ok(3, RENDEZVOUS_MPI, timeout=120, expect_lines=3)


def test_staged_communicator_semantics_on_host_devices():
    devices = [Device("cpu", i) for i in range(3)]
    staged = StagedCommunicator(devices, HostCommunicator(devices))
    host = HostCommunicator(devices)
    vals = [np.arange(6, dtype=np.float32).reshape(6, 1) * (i + 1) for i in range(3)]
    for op in ("sum", "mean", "max", "min"):
        for a, b in zip(staged.all_reduce(vals, op), host.all_reduce(vals, op)):
            np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(staged.reduce(vals, "sum"), vals[0] * 6)
    np.testing.assert_array_equal(staged.all_gather(vals, 0)[2], np.concatenate(vals))
    np.testing.assert_array_equal(staged.broadcast(vals, root=1)[0], vals[1])
    np.testing.assert_array_equal(staged.reduce_scatter(vals, "sum")[1], (vals[0] * 6)[2:4])
    assert staged.num_replicas == 3
    with pytest.raises(ValueError, match="host communicator has 3 local replicas but 2"):
        StagedCommunicator(devices[:2], host)


def test_gpu_tests_fail_when_a_gpu_is_required():
    from gpustrat.devices import gpu_count
    if gpu_count():
        pytest.skip("a GPU is present: the GPU tests run for real")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         str(HERE / "test_gpu_kernels.py")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env=dict(os.environ, GPUSTRAT_TEST_GPU="1", PYTHONPATH=str(REPO)))
    assert proc.returncode != 0
    assert "GPUSTRAT_TEST_GPU=1 says a GPU must be present" in proc.stdout, proc.stdout[-2000:]
    # Without the variable they run on the stream-ordering sanitizer's fake GPUs.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-rs", "-k", "scatter", str(HERE / "test_gpu_kernels.py")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={k: v for k, v in dict(os.environ, PYTHONPATH=str(REPO)).items()
             if k != "GPUSTRAT_TEST_GPU"})
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]


def test_an_unnamed_nccl_result_is_named_in_the_error():
    # Some CuPy versions' NcclError knows results 0..5 only: result 6 is a KeyError(6).
    def check():
        raise KeyError(6)

    with pytest.raises(RuntimeError, match=r"NCCL all_reduce\(SUM\) failed on the device "
                                           r"\(ncclRemoteError: a peer failed .*\(6\)\)"):
        nccl.wait_for(lambda: False, 10, lambda: "NCCL all_reduce(SUM)",
                      on_timeout=lambda: None, check=check)
