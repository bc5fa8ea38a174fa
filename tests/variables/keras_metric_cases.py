"""The metric cases recorded from Keras 3 (``record_keras_metrics.py``) and checked
against gpustrat (``test_metrics_keras_recorded.py``): each case is a metric made with
the same arguments on both sides, updated with three seeded batches of 7, 5 and 9 rows
(with sample weights where the case says so), read after each update, then reset,
updated once more and read. Plain NumPy: imported by both sides.

Scores are distinct random floats (no ties for top-k or thresholds to break), labels
random; every input is float32 or an integer array, as a Keras loop gives them.
"""

from __future__ import annotations

import numpy as np

ROWS = (7, 5, 9, 6)         # three updates, then one after reset_state
CLASSES = 4

#: name -> (class name, keyword arguments, input kind, weighted). A ``fn`` argument
#: names a function of the library's ``metrics`` module.
CASES = {
    "accuracy": ("Accuracy", {}, "int_labels", False),
    "accuracy_weighted": ("Accuracy", {}, "int_labels", True),
    "binary_accuracy": ("BinaryAccuracy", {}, "binary", False),
    "binary_accuracy_threshold": ("BinaryAccuracy", {"threshold": 0.75}, "binary", True),
    "categorical_accuracy": ("CategoricalAccuracy", {}, "one_hot", True),
    "sparse_categorical_accuracy": ("SparseCategoricalAccuracy", {}, "sparse", True),
    "sparse_categorical_accuracy_column": ("SparseCategoricalAccuracy", {},
                                           "sparse_column", False),
    "top_k_categorical_accuracy": ("TopKCategoricalAccuracy", {"k": 2}, "one_hot", True),
    "sparse_top_k_categorical_accuracy": ("SparseTopKCategoricalAccuracy", {"k": 2},
                                          "sparse", True),
    "precision": ("Precision", {}, "binary", False),
    "precision_thresholds": ("Precision", {"thresholds": [0.25, 0.5, 0.75]}, "binary",
                             True),
    "precision_top_k": ("Precision", {"top_k": 2}, "multi_label", False),
    "precision_class_id": ("Precision", {"class_id": 1}, "multi_label", True),
    "recall": ("Recall", {}, "binary", True),
    "recall_thresholds": ("Recall", {"thresholds": [0.25, 0.5, 0.75]}, "binary", False),
    "recall_top_k_class_id": ("Recall", {"top_k": 2, "class_id": 2}, "multi_label", False),
    "auc_roc": ("AUC", {"num_thresholds": 50}, "binary", False),
    "auc_roc_weighted": ("AUC", {"num_thresholds": 50}, "binary", True),
    "auc_pr": ("AUC", {"num_thresholds": 50, "curve": "PR"}, "binary", True),
    "auc_roc_minoring": ("AUC", {"num_thresholds": 20, "summation_method": "minoring"},
                         "binary", False),
    "auc_pr_majoring": ("AUC", {"num_thresholds": 20, "curve": "PR",
                                "summation_method": "majoring"}, "binary", False),
    "auc_from_logits": ("AUC", {"num_thresholds": 50, "from_logits": True}, "logits",
                        False),
    "auc_multi_label": ("AUC", {"num_thresholds": 30, "multi_label": True,
                                "num_labels": CLASSES}, "multi_label", True),
    "auc_thresholds": ("AUC", {"thresholds": [0.2, 0.4, 0.6, 0.8]}, "binary", False),
    "mean": ("Mean", {}, "values", True),
    "mean_metric_wrapper": ("MeanMetricWrapper", {"fn": "binary_accuracy",
                                                  "threshold": 0.25}, "binary", True),
}


def batches(name: str):
    """The four ``(y_true, y_pred, sample_weight or None)`` of case ``name``."""
    _, _, kind, weighted = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    out = []
    for n in ROWS:
        scores = rng.permutation(n * CLASSES).reshape(n, CLASSES).astype(np.float32)
        scores = (scores + rng.uniform(0.1, 0.9, scores.shape)) / (n * CLASSES + 1)
        scores = scores.astype(np.float32)
        labels = rng.integers(0, CLASSES, n)
        if kind == "int_labels":
            y_true, y_pred = labels.astype(np.int32), rng.integers(0, CLASSES, n).astype(
                np.int32)
        elif kind in ("binary", "logits"):
            y_true = rng.integers(0, 2, (n, 1)).astype(np.float32)
            y_pred = scores[:, :1]
            if kind == "logits":
                y_pred = (y_pred * 8 - 4).astype(np.float32)
        elif kind == "one_hot":
            y_true, y_pred = np.eye(CLASSES, dtype=np.float32)[labels], scores
        elif kind == "sparse":
            y_true, y_pred = labels.astype(np.int32), scores
        elif kind == "sparse_column":
            y_true, y_pred = labels.reshape(n, 1).astype(np.int32), scores
        elif kind == "multi_label":
            y_true = rng.integers(0, 2, (n, CLASSES)).astype(np.float32)
            y_pred = scores
        else:   # values
            y_true, y_pred = scores[:, 0], None
        weight = rng.uniform(0.0, 2.0, n).astype(np.float32) if weighted else None
        out.append((y_true, y_pred, weight))
    return out


def make(metrics, cls: str, kwargs: dict):
    """Case ``(cls, kwargs)`` as a metric of ``metrics`` (``keras.metrics`` or
    ``gpustrat.metrics``); a ``fn`` argument names a function of that module."""
    kwargs = dict(kwargs)
    if "fn" in kwargs:
        kwargs["fn"] = getattr(metrics, kwargs["fn"])
    return getattr(metrics, cls)(**kwargs)


def update(m, y_true, y_pred, weight) -> None:
    if y_pred is None:      # Mean: the values, weighted
        m.update_state(y_true, sample_weight=weight)
    else:
        m.update_state(y_true, y_pred, sample_weight=weight)
