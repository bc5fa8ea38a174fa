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
from mpi_util import assert_mpi_ok, repo_env  # noqa: E402


def run_python(code: str, env=None) -> subprocess.CompletedProcess:
    child_env = repo_env(**(env or {}))
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
        return bytes(range(128))

    assert broadcast_unique_id(LocalWorkerGroup(), make) == bytes(range(128))
    made.clear()
    root, other = TwoWorkers(0), TwoWorkers(1)
    assert broadcast_unique_id(root, make) == bytes(range(128))
    assert broadcast_unique_id(other, make) == bytes(range(128))
    assert made == [1]


# --- the unique id's two forms: CuPy 13 (tuple of signed chars) and CuPy 14 (bytes) ------

class FakeNccl:
    """``cupy.cuda.nccl`` of one CuPy major version, with its constructor's argument
    checks as the real Cython code makes them (cupy_backends/cuda/libs/nccl.pyx):
    CuPy 13: ``def __init__(self, int ndev, tuple commId, int rank)``, each item
    stored into a C ``char``; CuPy 14: ``bytes commId``, length checked."""

    NCCL_SUM, NCCL_AVG = 0, 4

    def __init__(self, major: int, uid: bytes = bytes(range(7, 135))):
        self.major, self.uid, self.made = major, uid, []
        fake = self

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                want = tuple if fake.major < 14 else bytes
                if type(commId) is not want:
                    raise TypeError(f"Argument 'commId' has incorrect type (expected "
                                    f"{want.__name__}, got {type(commId).__name__})")
                if len(commId) != 128:
                    raise ValueError(f"commId length {len(commId)} != 128.")
                if want is tuple and not all(-128 <= c <= 127 for c in commId):
                    raise OverflowError("value too large to convert to char")
                fake.made.append((ndev, commId, rank))

        self.NcclCommunicator = NcclCommunicator

    def get_unique_id(self):
        if self.major < 14:
            return tuple(b - 256 if b > 127 else b for b in self.uid)
        return self.uid

    def get_version(self):
        return 23203

    def groupStart(self):
        pass

    def groupEnd(self):
        pass


class ThreadWorkers(WorkerGroup):
    """Worker ``rank`` of ``size`` workers that are threads of this process."""

    def __init__(self, rank, shared):
        self.rank, self.size, self.shared = rank, shared["size"], shared

    def allgather(self, obj):
        self.shared["slots"][self.rank] = obj
        self.shared["barrier"].wait(timeout=30)
        out = list(self.shared["slots"])
        self.shared["barrier"].wait(timeout=30)
        return out

    def bcast(self, obj, root=0):
        return self.allgather(obj)[root]

    def allreduce_ints(self, values, op):
        raise AssertionError("not used")

    def barrier(self):
        self.shared["barrier"].wait(timeout=30)


def make_worker_communicators(monkeypatch, majors, gpus_per_worker=2):
    """gpustrat's NcclCommunicator on ``len(majors)`` workers (threads), worker ``w``
    with CuPy major version ``majors[w]``; returns each worker's FakeNccl."""
    import contextlib
    import threading
    import types
    fakes = [FakeNccl(m) for m in majors]
    local = threading.local()
    cp = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: contextlib.nullcontext()))
    monkeypatch.setattr(nccl, "cupy", lambda: cp)
    monkeypatch.setattr(nccl, "nccl_module", lambda: fakes[local.rank])
    shared = {"size": len(majors), "slots": [None] * len(majors),
              "barrier": threading.Barrier(len(majors))}
    errors = []

    def worker(rank):
        local.rank = rank
        try:
            nccl.NcclCommunicator([Device("gpu", i) for i in range(gpus_per_worker)],
                                  ThreadWorkers(rank, shared), timeout=5)
        except BaseException as e:  # reported below, from the test's thread
            errors.append((rank, e))
            shared["barrier"].abort()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(len(majors))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return fakes


@pytest.mark.parametrize("majors", [(13, 13), (14, 14, 14), (13, 14), (14, 13)])
def test_worker_communicators_get_the_id_in_their_cupys_form(monkeypatch, majors):
    fakes = make_worker_communicators(monkeypatch, majors)
    root_uid = fakes[0].uid
    n = 2 * len(majors)
    for w, fake in enumerate(fakes):
        # Every local GPU of every worker: the clique's size, its global replica id,
        # and rank 0's id in the form this worker's CuPy takes.
        assert [(ndev, rank) for ndev, _, rank in fake.made] == [(n, 2 * w), (n, 2 * w + 1)]
        for _, comm_id, _ in fake.made:
            if fake.major >= 14:
                assert comm_id == root_uid
            else:
                assert type(comm_id) is tuple
                assert bytes(c & 0xFF for c in comm_id) == root_uid


def test_unique_id_forms_round_trip_every_byte():
    from gpustrat.collectives import rendezvous as rv
    raw = bytes((i * 2 + 1) % 256 for i in range(128))
    chars = rv.unique_id_signed_chars(raw)
    assert min(chars) >= -128 and max(chars) <= 127 and min(chars) < 0
    assert rv.unique_id_bytes(chars) == raw == rv.unique_id_bytes(raw)
    every = bytes(range(256))
    for half in (every[:128], every[128:]):
        assert rv.unique_id_bytes(rv.unique_id_signed_chars(half)) == half
    with pytest.raises(ValueError, match="is 128 bytes, got 127"):
        rv.unique_id_bytes(raw[:127])
    with pytest.raises(ValueError, match=r"holds \[300\]"):
        rv.unique_id_bytes((300,) + (0,) * 127)


def test_a_constructor_that_takes_neither_form_is_a_clear_error():
    from gpustrat.collectives import rendezvous as rv
    fake = FakeNccl(14)

    def refuse(ndev, commId, rank):
        raise TypeError(f"no {type(commId).__name__}")
    fake.NcclCommunicator = refuse
    with pytest.raises(TypeError, match=r"neither as bytes .* nor as a tuple .*no bytes.*"
                                        r"no tuple"):
        rv.new_communicator(fake, 2, bytes(128), 0)


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
uid = broadcast_unique_id(g, lambda: os.urandom(128))
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
        env=repo_env(GPUSTRAT_TEST_GPU="1"))
    assert proc.returncode != 0
    assert "GPUSTRAT_TEST_GPU=1 says a GPU must be present" in proc.stdout, proc.stdout[-2000:]
    # Without the variable they run on the stream-ordering sanitizer's fake GPUs.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
         "-rs", "-k", "scatter", str(HERE / "test_gpu_kernels.py")],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={k: v for k, v in repo_env().items() if k != "GPUSTRAT_TEST_GPU"})
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-2000:]


def test_an_unnamed_nccl_result_is_named_in_the_error():
    # Some CuPy versions' NcclError knows results 0..5 only: result 6 is a KeyError(6).
    def check():
        raise KeyError(6)

    with pytest.raises(RuntimeError, match=r"NCCL all_reduce\(SUM\) failed on the device "
                                           r"\(ncclRemoteError: a peer failed .*\(6\)\)"):
        nccl.wait_for(lambda: False, 10, lambda: "NCCL all_reduce(SUM)",
                      on_timeout=lambda: None, check=check)
