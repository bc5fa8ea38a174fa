"""The timeline in one process: a valid Chrome trace whose spans nest, from one and
two replicas (logical CPU devices); what each hook records; nothing when off; the
summary, its JSON and its picture; merging files cut off by a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import timeline
from gpustrat.data import Dataset
from gpustrat.timeline import summary, trace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_checks import check_trace, load, png_size  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _train(strategy, steps: int = 6, rows: int = 8):
    """A small regression loop: dataset, run, a replica all_reduce, apply_gradients
    (one fused reduction of two variables), strategy.reduce of the loss."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((steps * rows, 3))
    y = x @ np.array([1.0, -2.0, 0.5])
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(rows))
    with strategy.scope():
        w = gs.Variable(np.zeros(3), name="w")
        b = gs.Variable(np.zeros(1), name="b")
        opt = gs.optimizers.SGD(0.1)

    def step(batch):
        xb, yb = batch
        err = xb @ w.value() + b.value()[0] - yb
        n = gs.get_replica_context().all_reduce("sum", float(len(yb)))
        opt.apply_gradients([(xb.T @ err * (2 / n), w),
                             (np.array([err.sum() * 2 / n]), b)])
        return (err ** 2).sum() / n

    losses = []
    for batch in dist:
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(batch,)),
                                            axis=None)))
    return losses


@pytest.fixture(autouse=True)
def _no_timeline_left_on():
    yield
    if timeline._rec is not None:
        timeline.stop(merge=False)
        pytest.fail("a test left the timeline on")


@pytest.mark.parametrize("devices", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_a_training_loop_gives_a_chrome_trace_whose_spans_nest(tmp_path, devices):
    s = gs.MirroredStrategy(devices)
    path = tmp_path / "trace.json"
    with gs.timeline.record(path):
        _train(s)
    spans = check_trace(load(path))
    n = len(devices)
    runs = [e for e in spans if e["name"] == "run"]
    assert sorted({e["tid"] for e in runs}) == list(range(n))
    assert len(runs) == 6 * n                       # one per replica and step
    assert sorted({e["args"]["step"] for e in runs}) == list(range(1, 7))
    gets = [e for e in spans if e["name"] == "get_next"]
    assert len(gets) == 7 and {e["tid"] for e in gets} == {0}   # the last one ends it
    colls = [e for e in spans if e["cat"] == "collective"]
    assert colls and all(e["args"]["replicas"] == n and e["args"]["workers"] == 1
                         for e in colls)
    # the replica all_reduce of the batch size, every step
    assert sum(e["args"]["kind"] == "all_reduce(SUM)" and e["args"]["bytes"] == 8 * n
               for e in colls) >= 6
    # strategy.reduce of the loss (a plain value on one replica: no collective)
    losses = [e for e in colls if e["args"]["kind"] == "reduce(SUM)"]
    assert len(losses) == (6 if n > 1 else 0)
    assert all(e["args"]["dtype"] == "float64" and e["args"]["bytes"] == 8 * n
               for e in losses), losses
    for e in colls:
        assert e["args"]["wait_us"] == 0            # one worker: no peers to wait for
        assert e["args"]["move_us"] == pytest.approx(e["dur"], abs=0.01)
    applied = [e for e in spans if e["name"] == "apply_gradients"]
    assert len(applied) == 6
    # The fused reduction: one all_reduce of both gradients (one bucket) inside each
    # apply_gradients, on its track.
    fused = [e for e in colls if any(
        a["tid"] == e["tid"] and a["ts"] <= e["ts"] and
        e["ts"] + e["dur"] <= a["ts"] + a["dur"] + 0.002 for a in applied)]
    if n == 1:
        assert not fused                            # nothing to sum over
    else:
        assert len(fused) == 6
        assert all(e["args"]["kind"] == "all_reduce(SUM)" and e["args"]["bytes"] == 2 * 4 * 8
                   for e in fused), fused          # (3 + 1) float64 per replica
        assert [e for e in spans if e["name"] == "wait for replicas"]
    files = trace.rank_files(str(path))
    assert list(files) == [0]                       # this rank's own file stays beside


def test_off_nothing_is_recorded_and_the_communicator_is_its_own(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    comm = s.communicator
    assert not timeline.ON
    assert "all_reduce" not in vars(comm)
    with gs.timeline.record(tmp_path / "t.json"):
        assert timeline.ON and "all_reduce" in vars(comm)   # timed while on
    assert not timeline.ON and "all_reduce" not in vars(comm)
    _train(s, steps=2)
    assert sorted(os.listdir(tmp_path)) == ["t.json", "t.json.rank0.events"]
    spans = check_trace(load(tmp_path / "t.json"))
    assert spans == []                              # the loop ran after the block


def test_the_same_results_with_the_timeline_on(tmp_path):
    off = _train(gs.MirroredStrategy(["cpu:0", "cpu:1"]))
    with gs.timeline.record(tmp_path / "t.json"):
        on = _train(gs.MirroredStrategy(["cpu:0", "cpu:1"]))
    assert on == off


def test_misuse_is_refused_with_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not exist; create it"):
        timeline.start(tmp_path / "missing" / "t.json")
    with gs.timeline.record(tmp_path / "a.json"):
        with pytest.raises(RuntimeError, match="already being recorded to .*a.json"):
            timeline.start(tmp_path / "b.json")
    assert timeline.stop() is None                  # nothing on: nothing to do
    monkeypatch.setenv("GPUSTRAT_TIMELINE_WAIT", "soon")
    with pytest.raises(ValueError, match="GPUSTRAT_TIMELINE_WAIT='soon': give the seconds"):
        timeline.start(tmp_path / "c.json")
    assert not timeline.ON and not (tmp_path / "c.json.rank0.events").exists()


def test_checkpoint_saves_record_the_blocking_and_the_background_parts(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    with s.scope():
        w = gs.Variable(np.arange(4.0), name="w")
    ckpt = gs.train.Checkpoint(w=w)
    with gs.timeline.record(tmp_path / "t.json"):
        ckpt.save(str(tmp_path / "sync" / "ckpt"))
        ckpt.save(str(tmp_path / "async" / "ckpt"),
                  options=gs.train.CheckpointOptions(experimental_enable_async_checkpoint=True))
        ckpt.sync()
    data = load(tmp_path / "t.json")
    spans = check_trace(data)
    names = {}
    for e in spans:
        names.setdefault(e["name"], []).append(e["tid"])
    assert names["checkpoint snapshot"] == [0, 0]   # both copy the state in the caller
    threads = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
               if e["name"] == "thread_name"}
    writers = [threads[t] for t in names["checkpoint write"]]
    assert writers.count("replica 0 (caller)") == 1
    assert writers.count("gpustrat-checkpoint") == 1   # the background part
    assert len(names["checkpoint commit"]) == 2


def test_summary_json_and_the_plot_of_a_two_replica_loop(tmp_path):
    path = tmp_path / "t.json"
    with gs.timeline.record(path):
        _train(gs.MirroredStrategy(["cpu:0", "cpu:1"]), steps=8)
    out = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", "summary",
                          str(path), "--json"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    r0 = got["ranks"]["0"]
    assert r0["steps"] == 8
    assert 0 < r0["step_time_median_s"] <= r0["step_time_p95_s"] < r0["wall_s"]
    assert 0 < r0["input_wait_share"] < 1 and 0 < r0["collective_wait_share"] < 1
    assert got["last_to_arrive"] == {"0": 0} and got["straggler"] is None
    assert got["collectives"]["reduce(SUM)"]["count"] == 8
    assert got["collectives"]["reduce(SUM)"]["bytes"] == 8 * 16
    k = got["collectives"]["reduce(SUM)"]
    assert k["bytes_per_s"] == pytest.approx(k["bytes"] / k["time_s"])
    if k["moving_bytes_per_s"] is not None:   # (None: no time spent moving data)
        assert k["moving_bytes_per_s"] >= k["bytes_per_s"] > 0
    text = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", "summary",
                           str(path)], capture_output=True, text=True, cwd=REPO,
                          timeout=120).stdout
    assert "step median" in text and "reduce(SUM): 8 calls, 128 bytes" in text
    pytest.importorskip("matplotlib")
    png = tmp_path / "gantt.png"
    w, h = summary.plot(trace.load(str(path)), str(png), steps=3)
    assert (w, h) == (summary.PLOT_WIDTH, summary.PLOT_TOP + 2 * summary.PLOT_ROW)
    assert png_size(png) == (w, h)


def _chunks(data: bytes) -> list:
    """The (start, end) of each chunk of a rank file's bytes."""
    at, out = len(trace.MAGIC), []
    while at < len(data):
        n = int.from_bytes(data[at:at + 4], "little")
        out.append((at, at + 4 + n))
        at += 4 + n
    return out


def test_merge_reads_files_cut_off_by_a_crash(tmp_path):
    path = str(tmp_path / "t.json")
    with gs.timeline.record(path):
        _train(gs.MirroredStrategy(["cpu:0"]), steps=3)
        timeline._rec.flush()                       # a chunk of its own for the last step
        _train(gs.MirroredStrategy(["cpu:0"]), steps=1)
    mine = Path(trace.rank_path(path, 0)).read_bytes()
    chunks = _chunks(mine)
    assert len(chunks) >= 4 and chunks[-1][1] == len(mine)
    # Rank 1 "died" while writing: no end chunk, and its last chunk cut in the middle.
    last = chunks[-2]
    Path(trace.rank_path(path, 1)).write_bytes(mine[:(last[0] + last[1]) // 2])
    os.remove(path)
    out = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", "merge", path,
                          "--ranks", "3"], capture_output=True, text=True, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "complete: [0]; missing: [2]" in out.stdout
    data = load(path)
    spans = check_trace(data)
    assert {e["pid"] for e in spans} == {0, 1}
    assert data["otherData"]["ranks"] == [0, 1] and data["otherData"]["complete"] == [0]
    runs = [sum(e["pid"] == p and e["name"] == "run" for e in spans) for p in (0, 1)]
    assert runs == [4, 3]                           # the last step's chunk was cut off
    # Each rank's file also reads on its own, and the path of the files as a whole.
    assert sum(e["name"] == "run" for e in trace.load(trace.rank_path(path, 1))) == 3
    os.remove(path)
    assert sum(e["name"] == "run" for e in trace.load(path)) == 7


def test_merge_and_summary_say_what_is_missing(tmp_path):
    path = str(tmp_path / "none.json")
    for cmd in (["merge", path], ["summary", path]):
        out = subprocess.run([sys.executable, "-m", "gpustrat", "timeline", *cmd],
                             capture_output=True, text=True, cwd=REPO, timeout=120)
        assert out.returncode == 1 and "none.json" in out.stderr and \
            "rank<N>.events" in out.stderr, out.stderr


def test_the_environment_variable_records_a_whole_program(tmp_path):
    path = tmp_path / "env.json"
    code = ("import gpustrat as gs\n"
            "s = gs.MirroredStrategy(['cpu:0', 'cpu:1'])\n"
            "for i in range(3):\n"
            "    s.reduce('sum', s.run(lambda: gs.get_replica_context().all_reduce("
            "'sum', 1.0)), axis=None)\n")
    env = dict(os.environ, GPUSTRAT_TIMELINE=str(path), PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    spans = check_trace(load(path))                 # merged at exit
    assert sum(e["name"] == "run" for e in spans) == 6


def test_the_plot_shows_the_last_steps_of_every_rank():
    # Two ranks whose steps interleave: each rank's last 3 steps are in the window, not
    # the last 3 starts of the two ranks pooled (which would show rank 0's last step
    # and a half).
    def run(rank, ts):
        return {"ph": "X", "name": "run", "pid": rank, "tid": 0, "ts": ts, "dur": 8}
    spans = [run(0, 10 * k) for k in range(10)] + [run(1, 10 * k + 5) for k in range(10)]
    lo, hi, shown = summary.plot_window(spans, 3)
    assert (lo, hi, shown) == (70, 103, 3)
    for rank in (0, 1):
        starts = sorted(e["ts"] for e in spans if e["pid"] == rank)
        assert all(ts >= lo for ts in starts[-3:]) and starts[-4] < lo
    # A rank with fewer steps than asked shows all of them.
    lo, _, shown = summary.plot_window([run(0, 5), run(0, 15), run(1, 40)], 3)
    assert (lo, shown) == (5, 2)
