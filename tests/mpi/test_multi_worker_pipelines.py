"""The newer tf.data transformations across workers (``mpiexec -n 2``): file caches
and windows refused on every rank, memory caches and sampling under FILE sharding,
padded batches and rebatching under DATA. Each child checks exact values."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

SCRIPT = r"""
import os, tempfile
import numpy as np
import gpustrat as gs
from gpustrat.data import AutoShardPolicy, Dataset, Options, TextLineDataset, TensorSpec

def with_policy(ds, policy):
    o = Options()
    o.experimental_distribute.auto_shard_policy = policy
    return ds.with_options(o)

def values(strategy, dist):
    return [[int(v) for p in strategy.experimental_local_results(x)
             for v in np.asarray(p).reshape(-1)] for x in dist]

s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
r = s.worker_index
tmp = tempfile.mkdtemp(prefix=f"gs-pipe-{r}-")
paths = []
for i in range(4):
    p = os.path.join(tmp, f"part-{i}.txt")
    with open(p, "w") as f:
        f.write("".join(f"{10 * i + j}\n" for j in range(3)))
    paths.append(p)
lines = lambda files: TextLineDataset(files).map(lambda l: np.int64(int(l)))

# A file cache over files that FILE sharding splits: the same error on every rank.
try:
    s.experimental_distribute_dataset(lines(paths).cache(os.path.join(tmp, "c")).batch(2))
except ValueError as e:
    assert "FILE auto-shard policy" in str(e) and "cache()" in str(e), str(e)
else:
    raise AssertionError("a file cache under FILE sharding must raise")

# A source read from no file beside files: FILE refuses it on every rank (every worker
# would read it whole); AUTO picks DATA, as TensorFlow does.
mixed = Dataset.zip((lines(paths), Dataset.range(100, 112))).batch(4)
try:
    s.experimental_distribute_dataset(with_policy(mixed, AutoShardPolicy.FILE))
except ValueError as e:
    assert "RangeDataset" in str(e) and "AutoShardPolicy.DATA" in str(e), str(e)
else:
    raise AssertionError("FILE with a source that reads no file must raise")
dist = s.experimental_distribute_dataset(mixed)
assert dist.auto_shard_policy == AutoShardPolicy.DATA
got = [[(int(a), int(b)) for a, b in zip(np.asarray(x[0]), np.asarray(x[1]))] for x in dist]
lo = [0, 1] if r == 0 else [2, 3]
assert got == [[(v, 100 + i) for i, v in enumerate([0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32])
                if i % 4 in lo][k * 2:k * 2 + 2] for k in range(3)], got

# Windows cannot be distributed: the same error on every rank.
try:
    s.experimental_distribute_dataset(Dataset.range(8).window(2))
except ValueError as e:
    assert "window()" in str(e), str(e)
else:
    raise AssertionError("window elements must raise")

# A memory cache under FILE: each worker caches only its own files, epoch after epoch.
dist = s.experimental_distribute_dataset(lines(paths).cache().batch(3))
mine = [10 * i + j for i in (r, r + 2) for j in range(3)]
assert [v for step in values(s, dist) for v in step] == mine
assert [v for step in values(s, dist) for v in step] == mine

# Sampling two file pipelines under FILE: each worker samples from its files only.
sampled = Dataset.sample_from_datasets([lines(paths[:2]), lines(paths[2:])], seed=3)
got = sorted(v for step in values(s, s.experimental_distribute_dataset(sampled.batch(2)))
             for v in step)
assert got == sorted(10 * i + j for i in (r, r + 2) for j in range(3)), got

# padded_batch and rebatch under DATA: worker r gets piece r of every global batch.
ragged = Dataset.from_generator(lambda: (np.arange(1, n + 1) for n in [1, 3, 2, 1, 2, 2]),
                                output_signature=TensorSpec((None,), np.int64))
pb = with_policy(ragged.padded_batch(2), AutoShardPolicy.DATA)
got = [np.asarray(x).tolist() for x in s.experimental_distribute_dataset(pb)]
assert got == ([[[1, 0, 0]], [[1, 2]], [[1, 2]]] if r == 0 else
               [[[1, 2, 3]], [[1, 0]], [[1, 2]]]), got
rb = with_policy(Dataset.range(10).batch(3).rebatch(4), AutoShardPolicy.DATA)
got = values(s, s.experimental_distribute_dataset(rb))
assert got == ([[0, 1], [4, 5], [8]] if r == 0 else [[2, 3], [6, 7], [9]]), got
print("OK", r, flush=True)
"""


def test_new_transformations_across_two_workers():
    assert_mpi_ok(2, SCRIPT, timeout=120, expect_lines=2)
