"""Remote variable updates (``assign_add``/``assign_sub``) under mpiexec -n 3
(coordinator, one server, one worker): each update is applied once, in order, and seen
by every later request, whether the server adds in its loop or in its applier thread
(the test chooses; by default a server uses the thread when its machine has a core to
spare beside one per rank). Every launch has a timeout (tests/mpi_util.py)."""

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
from gpustrat.distribute.parameter_server import server

THREADED = {threaded}
server.spare_core = lambda ch: THREADED  # read by the server when it starts
resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
rng = np.random.default_rng(0)
MIB = 1 << 20

with strategy.scope():
    a = gs.Variable(np.zeros(MIB // 4, np.float32), name="a")
    b = gs.Variable(np.zeros(MIB // 4, np.float32), name="b")  # same size as a
    h = gs.Variable(np.zeros((96, 70), np.float16), name="h")
    d = gs.Variable(np.zeros((3, 5, 7), np.float64), name="d")
    e = gs.Variable(np.zeros((0, 3), np.float32), name="e")
    opt = gs.optimizers.SGD(0.5)

# Back-to-back updates of two variables of one size (the server alternates its
# buffers), each followed at once by a read of the other variable or of itself.
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


@pytest.mark.parametrize("threaded", [True, False], ids=["applier-thread", "in-loop"])
def test_updates_apply_once_in_order_and_are_seen(threaded):
    out = assert_mpi_ok(3, UPDATES.format(threaded=threaded), timeout=120)
    assert "UPDATES OK" in out
