"""Workers that disagree about model state, under ``mpiexec -n 2/3/4`` (1 or 2 replicas
each), with timeouts: different values written into a mirrored variable, a bad value
or gradient on one worker, variables made in another order or on one worker only,
other optimizer variable lists, a metric read on one worker only, a worker that raises
in the middle of a step, one that exits early. Every worker must raise a clear error
(or, where the job cannot go on, the job must end) within seconds: never a hang, never
variables that differ between workers."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, format_result, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

COMMON = r"""
import re
import sys
import numpy as np
from mpi4py import MPI
import gpustrat as gs
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout

L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W = s.worker_index, s.num_workers
last = W - 1
with s.scope():
    w = gs.Variable(np.zeros(3, np.float32), name="w", aggregation="sum")
    b = gs.Variable(np.zeros(2, np.float32), name="b")
    opt = gs.optimizers.Adam(0.1)
    mean = gs.metrics.Mean()
ctx = gs.get_replica_context
ONES3, ONES2 = np.ones(3, np.float32), np.ones(2, np.float32)


def expect(fn, pattern, kinds=(ValueError, CollectiveMismatch, CollectiveTimeout)):
    try:
        fn()
    except kinds as e:
        assert re.search(pattern, str(e), re.S), f"rank {r}: {type(e).__name__}: {e}"
        return e
    raise AssertionError(f"rank {r}: no error, expected {pattern!r}")


def same_everywhere(*vs):
    # mpi4py directly: only where every rank is known to have left gpustrat's calls.
    for v in vs:
        mine = [np.asarray(c).tolist() for c in s.experimental_local_results(v)]
        every = [c for m in MPI.COMM_WORLD.allgather(mine) for c in m]
        assert all(c == every[0] for c in every), f"rank {r}: {v.name} differs: {every}"
        yield every[0]


def step(gw, gb):
    opt.apply_gradients([(gw, w), (gb, b)])
"""

# Each disagreement raises on every rank and writes nothing; the job goes on.
RECOVERABLE = COMMON + r"""
def cross_assign():
    with s.scope():
        w.assign(np.full(3, float(r), np.float32))

def sync_on_read_assign():
    with s.scope():
        mean.count.assign(np.float32(r))

def create_shape():
    with s.scope():
        gs.Variable(np.zeros(3 if r != last else 4, np.float32), name="c")

def create_order():
    with s.scope():
        for name in (("c", "d") if r != last else ("d", "c")):
            gs.Variable(np.zeros(3, np.float32), name=name)

def fewer_variables():
    pairs = [(ONES3, w)] + ([(ONES2, b)] if r != last else [])
    s.run(lambda: opt.apply_gradients(pairs))

CASES = [
    (cross_assign, "every worker must write the same value"),
    (sync_on_read_assign, "every worker must write the same value"),
    (lambda: s.run(lambda: ctx().merge_call(
        lambda st: w.assign(np.full(3, float(r), np.float32)))),
     "every worker must write the same value"),
    (lambda: s.run(lambda: w.assign_add(np.ones(4 if r == last else 3, np.float32))),
     "every worker must make the same variable updates"),
    (lambda: s.run(lambda: w.assign(ONES3) if r == last else w.assign_add(ONES3)),
     rf"rank {last} called assign of variable 'w'"),
    (create_shape, r"rank \d: \(Variable, c, 4\)"),
    (create_order, "creating variable 'd'"),
    (fewer_variables, "every worker must reduce the same values"),
    (lambda: s.run(step, args=(ONES3, None if r == last else ONES2)),
     "every worker must reduce the same values"),
    (lambda: s.run(step, args=(np.ones(4 if r == last else 3, np.float32), ONES2)),
     # Named as the agreement it is, not as a shape and dtype.
     rf"rank {last} called \w+.apply_gradients \(bad gradients: the gradient of variable "
     r"'w' has shape \(4,\) but the variable has \(3,\),\)"),
]
for fn, pattern in CASES:
    expect(fn, pattern)
    assert [x for x in same_everywhere(w, b, mean.count)] == [[0.0] * 3, [0.0] * 2, 0.0]
    assert int(opt.iterations) == 0
# Every rank still trains, to the same weights.
s.run(step, args=(ONES3, ONES2))
got = list(same_everywhere(w, b))
assert int(opt.iterations) == 1 and np.allclose(got[0], -0.1) and np.allclose(got[1], -0.1)
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (3, 2), (4, 1)])
def test_disagreements_raise_on_every_rank_and_write_nothing(ranks, local):
    # The bad gradient shape on one rank used to raise there alone while the others
    # waited for it in the optimizer's agreement.
    assert_mpi_ok(ranks, RECOVERABLE, timeout=300, args=(local,), expect_lines=ranks)


# A collective that one rank makes alone: every rank raises, naming what each called.
ALONE = COMMON + r"""
which = sys.argv[2]
def alone():
    if r == 0:
        with s.scope():
            if which == "create":
                gs.Variable(np.zeros(3, np.float32), name="extra")
            else:
                mean.result()
    s.run(step, args=(ONES3, ONES2))
if which == "create":
    expect(alone, "rank 0 called creating variable 'extra'.*rank 1 called Adam.apply_gradients")
else:  # both reductions carry an agreement: the lists differ, each caller is named
    expect(alone, r"rank 0 \(metric 'mean' result\(\)\): \(mean/total#\d+:scalar:float32, "
                  r"mean/count#\d+:scalar:float32\); .*rank 1 \(Adam.apply_gradients\)")
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("which", ["create", "metric"])
@pytest.mark.parametrize("ranks, local", [(2, 2), (3, 1)])
def test_a_collective_on_one_rank_only_raises_on_every_rank(ranks, local, which):
    assert_mpi_ok(ranks, ALONE, timeout=120, args=(local, which), expect_lines=ranks)


# A rank whose step raises and is not caught: the whole job ends at once.
RAISES = COMMON + r"""
def bad(gw, gb):
    if r == last:
        raise RuntimeError("injected failure in the step")
    step(gw, gb)
s.run(bad, args=(ONES3, ONES2))
print(f"NOT REACHED rank {r}", flush=True)
"""


@pytest.mark.parametrize("abort", [True, False])
@pytest.mark.parametrize("ranks, local", [(2, 2), (3, 1)])
def test_a_rank_that_raises_mid_step_ends_the_job(ranks, local, abort):
    # With abort on error (the default) the failing rank ends every rank at once;
    # without, every other rank raises, naming it (its error, or its exit).
    t0 = time.monotonic()
    rc, out, err = run_mpi(ranks, RAISES, timeout=120, args=(local,),
                           env={"GPUSTRAT_ABORT_ON_ERROR": "1" if abort else "0"})
    took = time.monotonic() - t0
    assert rc not in (0, -9), format_result(rc, out, err)
    assert "NOT REACHED" not in out, format_result(rc, out, err)
    assert "injected failure in the step" in err, err
    if abort:
        assert f"rank {ranks - 1} of {ranks}: uncaught exception" in err, err
    else:
        # Every other rank raises naming it: told of its error at the step, or of its
        # exit where that came first.
        named = err.count(f"worker {ranks - 1} failed before this collective: "
                          "RuntimeError: injected failure") + \
            err.count(f"rank {ranks - 1} has exited")
        assert named >= ranks - 1, err
    assert took < 100, took


# A rank whose step raises, every rank catching the error and taking the step again:
# every rank raised at that step, and every rank ends with the same weights.
CAUGHT = COMMON + r"""
def bad(gw, gb):
    if r == last:
        raise RuntimeError("injected failure in the step")
    step(gw, gb)
try:
    s.run(bad, args=(ONES3, ONES2))
except RuntimeError:
    s.run(step, args=(ONES3, ONES2))
got = list(same_everywhere(w, b))
assert int(opt.iterations) == 1 and np.allclose(got[0], -0.1), got
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (3, 2)])
def test_a_rank_that_catches_its_error_and_retries_stays_in_step(ranks, local):
    assert_mpi_ok(ranks, CAUGHT, timeout=120, args=(local,), expect_lines=ranks)


# A rank that exits before a step: the others raise within seconds, naming it.
EXITS = COMMON + r"""
import time
if r == last:
    sys.exit(0)
t0 = time.monotonic()
expect(lambda: s.run(step, args=(ONES3, ONES2)), rf"rank {last} has exited")
took = time.monotonic() - t0
assert took < 30, took
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("ranks, local", [(2, 2), (4, 1)])
def test_a_rank_that_exits_early_is_named_on_every_other_rank(ranks, local):
    assert_mpi_ok(ranks, EXITS, timeout=120, args=(local,), expect_lines=ranks - 1)
