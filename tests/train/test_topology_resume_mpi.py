"""Resuming a distributed iterator on another topology under mpiexec: OFF positions
move to any number of workers and replicas (2->3, 3->2 workers, 2x2 -> 2x1 and 1x2);
FILE positions move to another replica count on the same number of workers, and onto
another number of workers are an error on every worker. After the restore each worker
delivers the rest of its stream once, as the uninterrupted run of the new topology
delivers it from the step holding the position (that step without the rows consumed
before)."""

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

MOVE = r"""
import json, os, sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset, Options, AutoShardPolicy as P

R, policy, directory, phase, k = (int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4],
                                  int(sys.argv[5]))
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(R)])
rank, W = s.worker_index, s.num_workers

def build():
    if policy == "FILE":
        paths = []
        for f in range(4):
            p = os.path.join(directory, f"part-{f}.txt")
            if not os.path.exists(p):
                with open(p + f".tmp{rank}", "w") as out:
                    out.write("".join(f"{f * 1000 + i}\n" for i in range(20 + 3 * f)))
                os.replace(p + f".tmp{rank}", p)
            paths.append(p)
        ds = gs.data.TextLineDataset(paths).map(lambda line: np.int64(int(line))).batch(6)
    else:
        ds = Dataset.range(100).shuffle(30, seed=7).batch(12)
    o = Options()
    o.experimental_distribute.auto_shard_policy = getattr(P, policy)
    return ds.with_options(o)

def steps(it, n=None):
    out = []
    for x in it:
        out.append([np.asarray(p).tolist() for p in s.experimental_local_results(x)])
        if len(out) == n:
            break
    return out

flat = lambda steps: [v for step in steps for piece in step for v in piece]  # noqa: E731
ck_path = os.path.join(directory, "ck")
if phase == "save":
    it = iter(s.experimental_distribute_dataset(build()))
    head = steps(it, k)
    gs.train.Checkpoint(input=it).write(ck_path)
    json.dump(head, open(os.path.join(directory, f"head-{rank}.json"), "w"))
    print(f"OK saved {rank}", flush=True)
    sys.exit(0)
full = steps(iter(s.experimental_distribute_dataset(build())))   # uninterrupted, here
it = iter(s.experimental_distribute_dataset(build()))
try:
    gs.train.Checkpoint(input=it).read(ck_path)
except RuntimeError as e:
    print(f"OK error {rank}: {e}", flush=True)
    sys.exit(0)
rest = steps(it)
saved_workers = len([f for f in os.listdir(directory) if f.startswith("head-")])
head = json.load(open(os.path.join(directory, f"head-{rank % saved_workers}.json")))
# Every row of this worker's stream once: the rows before the save, then the rest.
assert flat(head) + flat(rest) == flat(full), (head, rest, full)
# The rest is the uninterrupted run's steps from the one holding the position.
first = full[len(full) - len(rest)]
assert rest[1:] == full[len(full) - len(rest) + 1:], (rest, full)
assert all(p[len(p) - len(q):] == q for p, q in zip(first, rest[0])), (first, rest[0])
print(f"OK resumed {rank} {len(head)}+{len(rest)} steps, first {rest[0]} of {first}",
      flush=True)
"""


def move(tmp_path, policy, saved, restored, k):
    """Save after ``k`` steps on ``saved`` = (workers, replicas), restore on each of
    ``restored``; returns each restore's output."""
    (w, r) = saved
    assert_mpi_ok(w, MOVE, timeout=120, args=(r, policy, tmp_path, "save", k),
                  expect_lines=w)
    outs = []
    for (w2, r2) in restored:
        outs.append(assert_mpi_ok(w2, MOVE, timeout=120,
                                  args=(r2, policy, tmp_path, "load", k), expect_lines=w2))
    return outs


def test_mpi_off_position_moves_from_two_to_three_workers(tmp_path):
    # 12-row batches, 6 rows a step on 2 workers: saved at row 6 of batch 1; on 3 workers
    # the step holding it is rows 4..7, continued without rows 4 and 5.
    (out,) = move(tmp_path, "OFF", (2, 1), [(3, 1)], 3)
    assert out.count("OK resumed") == 3 and "3+" in out, out


def test_mpi_off_position_moves_from_three_to_two_workers(tmp_path):
    (out,) = move(tmp_path, "OFF", (3, 1), [(2, 1)], 4)
    assert out.count("OK resumed") == 2, out


def test_mpi_off_position_moves_to_other_replica_counts(tmp_path):
    # 2x2 -> 2x1: 6 rows a step either way, the uninterrupted run's steps exactly;
    # 2x2 -> 1x2: one worker's step is a whole batch, its first without 6 rows.
    to_2x1, to_1x2 = move(tmp_path, "OFF", (2, 2), [(2, 1), (1, 2)], 3)
    assert to_2x1.count("OK resumed") == 2 and to_1x2.count("OK resumed") == 1


def test_mpi_file_position_moves_to_another_replica_count_not_worker_count(tmp_path):
    to_2x1, to_3x1 = move(tmp_path, "FILE", (2, 2), [(2, 1), (3, 1)], 3)
    assert to_2x1.count("OK resumed") == 2, to_2x1
    assert to_3x1.count("OK error") == 3, to_3x1
    # Every worker raises the same error, which names every worker's reason.
    assert to_3x1.count("failed on 3 of 3 workers") == 3, to_3x1
    assert to_3x1.count("saved on 2 worker(s) x 2 replica(s) per worker (policy "
                        "AutoShardPolicy.FILE) onto 3 worker(s) x 1 replica(s) per worker "
                        "(policy AutoShardPolicy.FILE): under the FILE policy each worker "
                        "reads its own files") == 9, to_3x1
