"""The accuracy and confusion metrics on GPU replicas, under the stream-ordering
sanitizer (:func:`gpustrat.testing.sanitize`): every update runs on the replica's
device, ordered, and the results are what two CPU replicas give."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing

M = gs.metrics
MAKERS = {
    "auc": lambda: M.AUC(num_thresholds=11),
    "pr_auc_multi_label": lambda: M.AUC(num_thresholds=7, curve="PR", multi_label=True),
    "precision_unsorted_thresholds": lambda: M.Precision(thresholds=[0.6, 0.3]),
    "recall_top_k_class": lambda: M.Recall(class_id=1, top_k=2),
    "sparse_top_2": lambda: M.SparseTopKCategoricalAccuracy(k=2),
    "top_2": lambda: M.TopKCategoricalAccuracy(k=2),
    "categorical": M.CategoricalAccuracy,
    "binary": M.BinaryAccuracy,
    "sparse_categorical": M.SparseCategoricalAccuracy,
}


def _run(names, gpu, seed):
    rng = np.random.default_rng(seed)
    scores = rng.random((2, 6, 3)).astype(np.float32)
    onehot = (rng.random((2, 6, 3)) > 0.5).astype(np.float32)
    labels = rng.integers(0, 3, (2, 6))
    weights = rng.random((2, 6)).astype(np.float32)
    xp = devices.cupy() if gpu else np
    s = gs.MirroredStrategy(names)
    try:
        with s.scope():
            ms = {k: make() for k, make in MAKERS.items()}

        def step():
            r = gs.get_replica_context().replica_id_in_sync_group
            p, t = xp.asarray(scores[r]), xp.asarray(onehot[r])
            y, w = xp.asarray(labels[r]), xp.asarray(weights[r])
            ms["auc"].update_state(t[:, 0], p[:, 0], sample_weight=w)
            ms["pr_auc_multi_label"].update_state(t, p)
            ms["precision_unsorted_thresholds"].update_state(t, p, sample_weight=w)
            ms["recall_top_k_class"].update_state(t, p)
            ms["sparse_top_2"].update_state(y, p)
            ms["top_2"].update_state(t, p)
            ms["categorical"].update_state(t, p)
            ms["binary"].update_state(t, p)
            ms["sparse_categorical"].update_state(y, p)
        s.run(step)
        return {k: devices.to_host(m.result()) for k, m in ms.items()}
    finally:
        s.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_metrics_on_sanitized_gpus_as_on_cpus(seed):
    want = _run(["cpu:0", "cpu:1"], False, seed)
    with testing.sanitize(seed=seed, check=False) as san:
        got = _run(["gpu:0", "gpu:1"], True, seed)
        san.drain()
    assert not san.reports, [str(r) for r in san.reports[:3]]
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, atol=1e-7, err_msg=k)
