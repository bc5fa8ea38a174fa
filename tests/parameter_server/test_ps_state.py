"""State under ParameterServerStrategy, under mpiexec: metrics aggregated on the servers,
optimizer slots, checkpoints written on the coordinator (and a job restored after a
server was lost), and per-worker values. Every launch has a timeout."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, format_result, killed_by_signal_9, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

# Two replicas per worker (worker_devices): every replica of every scheduled function
# updates the metrics; the totals on the coordinator are exact because nothing is run
# twice here (no function process is lost).
METRICS = r"""
import time, numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps={num_ps})
strategy = gs.distribute.experimental.ParameterServerStrategy(
    resolver, worker_devices=["cpu:0", "cpu:1"])
with strategy.scope():
    mean = gs.metrics.Mean(name="loss")
    total = gs.metrics.Sum()
    acc = gs.metrics.Accuracy()
    sparse = gs.metrics.SparseCategoricalAccuracy()
assert all(v.device.startswith("/job:ps/") for m in (mean, total, acc, sparse)
           for v in m.variables), [v.device for v in mean.variables]
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)

def step(i):
    def replica(i):
        r = gs.distribute.get_replica_context().replica_id_in_sync_group
        mean.update_state(np.array([i, r], np.float32), sample_weight=[1.0, 2.0])
        total.update_state(np.float32(i + r))
        acc.update_state(np.array([1, 2, 0]), np.array([1, 2, i % 3]))
        sparse.update_state(np.array([[1]]), np.array([[0.2, 0.8]]) if i % 2 else
                            np.array([[0.8, 0.2]]))
    strategy.run(replica, args=(i,))
    time.sleep(0.01)  # both workers take functions
    # Inside a function, result() reads the total of every update so far.
    seen = float(total.result())
    return gs.distribute.coordinator.experimental_get_current_worker_index(), seen

N = 40
got = coord.fetch([coord.schedule(step, args=(i,)) for i in range(N)])
coord.join()
assert {w for w, _ in got} == {0, 1}, got
# Every update of both replicas of every function reached the servers.
exp_mean = sum(i + 2.0 * r for i in range(N) for r in (0, 1)) / (N * 2 * 3.0)
assert np.isclose(float(mean.result()), exp_mean), (mean.result(), exp_mean)
exp_total = sum(i + r for i in range(N) for r in (0, 1))
assert float(total.result()) == exp_total, (total.result(), exp_total)
hits = sum(2 + (i % 3 == 0) for i in range(N)) * 2
assert np.isclose(float(acc.result()), hits / (N * 2 * 3)), acc.result()
assert float(sparse.result()) == 0.5, sparse.result()
assert max(s for _, s in got) <= exp_total and min(s for _, s in got) > 0, got
print("METRICS", float(mean.result()), float(total.result()), flush=True)
# The replicas are threads of one process with one connection to its worker rank:
# their requests at the same time each get their own answer.
with strategy.scope():
    a, c = gs.Variable(np.zeros(3), name="a"), gs.Variable(np.ones((5, 2)), name="c")
def reads():
    def replica():
        ctx = gs.distribute.get_replica_context()
        r = ctx.replica_id_in_sync_group
        ctx.all_reduce("SUM", 1.0)  # the replicas meet: from here on they run at once
        v, value = (a, np.zeros(3)) if r == 0 else (c, np.ones((5, 2)))
        return all(np.array_equal(v.numpy(), value) for _ in range(300))
    return strategy.experimental_local_results(strategy.run(replica))
assert coord.schedule(reads).fetch() == (True, True)
for m in (mean, total, acc, sparse):
    m.reset_state()
    assert float(m.result()) == 0.0, (m, m.result())
coord.schedule(step, args=(3,)).fetch()
assert float(total.result()) == 3 + 4, total.result()
print("OK", flush=True)
"""


@pytest.mark.parametrize("n, num_ps", [(4, 1), (5, 2)])
def test_metrics_aggregate_updates_of_every_worker_and_replica(n, num_ps):
    out = assert_mpi_ok(n, METRICS.replace("{num_ps}", str(num_ps)), timeout=90)
    assert "METRICS" in out and out.rstrip().endswith("OK")


# Slots: an optimizer's slots live on the servers of their variables; get_slot gives a
# remote variable (a sharded one for a sharded variable) holding what a local
# optimizer's slot holds after the same steps, readable and assignable from the
# coordinator and from scheduled functions.
SLOTS = r"""
import numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps={num_ps})
strategy = gs.distribute.experimental.ParameterServerStrategy(
    resolver, variable_partitioner={partitioner})
init = np.arange(12, dtype=np.float32).reshape(6, 2) / 10
with strategy.scope():
    w = gs.Variable(init, name="w")
    b = gs.Variable(np.zeros(2, np.float32), name="b")
    adam = gs.optimizers.Adam(0.05)
    sgd = gs.optimizers.SGD(0.1, momentum=0.5)
    # A learning-rate schedule is evaluated by the caller at the step's number.
    decayed = gs.optimizers.Adam(gs.optimizers.schedules.InverseTimeDecay(0.1, 1, 1.0))
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
lw, lb = gs.Variable(init.copy()), gs.Variable(np.zeros(2, np.float32))
ladam, lsgd = gs.optimizers.Adam(0.05), gs.optimizers.SGD(0.1, momentum=0.5)
ldecayed = gs.optimizers.Adam(gs.optimizers.schedules.InverseTimeDecay(0.1, 1, 1.0))
with strategy.scope():
    w2 = gs.Variable(init, name="w2")
lw2 = gs.Variable(init.copy())

try:
    adam.get_slot(w, "m")
    raise SystemExit("a slot was found before the first step")
except KeyError as e:
    assert "first apply_gradients" in str(e), e

def grads(i):
    return (np.full((6, 2), i + 1.0, np.float32) * np.arange(1, 7, dtype=np.float32)[:, None],
            np.array([1.0, -1.0], np.float32) * (i + 1))

def train(i):
    gw, gb = grads(i)
    adam.apply_gradients([(gw, w)])
    sgd.apply_gradients([(gb, b)])
    decayed.apply_gradients([(gw, w2)])

for i in range(3):  # one at a time: the same order as the local optimizers
    coord.schedule(train, args=(i,)).fetch()
    gw, gb = grads(i)
    ladam.apply_gradients([(gw, lw)])
    lsgd.apply_gradients([(gb, lb)])
    ldecayed.apply_gradients([(gw, lw2)])
assert np.allclose(w.numpy(), lw.numpy(), rtol=1e-6), (w.numpy(), lw.numpy())
assert np.allclose(w2.numpy(), lw2.numpy(), rtol=1e-6), (w2.numpy(), lw2.numpy())
assert int(adam.iterations.numpy()) == int(decayed.iterations.numpy()) == 3

m, v = adam.get_slot(w, "m"), adam.get_slot(w, "v")
kind = type(w).__name__
assert type(m).__name__ == kind and m.shape == (6, 2) and m.name == "w/momentum", (m, kind)
assert np.allclose(m.numpy(), ladam.get_slot(lw, "m").numpy(), rtol=1e-6)
assert np.allclose(v.numpy(), ladam.get_slot(lw, "v").numpy(), rtol=1e-6)
mom = sgd.get_slot(b, "momentum")
assert np.allclose(mom.numpy(), lsgd.get_slot(lb, "momentum").numpy()), mom.numpy()
assert all(s.device.startswith("/job:ps/") for s in (m, v, mom))
if kind == "ShardedVariable":
    assert [s.server for s in m.variables] == [s.server for s in w.variables]
# Read inside a scheduled function: the same values.
inside = coord.schedule(lambda: adam.get_slot(w, "v").numpy()).fetch()
assert np.array_equal(inside, v.numpy())
# Assigning a slot changes the next step as it does locally.
mom.assign(np.array([5.0, -5.0], np.float32))
lsgd.get_slot(lb, "momentum").assign(np.array([5.0, -5.0], np.float32))
coord.schedule(train, args=(3,)).fetch()
lsgd.apply_gradients([(grads(3)[1], lb)])
assert np.allclose(b.numpy(), lb.numpy()), (b.numpy(), lb.numpy())
try:
    adam.get_slot(w, "accumulator")
    raise SystemExit("a slot Adam does not have was found")
except KeyError as e:
    assert "'accumulator'" in str(e) and "['momentum', 'velocity']" in str(e), e
names = [x.name for x in adam.variables]
assert names == ["Adam/iterations", "w/momentum", "w/velocity"], names
assert [x.name for x in sgd.variables] == ["SGD/iterations", "b/momentum"]
print("OK", flush=True)
"""


@pytest.mark.parametrize("n, num_ps, partitioner", [
    (4, 1, "None"),
    (5, 2, "gs.distribute.experimental.partitioners.FixedShardsPartitioner(2)")])
def test_optimizer_slots_live_on_the_servers(n, num_ps, partitioner):
    out = assert_mpi_ok(n, SLOTS.replace("{num_ps}", str(num_ps)).replace(
        "{partitioner}", partitioner),
                        timeout=90)
    assert out.rstrip().endswith("OK")


# Hyperparameters changed between steps (on the coordinator, and in the copy a scheduled
# function gets) take effect at the next step, on every server, as with local
# optimizers; two servers, so that a step's parts go to the one holding `iterations`
# and to another.
HYPERPARAMETERS = r"""
import numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=2)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
def make():
    return (gs.optimizers.SGD(0.1, momentum=0.5), gs.optimizers.Adam(0.05),
            gs.optimizers.AdamW(0.05, weight_decay=0.1))
init = np.linspace(1, 2, 4).astype(np.float32)
with strategy.scope():
    opts = make()
    ws = [gs.Variable(init, name=f"w{i}") for i in range(6)]  # servers 0, 1, 0, ...
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
local_opts = make()
local_ws = [gs.Variable(init.copy()) for _ in range(6)]

def step(opts, ws, g):
    for k, opt in enumerate(opts):
        opt.apply_gradients([(g, ws[2 * k]), (2 * g, ws[2 * k + 1])])

changes = [None,
           lambda sgd, adam, adamw: setattr(sgd, "momentum", 0.0),
           lambda sgd, adam, adamw: (setattr(adam, "beta_1", 0.5),
                                     setattr(adamw, "weight_decay", 0.0)),
           lambda sgd, adam, adamw: (setattr(sgd, "momentum", 0.9),
                                     setattr(adam, "epsilon", 1e-2),
                                     setattr(adamw, "weight_decay", 0.5))]
for i, change in enumerate(changes):
    if change is not None:
        change(*opts)
        change(*local_opts)
    g = np.full(4, i + 1.0, np.float32)
    if i % 2:
        step(opts, ws, g)  # on the coordinator
    else:
        coord.schedule(step, args=(opts, ws, g)).fetch()  # on a worker
    step(local_opts, local_ws, g)
    for w, lw in zip(ws, local_ws):
        assert np.allclose(w.numpy(), lw.numpy(), rtol=1e-6), (i, w.name, w.numpy(),
                                                                lw.numpy())
# Settings changed inside a scheduled function apply to that function's steps.
def inside(opts, ws, g):
    opts[0].momentum = 0.0
    step(opts, ws, g)
coord.schedule(inside, args=(opts, ws, np.ones(4, np.float32))).fetch()
local_opts[0].momentum = 0.0
step(local_opts, local_ws, np.ones(4, np.float32))
for w, lw in zip(ws, local_ws):
    assert np.allclose(w.numpy(), lw.numpy(), rtol=1e-6), (w.name, w.numpy(), lw.numpy())
print("OK", flush=True)
"""


def test_hyperparameters_changed_between_steps_apply_on_the_servers():
    out = assert_mpi_ok(4, HYPERPARAMETERS, timeout=120)
    assert out.rstrip().endswith("OK")


# A training job that checkpoints on the coordinator (variables, an optimizer with
# slots, a metric); in "first" mode a server is then killed, which ends the job; in
# "resume" mode a new job (possibly with another number of servers) restores the
# checkpoint and goes on from the saved values.
RESUME = r"""
import json, os, signal, sys, numpy as np
import gpustrat as gs

mode, ckpt_dir, num_ps = sys.argv[1], sys.argv[2], int(sys.argv[3])
resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=num_ps)
with open(os.path.join(ckpt_dir, f"pid-{mode}-{resolver.rank}"), "w") as f:
    f.write(str(os.getpid()))
strategy = gs.distribute.experimental.ParameterServerStrategy(
    resolver, variable_partitioner=gs.distribute.experimental.partitioners.
    FixedShardsPartitioner(num_ps))
TRUE_W = np.linspace(-1, 1, 8).astype(np.float32)[:, None]
with strategy.scope():
    w = gs.Variable(np.zeros((8, 1), np.float32), name="w")
    b = gs.Variable(0.0, name="b")
    opt = gs.optimizers.SGD(0.05, momentum=0.5)
    loss = gs.metrics.Mean(name="loss")
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
ckpt = gs.train.Checkpoint(w=w, b=b, optimizer=opt, loss=loss)
manager = gs.train.CheckpointManager(ckpt, ckpt_dir, max_to_keep=2)

def dataset_fn():
    x = np.random.default_rng(5).normal(size=(256, 8)).astype(np.float32)
    return gs.data.Dataset.from_tensor_slices((x, x @ TRUE_W + 0.5)).repeat().batch(32)
it = iter(coord.create_per_worker_dataset(dataset_fn))
try:  # per-worker iterators are not saved (as in TensorFlow): a clear error
    gs.train.Checkpoint(w=w, it=it)
except TypeError as e:
    assert "per-worker values and iterators are not saved" in str(e), e
else:
    raise AssertionError("a Checkpoint took a per-worker iterator")

def step(iterator):
    x, y = next(iterator)
    err = x @ w.numpy() + b.numpy() - y
    opt.apply_gradients([(x.T @ err / len(x), w), (np.float32(err.mean()), b)])
    loss.update_state((err ** 2).mean())
    return float((err ** 2).mean())

def state():
    return {"w": w.numpy().ravel().tolist(), "b": float(b.numpy()),
            "momentum": opt.get_slot(w, "momentum").numpy().ravel().tolist(),
            "iterations": int(opt.iterations.numpy()), "loss": float(loss.result())}

if mode == "first":
    losses = coord.fetch([coord.schedule(step, args=(it,)) for _ in range(30)])
    coord.join()
    path = manager.save()
    saved = state()
    with open(os.path.join(ckpt_dir, "saved.json"), "w") as f:
        json.dump({"path": path, "first_loss": losses[0], **saved}, f)
    print("SAVED", path, saved["iterations"], flush=True)
    # Train on after the save, then lose a server: the job ends.
    coord.fetch([coord.schedule(step, args=(it,)) for _ in range(10)])
    os.kill(int(open(os.path.join(ckpt_dir, f"pid-first-{num_ps}")).read()),
            signal.SIGKILL)
    coord.fetch([coord.schedule(step, args=(it,)) for _ in range(10)])
    print("NOT REACHED", flush=True)
else:
    saved = json.load(open(os.path.join(ckpt_dir, "saved.json")))
    latest = manager.latest_checkpoint
    assert latest == saved["path"], (latest, saved["path"])
    ckpt.restore(latest).assert_consumed()
    now = state()
    for k in ("w", "b", "momentum", "iterations", "loss"):
        assert np.allclose(now[k], saved[k], rtol=1e-6), (k, now[k], saved[k])
    # Training goes on from the saved values: the step count continues and the loss
    # starts where it was, far below a fresh start's.
    loss.reset_state()
    losses = coord.fetch([coord.schedule(step, args=(it,)) for _ in range(30)])
    coord.join()
    assert int(opt.iterations.numpy()) == saved["iterations"] + 30, opt.iterations.numpy()
    assert losses[0] < 0.5 * saved["first_loss"], (losses[0], saved["first_loss"])
    assert losses[-1] < losses[0], losses
    print("RESUMED", saved["iterations"], losses[0], losses[-1], flush=True)
print("OK", flush=True)
"""


@pytest.mark.parametrize("first_n, resume_n", [(4, 4), (5, 4)],
                         ids=["same-servers", "two-servers-then-one"])
def test_a_job_restored_after_a_server_loss_goes_on_from_the_checkpoint(
        tmp_path, first_n, resume_n):
    script = RESUME
    rc, out, err = run_mpi(first_n, script, timeout=90,
                           args=("first", tmp_path, first_n - 3))
    assert rc not in (0, -9), format_result(rc, out, err)  # -9: run_mpi's timeout
    assert "SAVED" in out and "NOT REACHED" not in out, format_result(rc, out, err)
    assert killed_by_signal_9(out + err), format_result(rc, out, err)
    saved = json.loads((tmp_path / "saved.json").read_text())
    assert saved["iterations"] == 30 and any(saved["momentum"]), saved
    out = assert_mpi_ok(resume_n, script, timeout=90,
                        args=("resume", tmp_path, resume_n - 3))
    got = re.search(r"RESUMED 30 (\S+) (\S+)", out)
    assert got and out.rstrip().endswith("OK"), out


# Per-worker values: each function gets the value of the worker running it; resources
# made on every worker keep their state between the functions of that worker.
PER_WORKER = r"""
import time, numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
PWV = gs.distribute.experimental.coordinator.PerWorkerValues
assert PWV is gs.distribute.coordinator.PerWorkerValue

seeds = PWV([np.full(1000, 7.0), np.full(1000, 9.0)])
def which(values, k, *, scale):
    time.sleep(0.01)  # both workers take functions
    wi = gs.distribute.coordinator.experimental_get_current_worker_index()
    return wi, float(values[0]["a"].mean()) * scale, k
got = coord.fetch([coord.schedule(which, args=([{"a": seeds}], i), kwargs={"scale": 2})
                   for i in range(20)])
assert {w for w, _, _ in got} == {0, 1}, got
assert all(v == {0: 14.0, 1: 18.0}[w] for w, v, _ in got), got
assert [k for _, _, k in got] == list(range(20))

counters = coord.create_per_worker_resources(dict, kwargs={"count": 0})
assert len(counters.values) == 2 and "worker 1" in repr(counters.values[1])
def bump(counter):
    time.sleep(0.01)
    counter["count"] += 1
    return gs.distribute.coordinator.experimental_get_current_worker_index(), counter["count"]
got = coord.fetch([coord.schedule(bump, args=(counters,)) for _ in range(20)])
for wi in (0, 1):
    mine = [c for w, c in got if w == wi]
    assert mine and sorted(mine) == list(range(1, len(mine) + 1)), got

# A global of the function is resolved too.
offsets = PWV([100, 200])
def offset():
    time.sleep(0.01)
    return gs.distribute.coordinator.experimental_get_current_worker_index(), offsets
got = coord.fetch([coord.schedule(offset) for _ in range(10)])
assert all(v == 100 * (w + 1) for w, v in got), got

# Per-worker iterators are per-worker values.
it = iter(coord.create_per_worker_dataset(lambda: gs.data.Dataset.range(100)))
assert isinstance(it, PWV), type(it)

# Bad input: a clear error on the coordinator, and the workers go on.
wrong = PWV([1, 2, 3])
for bad, kind, words in [
        (lambda: coord.schedule(which, args=(PWV([1, 2, 3]), 0), kwargs={"scale": 1}),
         ValueError, ["3 values", "2 workers"]),
        (lambda: coord.schedule(lambda: len(wrong)), TypeError, ["3 values", "2 workers"]),
        (lambda: coord.create_per_worker_resources(lambda: 1 / 0), RuntimeError,
         ["worker 0", "worker 1", "ZeroDivisionError"]),
        (lambda: coord.create_per_worker_resources(3), TypeError, ["callable"])]:
    try:
        bad()
        raise SystemExit(f"accepted: {words}")
    except kind as e:
        assert all(w in str(e) for w in words), (words, e)
try:
    gs.distribute.coordinator.experimental_get_current_worker_index()
    raise SystemExit("a worker index on the coordinator")
except RuntimeError as e:
    assert "scheduled" in str(e), e
assert coord.schedule(bump, args=(counters,)).fetch()[1] > 1
print("OK", flush=True)
"""


def test_per_worker_values_and_resources():
    out = assert_mpi_ok(4, PER_WORKER, timeout=90)
    assert out.rstrip().endswith("OK")
