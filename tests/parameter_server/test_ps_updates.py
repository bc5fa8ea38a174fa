"""Remote variable updates (``assign_add``/``assign_sub``) under mpiexec -n 3
(coordinator, one server, one worker): each update is applied once, in order, and seen
by every later request, whether its value goes through the caller's slots at the
server (shared memory), through MPI, or some one way and some the other (the test
sets the slots' size). Every launch has a timeout (tests/mpi_util.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

UPDATES = r"""
import numpy as np
import gpustrat as gs
from gpustrat.distribute.parameter_server import staging

staging.SLOT_BYTES = {slot_bytes}  # read by every rank when the strategy starts
resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
rng = np.random.default_rng(0)
MIB = 1 << 20
# The coordinator's slots at the server, as this test set them.
from gpustrat.distribute.parameter_server.channel import channel
sizes = [out[4] for out in channel().staging._out.values()]
assert sizes == ([staging._slot_bytes(3, 1)] if {slot_bytes} else []), sizes

with strategy.scope():
    a = gs.Variable(np.zeros(MIB // 4, np.float32), name="a")
    b = gs.Variable(np.zeros(MIB // 4, np.float32), name="b")  # same size as a
    h = gs.Variable(np.zeros((96, 70), np.float16), name="h")
    d = gs.Variable(np.zeros((3, 5, 7), np.float64), name="d")
    e = gs.Variable(np.zeros((0, 3), np.float32), name="e")
    opt = gs.optimizers.SGD(0.5)

# Back-to-back updates of two variables of one size (the caller alternates its two
# slots), each followed at once by a read of the other variable or of itself.
ra, rb = np.zeros(MIB // 4, np.float32), np.zeros(MIB // 4, np.float32)
for i in range(40):
    x = rng.normal(size=MIB // 4).astype(np.float32)
    if i % 3 == 2:
        a.assign_sub(x); ra -= x
    else:
        a.assign_add(x); ra += x
    y = rng.normal(size=MIB // 4).astype(np.float32)
    b.assign_add(y); rb += y
    if i % 4 == 0:
        assert np.array_equal(a.numpy(), ra), i
    if i % 4 == 1:
        assert np.array_equal(b.numpy(), rb), i
assert np.array_equal(a.numpy(), ra) and np.array_equal(b.numpy(), rb)

# An assign lands in the variable itself: it comes after the update before it.
a.assign_add(np.ones(MIB // 4, np.float32))
a.assign(np.full(MIB // 4, 3, np.float32))
a.assign_add(np.ones(MIB // 4, np.float32))
assert np.array_equal(a.numpy(), np.full(MIB // 4, 4, np.float32))

# An optimizer step (a request of the general kind) sees the update before it.
a.assign_add(np.ones(MIB // 4, np.float32))
opt.apply_gradients([(np.full(MIB // 4, 2, np.float32), a)])
assert np.array_equal(a.numpy(), np.full(MIB // 4, 4, np.float32)), a.numpy()[:4]

# float16 and float64, several dimensions; deltas that are not contiguous (a
# transposed view, a strided slice) or of another dtype of the same kind.
rh = np.zeros((96, 70), np.float16)
for i in range(5):
    x = rng.normal(size=(70, 96)).astype(np.float16).T
    assert not x.flags.c_contiguous
    h.assign_add(x); rh += x
    h.assign_sub(x[::-1]); rh -= x[::-1]
assert np.array_equal(h.numpy(), rh)
rd = np.zeros((3, 5, 7), np.float64)
big = rng.normal(size=(3, 10, 7))
d.assign_add(big[:, ::2]); rd += big[:, ::2]
d.assign_add(np.ones((3, 5, 7), np.float32)); rd += 1
assert d.numpy().dtype == np.float64 and np.array_equal(d.numpy(), rd)

# A variable without elements: an update is nothing to apply.
e.assign_add(np.zeros((0, 3), np.float32))
e.assign_sub(np.zeros((0, 3), np.float32))
assert e.numpy().shape == (0, 3)

# Errors right after an update: clear, on the caller; the server goes on.
a.assign_add(np.ones(MIB // 4, np.float32))
ghost = gs.distribute.parameter_server.variables.RemoteVariable._handle(
    999, 0, (MIB // 4,), np.float32, "ghost", True, a.synchronization, a.aggregation)
try:
    ghost.assign_add(np.ones(MIB // 4, np.float32))
    raise SystemExit("an update of an unknown variable was accepted")
except KeyError as err:
    assert "no variable #999" in str(err), err
small = gs.distribute.parameter_server.variables.RemoteVariable._handle(
    a._vid, 0, (10,), np.float32, "small", True, a.synchronization, a.aggregation)
for attempt in range(3):  # each use of a slot is released, also when refused
    try:
        small.assign_add(np.ones(10, np.float32))
        raise SystemExit("an update of the wrong size was accepted")
    except ValueError as err:
        assert "got 40 bytes for its 1048576" in str(err), err
try:
    a.assign_add(np.ones(MIB // 4 + 1, np.float32))
    raise SystemExit("an update of the wrong shape was accepted")
except ValueError as err:
    assert "shape" in str(err), err
try:
    a.assign_add(np.ones(MIB // 4, np.int32).astype(np.complex64))
    raise SystemExit("a complex update of a float variable was accepted")
except TypeError as err:
    assert "dtype" in str(err), err
a.assign_add(np.ones(MIB // 4, np.float32))
assert np.array_equal(a.numpy(), np.full(MIB // 4, 6, np.float32)), a.numpy()[:4]

# Two threads of the coordinator update at once (one of them through MPI while the
# other holds the slots).
import threading
b.assign(np.zeros(MIB // 4, np.float32))
def many(k):
    for _ in range(30):
        b.assign_add(np.full(MIB // 4, k, np.float32))
threads = [threading.Thread(target=many, args=(k,)) for k in (1, 2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert np.array_equal(b.numpy(), np.full(MIB // 4, 90, np.float32)), b.numpy()[:4]

# Functions on the worker update the same variable between the coordinator's updates
# (integer values: the sum is exact in any order).
b.assign(np.zeros(MIB // 4, np.float32))
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
def bump(k):
    b.assign_add(np.full(MIB // 4, k, np.float32))
for k in range(1, 4):
    coord.schedule(bump, args=(k,))
    b.assign_sub(np.ones(MIB // 4, np.float32))
coord.join()
assert np.array_equal(b.numpy(), np.full(MIB // 4, 6 - 3, np.float32))
print("UPDATES OK", flush=True)
"""


# Slots of 4 MiB take every update here; of 0 bytes none; of 40,000 bytes those of
# the float16 and float64 variables (13,440 and 840 bytes), not the MiB ones.
@pytest.mark.parametrize("slot_bytes", [4 << 20, 0, 40000],
                         ids=["staged", "through-mpi", "mixed"])
def test_updates_apply_once_in_order_and_are_seen(slot_bytes):
    out = assert_mpi_ok(3, UPDATES.format(slot_bytes=slot_bytes), timeout=120)
    assert "UPDATES OK" in out


# Waiters that sleep are woken by their answer's ring (a ring is skipped only when the
# waiter is known to be awake): a server asleep between spaced requests, and a caller
# that sleeps at once while waiting for its acknowledgement (no spinning). A wait that
# slept through its answer would last a whole sleep of the rung kind, 50 ms.
WAKE = r"""
import statistics, time
import numpy as np
import gpustrat as gs
from gpustrat.distribute.parameter_server import channel as ch_mod

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
assert ch_mod.channel().staging is not None
with strategy.scope():
    v = gs.Variable(np.zeros(1000, np.float32), name="v")
if {caller_sleeps}:
    ch_mod.transfer_spin = lambda nbytes: 0.0
one = np.ones(1000, np.float32)
took = []
for i in range(40):
    time.sleep(0.004)  # the server stops polling 0.3 ms after a request and sleeps
    t0 = time.perf_counter()
    v.assign_add(one)
    took.append(time.perf_counter() - t0)
assert np.array_equal(v.numpy(), np.full(1000, 40, np.float32))
# The coordinator's own count (the server's may be 1: it sleeps between requests).
mine = int(ch_mod.channel().staging._sleepers[0][0])
print("MEDIAN", statistics.median(took), "CALLER COUNT", mine, flush=True)
"""


@pytest.mark.parametrize("caller_sleeps", [False, True], ids=["server-asleep",
                                                                 "caller-asleep-too"])
def test_a_sleeping_waiter_is_woken_by_its_answer(caller_sleeps):
    out = assert_mpi_ok(3, WAKE.format(caller_sleeps=caller_sleeps), timeout=120)
    median = float(out.split("MEDIAN ")[1].split()[0])
    assert median < 0.03, out  # 50 ms each when a ring is missed
    assert "CALLER COUNT 0" in out, out  # not counted as asleep once answered
