"""Misuse between workers through the public calls, under ``mpiexec -n 2/3/4``: ranks
that call different collectives, debug mode with ``strategy.reduce``, a rank that calls
``MPI.Finalize()`` early or leaves with ``os._exit``. Every rank must raise a clear error
within seconds, and never return a wrong value first."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, format_result, mpi_flavour, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

# Every ordered pair of different public collectives: rank 0 makes the first, every
# other rank the second (at 3+ ranks, rank 2 makes a third in the last round). The job
# goes on after each error, so one launch covers all of them.
MIXED = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat.errors import CollectiveMismatch

L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W = s.worker_index, s.num_workers
val = s.experimental_distribute_values_from_function(
    lambda ctx: np.full((2, 3), ctx.replica_id_in_sync_group, np.float32))
ctx = gs.get_replica_context
calls = {
    "strategy.reduce [reduce(SUM, axis=None)": lambda: s.reduce("sum", val, axis=None),
    "strategy.reduce [reduce(MEAN, axis=0)": lambda: s.reduce("mean", val, axis=0),
    "strategy.reduce [reduce(MAX, axis=None)": lambda: s.reduce("max", val, axis=None),
    "strategy.reduce [reduce(MIN, axis=0)": lambda: s.reduce("min", val, axis=0),
    "strategy.gather [all_gather(axis=0)": lambda: s.gather(val, axis=0),
    "all_reduce in strategy.run [all_reduce(SUM)":
        lambda: s.run(lambda v: ctx().all_reduce("sum", v), args=(val,)),
    "all_gather in strategy.run [all_gather(axis=1)":
        lambda: s.run(lambda v: ctx().all_gather(v, 1), args=(val,)),
}
names = list(calls)
rounds = [(a, b, b) for a in names for b in names if a != b]
if W >= 3:
    rounds.append((names[0], names[4], names[5]))
errors = 0
for mine in rounds:
    me = mine[min(r, 2)]
    try:
        got = calls[me]()
    except CollectiveMismatch as e:
        text = str(e)
        for rank in range(W):
            want = f"rank {rank} called {mine[min(rank, 2)]} on shape "
            assert want in text, (want, text)
        errors += 1
    else:
        raise AssertionError(f"rank {r}: {me} against {mine} returned {got!r}")
assert errors == len(rounds)
# The job goes on, with right values.
total = s.reduce("sum", val, axis=None)
N = s.num_replicas_in_sync
assert np.array_equal(total, np.full((2, 3), N * (N - 1) / 2)), total
print("OK", r, errors, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,local,debug", [(2, 1, "0"), (2, 2, "0"), (3, 1, "0"),
                                           (4, 1, "0"), (2, 1, "1"), (3, 2, "1")])
def test_different_collectives_raise_collective_mismatch_on_every_rank(n, local, debug):
    # Debug mode once paired a reduce's layout check with another rank's debug check
    # (ValueError: too many values to unpack): it must give the same error.
    assert_mpi_ok(n, MIXED, timeout=110, args=[local], expect_lines=n,
                  env={"GPUSTRAT_TIMEOUT": "30", "GPUSTRAT_DEBUG_COLLECTIVES": debug})


# A rank that leaves the epoch early and starts the next one: its end-of-data agreement
# meets the others' agreement on the next block of the old epoch.
EPOCH = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.errors import CollectiveMismatch
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
# filter: unknown cardinality, so the workers agree on the steps block by block.
dist = s.experimental_distribute_dataset(
    Dataset.range(64).filter(lambda x: x >= 0).batch(2 * s.num_workers))
try:
    for step, x in enumerate(dist):
        if r == 0 and step == 0:
            for y in dist:  # a new epoch, while the others go on with this one
                pass
except CollectiveMismatch as e:
    assert "end-of-data agreement" in str(e), e
    print("MISMATCH", r, e, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_end_of_data_agreements_that_disagree_raise_on_every_rank(n):
    out = assert_mpi_ok(n, EPOCH, timeout=50, marker="MISMATCH", expect_lines=n,
                        env={"GPUSTRAT_TIMEOUT": "30"})
    for line in out.splitlines():
        assert "rank 0 called the input pipeline's end-of-data agreement [allgather]" in line
        assert "rank 1 called the input pipeline's end-of-data agreement [allreduce_ints" \
            in line, line


DEBUG_REDUCE = r"""
import sys
import numpy as np
import gpustrat as gs
L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, N = s.worker_index, s.num_replicas_in_sync
v = s.experimental_distribute_values_from_function(
    lambda ctx: np.arange(3, dtype=np.float32) + ctx.replica_id_in_sync_group)
k = N * (N - 1) / 2
for _ in range(3):
    assert np.array_equal(s.reduce("sum", v), np.arange(3) * N + k)
    assert np.allclose(s.reduce("mean", v, axis=0), (1 + (N - 1) / 2))
    assert s.gather(v, axis=0).shape == (3 * N,)
    out = s.run(lambda x: gs.get_replica_context().all_reduce("max", x), args=(v,))
    for o in s.experimental_local_results(out):
        assert np.array_equal(o, np.arange(3) + N - 1), o
print("OK", r, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n,local", [(2, 1), (3, 2)])
def test_debug_mode_with_strategy_reduce(n, local):
    assert_mpi_ok(n, DEBUG_REDUCE, timeout=50, args=[local], expect_lines=n,
                  env={"GPUSTRAT_DEBUG_COLLECTIVES": "1", "GPUSTRAT_TIMEOUT": "20"})


LEAVES = r"""
import os, sys, time
import numpy as np
import gpustrat as gs
from mpi4py import MPI
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
s.reduce("sum", np.ones(2))
if r == 1:
    if sys.argv[1] == "finalize":
        MPI.Finalize()
        time.sleep(60)  # still running: the others must not wait for its exit
    os._exit(0)
s.reduce("sum", np.ones(2))
print("RETURNED", r, flush=True)
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("how", ["finalize", "os_exit"])
def test_a_rank_that_finalizes_or_vanishes_is_named_within_seconds(n, how):
    # Hydra would otherwise kill the job (status 0) when a rank ends without
    # MPI_Finalize; -disable-auto-cleanup keeps the survivors running, as batch
    # systems and other launchers do.
    if how == "os_exit" and mpi_flavour() != "mpich":
        pytest.skip("keeping survivors alive uses MPICH Hydra's -disable-auto-cleanup")
    launcher = ["-disable-auto-cleanup"] if how == "os_exit" else []
    t0 = time.monotonic()
    rc, out, err = run_mpi(n, LEAVES, timeout=50, args=[how], launcher_args=launcher)
    elapsed = time.monotonic() - t0
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    assert elapsed < 20, f"job took {elapsed:.0f} s\n{report}"  # GPUSTRAT_TIMEOUT is 300
    assert "RETURNED" not in out, report
    if how == "finalize":
        assert "rank 1 has exited (its script ended, returned from main, or called " \
               "sys.exit or MPI.Finalize)" in err, report
    else:
        assert "rank 1 (process" in err and "os._exit" in err, report



# A rank that closes its strategy: the others' next collective on it raises within
# seconds naming that rank, and the job ends whether the others close their strategy
# too or just exit (with or without an error).
CLOSES = r"""
import sys, time
import numpy as np
import gpustrat as gs
from gpustrat.errors import CollectiveTimeout
L, after = int(sys.argv[1]), sys.argv[2]
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W = s.worker_index, s.num_workers
total = s.reduce("SUM", s.run(lambda: np.ones(2)), axis=None)
assert total.tolist() == [W * L] * 2, total
if r == W - 1:
    s.close()
    print("CLOSED", r, flush=True)
    sys.exit(0)
t0 = time.monotonic()
try:
    s.reduce("SUM", s.run(lambda: np.ones(2)), axis=None)
    print("RETURNED", r, flush=True)
except CollectiveTimeout as e:
    assert f"rank {W - 1} has closed its strategy" in str(e), e
    assert time.monotonic() - t0 < 10, time.monotonic() - t0
    print("NAMED", r, flush=True)
if after == "close":
    s.close()
elif after == "raise":
    raise SystemExit(3)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,local,after", [(2, 1, "exit"), (2, 2, "close"),
                                           (3, 1, "raise"), (3, 2, "exit")])
def test_a_rank_that_closes_its_strategy_is_named_and_the_job_ends(n, local, after):
    t0 = time.monotonic()
    rc, out, err = run_mpi(n, CLOSES, timeout=60, args=[str(local), after],
                           env={"GPUSTRAT_TIMEOUT": "120"})
    elapsed = time.monotonic() - t0
    report = format_result(rc, out, err)
    assert "[run_mpi] timed out" not in err, report
    assert elapsed < 40, f"job took {elapsed:.0f} s\n{report}"
    assert (rc != 0) == (after == "raise"), report
    assert "RETURNED" not in out, report
    assert out.count("NAMED") == n - 1 and out.count("CLOSED") == 1, report



# A step that fails on one worker, caught on every rank, which then skip the step: a
# replica raising while another replica of its worker is in a collective, before any
# collective (the replica in the calling thread), after the step's collectives, or a
# merge_call function (an optimizer's check) raising on one worker. Every worker raises
# at that step and every later step's values are exact (the failing worker's next
# collective used to meet the others' pending one).
SKIPS = r"""
import sys
import numpy as np
import gpustrat as gs
L, how = int(sys.argv[1]), sys.argv[2]
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W, N = s.worker_index, s.num_workers, s.num_replicas_in_sync
last = N - 1
with s.scope():
    w = gs.Variable(np.zeros(2, np.float32), name="w")
    b = gs.Variable(np.zeros(2, np.float32), name="b")
    opt = gs.optimizers.SGD(1.0)

def step(k):
    ctx = gs.get_replica_context()
    failing = ctx.replica_id_in_sync_group == last and k == 2
    failing_first = ctx.local_index == 0 and r == W - 1 and k == 2
    g = np.full(2, -float(k), np.float32)
    if how == "replica":
        if failing:
            raise FloatingPointError("loss is NaN")
    elif how == "first":   # the replica in the calling thread, before any collective
        if failing_first:
            raise FloatingPointError("loss is NaN")
    elif how == "after":   # after the step's collectives
        total = ctx.all_reduce("SUM", np.float32(k))
        if failing:
            raise FloatingPointError("loss is NaN")
        return total
    elif how == "apply":
        opt.apply_gradients([(g, w)] if failing else [(g, w), (g, b)])
    else:
        ctx.merge_call(check, args=(k,))
    return ctx.all_reduce("SUM", np.float32(k))

def check(strategy, k):
    if r == W - 1 and k == 2:
        raise ValueError("this worker's check failed")
    return strategy.reduce("MEAN", np.float32(k), axis=None)

failed = []
for k in range(5):
    try:
        got = s.reduce("SUM", s.run(step, args=(k,)), axis=None)
        assert float(got) == N * N * k, (k, float(got))
    except (FloatingPointError, ValueError) as e:
        assert k == 2, (k, e)
        failed.append(k)
        if r != W - 1:
            assert f"worker {W - 1} failed before this collective" in str(e), e
assert failed == [2], failed
if how == "apply":
    assert w.numpy().tolist() == [8.0 * N] * 2 and b.numpy().tolist() == w.numpy().tolist()
print(f"OK {r}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,local,how", [(2, 2, "replica"), (3, 2, "replica"),
                                         (2, 2, "first"), (2, 1, "first"),
                                         (3, 2, "after"), (2, 1, "after"),
                                         (2, 2, "apply"), (2, 1, "merge"),
                                         (3, 2, "merge")])
def test_a_step_failing_at_a_collective_on_one_worker_raises_on_every_worker(n, local,
                                                                            how):
    assert_mpi_ok(n, SKIPS, timeout=90, args=(local, how), expect_lines=n,
                  env={"GPUSTRAT_TIMEOUT": "60"})



# Nested values whose structures differ between workers (other dict keys, one more
# leaf): their leaves would pair up by position, so every rank raises, and the job goes
# on with exact values (they used to combine rank 0's "acc" with rank 1's "loss").
STRUCTURES = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat.errors import LayoutMismatch
L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W, N = s.worker_index, s.num_workers, s.num_replicas_in_sync
odd = r == W - 1
cases = {
    "reduce keys": lambda: s.reduce("SUM", s.run(lambda: {"loss": np.float32(1),
                                                          ("top5" if odd else "acc"):
                                                          np.float32(2)}), axis=None),
    "reduce count": lambda: s.reduce("SUM", s.run(
        lambda: [np.float32(1)] * (3 if odd else 2)), axis=None),
    "gather keys": lambda: s.gather(s.run(lambda: {("b" if odd else "a"): np.ones(2),
                                                   "c": np.ones(2)}), axis=0),
    "all_reduce keys": lambda: s.run(lambda: gs.get_replica_context().all_reduce(
        "SUM", {"a": np.float32(1), ("c" if odd else "b"): np.float32(2)})),
    "all_gather count": lambda: s.run(lambda: gs.get_replica_context().all_gather(
        (np.ones(2),) * (2 if odd else 1), axis=0)),
}
for name, call in cases.items():
    try:
        call()
        raise AssertionError(f"{name}: no error on rank {r}")
    except LayoutMismatch as e:
        assert "of a nested structure: the workers disagree" in str(e), (name, e)
    got = s.reduce("SUM", s.run(lambda: {"x": np.float32(1), "y": np.float32(2)}),
                   axis=None)
    assert got == {"x": N, "y": 2 * N}, (name, got)
print(f"OK {r}", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,local", [(2, 1), (3, 2)])
def test_nested_values_of_other_structures_raise_on_every_rank(n, local):
    assert_mpi_ok(n, STRUCTURES, timeout=90, args=(local,), expect_lines=n,
                  env={"GPUSTRAT_TIMEOUT": "60"})



# After a collective was left waiting (a timeout), the strategy's collectives say they
# cannot run any more (they raised a raw MPI error about an active request); after
# close(), that it was closed (an AttributeError).
AFTER = r"""
import sys, time
import numpy as np
import gpustrat as gs
from gpustrat.errors import CollectiveTimeout
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
if sys.argv[1] == "timeout":
    if r == 1:
        time.sleep(4)   # past rank 0's deadline
        sys.exit(0)
    for attempt in range(2):
        try:
            s.reduce("SUM", np.float32(1), axis=None)
            raise AssertionError("no timeout")
        except CollectiveTimeout as e:
            if attempt == 0:
                assert "did not complete within 2 s" in str(e), e
            else:
                assert "an earlier collective of this strategy did not complete" in \
                    str(e) and "restart" in str(e), e
else:
    s.close()
    try:
        s.reduce("SUM", np.float32(1), axis=None)
        raise AssertionError("no error")
    except RuntimeError as e:
        assert "this strategy (or worker group) was closed" in str(e), e
print(f"OK {r}", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("case", ["timeout", "closed"])
def test_collectives_after_a_timeout_or_close_say_why_they_cannot_run(case):
    rc, out, err = run_mpi(2, AFTER, timeout=60, args=[case],
                           env={"GPUSTRAT_TIMEOUT": "2", "GPUSTRAT_ABORT_ON_ERROR": "0"})
    report = format_result(rc, out, err)
    assert "[run_mpi] timed out" not in err and rc == 0, report
    assert out.count("OK") == (1 if case == "timeout" else 2), report



# Making a strategy waits for every rank: one that has exited is named within seconds
# (the wait lasted GPUSTRAT_TIMEOUT); one that closed its earlier strategy and makes
# the new one too is no error.
NEW_GROUP = r"""
import sys, time
import numpy as np
import gpustrat as gs
from gpustrat.errors import CollectiveTimeout
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r, W = s.worker_index, s.num_workers
assert s.reduce("SUM", np.float32(1), axis=None) == W
if sys.argv[1] == "exited":
    if r == 0:
        sys.exit(0)
    t0 = time.monotonic()
    try:
        gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
        raise AssertionError("made")
    except CollectiveTimeout as e:
        assert "rank 0 has exited" in str(e) and time.monotonic() - t0 < 20, e
else:
    if r == 0:
        s.close()
    time.sleep(0.5 * r)
    s2 = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    assert s2.reduce("SUM", np.float32(2), axis=None) == 2 * W
print(f"OK {r}", flush=True)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n,case", [(2, "exited"), (3, "exited"), (3, "closed")])
def test_making_a_strategy_names_a_rank_that_exited(n, case):
    rc, out, err = run_mpi(n, NEW_GROUP, timeout=60, args=[case],
                           env={"GPUSTRAT_TIMEOUT": "60", "GPUSTRAT_ABORT_ON_ERROR": "0"})
    report = format_result(rc, out, err)
    assert "[run_mpi] timed out" not in err and rc == 0, report
    assert out.count("OK") == (n - 1 if case == "exited" else n), report


# Random layouts around the 32 bytes that ride in the header, through the public calls:
# every replica's values are known to every rank (seeded by replica id), so each rank
# checks exact results. Held results must not change when later calls reuse buffers.
RANDOM = r"""
import sys
import numpy as np
import gpustrat as gs
L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, N = s.worker_index, s.num_replicas_in_sync
rng = np.random.default_rng(1234)  # the same draws on every rank
DTYPES = [np.float32, np.float64, np.int32, np.int8, np.float16, np.complex64, np.uint16]

def values(shape_of, dtype, seed):
    out = []
    for g in range(N):
        v = np.random.default_rng(seed * 100 + g).integers(0, 9, size=shape_of(g))
        out.append(v.astype(dtype))
    return out

held = []
for case in range(60):
    dtype = DTYPES[rng.integers(len(DTYPES))]
    trailing = tuple(int(n) for n in rng.integers(1, 4, size=rng.integers(0, 3)))
    big = rng.random() < 0.2
    rows = int(rng.integers(1, 3)) if not big else 40000
    vals = values(lambda g: (rows,) + trailing, dtype, case)
    pv = s.experimental_distribute_values_from_function(
        lambda ctx: vals[ctx.replica_id_in_sync_group])
    op = ["sum", "max", "min", "mean"][rng.integers(4)]
    if dtype is np.complex64 and op in ("max", "min"):
        op = "sum"
    stack = np.stack(vals)
    got = s.reduce(op, pv, axis=None)
    if op == "sum":
        want = stack.sum(axis=0, dtype=dtype)
    elif op == "mean":
        want = stack.mean(axis=0)
    else:
        want = getattr(stack, op)(axis=0)
    np.testing.assert_allclose(np.asarray(got, np.complex128), want, rtol=2e-3,
                               err_msg=f"{case} {op} {dtype} {stack.shape}")
    held.append((got, np.array(got, copy=True)))
    if big:  # equal rows everywhere, large: the blocking Allgather path
        got = s.gather(pv, axis=0)
        np.testing.assert_array_equal(got, np.concatenate(vals), err_msg=f"big {case}")
        held.append((got, np.concatenate(vals)))
    # axis=0 with rows differing between replicas (some empty), and gather.
    vals = values(lambda g: ((g + case) % 3,) + trailing, dtype, case + 1000)
    pv = s.experimental_distribute_values_from_function(
        lambda ctx: vals[ctx.replica_id_in_sync_group])
    cat = np.concatenate(vals)
    got = s.gather(pv, axis=0)
    np.testing.assert_array_equal(got, cat, err_msg=f"gather {case}")
    held.append((got, cat))
    if cat.shape[0] and dtype is not np.complex64:
        got = s.reduce("max", pv, axis=0)
        np.testing.assert_array_equal(got, cat.max(axis=0), err_msg=f"max0 {case}")
        got = s.reduce("sum", pv, axis=0)
        np.testing.assert_allclose(got, cat.sum(axis=0, dtype=dtype), rtol=2e-3)
    out = s.run(lambda x: gs.get_replica_context().all_gather(x, 0), args=(pv,))
    for o in s.experimental_local_results(out):
        np.testing.assert_array_equal(o, cat)
for got, copy in held:  # buffers reused by later calls never change a held result
    np.testing.assert_array_equal(got, copy)
print("OK", r, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,local", [(2, 1), (2, 2), (3, 1)])
def test_random_layouts_give_exact_results_on_every_rank(n, local):
    assert_mpi_ok(n, RANDOM, timeout=110, args=[local], expect_lines=n,
                  env={"GPUSTRAT_TIMEOUT": "60"})


@pytest.mark.timeout(120)
def test_bench_mpi_prints_public_rows_with_verdicts():
    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_mpi.py"
    script = f"import runpy, sys\nsys.argv = ['bench_mpi', '--quick', '--mib', '0.25', " \
             f"'--rounds', '2']\nrunpy.run_path({str(bench)!r}, run_name='__main__')\n"
    out = assert_mpi_ok(2, script, timeout=110)
    for case in ("strategy.reduce axis=None", "strategy.reduce axis=0", "strategy.gather",
                 "run all_reduce", "run all_gather"):
        rows = [ln for ln in out.splitlines() if case in ln and " public " in ln]
        assert len(rows) == 2, out  # the large buffer and one float
        assert all(ln.endswith((": met", ": NOT MET")) for ln in rows), out
    assert out.count("(internal, no target)") == 3, out
    for form in ("a NumPy scalar from run", "a 0-d array", "a PerReplica", "a Python float"):
        rows = [ln for ln in out.splitlines() if ln.startswith(f"loss: {form} ")]
        assert len(rows) == 1 and rows[0].endswith((": met", ": NOT MET")), out
