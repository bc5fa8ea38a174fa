"""Distributed input across workers with several replicas each, under ``mpiexec -n 2/3/4``:
how each auto-shard policy deals the pieces (against TensorFlow 2.21's values and the
rule), every element delivered exactly once, and what a pipeline that differs between
workers gets (a rank-dependent length is an error on every rank; an unseeded shuffle
is given one seed agreed by all workers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

PRELUDE = r"""
import os, random, tempfile
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset, Options, AutoShardPolicy as P, TextLineDataset

def pol(ds, p):
    o = Options()
    o.experimental_distribute.auto_shard_policy = p
    return ds.with_options(o)

def steps_of(s, dist):
    return [[np.asarray(p).tolist() for p in s.experimental_local_results(x)] for x in dist]

def write_files(tmp, contents):
    for i, rows in enumerate(contents):
        with open(os.path.join(tmp, f"part-{i:03d}.txt"), "w") as f:
            f.write("".join(f"{v}\n" for v in rows))

def text_files(pattern):
    return (Dataset.list_files(pattern, shuffle=False)
            .interleave(TextLineDataset, cycle_length=1)
            .map(lambda line: np.int64(int(line))))

def batches(values, b, drop):
    out = [values[i:i + b] for i in range(0, len(values), b)]
    return [x for x in out if len(x) == b] if drop else out

def cut(batch, n):
    # The splitting rule: pieces of ceil(rows / n) rows, in order; empty pieces last.
    per = -(-len(batch) // n)
    return [batch[i * per:(i + 1) * per] for i in range(n)]

def pad(per_worker, local):
    # Every worker runs as many steps as the longest; the others get empty pieces.
    longest = max(len(x) for x in per_worker)
    return [x + [[[]] * local] * (longest - len(x)) for x in per_worker]

def rule_data(values, b, drop, W, R):
    # The stream of per-replica pieces dealt round-robin over workers; each worker
    # hands consecutive pieces of its share to its replicas.
    return pad([[cut(x, W * R)[w::W] for x in batches(values, b, drop)] for w in range(W)], R)

def rule_stream(per_worker_values, b, drop, W, R):
    # FILE and OFF: each worker cuts its own batches into W*R pieces and hands them to
    # its replicas R at a time, leaving out steps whose pieces would all be empty.
    out = []
    for values in per_worker_values:
        steps = []
        for x in batches(values, b, drop):
            pieces = cut(x, W * R)
            nonempty = sum(1 for p in pieces if p)
            steps += [pieces[k * R:(k + 1) * R] for k in range(-(-nonempty // R))]
        out.append(steps)
    return pad(out, R)
"""

DEALING = PRELUDE + r"""
# DATA over W workers x R replicas, recorded from TF 2.21: for each worker, the pipeline
# MultiWorkerMirroredStrategy builds (distribute.batch_sizes_for_worker, rebatch,
# auto_shard_dataset with policy DATA), its elements taken R at a time by the worker's
# replicas, padded with empty pieces to the longest worker. Key: (n, b, drop, R) for
# range(n).batch(b, drop_remainder=drop).
TF_DATA = {2: {
    (15, 4, False, 2): [[[[0], [2]], [[4], [6]], [[8], [10]], [[12], [14]]], [[[1], [3]], [[5], [7]], [[9], [11]], [[13], []]]],
    (15, 4, False, 3): [[[[0], [2], []], [[4], [6], []], [[8], [10], []], [[12], [14], []]], [[[1], [3], []], [[5], [7], []], [[9], [11], []], [[13], [], []]]],
    (9, 4, False, 2): [[[[0], [2]], [[4], [6]], [[8], []]], [[[1], [3]], [[5], [7]], [[], []]]],
    (9, 4, False, 3): [[[[0], [2], []], [[4], [6], []], [[8], [], []]], [[[1], [3], []], [[5], [7], []], [[], [], []]]],
    (10, 6, False, 2): [[[[0, 1], [4, 5]], [[6], [8]]], [[[2, 3], []], [[7], [9]]]],
    (10, 6, False, 3): [[[[0], [2], [4]], [[6], [8], []]], [[[1], [3], [5]], [[7], [9], []]]],
    (13, 7, False, 2): [[[[0, 1], [4, 5]], [[7, 8], [11, 12]]], [[[2, 3], [6]], [[9, 10], []]]],
    (13, 7, False, 3): [[[[0, 1], [4, 5], []], [[7], [9], [11]]], [[[2, 3], [6], []], [[8], [10], [12]]]],
    (17, 5, True, 2): [[[[0, 1], [4]], [[5, 6], [9]], [[10, 11], [14]]], [[[2, 3], []], [[7, 8], []], [[12, 13], []]]],
    (17, 5, True, 3): [[[[0], [2], [4]], [[5], [7], [9]], [[10], [12], [14]]], [[[1], [3], []], [[6], [8], []], [[11], [13], []]]],
    (3, 4, False, 2): [[[[0], [2]]], [[[1], []]]],
    (3, 4, False, 3): [[[[0], [2], []]], [[[1], [], []]]],
}, 3: {
    (15, 4, False, 2): [[[[0], [3]], [[4], [7]], [[8], [11]], [[12], []]], [[[1], []], [[5], []], [[9], []], [[13], []]], [[[2], []], [[6], []], [[10], []], [[14], []]]],
    (15, 4, False, 3): [[[[0], [3], []], [[4], [7], []], [[8], [11], []], [[12], [], []]], [[[1], [], []], [[5], [], []], [[9], [], []], [[13], [], []]], [[[2], [], []], [[6], [], []], [[10], [], []], [[14], [], []]]],
    (9, 4, False, 2): [[[[0], [3]], [[4], [7]], [[8], []]], [[[1], []], [[5], []], [[], []]], [[[2], []], [[6], []], [[], []]]],
    (9, 4, False, 3): [[[[0], [3], []], [[4], [7], []], [[8], [], []]], [[[1], [], []], [[5], [], []], [[], [], []]], [[[2], [], []], [[6], [], []], [[], [], []]]],
    (10, 6, False, 2): [[[[0], [3]], [[6], [9]]], [[[1], [4]], [[7], []]], [[[2], [5]], [[8], []]]],
    (10, 6, False, 3): [[[[0], [3], []], [[6], [9], []]], [[[1], [4], []], [[7], [], []]], [[[2], [5], []], [[8], [], []]]],
    (13, 7, False, 2): [[[[0, 1], [6]], [[7], [10]]], [[[2, 3], []], [[8], [11]]], [[[4, 5], []], [[9], [12]]]],
    (13, 7, False, 3): [[[[0], [3], [6]], [[7], [10], []]], [[[1], [4], []], [[8], [11], []]], [[[2], [5], []], [[9], [12], []]]],
    (17, 5, True, 2): [[[[0], [3]], [[5], [8]], [[10], [13]]], [[[1], [4]], [[6], [9]], [[11], [14]]], [[[2], []], [[7], []], [[12], []]]],
    (17, 5, True, 3): [[[[0], [3], []], [[5], [8], []], [[10], [13], []]], [[[1], [4], []], [[6], [9], []], [[11], [14], []]], [[[2], [], []], [[7], [], []], [[12], [], []]]],
    (3, 4, False, 2): [[[[0], []]], [[[1], []]], [[[2], []]]],
    (3, 4, False, 3): [[[[0], [], []]], [[[1], [], []]], [[[2], [], []]]],
}}

tmp = tempfile.mkdtemp(prefix="gs-deal-")
for R in (2, 3):
    s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(R)])
    W, r, g = s.num_workers, s.worker_index, s.workers
    assert s.num_replicas_in_sync == W * R
    for (n, b, drop, RR), want in TF_DATA.get(W, {}).items():
        if RR != R:
            continue
        assert rule_data(list(range(n)), b, drop, W, R) == want, ("rule vs TF", n, b, drop)
        for p in (P.AUTO, P.DATA):
            got = steps_of(s, s.experimental_distribute_dataset(
                pol(Dataset.range(n).batch(b, drop_remainder=drop), p)))
            assert got == want[r], (p.name, n, b, drop, W, R, r, got, want[r])
    rng = random.Random(7 + R)          # the same cases on every rank
    for case in range(10):
        n, b, drop = rng.randint(0, 30), rng.randint(1, 9), rng.random() < 0.3
        values = list(range(n))
        for p in (P.AUTO, P.DATA, P.OFF, P.FILE):
            if p in (P.AUTO, P.DATA):
                ds = pol(Dataset.range(n).batch(b, drop_remainder=drop), p)
                want = rule_data(values, b, drop, W, R)
            elif p is P.OFF:
                ds = pol(Dataset.range(n).batch(b, drop_remainder=drop), p)
                want = rule_stream([values] * W, b, drop, W, R)
            else:
                nfiles = rng.randint(W, W + 3)
                bounds = [0] + sorted(rng.randint(0, n) for _ in range(nfiles - 1)) + [n]
                files = [values[bounds[i]:bounds[i + 1]] for i in range(nfiles)]
                d = os.path.join(tmp, f"r{R}-c{case}-rank{r}")
                os.makedirs(d)
                write_files(d, files)
                ds = pol(text_files(os.path.join(d, "*.txt")).batch(b, drop_remainder=drop), p)
                want = rule_stream([sum(files[w::W], []) for w in range(W)], b, drop, W, R)
            got = steps_of(s, s.experimental_distribute_dataset(ds))
            assert got == want[r], (p.name, n, b, drop, W, R, r, got, want[r])
            # Every element exactly once (under OFF: once per worker), every worker the
            # same number of steps, every step R pieces.
            every = g.allgather(got)
            assert len({len(x) for x in every}) == 1 and all(len(st) == R for st in got)
            delivered = sorted(v for x in every for st in x for piece in st for v in piece)
            kept = [v for x in batches(values, b, drop) for v in x] if p is not P.FILE else \
                [v for w in range(W) for x in batches(sum(files[w::W], []), b, drop) for v in x]
            assert delivered == sorted(kept * (W if p is P.OFF else 1)), (p.name, n, b, drop)
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pieces_are_dealt_round_robin_over_workers_with_several_replicas_each(n):
    out = assert_mpi_ok(n, DEALING, timeout=150)
    assert out.count("OK rank") == n


PIPELINES = PRELUDE + r"""
from gpustrat.data.transforms import ShuffleDataset
s1 = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
s2 = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
W, r, g = s1.num_workers, s1.worker_index, s1.workers

def delivered(s, dist):
    got = steps_of(s, dist)
    every = g.allgather(got)
    assert len({len(x) for x in every}) == 1, [len(x) for x in every]
    return sorted(v for x in every for st in x for piece in st for v in piece), got

# A mapped batch has an unknown batch dimension: OFF counts each worker's steps from the
# batches' rows, so no step may be run that is empty on every worker.
for s in (s1, s2):
    dist = s.experimental_distribute_dataset(pol(Dataset.range(5).batch(2).map(lambda x: x * 2), P.OFF))
    want = rule_stream([[0, 2, 4, 6, 8]] * W, 2, False, W, s.num_replicas_in_sync // W)
    assert steps_of(s, dist) == want[r], (steps_of(s, dist), want[r])
    assert dist.element_spec.shape == (None,)

# A DATA pipeline whose length depends on the rank is an error on every rank, whether
# the step counts are known in advance (compared once) or not (compared per block).
for s in (s1, s2):
    for known in (True, False):
        ds = Dataset.range(8 * s.num_replicas_in_sync + (4 if r == W - 1 else 0))
        if not known:
            ds = ds.filter(lambda v: True)
        dist = s.experimental_distribute_dataset(ds.batch(s.num_replicas_in_sync))
        try:
            sum(1 for _ in dist)
        except ValueError as e:
            assert "AutoShardPolicy.DATA every worker must read the same data" in str(e), str(e)
            assert f"worker {W - 1}: " in str(e) and "worker 0: 8 steps" in str(e), str(e)
        else:
            raise AssertionError(f"no error for a rank-dependent DATA pipeline (known={known})")
        g.barrier()
# The same pipeline on every worker still runs under DATA, with 1 collective per epoch
# when the counts are known.
it = iter(s2.experimental_distribute_dataset(Dataset.range(40).batch(8)))
assert sum(1 for _ in it) == 5 and it.agreement_collectives == 1

# Unseeded shuffles under DATA: worker 0's seeds on every worker, so every element is
# delivered exactly once, in every epoch (each epoch reshuffled), nested shuffles too.
for s in (s1, s2):
    N = s.num_replicas_in_sync
    ds = (Dataset.range(64).shuffle(64).map(lambda x: x * 10).shuffle(16)
          .batch(2 * N).shuffle(3))
    dist = s.experimental_distribute_dataset(ds)
    orders = []
    for epoch in range(2):
        values, got = delivered(s, dist)
        assert values == [10 * v for v in range(64)], (epoch, values)
        orders.append(got)
    assert orders[0] != orders[1]          # reshuffled each epoch, the same on every worker
    # The user's own dataset keeps its own random seeds.
    assert [n._seeded for n in (ds, ds._input._input)] == [False, False]
# A shuffled list of files read under DATA: the same file order on every worker.
tmp = tempfile.mkdtemp(prefix=f"gs-shuf-{r}-")
write_files(tmp, [range(i * 5, i * 5 + 5) for i in range(6)])
files = pol(Dataset.list_files(os.path.join(tmp, "*.txt"))
            .interleave(TextLineDataset, cycle_length=2)
            .map(lambda line: np.int64(int(line))).batch(4), P.DATA)
values, _ = delivered(s2, s2.experimental_distribute_dataset(files))
assert values == list(range(30)), values
# Shuffles inside an interleave function are seeded alike on every worker too.
nested = Dataset.range(6).interleave(lambda x: Dataset.range(8 * x, 8 * x + 8).shuffle(8),
                                     cycle_length=3).batch(4)
dist = s2.experimental_distribute_dataset(nested)
first, second = delivered(s2, dist), delivered(s2, dist)
assert first[0] == second[0] == list(range(48)) and first[1] != second[1]
# reshuffle_each_iteration=False keeps one agreed order for every epoch.
fixed = s1.experimental_distribute_dataset(
    Dataset.range(20).shuffle(20, reshuffle_each_iteration=False).batch(2 * W))
first, second = steps_of(s1, fixed), steps_of(s1, fixed)
assert first == second and g.allgather(first) == g.allgather(second)
assert sorted(v for x in g.allgather(first) for st in x for p in st for v in p) == list(range(20))
# A seed given by the user is kept.
seeded = Dataset.range(12).shuffle(12, seed=5).batch(2 * W)
got = steps_of(s1, s1.experimental_distribute_dataset(seeded))
ref = [b.tolist() for b in Dataset.range(12).shuffle(12, seed=5).batch(2 * W)]
assert got == [[cut(b, W)[r]] for b in ref], (got, ref)
# A parallel map with deterministic=False yields as results complete, in another order
# on each worker (the sleeps differ by rank): under DATA it keeps its input order.
import time
def uneven_work(x):
    time.sleep(0.0005 * ((int(x) * (r + 3)) % 4))
    return x
racy = Dataset.range(48).map(uneven_work, num_parallel_calls=4, deterministic=False)
values, _ = delivered(s2, s2.experimental_distribute_dataset(racy.batch(4)))
assert values == list(range(48)), values
# Different numbers of unseeded shuffles on different workers: an error on every rank.
uneven = Dataset.range(8)
for _ in range(1 + (r == W - 1)):
    uneven = uneven.shuffle(8)
try:
    s1.experimental_distribute_dataset(uneven.batch(W))
except ValueError as e:
    assert f"unseeded shuffles (worker 0: 1" in str(e) and f"worker {W - 1}: 2)" in str(e), str(e)
else:
    raise AssertionError("different pipelines must raise")
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3, 4])
def test_pipelines_that_differ_between_workers(n):
    out = assert_mpi_ok(n, PIPELINES, timeout=150)
    assert out.count("OK rank") == n
