"""Keras 3 training state across 2 MPI workers (launched with mpiexec under a timeout):
the metrics of Keras's loops (a custom metric too) and the optimizer features give what
one process gives on the whole global batch."""

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


class TruePositives(M.Metric):      # the custom metric of Keras's Metric documentation
    def __init__(self, name="true_positives"):
        super().__init__(name=name)
        self.tp = self.add_variable(shape=(), initializer="zeros", name="tp")

    def update_state(self, y_true, y_pred, sample_weight=None):
        values = (np.asarray(y_true) > 0.5) & (np.asarray(y_pred) > 0.5)
        values = values.astype(self.dtype) * np.asarray(sample_weight, self.dtype)[:, None]
        self.tp.assign_add(values.sum(dtype=self.dtype))

    def result(self):
        return self.tp.value()


makers = {{
    "categorical": lambda: M.CategoricalAccuracy(),
    "top2_categorical": lambda: M.TopKCategoricalAccuracy(k=2),
    "mse_wrapper": lambda: M.MeanMetricWrapper(lambda t, p: ((t - p) ** 2).mean(axis=-1),
                                               name="mse"),
    "custom": lambda: TruePositives(),
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
    ms["categorical"].update_state(t, p)
    ms["top2_categorical"].update_state(t, p, sample_weight=w)
    ms["mse_wrapper"].update_state(t, p, sample_weight=w)
    ms["custom"].update_state(t, p, sample_weight=w)


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


OPTIMIZERS = r"""
import numpy as np
import gpustrat as gs
O = gs.optimizers
s = gs.MultiWorkerMirroredStrategy(devices={local})
n = s.num_replicas_in_sync
PROGRAMS = {{
    "loss_scaled": lambda: O.LossScaleOptimizer(O.Adam(0.05), initial_scale=16.0,
                                               dynamic_growth_steps=2),
    "accumulated": lambda: O.SGD(0.1, momentum=0.9, gradient_accumulation_steps=3,
                                 use_ema=True, ema_momentum=0.5),
    "scheduled": lambda: O.Adam(O.schedules.CosineDecay(0.1, 4, warmup_target=0.2,
                                                        warmup_steps=2)),
    "lion": lambda: O.Lion(0.01),
    "ftrl": lambda: O.Ftrl(0.1, l1_regularization_strength=0.01),
    "lamb": lambda: O.Lamb(0.01),
    "adafactor": lambda: O.Adafactor(0.1, use_ema=True),
}}
rng = np.random.default_rng(0)
G = rng.standard_normal((7, 3)).astype(np.float32)
for name, make in PROGRAMS.items():
    with s.scope():
        w = gs.Variable(np.ones(3, np.float32), name="w")
        opt = make()
    ref_w = gs.Variable(np.ones(3, np.float32), name="w")
    ref = make()
    for k in range(7):
        bad = name == "loss_scaled" and k == 3
        scale = float(opt.scale_loss(1.0)) if hasattr(opt, "scale_loss") else 1.0

        def step():
            r = gs.get_replica_context().replica_id_in_sync_group     # global
            g = G[k] * scale / n
            if bad and r == n - 1:
                g = g * np.float32(np.nan)        # one replica of one worker overflows
            opt.apply_gradients([(g.astype(np.float32), w)])
        s.run(step)
        if not bad:
            ref.apply_gradients([(G[k] * scale, ref_w)])
        elif hasattr(ref, "scale_loss"):
            ref.apply_gradients([(G[k] * np.float32(np.nan), ref_w)])
    for c in s.experimental_local_results(w):
        np.testing.assert_allclose(c.numpy(), ref_w.numpy(), rtol=1e-5, err_msg=name)
    assert int(np.asarray(opt.iterations.numpy() if hasattr(opt.iterations, "numpy")
                          else opt.iterations)) == int(np.asarray(
        ref.iterations.numpy() if hasattr(ref.iterations, "numpy") else ref.iterations)), name
print(f"OK rank {{s.worker_index}}", flush=True)
s.close()
"""


@pytest.mark.parametrize("local", [["cpu:0"], ["cpu:0", "cpu:1"]])
def test_loss_scaling_accumulation_and_schedules_across_workers(local):
    # Lion, Ftrl, Lamb and Adafactor too. The skip decision (a NaN on the last replica of the last worker) is the same on
    # every worker, and every worker's weights are one process's on the global batch.
    assert_mpi_ok(2, OPTIMIZERS.format(local=local), timeout=180, expect_lines=2)
