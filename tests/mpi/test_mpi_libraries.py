"""What differs between the MPI libraries a cluster has (MPICH, Open MPI, Intel MPI),
under ``mpiexec -n 2/4``: a persistent Allgather that is missing (MPI before 4.0) or
returns stale data (Intel MPI 2021.13 to 2021.18) is replaced by ``MPI_Iallgather``;
the abort-on-error hooks follow a strategy's life; thread levels; calls after
``MPI.Finalize()``. The libraries' faults are simulated with a communicator subclass
(mpi4py keeps the subclass through ``Dup``/``Idup``), so that every library runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, format_result, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

# A communicator whose Allgather_init is missing ("missing"), returns the previous
# round's data on ranks other than 0 ("stale", as Intel MPI 2021.18 does), or is the
# library's own ("real").
FAULTY = r"""
import sys
import warnings
import numpy as np
from mpi4py import MPI
import gpustrat as gs
from gpustrat.collectives.mpi import header

case = sys.argv[1]


class StaleRequest:
    # A persistent Allgather whose ranks other than 0 get the previous round's data.
    def __init__(self, comm, send, recv):
        self.comm, self.send, self.recv = comm, send[0], recv[0]
        self.prev, self.req = None, None

    def Start(self):
        self.scratch = np.empty_like(self.recv)
        self.req = self.comm.Iallgather([self.send.copy(), MPI.INT64_T],
                                        [self.scratch, MPI.INT64_T])

    def Test(self, status=None):
        if self.req is None:
            return True
        if not self.req.Test():
            return False
        self.req = None
        stale = self.comm.Get_rank() > 0 and self.prev is not None
        self.recv[...] = self.prev if stale else self.scratch
        self.prev = self.scratch
        return True

    def Free(self):
        pass


class Faulty(MPI.Intracomm):
    def Allgather_init(self, send, recv):
        if case == "missing":
            raise NotImplementedError
        return StaleRequest(self, send, recv)


comm = MPI.COMM_WORLD if case == "real" else Faulty(MPI.COMM_WORLD)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    s = gs.MultiWorkerMirroredStrategy(communicator=comm)
r, W = s.worker_index, s.num_workers
for step in range(20):
    x = np.full((3,), r + step, np.float32)
    got = s.reduce("sum", x, axis=None)
    want = np.full((3,), sum(range(W)) + W * step, np.float32)
    assert np.array_equal(got, want), (step, got, want)
    loss = s.reduce("mean", np.float32(r * step), axis=None)
    assert float(loss) == step * (W - 1) / 2, (step, loss)
    rows = s.gather(np.full((step % 3 + 1, 2), r, np.int64), axis=0)
    assert rows.shape == (W * (step % 3 + 1), 2) and (rows[:, 0] == np.repeat(
        np.arange(W), step % 3 + 1)).all(), rows
path = header.header_path()
from gpustrat.cli import _mpi_info  # what `python -m gpustrat info` reports
assert _mpi_info()["mpi headers"] == path, (_mpi_info(), path)
warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
s.close()
print("OK", r, path, "| warned:", warned, flush=True)
"""


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["missing", "stale", "real"])
def test_headers_fall_back_to_iallgather_where_the_persistent_one_is_missing_or_wrong(
        n, case):
    out = assert_mpi_ok(n, FAULTY, timeout=90, args=[case], expect_lines=n)
    lines = [line for line in out.splitlines() if line.startswith("OK")]
    for line in lines:
        path = line.split(" ", 2)[2]
        if case == "missing":
            assert path.startswith("MPI_Iallgather (this MPI library") and \
                "has no MPI_Allgather_init" in path, line
        elif case == "stale":
            assert path.startswith("MPI_Iallgather (MPI_Allgather_init gave other data "
                                   f"than was sent on ranks {list(range(1, n))}"), line
        else:  # the library's own: either path, the same on every rank
            assert path.split(" |")[0] == lines[0].split(" ", 2)[2].split(" |")[0], lines
    rank0 = next(line for line in lines if line.startswith("OK 0 "))
    if case == "stale":  # told once, on rank 0
        assert "RuntimeWarning" not in rank0 and "every header uses MPI_Iallgather" in \
            rank0, rank0
        assert all("warned: []" in line for line in lines if line is not rank0), lines
    if case == "missing":  # an MPI without it is not a fault: nothing to warn of
        assert all("warned: []" in line for line in lines), lines


# --- the abort-on-error hooks follow a strategy's life ---------------------------------

HOOKS = r"""
import sys
import threading
import numpy as np
import gpustrat as gs

case = sys.argv[1]


def app_hook(t, e, tb):
    print("APP HOOK", type(e).__name__, flush=True)


def app_thread_hook(args):
    print("APP THREAD HOOK", args.exc_type.__name__, flush=True)


sys.excepthook, threading.excepthook = app_hook, app_thread_hook


def fail_in_a_thread():
    def boom():
        raise KeyError("lost in a thread")
    t = threading.Thread(target=boom, name="worker-thread")
    t.start()
    t.join()


first = gs.MultiWorkerMirroredStrategy()
r = first.worker_index
assert sys.excepthook is not app_hook  # the strategy's hooks, while it is open
if case == "after_close":
    first.close()
    # Given back: the application's own errors reach the application's hooks.
    assert sys.excepthook is app_hook and threading.excepthook is app_thread_hook
    if r == 1:
        fail_in_a_thread()
    again = gs.MultiWorkerMirroredStrategy()
    assert float(again.reduce("sum", np.float32(1), axis=None)) == again.num_workers
    again.close()
    assert sys.excepthook is app_hook
    print("OK", r, flush=True)
else:  # two strategies, the first closed: an error aborts through the second
    second = gs.MultiWorkerMirroredStrategy()
    first.close()
    assert sys.excepthook is not app_hook
    if r == 1:
        fail_in_a_thread()
    second.reduce("sum", np.float32(1), axis=None)  # rank 0 waits here until the abort
    print("NOT ABORTED", r, flush=True)
"""


def test_hooks_are_given_back_to_the_application_when_its_strategies_close():
    rc, out, err = run_mpi(2, HOOKS, timeout=60, args=["after_close"])
    report = format_result(rc, out, err)
    assert rc == 0 and sum(line.startswith("OK ") for line in out.splitlines()) == 2, report
    assert "APP THREAD HOOK KeyError" in out and "aborting every rank" not in err, report


def test_an_error_aborts_through_the_strategy_still_open():
    rc, out, err = run_mpi(2, HOOKS, timeout=60, args=["two"])
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err and "NOT ABORTED" not in out, \
        report
    assert err.count("[gpustrat] rank 1 of 2: uncaught exception in thread "
                     "'worker-thread'; aborting every rank") == 1, report
    # The application's own hook is told first; then MPI_Abort itself ends the job (the
    # library reports it: MPICH and Intel MPI "MPI_Abort", Open MPI "MPI_ABORT").
    assert "APP THREAD HOOK KeyError" in out, report
    assert "MPI_Abort" in out + err or "MPI_ABORT" in out + err, report


# --- thread levels -------------------------------------------------------------------

THREADS = r"""
import sys
import mpi4py
mpi4py.rc.thread_level = sys.argv[1]
from mpi4py import MPI
import numpy as np
import gpustrat as gs

level = MPI.Query_thread()
for local in (1, 2):
    try:
        s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(local)])
    except ValueError as e:
        assert local > 1 and level < MPI.THREAD_SERIALIZED, (local, level, e)
        print("REFUSED", local, e, flush=True)
        continue
    assert local == 1 or level >= MPI.THREAD_SERIALIZED, (local, level)
    x = s.experimental_distribute_values_from_function(
        lambda ctx: np.float32(ctx.replica_id_in_sync_group))
    got = s.run(lambda v: gs.get_replica_context().all_reduce("sum", v), args=(x,))
    n = s.num_replicas_in_sync
    assert float(s.experimental_local_results(got)[0]) == n * (n - 1) / 2
    s.close()
    print("RAN", local, flush=True)
print("OK", MPI.COMM_WORLD.Get_rank(), int(level >= MPI.THREAD_SERIALIZED), flush=True)
"""


@pytest.mark.parametrize("level", ["funneled", "serialized", "multiple"])
def test_several_local_replicas_need_a_thread_level_that_allows_their_threads(level):
    out = assert_mpi_ok(2, THREADS, timeout=60, args=[level], expect_lines=2)
    assert out.count("RAN 1") == 2, out  # one replica: MPI calls on the main thread
    serialized = {line.split()[2] for line in out.splitlines() if line.startswith("OK ")}
    if level == "funneled":  # what MPICH, Open MPI and Intel MPI give when asked
        assert serialized == {"0"}, out
    if serialized == {"0"}:
        refused = [line for line in out.splitlines() if line.startswith("REFUSED 2")]
        assert len(refused) == 2, out
        assert ("worker 0: 2 local replicas make MPI calls from their own threads, which "
                "needs MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE, but MPI was "
                "initialised with MPI_THREAD_") in refused[0], out
        assert "mpi4py.rc.thread_level = 'multiple'" in refused[0], out
    else:
        assert out.count("RAN 2") == 2, out


# --- calls after MPI.Finalize() -------------------------------------------------------

AFTER_FINALIZE = r"""
import numpy as np
from mpi4py import MPI
import gpustrat as gs

s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
x = s.experimental_distribute_values_from_function(lambda ctx: np.ones(2, np.float32))
assert (s.reduce("sum", x, axis=None) == s.num_replicas_in_sync).all()
MPI.Finalize()
calls = {
    "strategy.reduce": lambda: s.reduce("mean", np.ones(3, np.float32), axis=None),
    "strategy.gather": lambda: s.gather(x, axis=0),
    "all_reduce in strategy.run": lambda: s.run(
        lambda v: gs.get_replica_context().all_reduce("sum", v), args=(x,)),
    "creating a strategy": lambda: gs.MultiWorkerMirroredStrategy(),
}
for name, call in calls.items():
    try:
        call()
    except RuntimeError as e:
        assert str(e).startswith(f"{name} cannot run: MPI has been finalized"), (name, e)
    else:
        raise AssertionError(f"{name} ran after MPI.Finalize()")
s.close()  # nothing left to free: no error, no MPI call
print("OK", flush=True)
"""


def test_calls_after_finalize_raise_an_error_naming_the_call():
    assert_mpi_ok(2, AFTER_FINALIZE, timeout=60, expect_lines=2)


# --- agreements found by the key a plan keeps ------------------------------------------

AGREEMENTS = r"""
import numpy as np
from gpustrat.collectives.mpi import MpiCommunicator, MpiWorkerGroup
from gpustrat.devices import resolve_devices
from gpustrat.errors import LayoutMismatch

g = MpiWorkerGroup()
c = MpiCommunicator(resolve_devices(["cpu:0"]), g)
r = g.rank
one = np.ones(2)
kept = ("4x3:float32", "scalar:float64")  # one plan's key, the same object every step
for step in range(3):
    with c.agreeing(kept, "step"):
        assert (c.reduce([one], "sum") == g.size).all()
for what in ("SGD.apply_gradients", "Adam.apply_gradients"):
    # The same key object under other words, and keys made anew each time (ids reused
    # once they are dropped): each disagreement names this call's words and keys.
    for attempt, other in enumerate(["float32", "float64", "int8"]):
        key = kept if r == 0 else tuple(["4x3:float32", f"scalar:{other}"])
        try:
            with c.agreeing(key, what, "every worker must reduce the same values"):
                c.reduce([one], "sum")
        except LayoutMismatch as e:
            assert other != "float64", "rank 1's key is rank 0's by value"
            want = (f"{what}: the workers disagree: rank 0: (4x3:float32, scalar:float64); "
                    f"rank 1: (4x3:float32, scalar:{other}). every worker must reduce the "
                    "same values")
            assert str(e) == want, (str(e), want)
        else:
            assert other == "float64", (what, other)
with c.agreeing(kept, "step"):
    assert (c.reduce([one], "sum") == g.size).all()
c.close()
g.close()
print("OK", r, flush=True)
"""


def test_agreements_found_by_identity_still_compare_words_and_values():
    assert_mpi_ok(2, AGREEMENTS, timeout=60, expect_lines=2)


# --- embedded in an HPC code: sub-communicators ----------------------------------------

EMBEDDED = r"""
import os
import sys
import threading
import numpy as np
from mpi4py import MPI
import gpustrat as gs

case = sys.argv[1]
world = MPI.COMM_WORLD
rank = world.Get_rank()
assert world.allreduce(1) == world.Get_size()  # the application's own traffic before
color = rank % 2
sub = world.Split(color, key=rank)
trains = case == "both" or color == 0
if trains:
    s = gs.MultiWorkerMirroredStrategy(communicator=sub)
    assert s.num_workers == sub.Get_size() and s.worker_index == sub.Get_rank()
    w = np.zeros(3)
    for step in range(20):
        g = s.reduce("mean", np.full(3, s.worker_index + step + 10 * color), axis=None)
        w -= 0.1 * g
    want = -0.1 * sum(np.full(3, (sub.Get_size() - 1) / 2 + step + 10 * color)
                      for step in range(20))
    assert np.allclose(w, want), (w, want)
    s.close()
else:  # the simulation ranks: MPI work of their own while the others train
    total = 0
    for step in range(200):
        total += sub.allreduce(step)
    assert total == sub.Get_size() * sum(range(200))
if case == "abort":  # an error on a training rank ends the whole job
    import time
    if color == 0:
        s = gs.MultiWorkerMirroredStrategy(communicator=sub)
        if s.worker_index == 1:
            raise KeyError("lost on a training rank")
        s.reduce("sum", np.float32(1), axis=None)  # waits until the abort
    while True:  # the simulation ranks go on with their own work
        sub.allreduce(1)
        time.sleep(0.01)
assert world.allreduce(rank) == sum(range(world.Get_size()))  # and after
if case == "cycles":
    # Strategies made and closed again and again leave nothing behind.
    def held():
        return len(os.listdir("/proc/self/fd")), threading.active_count()
    for _ in range(5):
        gs.MultiWorkerMirroredStrategy(communicator=sub).close()
    before = held()
    for _ in range(100):
        s = gs.MultiWorkerMirroredStrategy(communicator=sub)
        assert float(s.reduce("sum", np.float32(1), axis=None)) == sub.Get_size()
        s.close()
    assert held() == before, (held(), before)
sub.Free()
print("OK", rank, flush=True)
"""


@pytest.mark.parametrize("case", ["one", "both", "cycles"])
def test_a_strategy_on_a_sub_communicator_lives_beside_the_applications_mpi(case):
    assert_mpi_ok(4, EMBEDDED, timeout=100, args=[case], expect_lines=4)


def test_an_error_on_a_training_rank_ends_the_whole_job_simulation_ranks_included():
    rc, out, err = run_mpi(4, EMBEDDED, timeout=60, args=["abort"])
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    assert err.count("[gpustrat] rank 1 of 2: uncaught exception; aborting every "
                     "rank") == 1 and "KeyError: 'lost on a training rank'" in err, report
