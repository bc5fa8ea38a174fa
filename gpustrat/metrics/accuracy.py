"""Accuracy metrics, with Keras 3's functions and shape rules
(``keras.metrics.accuracy`` and friends): each function gives one value per example (1.0
for a hit), and the class is a :class:`~gpustrat.metrics.MeanMetricWrapper` of it.

Shape rules (Keras's): ``accuracy`` and ``binary_accuracy`` drop or add a trailing axis
of size 1 where the ranks of ``y_true`` and ``y_pred`` differ by one, then compare
element-wise with broadcasting; ``sparse_categorical_accuracy`` drops a trailing axis
of size 1 from labels of the scores' rank and compares them with the arg-max of the
scores, broadcasting (labels ``(2, 1)`` against scores ``(1, 2, 3)`` compare as
``(2, 1)`` with ``(1, 2)``); the top-k functions flatten the leading axes of the
scores to one.
"""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.metrics.base import _same_rank
from gpustrat.metrics.reduction import MeanMetricWrapper

__all__ = ["accuracy", "binary_accuracy", "categorical_accuracy",
           "sparse_categorical_accuracy", "top_k_categorical_accuracy",
           "sparse_top_k_categorical_accuracy", "Accuracy", "BinaryAccuracy",
           "CategoricalAccuracy", "SparseCategoricalAccuracy", "TopKCategoricalAccuracy",
           "SparseTopKCategoricalAccuracy"]


def _arrays(y_true, y_pred):
    xp = array_module(y_pred)
    return xp, xp.asarray(y_true), xp.asarray(y_pred)


def _equal(xp, a, b, what: str, y_true, y_pred):
    try:
        return (a == b).astype(xp.float32)
    except ValueError:
        raise ValueError(f"{what}: y_true of shape {tuple(y_true.shape)} does not match "
                         f"y_pred of shape {tuple(y_pred.shape)} (after Keras's shape "
                         "rules they do not broadcast)") from None


def _class_axis(y_pred, what: str) -> None:
    if y_pred.ndim < 1 or y_pred.shape[-1] == 0:
        raise ValueError(f"{what}: y_pred must hold class scores along its last axis, "
                         f"got shape {tuple(y_pred.shape)}")


def accuracy(y_true, y_pred):
    """1.0 where ``y_true == y_pred`` (element-wise)."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    t, p = _same_rank(y_true, y_pred)
    return _equal(xp, t.astype(y_pred.dtype), p, "accuracy", y_true, y_pred)


def binary_accuracy(y_true, y_pred, threshold=0.5):
    """1.0 where ``y_true`` equals ``y_pred > threshold``."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    t, p = _same_rank(y_true, y_pred)
    return _equal(xp, t, (p > threshold).astype(t.dtype), "binary_accuracy",
                  y_true, y_pred)


def categorical_accuracy(y_true, y_pred):
    """1.0 where the arg-max of the one-hot ``y_true`` is the arg-max of ``y_pred``."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    _class_axis(y_true, "categorical_accuracy")
    labels = y_true.argmax(axis=-1).astype(y_pred.dtype)
    _class_axis(y_pred, "categorical_accuracy")
    shape = labels.shape
    reshaped = False
    if labels.ndim == y_pred.ndim:
        labels = labels[..., 0]       # Keras squeezes the last axis (it must be 1)
        reshaped = True
    hits = _equal(xp, labels, y_pred.argmax(axis=-1).astype(labels.dtype),
                  "categorical_accuracy", y_true, y_pred)
    return hits.reshape(shape) if reshaped else hits


def sparse_categorical_accuracy(y_true, y_pred):
    """1.0 where the integer label ``y_true`` is the arg-max of the scores ``y_pred``."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    what = "sparse_categorical_accuracy"
    _class_axis(y_pred, what)
    labels = y_true.astype(y_pred.dtype)
    shape = labels.shape
    reshaped = False
    if labels.ndim == y_pred.ndim and labels.shape[-1:] == (1,):
        labels = labels[..., 0]
        reshaped = True
    hits = _equal(xp, labels, y_pred.argmax(axis=-1).astype(labels.dtype), what,
                  y_true, y_pred)
    if reshaped:
        hits = hits.reshape(shape)
    if hits.ndim > 1 and hits.shape[-1] == 1:
        hits = hits[..., 0]
    return hits


def _in_top_k(xp, labels, scores, k: int):
    """Whether each row's label scores among its ``k`` highest (a tie at the k-th
    score counts, as ``in_top_k``)."""
    n = scores.shape[-1]
    kth = xp.sort(scores, axis=-1)[:, max(n - int(k), 0)]
    # The label's score, by a one-hot mask (no gather of pairs of indices).
    mask = xp.arange(n).reshape(1, n) == labels.reshape(-1, 1)
    own = xp.where(mask, scores, 0).sum(axis=1)
    return own >= kth


def _top_k(xp, labels, y_pred, k, what: str, y_true, sorted_ids=False):
    _class_axis(y_pred, what)
    shape = labels.shape
    if y_pred.ndim > 2:
        y_pred = y_pred.reshape(-1, y_pred.shape[-1])
    flat = labels.reshape(-1) if labels.ndim > 1 else labels
    if flat.shape[0] != y_pred.shape[0]:
        raise ValueError(f"{what}: y_true of shape {tuple(y_true.shape)} does not match "
                         f"y_pred of shape {tuple(y_pred.shape)} (one label per row of "
                         "scores)")
    if sorted_ids:
        hits = (flat[:, None] == y_pred[:, :int(k)]).any(axis=1)
    else:
        hits = _in_top_k(xp, flat.astype(xp.int64), y_pred, k)
    hits = hits.astype(xp.float32)
    return hits.reshape(shape) if labels.ndim > 1 else hits


def top_k_categorical_accuracy(y_true, y_pred, k=5):
    """1.0 where the arg-max of the one-hot ``y_true`` is among the ``k`` highest
    scores of ``y_pred``."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    _class_axis(y_true, "top_k_categorical_accuracy")
    return _top_k(xp, y_true.argmax(axis=-1), y_pred, k, "top_k_categorical_accuracy",
                  y_true)


def sparse_top_k_categorical_accuracy(y_true, y_pred, k=5, from_sorted_ids=False):
    """1.0 where the integer label ``y_true`` is among the ``k`` highest scores of
    ``y_pred`` (``from_sorted_ids``: ``y_pred`` holds class ids, best first)."""
    xp, y_true, y_pred = _arrays(y_true, y_pred)
    labels = y_true.astype(y_pred.dtype if from_sorted_ids else xp.int32)
    return _top_k(xp, labels, y_pred, k, "sparse_top_k_categorical_accuracy", y_true,
                  sorted_ids=from_sorted_ids)


class Accuracy(MeanMetricWrapper):
    """How often ``y_pred`` equals ``y_true`` (element-wise, weighted)."""

    def __init__(self, name: str = "accuracy", dtype=None):
        super().__init__(accuracy, name=name, dtype=dtype)

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype)}


class BinaryAccuracy(MeanMetricWrapper):
    """How often ``y_pred > threshold`` equals the binary label ``y_true``."""

    def __init__(self, name: str = "binary_accuracy", dtype=None, threshold=0.5):
        super().__init__(binary_accuracy, name=name, dtype=dtype, threshold=threshold)
        self.threshold = threshold

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype), "threshold": self.threshold}


class CategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot ``y_true``'s class is the arg-max of ``y_pred``."""

    def __init__(self, name: str = "categorical_accuracy", dtype=None):
        super().__init__(categorical_accuracy, name=name, dtype=dtype)

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype)}


class SparseCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label ``y_true`` is the arg-max of the scores ``y_pred``
    (``y_true``: shape ``(n,)`` or ``(n, 1)``; ``y_pred``: ``(n, classes)``; other
    shapes by Keras's rules, see the module docstring)."""

    def __init__(self, name: str = "sparse_categorical_accuracy", dtype=None):
        super().__init__(sparse_categorical_accuracy, name=name, dtype=dtype)

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype)}


class TopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the one-hot ``y_true``'s class is among the ``k`` highest scores."""

    def __init__(self, k: int = 5, name: str = "top_k_categorical_accuracy", dtype=None):
        super().__init__(top_k_categorical_accuracy, name=name, dtype=dtype, k=k)
        self.k = k

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype), "k": self.k}


class SparseTopKCategoricalAccuracy(MeanMetricWrapper):
    """How often the integer label ``y_true`` is among the ``k`` highest scores."""

    def __init__(self, k: int = 5, name: str = "sparse_top_k_categorical_accuracy",
                 dtype=None, from_sorted_ids: bool = False):
        super().__init__(sparse_top_k_categorical_accuracy, name=name, dtype=dtype, k=k,
                         from_sorted_ids=from_sorted_ids)
        self.k = k
        self.from_sorted_ids = from_sorted_ids

    def get_config(self) -> dict:
        config = {"name": self.name, "dtype": str(self.dtype), "k": self.k}
        if self.from_sorted_ids:
            config["from_sorted_ids"] = True
        return config
