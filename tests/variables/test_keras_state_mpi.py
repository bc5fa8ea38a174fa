"""Keras 3 training state across 2 MPI workers (launched with mpiexec under a timeout):
the metrics of Keras's loops and the optimizer features give what one process gives on
the whole global batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

pytestmark = pytest.mark.mpi

METRICS = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices={local})
M = gs.metrics
makers = {{
    "auc": lambda: M.AUC(num_thresholds=11),
    "pr_auc": lambda: M.AUC(num_thresholds=7, curve="PR", multi_label=True),
    "precision": lambda: M.Precision(thresholds=[0.3, 0.6]),
    "recall": lambda: M.Recall(class_id=1),
    "top2": lambda: M.SparseTopKCategoricalAccuracy(k=2),
    "binary": lambda: M.BinaryAccuracy(threshold=0.4),
}}
with s.scope():
    dist = {{k: make() for k, make in makers.items()}}
plain = {{k: make() for k, make in makers.items()}}
rng = np.random.default_rng(0)
scores = rng.random((13, 3)).astype(np.float32)          # 13 rows: the last batch partial
onehot = (rng.random((13, 3)) > 0.5).astype(np.float32)
labels = rng.integers(0, 3, 13)
weights = rng.random(13).astype(np.float32)


def update(ms, p, t, y, w):
    ms["auc"].update_state(t[:, 0], p[:, 0], sample_weight=w)
    ms["pr_auc"].update_state(t, p)
    ms["precision"].update_state(t, p, sample_weight=w)
    ms["recall"].update_state(t, p)
    ms["top2"].update_state(y, p)
    ms["binary"].update_state(t, p)


ds = Dataset.from_tensor_slices((scores, onehot, labels, weights)).batch(4)
for p, t, y, w in s.experimental_distribute_dataset(ds):
    s.run(lambda p, t, y, w: update(dist, p, t, y, w), args=(p, t, y, w))
update(plain, scores, onehot, labels, weights)
with s.scope():
    for k in makers:
        got, want = dist[k].result(), plain[k].result()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=k)
print(f"OK rank {{s.worker_index}}", flush=True)
s.close()
"""


@pytest.mark.parametrize("local", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_confusion_and_top_k_metrics_aggregate_over_every_worker(local):
    assert_mpi_ok(2, METRICS.format(local=local), timeout=180, expect_lines=2)
