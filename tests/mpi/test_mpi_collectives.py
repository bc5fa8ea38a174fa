"""MPI worker group and communicator, under ``mpiexec -n 2``, ``-n 3`` and ``-n 4``.

Each test launches one small job whose ranks check exact expected values and print a
line per rank; the parent asserts the exit status and those lines, and shows the
children's output on failure. Failure tests check that jobs end quickly and non-zero.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import REPO, assert_mpi_ok, format_result, mpi_flavour, run_mpi  # noqa: E402

from gpustrat.collectives import mpi as gmpi  # noqa: E402
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout  # noqa: E402

pytestmark = pytest.mark.mpi

COLLECTIVES = r"""
import numpy as np
from mpi4py import MPI
from gpustrat.collectives.mpi import MpiCommunicator, MpiWorkerGroup
from gpustrat.devices import resolve_devices
from gpustrat.reduce_util import ReduceOp

g = MpiWorkerGroup()
W, r = g.size, g.rank
assert W == MPI.COMM_WORLD.Get_size() and r == MPI.COMM_WORLD.Get_rank()
eq = np.testing.assert_array_equal

for L in (1, 2):
    c = MpiCommunicator(resolve_devices([f"cpu:{i}" for i in range(L)]), g)
    N = W * L
    assert (c.num_workers, c.worker_index, c.num_replicas) == (W, r, N)
    gids = [r * L + i for i in range(L)]
    vals = [np.array([k, -k, 2 * k + 1], np.float32) for k in gids]
    before = [v.copy() for v in vals]
    k = np.arange(N)
    expected = {
        ReduceOp.SUM: [k.sum(), -k.sum(), (2 * k + 1).sum()],
        ReduceOp.MEAN: [k.mean(), -k.mean(), (2 * k + 1).mean()],
        ReduceOp.MAX: [N - 1, 0, 2 * N - 1],
        ReduceOp.MIN: [0, -(N - 1), 1],
    }
    for op, want in expected.items():
        for spelling in (op, op.name.lower()):
            outs = c.all_reduce(vals, spelling)
            assert len(outs) == L and len({id(o) for o in outs}) == L, (op, L)
            for o in outs:
                assert o.dtype == np.float32 and o.shape == (3,), (o.dtype, o.shape)
                np.testing.assert_allclose(o, np.asarray(want, np.float32), rtol=1e-6)
        np.testing.assert_allclose(c.reduce(vals, op), np.asarray(want, np.float32))
    for v, b in zip(vals, before):
        eq(v, b)  # inputs untouched
    # Scalars, integers (MEAN becomes float), float16 (reduced in float32).
    eq(c.reduce([np.float64(k) for k in gids], "sum"), k.sum())
    m = c.reduce([np.array([k], np.int64) for k in gids], "mean")
    assert m.dtype == np.float64 and m[0] == k.mean(), m
    h = c.reduce([np.full(4, 0.5, np.float16)] * L, "sum")
    assert h.dtype == np.float16 and (h == 0.5 * N).all(), h
    eq(c.reduce([np.array([k % 2 == 0]) for k in gids], "min"), [N == 1])

    # all_gather, sizes differing along the axis, in global replica order.
    parts = [np.arange(2 * (k + 1)).reshape(k + 1, 2) + 100 * k for k in gids]
    want = np.concatenate([np.arange(2 * (j + 1)).reshape(j + 1, 2) + 100 * j
                           for j in range(N)])
    for o in c.all_gather(parts, axis=0):
        eq(o, want)
    for o in c.all_gather([p.T for p in parts], axis=1):
        eq(o, want.T)
        assert o.flags.c_contiguous
    for o in c.all_gather([p.T.astype(np.float16) for p in parts], axis=-1):
        eq(o, want.T.astype(np.float16))
    eq(c.all_gather([np.zeros((0, 3)) if k % 2 else np.ones((1, 3)) for k in gids])[0],
       np.ones(((N + 1) // 2, 3)))

    # broadcast from a root replica on another worker (the last, and worker 1).
    for root in (N - 1, L):
        outs = c.broadcast([np.array([[k, 7]], np.int32) for k in gids], root=root)
        for o in outs:
            eq(o, [[root, 7]])

    # reduce_scatter: replica j gets the j-th of N chunks of the sum.
    bufs = [np.arange(2 * N, dtype=np.float64) * (k + 1) for k in gids]
    total = np.arange(2 * N) * (k + 1).sum()
    for i, o in enumerate(c.reduce_scatter(bufs, "sum")):
        eq(o, total[2 * gids[i]: 2 * gids[i] + 2])
    c.close()

# The control plane.
assert g.allgather({"rank": r}) == [{"rank": i} for i in range(W)]
v = np.array([r, 1, -r])
eq(g.allreduce_ints(v, "sum"), [W * (W - 1) // 2, W, -(W * (W - 1) // 2)])
eq(g.allreduce_ints(v, "max"), [W - 1, 1, 0])
eq(g.allreduce_ints(v, "min"), [0, 1, -(W - 1)])
assert g.allreduce_ints(v, "sum").dtype == np.int64
assert g.bcast(("from", r, np.arange(r)), root=W - 1)[1] == W - 1
assert g.bcast(None if r else {"x": 1}) == {"x": 1}
g.barrier()
assert g.node_local_size() == W and 0 <= g.node_local_rank() < W  # one node here

# Groups coexist: each works on its own duplicate, also of a sub-communicator.
g2 = MpiWorkerGroup()
assert g2.allgather(r * 10) == [i * 10 for i in range(W)]
assert g.allgather(r) == list(range(W))
sub = MpiWorkerGroup(MPI.COMM_WORLD.Split(r % 2, r))
assert sub.allgather(r) == list(range(r % 2, W, 2))
for x in (sub, g2, g):
    x.close()
print("OK", r, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives(n):
    assert_mpi_ok(n, COLLECTIVES, timeout=80, expect_lines=n)


# What the one-replica-per-worker child scripts start with.
ONE_REPLICA_PRELUDE = r"""
import os
import sys
import threading
import time
import numpy as np
from gpustrat.collectives.mpi import MpiCommunicator, MpiWorkerGroup
from gpustrat.devices import resolve_devices
from gpustrat.distribute.failures import install_abort_on_error
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout

g = MpiWorkerGroup()
c = MpiCommunicator(resolve_devices(["cpu:0"]), g)
"""

SMALL_AND_LARGE = ONE_REPLICA_PRELUDE + r"""
from gpustrat.reduce_util import ReduceOp
from gpustrat.distribute.reduction import NAMES_AXIS_NONE
assert install_abort_on_error(g)
W, r = g.size, g.rank
eq = np.testing.assert_array_equal
# A gather along axis 1 where this rank's few numbers would ride in the header as a
# non-contiguous view while another rank's do not fit there: every rank sends its rows.
cols = [2 if k % 2 == 0 else 10 for k in range(W)]
parts = [np.arange(2 * n, dtype=np.float32).reshape(2, n) + 100 * k
         for k, n in enumerate(cols)]
for _ in range(2):
    eq(c.gather([parts[r]], axis=1), np.concatenate(parts, axis=1))
    eq(c.all_gather([parts[r]], axis=1)[0], np.concatenate(parts, axis=1))
# Few rows on every rank, the same count or not.
for rows in ([1] * W, [k % 2 for k in range(W)], [k + 1 for k in range(W)]):
    xs = [np.full((n, 2), k, np.int32) for k, n in enumerate(rows)]
    for _ in range(2):
        eq(c.gather([xs[r]], 0), np.concatenate(xs))
        eq(c.gather([xs[r].T], 1), np.concatenate(xs).T)
# A named reduce of every dtype and op, small and large, 0-d too; the same call again
# (its plan remembered) and after another layout.
k = np.arange(W)
for shape in ((), (1,), (3,), (40,)):
    for dtype in (np.float32, np.float64, np.int32, np.int64, np.float16):
        for op in ReduceOp:
            x = np.full(shape, r + 1, dtype)
            for _ in range(2):
                got = c.reduce_named(x, op, NAMES_AXIS_NONE[id(op)])
                want = {ReduceOp.SUM: (k + 1).sum(), ReduceOp.MEAN: (k + 1).mean(),
                        ReduceOp.MAX: W, ReduceOp.MIN: 1}[op]
                assert got.shape == shape, (got.shape, shape)
                np.testing.assert_allclose(got, np.full(shape, want), rtol=1e-3)
                eq(x, np.full(shape, r + 1, dtype))  # the input is left alone
print("OK", r, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_small_payloads_beside_large_ones_and_named_reduces(n):
    assert_mpi_ok(n, SMALL_AND_LARGE, timeout=80, expect_lines=n,
                  env={gmpi.ENV_TIMEOUT: "30"})


MISMATCH = ONE_REPLICA_PRELUDE + r"""
r = g.rank
c.reduce([np.ones(2, np.float32)], "sum")  # agreeing calls pass
case = sys.argv[1]
try:
    if case == "shape":
        c.reduce([np.ones(4 if r == 1 else 3, np.float32)], "sum")
    elif case == "skip":  # rank 1 skips the all_reduce and goes on to an all_gather
        if r != 1:
            c.reduce([np.ones(3, np.float32)], "sum")
        c.all_gather([np.ones((r + 1, 2), np.float32)])
    else:  # the same collective from two lines of code
        if r == 1:
            c.reduce([np.ones(3, np.float32)], "sum")
        else:
            c.reduce([np.ones(3, np.float32)], "sum")
except CollectiveMismatch as e:
    print("MISMATCH", r, type(e).__name__, e, flush=True)
else:
    print("NO ERROR", r, flush=True)
"""


AGREEING = ONE_REPLICA_PRELUDE + r"""
from gpustrat.collectives.staged import StagedCommunicator
from gpustrat.errors import LayoutMismatch
r, W = g.rank, g.size
x = np.full(3, r + 1.0, np.float32)
big = np.full(40_000, r + 1.0, np.float32)      # beyond the header's inline payload
total = W * (W + 1) / 2
for y in (x, big):
    before = c._ch.calls
    with c.agreeing(("a:3:float32", "b:2:float32"), "fused(SUM)", "do the same"):
        out = c.reduce([y], "sum")
    assert c._ch.calls - before == 1                # the agreement rode in the header
    assert np.array_equal(out, np.full(y.shape, total)), out
    try:
        with c.agreeing(("a:3:float32", f"b:{2 + (r == 1)}:float32"), "fused(SUM)",
                        "do the same"):
            c.reduce([y], "sum")
    except LayoutMismatch as e:
        assert "fused(SUM): the workers disagree: rank 0: (a:3:float32, b:2:float32); " \
               "rank 1: (a:3:float32, b:3:float32)" in str(e) and "do the same" in str(e), e
    else:
        raise AssertionError("no error")
# A second agreement (a kept checksum, words only when asked) rides in the same header;
# where only it differs, every rank raises StateMismatch with its words.
from gpustrat.errors import StateMismatch
said = lambda: ((f"lr={0.1 * (1 + (r == 1)):.1f}", "n=3"), "opt", "use one rate")
before = c._ch.calls
with c.agreeing(("a:3:float32",), "fused(SUM)", "do the same", also=(7, said)):
    assert np.array_equal(c.reduce([x], "sum"), np.full(3, total))
assert c._ch.calls - before == 1
try:
    with c.agreeing(("a:3:float32",), "fused(SUM)", "do the same", also=(7 + r, said)):
        c.reduce([x], "sum")
except StateMismatch as e:
    assert "opt: the workers disagree: rank 0: (lr=0.1, n=3); rank 1: (lr=0.2, n=3)" \
        in str(e) and str(e).endswith("use one rate"), e
else:
    raise AssertionError("no error")
# An error inside the with, before any collective: the agreement is dropped with it.
try:
    with c.agreeing((f"rank {r}",), "nothing", ""):
        raise KeyError("before the collective")
except KeyError:
    pass
assert np.array_equal(c.reduce([x], "sum"), np.full(3, total))
# The host-staged communicator (GPU buffers without NCCL) agrees through its host one.
staged = StagedCommunicator(resolve_devices(["cpu:0"]), c)
for call in ("agree", "agreeing"):
    try:
        if call == "agree":
            staged.agree((f"key {r % 2}",), "staged", "")
        else:
            with staged.agreeing((f"key {r % 2}",), "staged", ""):
                staged.all_reduce([x], "sum")
    except LayoutMismatch as e:
        assert "key 0" in str(e) and "key 1" in str(e), e
    else:
        raise AssertionError(f"no error from staged {call}")
staged.agree(("same",), "staged", "")
print("OK", r, flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n", [2, 3])
def test_an_agreement_rides_in_the_next_header_and_raises_on_every_rank(n):
    assert_mpi_ok(n, AGREEING, timeout=80, expect_lines=n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case", ["shape", "skip", "site"])
def test_mismatched_collectives_raise_on_every_rank(n, case):
    env = {gmpi.ENV_TIMEOUT: "20"}
    if case == "site":
        env[gmpi.ENV_DEBUG] = "1"  # lines of code are compared in debug mode only
    out = assert_mpi_ok(n, MISMATCH, timeout=50, args=[case], marker="MISMATCH",
                        expect_lines=n, env=env)
    for line in out.splitlines():
        if case == "shape":
            assert "LayoutMismatch" in line, line
            assert ("all_reduce(SUM): every worker must contribute the same shape and "
                    "dtype, but the workers hold rank 0: (3,) float32; rank 1: (4,) "
                    "float32") in line, line
        elif case == "skip":
            assert "collective #2 " in line, line
            assert "rank 0 called all_reduce(SUM) on shape (3,) float32 at " in line, line
            assert "rank 1 called all_gather(axis=0) on shape (2, 2) float32 at " in line
            if n == 3:
                assert "rank 2 called all_reduce(SUM)" in line, line
        else:
            assert "from different lines of code" in line, line
            assert "child.py:27" in line and "child.py:29" in line, line


GATHER_MISMATCH = ONE_REPLICA_PRELUDE + r"""
r = g.rank
case = sys.argv[1]
# Rank 1 differs: same itemsize, other dtype (the bytes would be reinterpreted), other
# trailing shape, other number of dimensions.
x = {"dtype": np.ones((2, 3), np.int32 if r == 1 else np.float32),
     "shape": np.ones((2, 4 if r == 1 else 3), np.float32),
     "ndim": np.ones((2, 3, 1) if r == 1 else (2, 3), np.float32)}[case]
try:
    c.all_gather([x], axis=0)
except ValueError as e:
    print("ERROR", r, e, flush=True)
else:
    print("NO ERROR", r, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case,rank1", [("dtype", "(2, 3) int32"), ("shape", "(2, 4) float32"),
                                        ("ndim", "(2, 3, 1) float32")])
def test_all_gather_mismatch_between_workers_is_an_error_on_every_rank(n, case, rank1):
    out = assert_mpi_ok(n, GATHER_MISMATCH, timeout=50, args=[case], marker="ERROR",
                        expect_lines=n, env={gmpi.ENV_TIMEOUT: "20"})
    for line in out.splitlines():
        assert f"rank 0: (2, 3) float32; rank 1: {rank1}" in line, line
        assert "dtypes must match" in line, line


TIMEOUT = ONE_REPLICA_PRELUDE + r"""
assert install_abort_on_error(g)
r = g.rank
g.barrier()
if r == 1:
    time.sleep(60)  # skips the collective; MPI_Abort from another rank ends it
t0 = time.monotonic()
try:
    c.reduce([np.ones(3, np.float32)], "sum")
except CollectiveTimeout as e:
    print(f"TIMEOUT {r} after {time.monotonic() - t0:.1f} s: {e}", flush=True)
    raise
print("NO TIMEOUT", r, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_skipped_collective_times_out_and_the_job_ends(n):
    t0 = time.monotonic()
    rc, out, err = run_mpi(n, TIMEOUT, timeout=45, env={gmpi.ENV_TIMEOUT: "2"})
    elapsed = time.monotonic() - t0
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    assert elapsed < 30, f"job took {elapsed:.0f} s\n{report}"
    lines = [ln for ln in out.splitlines() if ln.startswith("TIMEOUT")]
    assert lines, report  # the rank that reached the abort first printed its timeout
    for ln in lines:
        rank = int(ln.split()[1])
        assert rank != 1, report
        secs = float(ln.split()[3])
        assert 2 <= secs < 10, ln
        assert (f"all_reduce(SUM) on shape (3,) float32 did not complete within 2 s on "
                f"rank {rank}") in ln, ln
        assert "skipped this collective" in ln, ln
    assert "NO TIMEOUT" not in out, report
    assert err.count("CollectiveTimeout:") >= 1 and "[gpustrat] rank" in err, report


RAISES = ONE_REPLICA_PRELUDE + r"""
assert install_abort_on_error(g)
r = g.rank
g.barrier()
if r == 1:
    def fail():
        raise ValueError("boom from rank 1")
    if sys.argv[1] == "thread":
        t = threading.Thread(target=fail, name="input-pipeline")
        t.start()
        t.join()
    else:
        fail()
# The others wait in a collective that rank 1 never joins (default deadline: 300 s).
c.reduce([np.ones(3, np.float32)], "sum")
print("SURVIVED", r, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_exception_on_one_rank_ends_every_rank_quickly(where):
    t0 = time.monotonic()
    rc, out, err = run_mpi(3, RAISES, timeout=45, args=[where])
    elapsed = time.monotonic() - t0
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    assert elapsed < 20, f"job took {elapsed:.0f} s\n{report}"
    assert "SURVIVED" not in out, report
    assert err.count("[gpustrat] rank 1 of 3: uncaught exception") == 1, report
    assert err.count("ValueError: boom from rank 1") == 1, report
    assert "[gpustrat] rank 0" not in err and "[gpustrat] rank 2" not in err, report
    if where == "thread":
        assert "in thread 'input-pipeline'" in err, report


KILLED = ONE_REPLICA_PRELUDE + r"""
install_abort_on_error(g)
g.barrier()
if g.rank == 1:
    os._exit(3)  # dies without a word, before the collective
c.reduce([np.ones(3, np.float32)], "sum")
print("SURVIVED", g.rank, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cleanup", ["launcher", "deadline"])
def test_killed_rank_leaves_no_survivor_waiting(cleanup):
    """The launcher usually ends the job; when it does not (Hydra's
    -disable-auto-cleanup), the survivors' deadline fires and they abort."""
    launcher_args = []
    if cleanup == "deadline":
        if mpi_flavour() != "mpich":
            pytest.skip("keeping survivors alive uses MPICH Hydra's -disable-auto-cleanup")
        launcher_args = ["-disable-auto-cleanup"]
    t0 = time.monotonic()
    rc, out, err = run_mpi(3, KILLED, timeout=45, env={gmpi.ENV_TIMEOUT: "3"},
                           launcher_args=launcher_args)
    elapsed = time.monotonic() - t0
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    assert elapsed < 30, f"job took {elapsed:.0f} s\n{report}"
    assert "SURVIVED" not in out, report
    if cleanup == "deadline":
        # The survivors see rank 1's process gone (same node) before the deadline.
        assert "rank 1 (process" in err and "os._exit" in err, report


# --- in-process: no MPI initialised ----------------------------------------------

class _Never:
    calls = 0

    def Test(self):
        self.calls += 1
        return False


class _After:
    def __init__(self, n):
        self.n = n

    def Test(self):
        self.n -= 1
        return self.n <= 0


def test_wait_deadline_raises_collective_timeout():
    req = _Never()
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout) as ei:
        gmpi.wait(req, lambda: "all_reduce(SUM) on shape (3,) float32", 4, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 3
    msg = str(ei.value)
    assert "all_reduce(SUM) on shape (3,) float32 did not complete within 0.3 s on rank 4" \
        in msg and "GPUSTRAT_TIMEOUT" in msg and "skipped" in msg
    # The backoff reaches 1 ms sleeps: far fewer tests than a busy spin would make.
    assert req.calls < 200_000


def test_wait_returns_once_the_request_completes():
    # Within the spin (1, 50), past it into the backoff (5000): wait must keep testing
    # until the request completes, and stop at the first Test() that says so.
    for n in (1, 50, 5000):
        req = _After(n)
        t0 = time.monotonic()
        gmpi.wait(req, "barrier", 0, 5.0)
        assert req.n == 0, f"wait returned after {n - req.n} of the {n} tests needed"
        assert time.monotonic() - t0 < 5.0


def test_timeout_from_env(monkeypatch):
    monkeypatch.delenv(gmpi.ENV_TIMEOUT, raising=False)
    assert gmpi.timeout_from_env() == 300
    monkeypatch.setenv(gmpi.ENV_TIMEOUT, "2.5")
    assert gmpi.timeout_from_env() == 2.5
    monkeypatch.setenv(gmpi.ENV_TIMEOUT, "inf")
    assert gmpi.timeout_from_env() == float("inf")
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(gmpi.ENV_TIMEOUT, bad)
        with pytest.raises(ValueError, match="GPUSTRAT_TIMEOUT"):
            gmpi.timeout_from_env()


def test_error_kinds():
    assert issubclass(gmpi.LayoutMismatch, CollectiveMismatch)
    assert issubclass(gmpi.LayoutMismatch, ValueError)  # bad input, as before
    assert issubclass(CollectiveMismatch, RuntimeError)
    assert issubclass(CollectiveTimeout, TimeoutError)


def test_importing_gpustrat_does_not_initialise_mpi():
    code = ("import sys, gpustrat, gpustrat.collectives.mpi, gpustrat.distribute.failures;"
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'; print('clean')")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert p.returncode == 0 and "clean" in p.stdout, p.stderr


ABORT_REPORT = r"""
import os
from gpustrat.distribute.failures import install_abort_on_error, uninstall_abort_on_error
import sys
import threading

class Group:
    size, rank = 2, 1
    def abort(self, code=1):
        print("ABORT", code, flush=True)

os.environ["GPUSTRAT_ABORT_ON_ERROR"] = "0"
assert install_abort_on_error(Group()) is False
os.environ["GPUSTRAT_ABORT_ON_ERROR"] = "1"
one = Group(); one.size = 1
assert install_abort_on_error(one) is False
g = Group()
assert install_abort_on_error(g) and install_abort_on_error(g)
other = Group(); other.rank = 0
assert install_abort_on_error(other)  # the newest open group aborts
uninstall_abort_on_error(other)
assert sys.excepthook is not sys.__excepthook__  # g is still open
uninstall_abort_on_error()
assert sys.excepthook is sys.__excepthook__
assert threading.excepthook is threading.__excepthook__
assert install_abort_on_error(other) and install_abort_on_error(g)
uninstall_abort_on_error(other)
raise KeyError("lost key")
"""


def test_abort_hook_reports_once_and_exits_nonzero():
    p = subprocess.run([sys.executable, "-c", ABORT_REPORT], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert p.stdout.strip() == "ABORT 1", p.stdout
    assert p.stderr.count("[gpustrat] rank 1 of 2: uncaught exception") == 1, p.stderr
    assert "KeyError: 'lost key'" in p.stderr, p.stderr
