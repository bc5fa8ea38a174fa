"""MultiWorkerMirroredStrategy under ``mpiexec -n 2/3/4``: SPEC's multi-worker examples,
auto-shard policies, end-of-data agreement, exactly-once delivery, cross-worker
collectives and failure behaviour. Each child checks exact values and prints one line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, format_result, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

PRELUDE = r"""
import os, tempfile
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset, Options, AutoShardPolicy, TextLineDataset

def with_policy(ds, policy):
    o = Options()
    o.experimental_distribute.auto_shard_policy = policy
    return ds.with_options(o)

def steps_of(strategy, dist):
    out = []
    for x in dist:
        out.append([[int(v) for v in np.asarray(p).reshape(-1)]
                    for p in strategy.experimental_local_results(x)])
    return out

def write_files(tmp, contents):
    paths = []
    for i, rows in enumerate(contents):
        p = os.path.join(tmp, f"part-{i:03d}.txt")
        with open(p, "w") as f:
            f.write("".join(f"{v}\n" for v in rows))
        paths.append(p)
    return paths

def text_files(pattern):
    return (Dataset.list_files(pattern, shuffle=False)
            .interleave(TextLineDataset, cycle_length=1)
            .map(lambda line: np.int64(int(line))))
"""

SPEC_EXAMPLES = PRELUDE + r"""
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
W, r = s.num_workers, s.worker_index
assert W == 2 and s.num_replicas_in_sync == 2
D = AutoShardPolicy.DATA

# Seed DATA example: 12 elements, global batch 4.
got = steps_of(s, s.experimental_distribute_dataset(with_policy(Dataset.range(12).batch(4), D)))
assert got == ([[[0, 1]], [[4, 5]], [[8, 9]]] if r == 0 else [[[2, 3]], [[6, 7]], [[10, 11]]]), got
# AUTO on a dataset reading no files is DATA.
got = steps_of(s, s.experimental_distribute_dataset(Dataset.range(12).batch(4)))
assert got == ([[[0, 1]], [[4, 5]], [[8, 9]]] if r == 0 else [[[2, 3]], [[6, 7]], [[10, 11]]]), got
# TensorFlow's own tests.
got = steps_of(s, s.experimental_distribute_dataset(with_policy(Dataset.range(8).batch(3), D)))
assert got == ([[[0, 1]], [[3, 4]], [[6]]] if r == 0 else [[[2]], [[5]], [[7]]]), got
got = steps_of(s, s.experimental_distribute_dataset(with_policy(Dataset.range(9).batch(2), D)))
assert got == ([[[0]], [[2]], [[4]], [[6]], [[8]]] if r == 0 else [[[1]], [[3]], [[5]], [[7]], [[]]]), got
# OFF: every worker reads everything.
got = steps_of(s, s.experimental_distribute_dataset(
    with_policy(Dataset.range(12).batch(4), AutoShardPolicy.OFF)))
assert got == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]], [[8, 9]], [[10, 11]]], got

# Seed FILE example: file 1 holds 0..5, file 2 holds 6..11 (AUTO picks FILE).
tmp = tempfile.mkdtemp(prefix=f"gs-file-{r}-")
write_files(tmp, [range(0, 6), range(6, 12)])
dist = s.experimental_distribute_dataset(text_files(os.path.join(tmp, "*.txt")).batch(4))
assert dist.auto_shard_policy == AutoShardPolicy.FILE
got = steps_of(s, dist)
assert got == ([[[0, 1]], [[2, 3]], [[4]], [[5]]] if r == 0 else [[[6, 7]], [[8, 9]], [[10]], [[11]]]), got

# Uneven files: worker 1's data ends first; it yields empty pieces until worker 0 ends.
tmp2 = tempfile.mkdtemp(prefix=f"gs-uneven-{r}-")
write_files(tmp2, [range(0, 10), range(10, 12)])
it = iter(s.experimental_distribute_dataset(text_files(os.path.join(tmp2, "*.txt")).batch(4)))
got = []
while True:
    o = it.get_next_as_optional()
    if not o.has_value():
        break
    got.append([int(v) for v in np.asarray(o.get_value())])
assert got == ([[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]] if r == 0 else
               [[10], [11], [], [], [], []]), got
# Unknown step counts: agreement in blocks 1, 2, 4, ...: far fewer collectives than steps.
assert 1 <= it.agreement_collectives <= 5, it.agreement_collectives

# Too few files for FILE: the same clear error on every rank.
tmp3 = tempfile.mkdtemp(prefix=f"gs-one-{r}-")
write_files(tmp3, [range(4)])
try:
    s.experimental_distribute_dataset(
        with_policy(text_files(os.path.join(tmp3, "*.txt")).batch(2), AutoShardPolicy.FILE))
except ValueError as e:
    assert "1" in str(e) and "2" in str(e) and "DATA" in str(e), str(e)
else:
    raise AssertionError("fewer files than workers must raise")

# distribute_datasets_from_function: one pipeline per worker.
dd = s.distribute_datasets_from_function(
    lambda ctx: Dataset.range(10).shard(ctx.num_input_pipelines, ctx.input_pipeline_id)
    .batch(ctx.get_per_replica_batch_size(4)))
assert dd.input_context.num_input_pipelines == 2 and dd.input_context.input_pipeline_id == r
got = steps_of(s, dd)
assert got == ([[[0, 2]], [[4, 6]], [[8]]] if r == 0 else [[[1, 3]], [[5, 7]], [[9]]]), got

# Uneven per-worker data with known cardinality: one allgather per epoch, then padding.
dd = s.distribute_datasets_from_function(lambda ctx: Dataset.range(2 + 4 * ctx.input_pipeline_id).batch(2))
it = iter(dd)
got = [[int(v) for v in np.asarray(x)] for x in it]
assert got == ([[0, 1], [], []] if r == 0 else [[0, 1], [2, 3], [4, 5]]), got
assert it.agreement_collectives == 1, it.agreement_collectives
print(f"OK rank {r}", flush=True)
"""


def test_spec_multi_worker_examples():
    out = assert_mpi_ok(2, SPEC_EXAMPLES, timeout=120)
    assert out.count("OK rank") == 2


SEVERAL_REPLICAS = PRELUDE + r"""
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
W, r = s.num_workers, s.worker_index
N = s.num_replicas_in_sync
assert N == 2 * W
# Partial batches with two replicas per worker, DATA: a step is one global batch, its
# pieces dealt round-robin over the workers.
data = Dataset.range(11).batch(2 * W + 1)
got = steps_of(s, s.experimental_distribute_dataset(data))
expected = []
for start in range(0, 11, 2 * W + 1):
    batch = list(range(start, min(11, start + 2 * W + 1)))
    per = -(-len(batch) // N)
    pieces = [batch[i * per:(i + 1) * per] for i in range(N)]
    expected.append(pieces[r::W])
assert got == expected, (got, expected)

# Cross-worker collectives inside run reach every replica of every worker.
def step(x):
    ctx = gs.get_replica_context()
    total = ctx.all_reduce("sum", np.float64(ctx.replica_id_in_sync_group))
    ids = ctx.all_gather(np.array([ctx.replica_id_in_sync_group]), axis=0)
    return total, ids, x * 2.0
for x in s.experimental_distribute_dataset(Dataset.range(4 * W).batch(2 * W)):
    total, ids, doubled = s.run(step, args=(x,))
    for t in s.experimental_local_results(total):
        assert float(t) == sum(range(N))
    for g in s.experimental_local_results(ids):
        assert list(g) == list(range(N))
    # reduce and gather across workers: the whole global batch.
    full = s.gather(x, axis=0)
    assert sorted(full) == list(range(min(full), min(full) + 2 * W))  # the whole global batch
    np.testing.assert_array_equal(s.gather(doubled, axis=0), 2.0 * full)
    assert float(s.reduce("sum", doubled, axis=0)) == 2.0 * float(full.sum())
    assert float(s.reduce("mean", doubled, axis=0)) == 2.0 * float(full.mean())

# SPEC's last-step reduce with an uneven, partly empty global batch over all workers.
last = s.experimental_distribute_dataset(Dataset.range(3).batch(3))
for x in last:
    doubled = s.run(lambda v: v * 2.0, args=(x,))
    assert float(s.reduce("sum", doubled, axis=0)) == 6.0
    assert float(s.reduce("mean", doubled, axis=0)) == 2.0
    # Replica order, not row order: on 2 workers x 2 replicas rows 0 and 2 are worker 0's.
    assert list(s.gather(doubled, axis=0)) == ([0.0, 4.0, 2.0] if W == 2 else [0.0, 2.0, 4.0])

# DATA with a known step count costs one agreement collective per epoch.
dist = s.experimental_distribute_dataset(Dataset.range(40).batch(4))
it = iter(dist)
n_steps = sum(1 for _ in it)
assert n_steps == 10 and it.agreement_collectives == 1
assert sum(1 for _ in dist) == 10 and it.agreement_collectives == 2  # per epoch
# A rank-dependent pipeline under DATA (a user error) is an error on every rank: no
# hang, no lost pieces.
uneven = s.experimental_distribute_dataset(Dataset.range(8 + 8 * r).filter(lambda v: True).batch(4))
try:
    sum(1 for _ in uneven)
except ValueError as e:
    assert "different lengths (worker 0: 2 steps, worker 1: at least" in str(e), str(e)
else:
    raise AssertionError("a shorter DATA pipeline on one worker must raise")
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_several_replicas_per_worker(n):
    out = assert_mpi_ok(n, SEVERAL_REPLICAS, timeout=150)
    assert out.count("OK rank") == n


EXACTLY_ONCE = PRELUDE + r"""
import random
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(int(os.environ["LOCAL"]))])
W, r = s.num_workers, s.worker_index
g = s.workers
rng = random.Random(1234)          # the same cases on every rank
for case in range(12):
    size = rng.randint(0, 40)
    batch = rng.randint(1, 9)
    drop = rng.random() < 0.3
    policy = rng.choice(["DATA", "FILE"])
    if policy == "DATA":
        ds = with_policy(Dataset.range(size).batch(batch, drop_remainder=drop), AutoShardPolicy.DATA)
        expected = list(range((size // batch) * batch if drop else size))
    else:
        nfiles = rng.randint(W, W + 3)
        cuts = sorted(rng.randint(0, size) for _ in range(nfiles - 1))
        bounds = [0] + cuts + [size]
        tmp = tempfile.mkdtemp(prefix=f"gs-x{case}-{r}-")
        write_files(tmp, [range(bounds[i], bounds[i + 1]) for i in range(nfiles)])
        ds = text_files(os.path.join(tmp, "*.txt")).batch(batch)
        expected = list(range(size))
    mine, steps = [], 0
    for x in s.experimental_distribute_dataset(ds):
        steps += 1
        for p in s.experimental_local_results(x):
            mine.extend(int(v) for v in np.asarray(p))
    every = g.allgather((mine, steps))
    union = sorted(v for m, _ in every for v in m)
    assert union == expected, (case, policy, size, batch, drop, union, expected)
    assert len({st for _, st in every}) == 1, ("step counts differ", case, every)
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("n,local", [(2, 1), (3, 2)])
def test_exactly_once_data_and_file(n, local):
    out = assert_mpi_ok(n, EXACTLY_ONCE, timeout=180, env={"LOCAL": str(local)})
    assert out.count("OK rank") == n


FOUR = PRELUDE + r"""
s = gs.MultiWorkerMirroredStrategy()
W, r = s.num_workers, s.worker_index
assert W == 4 and s.local_devices[0].name == "cpu:0"
got = steps_of(s, s.experimental_distribute_dataset(Dataset.range(10).batch(4)))
# Global batches [0..3] [4..7] [8,9] cut in 4: worker r takes piece r.
expected = [[[4 * b + r]] if 4 * b + r < 10 and (b < 2 or r < 2) else [[]] for b in range(3)]
assert got == expected, (got, expected)
out = s.run(lambda: gs.get_replica_context().all_reduce("max", np.int64(r)))
assert int(out) == 3
print(f"OK rank {r}", flush=True)
"""


def test_four_workers_default_devices():
    out = assert_mpi_ok(4, FOUR, timeout=150)
    assert out.count("OK rank") == 4


FAILING = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
def bad(x):
    if s.worker_index == 1:
        raise RuntimeError("replica function failed on purpose")
    return gs.get_replica_context().all_reduce("sum", x)
for x in s.experimental_distribute_dataset(Dataset.range(8).batch(2)):
    s.run(bad, args=(x,))
print("UNREACHABLE", flush=True)
"""


def assert_job_fails_fast(n: int, script: str, message: str, rank: int, args=()) -> None:
    """The job exits non-zero within a minute, printing ``message`` and naming the failing
    rank: in its own report (``rank R``) or, where the launcher killed it before its report
    reached standard error (Intel MPI's does), in the other ranks' (``worker R failed``)."""
    t0 = time.monotonic()
    rc, out, err = run_mpi(n, script, timeout=90, args=args)
    took = time.monotonic() - t0
    text = out + err
    assert rc != 0 and "UNREACHABLE" not in text, format_result(rc, out, err)
    named = f"rank {rank}" in text or f"worker {rank} failed" in text
    assert message in text and named, format_result(rc, out, err)
    assert took < 60, f"the job took {took:.0f} s to end after one rank failed"


def test_error_in_one_rank_ends_every_rank():
    assert_job_fails_fast(3, FAILING, "replica function failed on purpose", rank=1)


TWO_STRATEGIES = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
a = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
b = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
r = a.worker_index
assert a.num_replicas_in_sync == 2 and b.num_replicas_in_sync == 4
# Interleaved use of both: each works on its own duplicate communicator.
for x, y in zip(a.experimental_distribute_dataset(Dataset.range(8).batch(4)),
                b.experimental_distribute_dataset(Dataset.range(8).batch(4))):
    sa = a.reduce("sum", a.run(lambda v: v * 1.0, args=(x,)), axis=0)
    sb = b.reduce("sum", b.run(lambda v: v * 1.0, args=(y,)), axis=0)
    assert float(sa) == float(sb)
out = b.run(lambda: gs.get_replica_context().all_reduce("sum", 1.0))
assert b.experimental_local_results(out) == (4.0, 4.0)
print(f"OK rank {r}", flush=True)
"""


def test_two_strategies_coexist():
    out = assert_mpi_ok(2, TWO_STRATEGIES, timeout=120)
    assert out.count("OK rank") == 2


PIPELINE_FAILS = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
def parse(x):
    if s.worker_index == 2 and int(x[0]) >= 8:
        raise ValueError("corrupt record in worker 2's input")
    return x
for x in s.experimental_distribute_dataset(Dataset.range(40).batch(4).map(parse)):
    s.reduce("sum", s.run(lambda v: v * 1.0, args=(x,)), axis=0)
print("UNREACHABLE", flush=True)
"""


def test_error_in_one_ranks_input_pipeline_ends_every_rank():
    assert_job_fails_fast(3, PIPELINE_FAILS, "corrupt record in worker 2's input", rank=2)


LEAVES_EARLY = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset

def main():
    s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    for i, x in enumerate(s.experimental_distribute_dataset(Dataset.range(40).batch(4))):
        if s.worker_index == 1 and i == 2:
            if sys.argv[1] == "return":
                return
            sys.exit(0 if sys.argv[1] == "exit0" else "bad config on rank 1")
        s.reduce("sum", s.run(lambda v: v * 1.0, args=(x,)), axis=0)
    print("UNREACHABLE", flush=True)
main()
"""


@pytest.mark.timeout(100)
@pytest.mark.parametrize("how", ["return", "exit0", "exit_message"])
def test_rank_leaving_early_ends_every_rank_without_waiting_for_the_timeout(how):
    # Under the default GPUSTRAT_TIMEOUT (300 s): the others learn of the exit at once.
    assert_job_fails_fast(3, LEAVES_EARLY, "rank 1 has exited (its script ended", rank=1,
                          args=[how])


LEAVES_AT_THE_END = r"""
import time
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
b = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
r = s.worker_index
for x in s.experimental_distribute_dataset(Dataset.range(24).batch(4)):
    s.reduce("sum", s.run(lambda v: v * 1.0, args=(x,)), axis=0)
if r != 0:
    time.sleep(1.5)  # rank 0 roots the last collective and exits before the others join
assert s.workers.bcast(r, root=0) == 0
if r == 1:
    time.sleep(1.5)  # a rank still working (saving a checkpoint) after the others exit
ids = b.run(lambda: np.float64(gs.get_replica_context().replica_id_in_sync_group))
n = b.num_replicas_in_sync
assert float(b.reduce("sum", ids, axis=None)) == n * (n - 1) / 2
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.timeout(100)
def test_ranks_exiting_at_different_times_after_the_last_collective_is_no_error():
    out = assert_mpi_ok(3, LEAVES_AT_THE_END, timeout=90)
    assert out.count("OK rank") == 3


REDUCE_LAYOUTS = r"""
import sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
r = s.worker_index
case = sys.argv[1]
# Rank 1 differs from the others.
shape, dtype, axis = {
    "rows": ((2, 3) if r == 1 else (4, 3), np.float64, None),
    "dtype": ((4, 3), np.float32 if r == 1 else np.float64, None),
    "trailing": ((4, 2) if r == 1 else (4, 3), np.float64, 0),
}[case]
v = s.experimental_distribute_values_from_function(lambda ctx: np.ones(shape, dtype))
try:
    s.reduce("sum", v, axis=axis)
except ValueError as e:
    print("ERROR", r, e, flush=True)
else:
    print("NO ERROR", r, flush=True)
# The job goes on: partial batches (rows differ between workers) reduce along axis 0.
rows = 1 + r
v = s.experimental_distribute_values_from_function(lambda ctx: np.ones((rows, 3)))
total = s.reduce("sum", v, axis=0)
want = 2 * sum(1 + w for w in range(s.num_workers))
assert np.array_equal(total, np.full(3, float(want))), total
mean = s.reduce("mean", v, axis=0)
assert np.array_equal(mean, np.ones(3)), mean
"""


@pytest.mark.timeout(100)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("case,rank0,rank1", [
    ("rows", "(4, 3) float64", "(2, 3) float64"),
    ("dtype", "(4, 3) float64", "(4, 3) float32"),
    ("trailing", "(*, 3) float64", "(*, 2) float64"),
])
def test_reduce_of_values_whose_layout_differs_between_workers_fails_on_every_rank(
        n, case, rank0, rank1):
    out = assert_mpi_ok(n, REDUCE_LAYOUTS, timeout=90, args=[case], marker="ERROR",
                        expect_lines=n)
    axis = "0" if case == "trailing" else "None"
    for line in out.splitlines():
        assert f"reduce(SUM, axis={axis}): every worker must contribute the same shape " \
               f"and dtype, but the workers hold rank 0: {rank0}; rank 1: {rank1}" in line, line
        hint = "pass axis=0" if axis == "None" else "only along the reduced axis"
        assert hint in line, line


ONE_ARRAY_IN_RUN = r"""
import numpy as np
import gpustrat as gs
from gpustrat import ReduceOp
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
W, r = s.num_workers, s.worker_index
ctx = gs.get_replica_context
ranks = np.arange(W)
for dtype in (np.float32, np.float64, np.int32, np.int64, np.complex64):
    for shape in ((), (1,), (3, 2)):
        every = [np.asarray(np.arange(int(np.prod(shape)) or 1).reshape(shape) + 3 * k,
                            dtype) for k in ranks]
        x = every[r]
        for op, want in (("sum", sum(every)), (ReduceOp.SUM, sum(every)),
                         ("MEAN", sum(every) / W), ("max", np.max(every, axis=0)),
                         (ReduceOp.MIN, np.min(every, axis=0))):
            if dtype is np.complex64 and op in ("max", ReduceOp.MIN):
                continue
            got = s.run(lambda v: ctx().all_reduce(op, v), args=(x,))
            nested = s.run(lambda v: ctx().all_reduce(op, [v]), args=(x,))[0]
            assert np.shape(got) == shape and type(got) is type(nested), (op, dtype, got)
            assert got.dtype == nested.dtype, (op, dtype, got.dtype, nested.dtype)
            np.testing.assert_allclose(got, want, rtol=1e-6)
            np.testing.assert_array_equal(got, nested)
            # Outside run: strategy.reduce of the array and of the array in a list.
            for axis in (None, 0, -1) if shape else (None,):
                got = s.reduce(op, x, axis=axis)
                nested = s.reduce(op, [x], axis=axis)[0]
                assert type(got) is type(nested) and got.dtype == nested.dtype, (op, axis)
                np.testing.assert_array_equal(got, nested)
        if shape:
            for axis in (0, -1):
                got = s.run(lambda v: ctx().all_gather(v, axis), args=(x,))
                np.testing.assert_array_equal(got, np.concatenate(every, axis=axis))
                np.testing.assert_array_equal(s.gather(x, axis), got)
# Booleans: SUM and MEAN are errors on every path; MAX is any, MIN all.
flags = np.array([r == 0, True])
for call in (lambda: s.run(lambda: ctx().all_reduce("sum", flags)),
             lambda: s.reduce("mean", flags), lambda: s.reduce("sum", flags, axis=0)):
    try:
        call()
    except TypeError as e:
        assert "of booleans is not defined" in str(e), e
    else:
        raise AssertionError("no TypeError for booleans")
np.testing.assert_array_equal(s.run(lambda: ctx().all_reduce("max", flags)), [True, True])
np.testing.assert_array_equal(s.reduce("min", flags), [W == 1, True])
np.testing.assert_array_equal(s.gather(flags, 0), np.concatenate(
    [np.array([k == 0, True]) for k in ranks]))
# Rows that differ between workers along the gathered axis.
x = np.full((r + 1, 2), r, np.float32)
got = s.run(lambda v: ctx().all_gather(v, 0), args=(x,))
np.testing.assert_array_equal(got, np.concatenate([np.full((k + 1, 2), k, np.float32)
                                                   for k in ranks]))
# Bad input raises the same error on every rank, and the next collective still works.
for call, err, words in (
        (lambda: ctx().all_reduce("avg", np.ones(2)), ValueError, "unknown reduce op"),
        (lambda: ctx().all_gather(np.ones(2), 3), ValueError, "out of range"),
        (lambda: ctx().all_gather(np.ones(()), 0), ValueError, "scalar"),
        (lambda: ctx().all_reduce("sum", np.array([object()])), TypeError, "")):
    try:
        s.run(call)
    except err as e:
        assert words in str(e), e
    else:
        raise AssertionError(f"no {err.__name__}")
    assert float(s.run(lambda: ctx().all_reduce("sum", np.ones(1)))[0]) == W
# Outside run a replica context issues no collective.
c = s.run(ctx)
try:
    c.all_reduce("sum", np.ones(1))
except RuntimeError as e:
    assert "outside strategy.run" in str(e), e
else:
    raise AssertionError("a collective outside run did not raise")
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_one_array_collectives_in_run_match_the_structure_path(n):
    """A worker's only CPU replica reducing or gathering one NumPy array (the short
    path) gets the same values and dtypes as the same array inside a list, for every
    op spelling, and the same errors on every rank."""
    out = assert_mpi_ok(n, ONE_ARRAY_IN_RUN, timeout=150)
    assert out.count("OK rank") == n


# One worker's own replicas disagree (the partial last step of range(9).batch(4) on 2x2:
# worker 0 holds pieces [8] and [], worker 1 two empty ones) while the other workers'
# agree: they used to enter the collective alone and wait for GPUSTRAT_TIMEOUT.
LOCAL_DISAGREEMENT = r"""
import time
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
r = s.worker_index
ctx = gs.get_replica_context
last = list(s.experimental_distribute_dataset(Dataset.range(9).batch(4)))[-1]
x = s.run(lambda v: np.asarray(v, np.float64), args=(last,))
# Only global replica 1 (worker 0's second) has 2 columns.
pieces = s.run(lambda v: np.ones((len(v), 3 - (ctx().replica_id_in_sync_group == 1))),
               args=(last,))
# Only global replica 1 gives float32.
mixed = s.run(lambda: np.ones(2, np.float32 if ctx().replica_id_in_sync_group == 1
                              else np.float64))

def returns_early():
    if ctx().replica_id_in_sync_group == 1:  # its worker's other replica reduces
        return 0.0
    return ctx().all_reduce("sum", 1.0)
cases = [
    ("reduce", lambda: s.reduce("sum", x, axis=None), "pass axis=0"),
    ("dtypes", lambda: s.reduce("sum", mixed, axis=None), "different dtypes"),
    ("returned", lambda: s.run(returns_early), "returned from its function first"),
    ("all_reduce", lambda: s.run(lambda v: ctx().all_reduce("sum", v), args=(x,)),
     "replicas issued different collectives"),
    ("gather", lambda: s.gather(pieces, axis=0), "differ only along that axis"),
]
for name, call, words in cases:
    t0 = time.monotonic()
    try:
        call()
    except ValueError as e:
        took = time.monotonic() - t0
        assert words in str(e), (r, name, str(e))
        assert took < 10, (r, name, took)   # not the 30 s deadline
        print(f"ERROR rank {r} {name} {type(e).__name__}: {e}", flush=True)
    else:
        raise AssertionError(f"rank {r}: {name} raised nothing")
# The job goes on: the same step reduced along the batch axis.
assert float(s.reduce("sum", x, axis=0)) == 8.0
print(f"OK rank {r}", flush=True)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("n", [2, 3])
def test_replicas_disagreeing_on_one_worker_raise_on_every_worker_at_once(n):
    out = assert_mpi_ok(n, LOCAL_DISAGREEMENT, timeout=120, expect_lines=n,
                        env={"GPUSTRAT_TIMEOUT": "30"})
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 5 * n, out
    # The workers whose replicas agreed name the worker that found the error.
    others = [line for line in errors if not line.startswith("ERROR rank 0")]
    assert all("LayoutMismatch: worker 0 failed before this collective: ValueError:"
               in line for line in others), others



# strategy.cluster_resolver, as tf.distribute code reads it to pick worker 0's tasks;
# TensorFlow-only constructor arguments are refused with the reason, on every rank.
RESOLVER = r"""
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
res = s.cluster_resolver
assert (res.task_type, res.task_id) == ("worker", s.worker_index), res
assert res.cluster_spec().as_dict() == {"worker": ["mpi-rank-0", "mpi-rank-1", "mpi-rank-2"]}
for kwargs in ({"communication_options": object()}, {"cluster_resolver": res}):
    try:
        gs.MultiWorkerMirroredStrategy(devices=["cpu:0"], **kwargs)
        raise AssertionError(kwargs)
    except TypeError as e:
        assert "has no counterpart" in str(e), e
print(f"OK {s.worker_index}", flush=True)
"""


def test_cluster_resolver_names_the_worker_and_tf_arguments_are_refused():
    assert_mpi_ok(3, RESOLVER, timeout=60, expect_lines=3)


LOSS_FORMS = r"""
import numpy as np
import gpustrat as gs
from gpustrat.distribute.strategy import Strategy
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r, W = s.worker_index, s.num_workers
comm = s._communicator
taken = []
named = comm.reduce_named
comm.reduce_named = lambda *a, **k: (taken.append(1), named(*a, **k))[1]
values = {
    "run": s.run(lambda: np.ones(4, np.float32).mean() * (r + 1)),
    "np64": np.float64(r + 0.5), "i32": np.int32(r + 3), "f16": np.float16(r),
    "float": r + 1.5, "int": r + 2, "0d": np.full((), r, np.float32),
    "pr": s.experimental_distribute_values_from_function(lambda ctx: np.float32(r)),
    "pr_float": s.experimental_distribute_values_from_function(lambda ctx: r + 0.25),
    "pr_arr": s.experimental_distribute_values_from_function(
        lambda ctx: np.full(2, r, np.int64)),
    # The general path: booleans and complex numbers (named in its errors).
    "bool": True, "npbool": np.bool_(r == 0), "c64": np.complex64(1 + r * 1j),
}
assert type(values["run"]) is np.float32 and type(values["pr"]).__name__ == "PerReplica"
fast = {"run", "np64", "i32", "f16", "float", "int", "0d", "pr", "pr_float", "pr_arr"}


def outcome(fn):
    try:
        got = fn()
    except Exception as e:
        return ("error", type(e).__name__, str(e))
    return (type(got).__name__, str(got.dtype), got.shape, got.tolist())


for name, v in values.items():
    for op in ("sum", "mean", "max", "min"):
        del taken[:]
        mine = outcome(lambda: s.reduce(op, v, axis=None))
        assert bool(taken) == (name in fast and mine[0] != "error"), (name, op, taken)
        general = outcome(lambda: Strategy.reduce(s, op, v, axis=None))
        assert mine == general, (name, op, mine, general)
# A loss whose form differs between workers: the same error on every worker.
try:
    s.reduce("sum", np.float32(1) if r == 0 else 1.0, axis=None)
except ValueError as e:
    assert "rank 0: () float32; rank 1: () float64" in str(e), e
else:
    raise AssertionError("no error")
assert float(s.reduce("sum", 1.0, axis=None)) == W  # the job goes on
print("OK", r, flush=True)
"""


@pytest.mark.timeout(100)
def test_the_loss_in_every_form_takes_the_one_array_path_with_the_general_paths_result():
    assert_mpi_ok(2, LOSS_FORMS, timeout=90, expect_lines=2)
