"""Input steps in the collective header, under ``mpiexec -n 2/3``: a rank that skips a
collective inside a loop over a distributed dataset raises CollectiveMismatch on every
rank at the next collective, naming each rank's input step, and no rank returns a value
from a shifted pairing; loops that are legitimate never raise."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

# The last rank skips its collective on step 2 (the third step). Each step's batch holds
# the numbers of that step, so a reduce paired with another step's would be off.
SKIP = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.errors import CollectiveMismatch

L, how = int(sys.argv[1]), sys.argv[2]
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W, N = s.worker_index, s.num_workers, s.num_replicas_in_sync
B = 2 * N  # global batch: two rows per replica
steps = 6
dist = s.experimental_distribute_dataset(
    Dataset.range(steps * B).map(lambda x: np.float64(x)).batch(B))
ctx = gs.get_replica_context


def collective(x):
    if how == "reduce":
        return s.reduce("sum", x, axis=0)
    out = s.run(lambda v: ctx().all_reduce("sum", v.sum(keepdims=True)), args=(x,))
    return s.experimental_local_results(out)[0][0]


raised = None
it = iter(dist)
for step, x in enumerate(it):
    if r == W - 1 and step == 2:
        continue  # this rank skips the step's collective
    want = sum(range(step * B, (step + 1) * B))
    try:
        got = collective(x)
    except CollectiveMismatch as e:
        raised = (step, str(e))
        break
    assert float(got) == want, (r, step, float(got), want)  # never a shifted pairing
assert raised is not None, f"rank {r}: no error"
step, text = raised
# The others meet the skipper's next collective at their step 2; the skipper at step 3.
assert step == (3 if r == W - 1 else 2), (r, step)
want = ", ".join(f"rank {q} at input step {4 if q == W - 1 else 3}" for q in range(W))
assert text.startswith(want + ": a rank skipped or added a collective"), text
assert "GPUSTRAT_CHECK_INPUT_STEPS=0" in text, text
# The job goes on: a collective after the loop, at the same step everywhere, agrees.
# (The skipper stopped one step later: the others take one more step first; the
# steps are known, so that step needs no agreement.)
if r != W - 1:
    next(it)
total = s.reduce("sum", s.experimental_distribute_values_from_function(
    lambda c: np.ones(2)), axis=None)
assert np.array_equal(total, np.full(2, N)), total
print("OK", r, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,local,how", [(2, 1, "reduce"), (3, 1, "reduce"),
                                         (2, 2, "reduce"), (2, 1, "run"), (3, 2, "run")])
def test_a_skipped_collective_in_an_input_loop_raises_on_every_rank(n, local, how):
    assert_mpi_ok(n, SKIP, timeout=110, args=[local, how], expect_lines=n,
                  env={"GPUSTRAT_TIMEOUT": "30"})


# Loops that are right must never raise: several iterators of one dataset, an
# evaluation dataset between training steps, get_next_as_optional to the end, a partial
# last step (some workers get empty pieces), unknown cardinality (end of data agreed
# block by block), datasets from a function with a different length per worker, steps
# with no collective, and a second strategy whose own steps are counted apart.
LEGIT = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset

s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r, W = s.worker_index, s.num_workers
other = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
ctx = gs.get_replica_context


def total(x):
    out = s.run(lambda v: ctx().all_reduce("sum", v.sum(keepdims=True)), args=(x,))
    return float(s.reduce("sum", x, axis=0)), float(out[0])


train = s.experimental_distribute_dataset(Dataset.range(4 * W + 1).batch(2 * W))
evaluate = s.experimental_distribute_dataset(
    Dataset.range(3 * W).filter(lambda v: v % 2 == 0).batch(W))
taken = 0
for epoch in range(2):
    it = iter(train)
    ev = iter(evaluate)
    while True:
        opt = it.get_next_as_optional()
        if not opt.has_value():
            break
        taken += 1
        a, b = total(opt.get_value())
        assert a == b, (a, b)
        e = ev.get_next_as_optional()  # an evaluation step now and then
        if e.has_value():
            taken += 1
            s.reduce("sum", e.get_value(), axis=0)
    for x in evaluate:  # steps with no collective at all
        taken += 1
    for x in other.experimental_distribute_dataset(Dataset.range(4 * W).batch(W)):
        other.reduce("sum", x, axis=0)  # another strategy's steps, counted on its group
    s.reduce("sum", np.ones(1), axis=None)  # between epochs, after the loops

def per_worker(ctx):
    # Worker i has 2 + i elements: the agreement pads the shorter workers.
    return Dataset.range(2 + ctx.input_pipeline_id).batch(1)

fn_steps = 0
for x in s.distribute_datasets_from_function(per_worker):
    fn_steps += 1
    s.reduce("sum", x, axis=0)
assert fn_steps == W + 1, fn_steps
taken += fn_steps
assert s.workers.input_steps == taken, (s.workers.input_steps, taken)
assert other.workers.input_steps == 2 * 4, other.workers.input_steps
print("OK", r, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_legitimate_input_loops_never_raise(n):
    assert_mpi_ok(n, LEGIT, timeout=110, expect_lines=n, env={"GPUSTRAT_TIMEOUT": "30"})


# A program that takes steps in one thread while another makes collectives can turn the
# comparison off; then a skipped collective is found only where the calls differ.
OFF = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
it = iter(s.experimental_distribute_dataset(Dataset.range(8).batch(s.num_workers)))
next(it)  # known steps: the end-of-data agreement is one allgather, here
if r == 0:
    next(it)  # rank 0 alone takes a second step (no collective: the steps are known)
got = s.reduce("sum", np.ones(1), axis=None)
assert got[0] == s.num_workers, got
print("OK", r, s.workers.input_steps, flush=True)
"""


@pytest.mark.timeout(60)
def test_the_input_step_check_can_be_turned_off():
    out = assert_mpi_ok(2, OFF, timeout=50, expect_lines=2,
                        env={"GPUSTRAT_TIMEOUT": "20", "GPUSTRAT_CHECK_INPUT_STEPS": "0"})
    assert "OK 0 2" in out and "OK 1 1" in out, out
