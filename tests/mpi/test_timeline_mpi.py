"""The timeline under ``mpiexec -n 2`` and ``-n 3``: rank 0 merges every rank's events
into one valid Chrome trace (one track per rank and replica, spans nesting); a rank
made slow before its collectives is named the straggler by the summary; a rank that
dies leaves the others' events on disk, merged afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "timeline"))
from mpi_util import REPO, assert_mpi_ok, run_mpi  # noqa: E402
from trace_checks import check_trace, load  # noqa: E402

pytestmark = pytest.mark.mpi

LOOP = r"""
import sys, time
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset

path, local, slow, die = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(local)])
r = s.worker_index
rows = 4 * s.num_replicas_in_sync
x = np.arange(8 * rows * 3, dtype=np.float64).reshape(-1, 3) / 100
dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(rows))
with s.scope():
    w = gs.Variable(np.zeros(3), name="w")
    opt = gs.optimizers.SGD(0.01)

def step(xb):
    if r == 1 and slow:
        time.sleep(slow)          # the straggler: late to every step's collectives
    opt.apply_gradients([(xb.sum(axis=0), w)])
    return float(len(xb))

def loop():
    for k, xb in enumerate(dist):
        if die and r == 1 and k == 3:
            time.sleep(0.6)       # its events so far reach its file
            import os
            os._exit(3)
        s.reduce("sum", s.run(step, args=(xb,)), axis=None)

if die:
    loop()                        # GPUSTRAT_TIMELINE records the whole program
else:
    with gs.timeline.record(path):
        loop()
print(f"OK rank {r}", flush=True)
"""


def _summary(path, *extra) -> dict:
    out = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", "summary",
                          str(path), "--json", *extra], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("n,local", [(2, 1), (3, 1), (2, 2)])
def test_rank_0_merges_every_ranks_events_into_one_trace(tmp_path, n, local):
    path = tmp_path / "t.json"
    assert_mpi_ok(n, LOOP, args=(path, local, 0, 0), expect_lines=n, timeout=180)
    data = load(path)
    spans = check_trace(data)
    assert data["otherData"]["ranks"] == list(range(n))
    assert data["otherData"]["complete"] == list(range(n))
    assert {(e["pid"], e["tid"]) for e in spans if e["name"] == "run"} == \
        {(p, t) for p in range(n) for t in range(local)}
    for p in range(n):
        runs = [e for e in spans if e["name"] == "run" and e["pid"] == p]
        assert len(runs) == 8 * local
        colls = [e for e in spans if e["pid"] == p and e["cat"] == "collective"]
        between = [e for e in colls if e["args"]["workers"] == n]
        assert between and all(e["args"]["replicas"] == n * local for e in between)
        for e in between:
            a = e["args"]
            assert a["wait_us"] >= 0 and a["move_us"] >= 0
            assert a["wait_us"] + a["move_us"] == pytest.approx(e["dur"], abs=0.01)
        # Every collective between workers opens with its wait for the peers, inside it.
        peers = [e for e in spans if e["pid"] == p and e["name"] == "wait for peers"]
        assert len(peers) >= len(between)
    got = _summary(path)
    assert sorted(got["ranks"]) == [str(p) for p in range(n)]
    assert got["matched_collectives"] >= 16         # fused gradients and the loss, 8 steps
    assert sum(got["last_to_arrive"].values()) == got["matched_collectives"]


@pytest.mark.parametrize("n", [2, 3])
def test_a_slow_rank_is_named_the_straggler(tmp_path, n):
    path = tmp_path / "t.json"
    assert_mpi_ok(n, LOOP, args=(path, 1, 0.03, 0), expect_lines=n, timeout=180)
    got = _summary(path)
    assert got["straggler"]["rank"] == 1, got
    # It came last at each step's first collective at least (the fused gradients).
    assert got["last_to_arrive"]["1"] >= 8, got["last_to_arrive"]
    assert got["straggler"]["others_waited_s"] >= 8 * 0.03 * (n - 1) * 0.8
    for p in range(n):
        share = got["ranks"][str(p)]["collective_wait_share"]
        assert (share < 0.5) if p == 1 else (share > 0.3), (p, got["ranks"])


def test_a_rank_that_dies_leaves_the_others_events_to_merge(tmp_path):
    path = tmp_path / "t.json"
    rc, out, err = run_mpi(2, LOOP, args=(path, 1, 0, 1), timeout=120,
                           env={"GPUSTRAT_TIMELINE": str(path),
                                "GPUSTRAT_TIMELINE_WAIT": "1",
                                "GPUSTRAT_TIMEOUT": "5"})
    assert rc != 0, out
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "t.json.rank0.events" in files and "t.json.rank1.events" in files, files
    merged = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", "merge",
                             str(path), "--ranks", "2"], capture_output=True, text=True,
                            cwd=REPO, timeout=120)
    assert merged.returncode == 0, merged.stderr
    data = load(path)
    spans = check_trace(data)
    assert 1 not in data["otherData"]["complete"]   # rank 1's file has no end
    for p in (0, 1):
        runs = [e for e in spans if e["pid"] == p and e["name"] == "run"]
        assert len(runs) >= 3, (p, len(runs))       # the steps before rank 1 died


PS = r"""
import numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
# Only the coordinator (rank 0) gets here; it alone records (GPUSTRAT_TIMELINE).
with strategy.scope():
    w = gs.Variable(np.zeros(4, np.float32), name="w")
    opt = gs.optimizers.SGD(0.1)
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)

def step():
    opt.apply_gradients([(np.ones(4, np.float32), w)])
    return 1.0

results = [coord.schedule(step) for _ in range(12)]
coord.join()
assert [r.fetch() for r in results] == [1.0] * 12
print("OK", flush=True)
"""


def test_the_parameter_servers_schedule_run_and_fetch_are_recorded(tmp_path):
    path = tmp_path / "ps.json"
    assert_mpi_ok(4, PS, timeout=120, expect_lines=1,
                  env={"GPUSTRAT_TIMELINE": str(path), "GPUSTRAT_TIMELINE_WAIT": "10"})
    data = load(path)
    spans = check_trace(data)
    assert data["otherData"]["ranks"] == [0]        # servers and workers do not record
    names = {}
    for e in spans:
        names.setdefault(e["name"], set()).add(e["tid"])
    assert names["ps schedule"] == {0} and names["ps fetch"] == {0}
    assert names["ps join"] == {0}
    assert names["ps run"] <= {200, 201} and names["ps run"]   # per worker: 2 workers
    assert sum(e["name"] == "ps run" for e in spans) == 12
    assert sum(e["name"] == "ps schedule" for e in spans) == 12
