"""State that every worker must hold alike and that no shape reveals, under ``mpiexec
-n 2/3`` (1 or 2 replicas each), with timeouts: an optimizer's learning rate (a
constant, or a schedule of the step), hyperparameters and ``iterations``, and a metric's
resets and cross-replica updates when its result is
read. A difference raises the same
``StateMismatch`` on every worker, naming each worker's values, and writes nothing;
agreeing workers go on training."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

COMMON = r"""
import re
import sys
import numpy as np
from mpi4py import MPI
import gpustrat as gs
from gpustrat.errors import StateMismatch

L = int(sys.argv[1])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(L)])
r, W = s.worker_index, s.num_workers
last = W - 1


def expect(fn, pattern):
    try:
        fn()
    except StateMismatch as e:
        assert re.search(pattern, str(e), re.S), f"rank {r}: {e}"
        return e
    raise AssertionError(f"rank {r}: no error, expected {pattern!r}")


def same_everywhere(v):
    # mpi4py directly: only where every rank is known to have left gpustrat's calls.
    mine = [np.asarray(c).tolist() for c in s.experimental_local_results(v)]
    every = [c for m in MPI.COMM_WORLD.allgather(mine) for c in m]
    assert all(c == every[0] for c in every), f"rank {r}: {v.name} differs: {every}"
    return every[0]
"""

OPTIMIZERS = COMMON + r"""
ONES = np.ones(3, np.float32)
with s.scope():
    w = gs.Variable(np.zeros(3, np.float32), name="w")
    lr = gs.optimizers.SGD(0.2 if r == last else 0.1)
    by_rank = gs.optimizers.SGD(gs.optimizers.schedules.PiecewiseConstantDecay([1], [0.1 * (1 + r)] * 2))
    momentum = gs.optimizers.SGD(0.1, momentum=0.8 if r == last else 0.9)
    epsilon = gs.optimizers.Adam(0.1, epsilon=1e-6 if r == last else 1e-7)
    decay = gs.optimizers.AdamW(0.1, weight_decay=0.0 if r == last else 0.004)
    restored = gs.optimizers.SGD(0.1)
    later = gs.optimizers.SGD(gs.optimizers.schedules.PiecewiseConstantDecay([1], [0.1, 0.1 * (1 + r)]))
    good = gs.optimizers.SGD(0.1, momentum=0.5)
# A restore that reached some workers only (each component written directly).
for c in s.experimental_local_results(restored.iterations):
    c.assign(np.int64(7 if r == last else 5))


def train(opt, gradient_buffers=False):
    def fn():
        if gradient_buffers and opt._known_plan([w]) is not None:
            (g,) = opt.gradient_buffers([w])
            g[...] = 1
            opt.apply_gradients([(g, w)])
        else:
            opt.apply_gradients([(ONES, w)])
    s.run(fn)


CASES = [
    (lr, r"learning_rate=0\.1, momentum=0\.0, nesterov=False, iterations=0\); "
         rf"rank {last}: \(learning_rate=0\.2, "),
    (by_rank, rf"rank 0: \(learning_rate=0\.1, .*rank 1: \(learning_rate=0\.2, "),
    (momentum, rf"rank 0: \(learning_rate=0\.1, momentum=0\.9, .*"
               rf"rank {last}: \(learning_rate=0\.1, momentum=0\.8, "),
    (epsilon, rf"epsilon=1e-07, amsgrad=False, iterations=0\); .*"
              rf"rank {last}: .*epsilon=1e-06, "),
    (decay, rf"rank 0: .*weight_decay=0\.004, .*rank {last}: .*weight_decay=0\.0, "),
    (restored, rf"rank 0: .*iterations=5\); .*rank {last}: .*iterations=7\)"),
]
for opt, pattern in CASES:
    for buffers in (False, True):   # arrays, then the plan's gradient buffers
        e = expect(lambda: train(opt, buffers), pattern)
        assert type(opt).__name__ + ".apply_gradients (learning rate, hyperparameters " \
            "and iterations): the workers disagree" in str(e), e
        assert "make the optimizer alike on every worker" in str(e), e
        assert same_everywhere(w) == [0.0] * 3
        held = (7 if r == last else 5) if opt is restored else 0
        assert [int(np.asarray(c)) for c in s.experimental_local_results(opt.iterations)] \
            == [held] * L
# A schedule that differs from the third step on: two steps, then an error.
train(later)
train(later, True)
before = same_everywhere(w)
assert np.allclose(before, -0.2 * W * L), before
expect(lambda: train(later), r"rank 0: \(learning_rate=0\.1, .*iterations=2\); "
                             r"rank 1: \(learning_rate=0\.2, .*iterations=2\)")
assert same_everywhere(w) == before and int(later.iterations) == 2
# Agreeing workers train, and a learning rate changed on every worker is taken.
for step in range(3):
    if step == 2:
        good.learning_rate = 0.05
    train(good, step > 0)
got = same_everywhere(w)
assert int(good.iterations) == 3
# Changed on one worker only: an error naming both rates, nothing written.
if r == last:
    good.learning_rate = 0.5
expect(lambda: train(good), rf"learning_rate=0\.05, .*rank {last}: \(learning_rate=0\.5, ")
assert same_everywhere(w) == got and int(good.iterations) == 3
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (3, 2)])
def test_optimizers_that_differ_between_workers_raise_on_every_rank(ranks, local):
    # Workers with other learning rates, hyperparameters or iterations used to train
    # different weights without a word.
    assert_mpi_ok(ranks, OPTIMIZERS, timeout=300, args=(local,), expect_lines=ranks)


METRICS = COMMON + r"""
with s.scope():
    m = gs.metrics.Mean()
    total = gs.metrics.Sum()
s.run(lambda: m.update_state(np.ones(4, np.float32)))
assert float(m.result()) == 1.0
if r == last:
    m.reset_state()                       # one worker starts its epoch early
expect(m.result, r"metric 'mean' result\(\): the workers disagree: rank 0: \(0 resets, 0 "
                 r"cross-replica updates since the last reset\); "
                 rf".*rank {last}: \(1 resets, 0 cross-replica updates since the last "
                 r"reset\)\. every worker must call reset_state")
if r != last:
    m.reset_state()
s.run(lambda: m.update_state(np.full(4, 1.0 + r, np.float32)))
want = sum(1.0 + k for k in range(W)) / W
assert np.isclose(float(m.result()), want), (float(m.result()), want)
# Inside run the workers may update a metric different numbers of times (a loop over
# the examples of their batches): the result aggregates every update of every worker.
def updates():
    for _ in range(r + 1):
        total.update_state(np.ones(2, np.float32))
s.run(updates)
want = 2.0 * L * sum(range(1, W + 1))
assert float(total.result()) == want, (float(total.result()), want)
# One more cross-replica update on one worker (it adds its value over the number of
# workers): an error, then agreement again once every worker has made it.
if r == 0:
    total.update_state(np.full(2, W, np.float32))
expect(total.result, r"rank 0: \(0 resets, 1 cross-replica updates since the last reset\); "
                     r"rank 1: \(0 resets, 0 cross-replica updates")
if r != 0:
    total.update_state(np.full(2, W, np.float32))
assert float(total.result()) == want + 2.0 * W, float(total.result())
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 2), (3, 1)])
def test_metrics_reset_or_updated_across_replicas_on_some_workers_raise_at_result(ranks, local):
    # A reset on one worker used to give a result that mixed the others' old totals in.
    assert_mpi_ok(ranks, METRICS, timeout=300, args=(local,), expect_lines=ranks)


READ_ORDER = COMMON + r"""
from gpustrat.errors import CollectiveMismatch

ON_READ = dict(synchronization=gs.VariableSynchronization.ON_READ,
               aggregation=gs.VariableAggregation.SUM)
with s.scope():
    m1 = gs.metrics.Sum(name="m1")
    m2 = gs.metrics.Sum(name="m2")
    a = gs.Variable(np.float32(0), name="a", **ON_READ)
    b = gs.Variable(np.float32(0), name="b", **ON_READ)


def step():
    m1.update_state(np.float32(1))
    m2.update_state(np.float32(50))
    a.assign_add(np.float32(1))
    b.assign_add(np.float32(50))
s.run(step)
n = W * L


def mismatch(first, second, pattern):
    # The last worker makes the two reads in the other order: every worker raises at
    # both (each pairs with another worker's other read), none gets a mixed value.
    order = (second, first) if r == last else (first, second)
    for read in order:
        try:
            got = read()
        except CollectiveMismatch as e:
            assert re.search(pattern, str(e), re.S), f"rank {r}: {e}"
        else:
            raise AssertionError(f"rank {r}: read {got} with the workers out of order")


mismatch(m1.result, m2.result, r"metric 'm\d' result\(\): the workers disagree: "
         r"rank 0 \(metric 'm\d' result\(\)\): \(m\d/total#\d+:scalar:float32\).*every "
         r"worker must read the same sync-on-read variables and metric results")
mismatch(a.read_value, b.read_value, r"reading sync-on-read variable '[ab]': the workers "
         r"disagree: rank 0 \(reading sync-on-read variable '[ab]'\): \(read [ab]#\d+\)")
ones = s.run(lambda: np.float32(1))  # a per-replica value of a's layout
mismatch(a.numpy, lambda: s.reduce("sum", ones, axis=None),
         r"reading sync-on-read variable 'a': the workers disagree: .*nothing to agree "
         r"on \(another call\)")
# In the same order on every worker: the totals.
assert float(m1.result()) == n and float(m2.result()) == 50 * n
assert float(a.read_value()) == n and float(b.numpy()) == 50 * n
print(f"OK rank {r}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (3, 2)])
def test_reads_of_metrics_and_sync_on_read_variables_in_other_orders_raise(ranks, local):
    # Two metrics (or two sync-on-read variables) of one layout read in different
    # orders on different workers used to return each a mix of both, on every worker.
    assert_mpi_ok(ranks, READ_ORDER, timeout=300, args=(local,), expect_lines=ranks)
