"""The stall inspector under ``mpiexec -n 2/3``: once a wait passes
``GPUSTRAT_STALL_WARNING`` seconds every waiting rank prints where every rank is (the
collective, the gpustrat call and the user's line), names a collective reached by some
workers only with its fix, and the deadline's CollectiveTimeout says the same."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import format_result, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

DELAY = 2

# The classic habit: read a metric (a collective) on worker 0 only. Worker 0 waits in
# result(); the others go on to the next epoch and wait in its first batch.
PLANTED = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
task_id = s.cluster_resolver.task_id
with s.scope():
    train_loss = gs.metrics.Mean()
dist = s.experimental_distribute_dataset(Dataset.range(32).batch(4 * s.num_workers))
for epoch in range(2):
    for x in dist:  # LINE-LOOP
        s.run(lambda b: train_loss.update_state(b.astype(np.float32)), args=(x,))
    if task_id == 0:
        print(train_loss.result(), flush=True)  # LINE-RESULT
"""


def _line(script: str, tag: str) -> int:
    return next(i for i, text in enumerate(script.splitlines(), 1) if f"# {tag}" in text)


def _warnings(err: str) -> dict:
    """rank -> the text of the first stall warning it printed (to the next warning)."""
    found = {}
    for m in re.finditer(r"\[gpustrat\] rank (\d+) has waited (\d+) s in (.*?)(?=\n\[gpustrat\]|"
                         r"\nTraceback|\Z)", err, re.S):
        found.setdefault(int(m.group(1)), (int(m.group(2)), m.group(0)))
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_a_metric_read_on_worker_0_only_is_named_with_its_fix(n):
    rc, out, err = run_mpi(n, PLANTED, timeout=100,
                           env={"GPUSTRAT_STALL_WARNING": str(DELAY), "GPUSTRAT_TIMEOUT": "25"})
    report = format_result(rc, out, err)
    assert rc != 0 and "[run_mpi] timed out" not in err, report
    result_at = f"Mean.result() at child.py:{_line(PLANTED, 'LINE-RESULT')}"
    loop_at = f"next(DistributedIterator) at child.py:{_line(PLANTED, 'LINE-LOOP')}"
    warned = _warnings(err)
    assert set(warned) == set(range(n)), report  # every waiting rank (all of them) warns
    for rank, (waited, text) in warned.items():
        # Within the delay (and the survey's answer time), long before the deadline.
        assert waited <= DELAY + 8, report
        assert f"rank 0: waiting in {result_at} [all_reduce(SUM) on shape (2,) float32]" \
            in text, text
        for other in range(1, n):
            assert f"rank {other}: waiting in {loop_at} [allgather: the input pipeline's " \
                   "end-of-data agreement]" in text, text
        assert "A collective reached by some workers only" in text, text
        assert "call it on every worker and print on one" in text, text
        assert "if task_id == 0: print(value)" in text, text
    # The deadline's error says the same.
    tail = err[err.index("CollectiveTimeout:"):]
    assert "Where every rank is:" in tail, report
    assert f"rank 0: waiting in {result_at}" in tail and "some workers only" in tail, report


# One rank sits in a checkpoint save (a slow disk) while the others wait inside it.
SLOW_SAVE = r"""
import sys, time
import numpy as np
import gpustrat as gs
from gpustrat.train import saving
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
with s.scope():
    v = gs.Variable(np.zeros(3, np.float32))
ckpt = gs.train.Checkpoint(v=v)
if r == 1:
    write = saving.Job.write
    def slow_write(job):
        time.sleep(float(sys.argv[2]))
        write(job)
    saving.Job.write = slow_write
path = ckpt.save(sys.argv[1] + "/ckpt")  # LINE-SAVE
print("OK", r, path, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_that_sits_in_a_checkpoint_save_is_named(n, tmp_path):
    rc, out, err = run_mpi(n, SLOW_SAVE, timeout=100, args=[tmp_path, 3 * DELAY + 4],
                           env={"GPUSTRAT_STALL_WARNING": str(DELAY), "GPUSTRAT_TIMEOUT": "60"})
    report = format_result(rc, out, err)
    assert rc == 0 and out.count("OK") == n, report  # the job goes on once it is written
    save_at = f"Checkpoint.save() at child.py:{_line(SLOW_SAVE, 'LINE-SAVE')}"
    warned = _warnings(err)
    assert 1 not in warned and set(warned) >= {0}, report
    for rank, (waited, text) in warned.items():
        assert waited <= DELAY + 8, report
        assert f"rank 1: working in {save_at} (not waiting for other ranks)" in text, text
        assert f"rank {rank}: waiting in {save_at}" in text, text
        assert "rank 1 is still working in the same call" in text, text


# One rank in its own code (an evaluation) while the others wait in a reduce.
OUTSIDE = r"""
import sys, time
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index

def evaluate():
    time.sleep(float(sys.argv[1]))  # LINE-SLEEP

if r == 1:
    evaluate()
total = s.reduce("sum", s.run(lambda: np.ones(2)), axis=None)  # LINE-REDUCE
print("OK", r, total.tolist(), flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_a_rank_outside_gpustrat_is_named_with_its_line(n):
    rc, out, err = run_mpi(n, OUTSIDE, timeout=100, args=[3 * DELAY + 4],
                           env={"GPUSTRAT_STALL_WARNING": str(DELAY), "GPUSTRAT_TIMEOUT": "60"})
    report = format_result(rc, out, err)
    assert rc == 0 and out.count("OK") == n, report
    warned = _warnings(err)
    assert 1 not in warned and 0 in warned, report
    for rank, (waited, text) in warned.items():
        assert "rank 1: outside any gpustrat call, at " \
               f"child.py:{_line(OUTSIDE, 'LINE-SLEEP')} (in evaluate)" in text, text
        assert f"rank {rank}: waiting in MultiWorkerMirroredStrategy.reduce() at " \
               f"child.py:{_line(OUTSIDE, 'LINE-REDUCE')}" in text, text
        assert "rank 1 is in no collective" in text, text


# Off: no warning and no thread; on: one thread per group, gone once it is closed.
THREADS = r"""
import os, threading, time
import numpy as np
import gpustrat as gs
def inspectors():
    return [t for t in threading.enumerate() if t.name == "gpustrat-stall-inspector"]
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
on = os.environ["GPUSTRAT_STALL_WARNING"] != "off"
assert len(inspectors()) == (1 if on else 0), inspectors()
if r == 1:
    time.sleep(4)
s.reduce("sum", s.run(lambda: np.ones(2)), axis=None)
s.close()
assert not inspectors(), inspectors()
print("OK", r, flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["off", "1"])
def test_the_inspector_can_be_turned_off_and_its_thread_ends_with_the_strategy(setting):
    rc, out, err = run_mpi(2, THREADS, timeout=100, env={"GPUSTRAT_STALL_WARNING": setting})
    report = format_result(rc, out, err)
    assert rc == 0 and out.count("OK") == 2, report
    assert ("has waited" in err) == (setting != "off"), report
