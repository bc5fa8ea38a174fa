"""Variables across MPI workers (2 workers x 1 and x 2 replicas), launched with mpiexec
under a timeout: TensorFlow 2.21's recorded values (2 and 4 replicas in sync), initial
values from worker 0, and disagreements raised on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

PARITY = r"""
import sys
sys.path.insert(0, {here!r})
import gpustrat as gs
from tf_recorded_variables import TF_2_REPLICAS, TF_4_REPLICAS
from variable_cases import compare_all
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{{i}}" for i in range({local})])
assert s.num_replicas_in_sync == {ranks} * {local}
table = {{2: TF_2_REPLICAS, 4: TF_4_REPLICAS}}[s.num_replicas_in_sync]
bad = compare_all(s, table)
assert bad == [], bad
print(f"OK rank {{s.worker_index}}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 1), (2, 2), (4, 1)])
def test_every_update_matches_tensorflow_across_workers(ranks, local):
    # 2 x 1 against TensorFlow's 2 replicas; 2 x 2 and 4 x 1 against its 4.
    assert_mpi_ok(ranks, PARITY.format(here=str(HERE), local=local, ranks=ranks),
                  timeout=300, expect_lines=ranks)


DISAGREE = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
rank = s.worker_index
rng = np.random.default_rng(rank)                      # a different seed on each rank
with s.scope():
    w = gs.Variable(rng.standard_normal(3), aggregation="sum", name="w")
    b = gs.Variable(np.zeros(2), aggregation="sum", name="b")
first = [np.asarray(c) for c in s.experimental_local_results(w)]
want = np.random.default_rng(0).standard_normal(3)     # worker 0's
assert all(np.array_equal(c, want) for c in first), first

def expect(fn, pattern):
    try:
        fn()
    except (ValueError, gs.errors.CollectiveMismatch) as e:
        import re
        assert re.search(pattern, str(e), re.S), str(e)
    else:
        raise AssertionError("no error for " + pattern)

# Worker 1 updates another variable than worker 0: different collectives, each named.
expect(lambda: s.run(lambda: (w if rank == 0 else b).assign_add(np.ones((3,) if rank == 0 else (2,)))),
       "rank 0 called assign_add of variable 'w'.*rank 1 called assign_add of variable 'b'")
# Worker 1 gives a value of the wrong shape: every worker raises.
expect(lambda: s.run(lambda: w.assign_add(np.ones(3 if rank == 0 else 4))),
       "every worker must make the same variable updates")
# Cross-replica writes of different values on different workers.
def cross():
    with s.scope():
        w.assign(np.full(3, float(rank)))
# Each worker's agreement is named as it is, not as a shape and dtype.
expect(cross, r"assign of variable 'w' in cross-replica context: the workers disagree: "
              r"rank 0: \(w#\d+\.assign, value checksum \d+, float\d+, 3\); rank 1: "
              r"\(w#\d+\.assign, value checksum \d+, float\d+, 3\)\. every worker must "
              r"write the same value")
# Nothing was written, and the strategy still works.
assert all(np.array_equal(np.asarray(c), want) for c in s.experimental_local_results(w))
s.run(lambda: w.assign_add(np.ones(3)))
got = [np.asarray(c) for c in s.experimental_local_results(w)]
assert all(np.allclose(c, want + 4) for c in got), got
print(f"OK rank {rank}", flush=True)
s.close()
"""


def test_disagreements_raise_on_every_rank_and_leave_variables_equal():
    assert_mpi_ok(2, DISAGREE, timeout=120, expect_lines=2)


METRICS = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
with s.scope():
    mean, acc = gs.metrics.Mean(), gs.metrics.SparseCategoricalAccuracy()
data = np.arange(11.0, dtype=np.float32)          # 11 rows: the last batch is partial
labels = (np.arange(11) % 3).astype(np.int64)
scores = np.eye(3, dtype=np.float32)[np.arange(11) % 2 * 2]   # predicts 0, 2, 0, 2, ...
ds = Dataset.from_tensor_slices((data, labels, scores)).batch(4)
for x, y, p in s.experimental_distribute_dataset(ds):
    s.run(lambda x, y, p: (mean.update_state(x), acc.update_state(y, p)), args=(x, y, p))
with s.scope():
    got = float(mean.result()), float(acc.result())
want_acc = float(np.mean(labels == np.arange(11) % 2 * 2))
assert got == (5.0, np.float32(want_acc)), got
print(f"OK rank {s.worker_index}", flush=True)
s.close()
"""


def test_metrics_aggregate_over_every_worker():
    assert_mpi_ok(2, METRICS, timeout=120, expect_lines=2)


SCALARS = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])
with s.scope():
    a = gs.Variable(3, name="a")                                   # int32, mirrored
    b = gs.Variable(1.5, aggregation="only_first_replica", name="b")
    c = gs.Variable(np.float64(2.0), synchronization="on_read",
                    aggregation="only_first_replica", name="c")
for v in (a, b, c):
    assert all(type(x._array) is np.ndarray and x.shape == () for x in v.values), v
with s.scope():
    a.assign(4)
    a.assign_add(np.int32(1))
def step():
    r = gs.get_replica_context().replica_id_in_sync_group
    b.assign_add(np.float32(r + 1))      # global replica 0's value, everywhere
    c.assign(np.float64(10 * r))         # each replica's own
s.run(step)
with s.scope():
    got = [a.numpy(), b.numpy(), c.read_value()]
assert [x.tolist() for x in got] == [5, 2.5, 0.0], got
assert [type(x) for x in got] == [np.ndarray] * 3 and got[0].dtype == np.int32, got
print(f"OK rank {s.worker_index}", flush=True)
s.close()
"""


def test_scalar_variables_across_workers():
    # Worker 0's scalar initial value used to arrive as a NumPy scalar, which the first
    # assign could not write into.
    assert_mpi_ok(2, SCALARS, timeout=120, expect_lines=2)


CROSS_METRICS = r"""
import numpy as np
import gpustrat as gs
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{{i}}" for i in range({local})])
rank = s.worker_index
with s.scope():
    total, mean = gs.metrics.Sum(), gs.metrics.Mean()
def step():
    r = np.float32(gs.get_replica_context().replica_id_in_sync_group)
    total.update_state(np.array([r + 1]))
    mean.update_state(np.array([r]))
s.run(step)                                   # 4 replicas: sum 10; mean 6 / 4
with s.scope():
    total.update_state(np.array([1.0, 2.0]))  # every worker runs it: counted once
    mean.update_state(np.array([10.0]))
    got = [float(total.result()), float(mean.result())]
    assert got == [13.0, np.float32(3.2)], got
    # Workers with different values: the total grows by their mean, as Keras's.
    total.update_state(np.array([2.0 + 2 * rank]))
    got = float(total.result())
assert got == 13.0 + np.mean([2.0 + 2 * w for w in range(s.num_workers)]), got
print(f"OK rank {{rank}}", flush=True)
s.close()
"""


@pytest.mark.parametrize("ranks, local", [(2, 2), (4, 1)])
def test_cross_replica_metric_updates_count_once_across_workers(ranks, local):
    # As in one process with 4 replicas (tests/variables/test_metrics.py); each worker
    # used to add the whole value, counting it once per worker.
    assert_mpi_ok(ranks, CROSS_METRICS.format(local=local), timeout=120,
                  expect_lines=ranks)
