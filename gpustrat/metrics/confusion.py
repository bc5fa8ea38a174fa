"""Metrics of the confusion matrix at thresholds: :class:`Precision`, :class:`Recall`
and :class:`AUC` (Keras 3's, with its formulas, defaults and state variables).

A prediction is positive at threshold ``t`` when it is greater than ``t``; the counts
(true and false positives and negatives) are kept per threshold (and per label with
``AUC(multi_label=True)``), weighted by ``sample_weight``. Like every metric here they
are sync-on-read SUM variables: each replica counts its own examples and the result
sums the counts over every replica of every worker.
"""

from __future__ import annotations

import numpy as np

from gpustrat.devices import array_module
from gpustrat.distribute import context
from gpustrat.metrics.base import Metric, _same_rank

__all__ = ["Precision", "Recall", "AUC"]

#: What Keras's top_k filter gives the scores it drops.
NEG_INF = -1e10
#: Keras's backend epsilon (the AUC's outer thresholds sit this far outside [0, 1]).
EPSILON = 1e-7


def _thresholds(thresholds, default: float, who: str) -> list:
    if thresholds is None:
        return [default]
    values = list(thresholds) if isinstance(thresholds, (list, tuple, np.ndarray)) else \
        [thresholds]
    bad = [t for t in values if t is None or not 0 <= t <= 1]
    if bad:
        raise ValueError(f"{who}: threshold values must be in [0, 1]. Received: {values}")
    return [float(t) for t in values]


def _filter_top_k(xp, x, k: int):
    """Keras's ``_filter_top_k``: the ``k`` highest scores of each row kept, the others
    set to -1e10 (ties: the first ones kept)."""
    kw = {"kind": "stable"} if xp is np else {}
    rank = xp.argsort(xp.argsort(-x, axis=-1, **kw), axis=-1, **kw)
    mask = (rank < int(k)).astype(x.dtype)
    return x * mask + NEG_INF * (1 - mask)


def confusion_counts(y_true, y_pred, thresholds, dtype, sample_weight=None, top_k=None,
                     class_id=None, multi_label=False, label_weights=None) -> tuple:
    """``(tp, fp, tn, fn)`` of a batch at each threshold (arrays of shape ``(T,)``, or
    ``(T, labels)`` with ``multi_label``), as Keras's
    ``update_confusion_matrix_variables`` adds them."""
    xp = array_module(y_pred)
    y_true = xp.asarray(y_true).astype(dtype)
    y_pred = xp.asarray(y_pred).astype(dtype)
    y_pred, y_true = _same_rank(y_pred, y_true)
    if sample_weight is not None:
        w = xp.asarray(sample_weight).astype(dtype)[..., None]
        if w.ndim == y_true.ndim + 1 and w.shape[-1] == 1:
            w = w[..., 0]
    if top_k is not None:
        y_pred = _filter_top_k(xp, y_pred, top_k)
    if class_id is not None:
        if y_pred.ndim == 1:
            raise ValueError("When class_id is provided, y_pred must be a 2D array with "
                             "shape (num_samples, num_classes), found shape: "
                             f"{tuple(y_pred.shape)}")
        y_true = y_true[..., class_id, None]
        y_pred = y_pred[..., class_id, None]
        if sample_weight is not None and w.ndim == y_pred.ndim and w.shape[-1] != 1:
            w = w[..., class_id, None]
    try:
        weights = xp.ones(y_pred.shape, dtype) if sample_weight is None else \
            xp.broadcast_to(w, y_pred.shape).astype(dtype)
        if label_weights is not None:
            weights = weights * xp.broadcast_to(xp.asarray(label_weights, dtype)[None],
                                                y_pred.shape)
        labels = xp.broadcast_to(y_true != 0, y_pred.shape)
    except ValueError:
        raise ValueError(f"y_true of shape {tuple(y_true.shape)}, y_pred of shape "
                         f"{tuple(y_pred.shape)} and sample_weight of shape "
                         f"{None if sample_weight is None else np.shape(sample_weight)} "
                         "do not broadcast together") from None
    if _evenly_distributed(thresholds):
        # Keras counts evenly spread thresholds by buckets of the scores clipped to
        # [0, 1] (its AUC's outer thresholds sit epsilon outside).
        y_pred = xp.clip(y_pred, 0.0, 1.0)
    # The thresholds are host numbers: sorted here, the counts put back in their order
    # on the device only when they were not sorted.
    host_thr = np.asarray(thresholds, dtype)
    order = np.argsort(host_thr, kind="stable")
    sorted_thr = xp.asarray(host_thr[order])
    n_thr = int(host_thr.shape[0])
    if multi_label:
        if y_pred.ndim != 2:
            raise ValueError("`y_pred` must have rank 2 when `multi_label=True`. Found "
                             f"rank {y_pred.ndim}. Full shape received for `y_pred`: "
                             f"{tuple(y_pred.shape)}")
        n_labels = y_pred.shape[1]
        column = xp.broadcast_to(xp.arange(n_labels)[None], y_pred.shape).reshape(-1)
    else:
        n_labels = 1
        column = xp.zeros(y_pred.size, xp.int64)
    # Thresholds below each prediction (it is positive at those): a bucket per count.
    below = xp.searchsorted(sorted_thr, y_pred.reshape(-1), side="left")
    index = column * (n_thr + 1) + below
    size = n_labels * (n_thr + 1)
    positive = labels.astype(dtype)
    true_w = (weights * positive).reshape(-1)
    false_w = (weights * (1 - positive)).reshape(-1)
    true_b = xp.bincount(index, weights=true_w, minlength=size).reshape(n_labels, -1)
    false_b = xp.bincount(index, weights=false_w, minlength=size).reshape(n_labels, -1)
    # Positive at sorted threshold j: the buckets above j.
    tp = _above(xp, true_b)
    fp = _above(xp, false_b)
    if (order != np.arange(n_thr)).any():
        back = np.argsort(order)
        tp, fp = xp.take(tp, back, axis=1), xp.take(fp, back, axis=1)
    total_true = true_b.sum(axis=1, keepdims=True)
    total_false = false_b.sum(axis=1, keepdims=True)
    tn, fn = total_false - fp, total_true - tp
    out = tuple(x.T.astype(dtype) if multi_label else x[0].astype(dtype)
                for x in (tp, fp, tn, fn))
    return out


def _above(xp, buckets):
    """``out[:, j]``: the sum of ``buckets[:, j + 1:]`` (the weights of the scores above
    sorted threshold j), as total minus a running sum."""
    running = xp.cumsum(buckets, axis=1)
    return running[:, -1:] - running[:, :-1]


def _evenly_distributed(thresholds) -> bool:
    """Keras's ``is_evenly_distributed_thresholds`` (3 or more, i / (n - 1) each, or an
    AUC's: the same with epsilon outside the ends)."""
    t = np.asarray(thresholds, np.float64)
    n = len(t)
    if n < 3:
        return False
    even = np.arange(n, dtype=np.float32) / (n - 1)
    return bool(np.allclose(t, even, atol=EPSILON))


def _divide_no_nan(xp, a, b):
    zero = b == 0
    return xp.where(zero, 0, a / xp.where(zero, 1, b)).astype(a.dtype)


class _Thresholded(Metric):
    """Precision's and Recall's common part."""

    def __init__(self, thresholds=None, top_k=None, class_id=None, name=None, dtype=None):
        super().__init__(name=name, dtype=dtype)
        self.init_thresholds = thresholds
        self.top_k = top_k
        self.class_id = class_id
        self.thresholds = _thresholds(thresholds, 0.5 if top_k is None else NEG_INF,
                                      self.name)
        n = len(self.thresholds)
        self.true_positives = self.add_variable((n,), name="true_positives")
        self.other = self.add_variable((n,), name=self._other)

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        tp, fp, _, fn = confusion_counts(y_true, y_pred, self.thresholds, self.dtype,
                                         sample_weight, self.top_k, self.class_id)
        self._add(tp, fp if self._other == "false_positives" else fn)

    def _compute(self, tp, other):
        xp = array_module(tp)
        result = _divide_no_nan(xp, tp, tp + other)
        return result[0] if len(self.thresholds) == 1 else result

    def get_config(self) -> dict:
        return {**super().get_config(), "thresholds": self.init_thresholds,
                "top_k": self.top_k, "class_id": self.class_id}


class Precision(_Thresholded):
    """``true_positives / (true_positives + false_positives)`` at each threshold
    (``keras.metrics.Precision``; default threshold 0.5; with ``top_k``, only the ``k``
    highest scores of a row count as positive; ``class_id``: one class's column)."""

    _other = "false_positives"

    @property
    def false_positives(self):
        return self.other


class Recall(_Thresholded):
    """``true_positives / (true_positives + false_negatives)`` at each threshold
    (``keras.metrics.Recall``; arguments as :class:`Precision`)."""

    _other = "false_negatives"

    @property
    def false_negatives(self):
        return self.other


_CURVES = {"roc": "ROC", "pr": "PR", "prgain": "PRGAIN"}
_SUMMATIONS = {"interpolation": "interpolation", "majoring": "majoring",
               "minoring": "minoring"}


class AUC(Metric):
    """The area under the ROC or precision-recall curve (``keras.metrics.AUC``), by a
    Riemann sum over ``num_thresholds`` thresholds (0 - epsilon, ``(i + 1) /
    (num_thresholds - 1)`` for ``i < num_thresholds - 2``, 1 + epsilon, or the given
    ``thresholds`` between the outer two). ``curve``: "ROC", "PR" or "PRGAIN";
    ``summation_method``: "interpolation" (PR: Davis and Goadrich's interpolation),
    "minoring" or "majoring"; ``multi_label``: one curve per label (the column of
    ``y_pred``), averaged (weighted by ``label_weights``); ``from_logits``: apply a
    sigmoid to ``y_pred`` first."""

    def __init__(self, num_thresholds=200, curve="ROC", summation_method="interpolation",
                 name=None, dtype=None, thresholds=None, multi_label=False, num_labels=None,
                 label_weights=None, from_logits=False):
        curve_key = _CURVES.get(str(curve).lower())
        if curve_key is None:
            raise ValueError(f'Invalid AUC curve value: "{curve}". Expected values are '
                             '["PR", "ROC", "PRGAIN"]')
        summation = _SUMMATIONS.get(str(summation_method).lower())
        if summation is None:
            raise ValueError(f'Invalid AUC summation method value: "{summation_method}". '
                             'Expected values are ["interpolation", "majoring", '
                             '"minoring"]')
        self._init_from_thresholds = thresholds is not None
        if thresholds is not None:
            self.num_thresholds = len(thresholds) + 2
            inner = sorted(float(t) for t in thresholds)
        else:
            if num_thresholds <= 1:
                raise ValueError("Argument `num_thresholds` must be an integer > 1. "
                                 f"Received: num_thresholds={num_thresholds}")
            self.num_thresholds = int(num_thresholds)
            inner = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self._thresholds = np.array([0.0 - EPSILON] + inner + [1.0 + EPSILON])
        self.curve = curve_key
        self.summation_method = summation
        super().__init__(name=name, dtype=dtype)
        self.multi_label = bool(multi_label)
        self.num_labels = num_labels
        self.label_weights = None if label_weights is None else \
            np.asarray(label_weights, self.dtype)
        self._from_logits = bool(from_logits)
        self._built = False
        if self.multi_label:
            if num_labels:
                self._build(int(num_labels))
        else:
            if num_labels:
                raise ValueError("`num_labels` is needed only when `multi_label` is True.")
            self._build(None)

    @property
    def thresholds(self) -> list:
        return [float(t) for t in self._thresholds]

    def _build(self, labels) -> None:
        shape = (self.num_thresholds,) if labels is None else (self.num_thresholds, labels)
        self._num_labels = labels
        for name in ("true_positives", "false_positives", "true_negatives",
                     "false_negatives"):
            setattr(self, name, self.add_variable(shape, name=name))
        self._built = True

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        xp = array_module(y_pred)
        y_pred = xp.asarray(y_pred)
        if not self._built:
            if y_pred.ndim != 2:
                raise ValueError("`y_pred` must have rank 2 when `multi_label=True`. Found "
                                 f"rank {y_pred.ndim}. Full shape received for `y_pred`: "
                                 f"{tuple(y_pred.shape)}")
            labels = int(y_pred.shape[1])
            ctx = context.current()[1]
            if ctx is not None:
                # Inside run: every replica waits here while one builds the state, in
                # cross-replica context (as a variable made in the scope).
                ctx.merge_call(lambda strategy: None if self._built else
                               self._build(labels))
            else:
                self._build(labels)
        if self._from_logits:
            y_pred = 1 / (1 + xp.exp(-y_pred.astype(self.dtype)))
        tp, fp, tn, fn = confusion_counts(
            y_true, y_pred, self._thresholds, self.dtype, sample_weight,
            multi_label=self.multi_label,
            label_weights=None if self.multi_label else self.label_weights)
        self._add(tp, fp, tn, fn)

    def _prepare_checkpoint_restore(self, state: list):
        # A multi-label AUC not yet built takes its number of labels from the
        # checkpoint (each count saved as (num_thresholds, labels)).
        if not self._built and len(state) == 4 and np.ndim(state[0]) == 2 and \
                np.shape(state[0])[0] == self.num_thresholds:
            self._build(int(np.shape(state[0])[1]))
        return super()._prepare_checkpoint_restore(state)

    def _by_label(self, xp, terms):
        if not self.multi_label:
            return terms.sum()
        by_label = terms.sum(axis=0)
        if self.label_weights is None:
            return by_label.mean()
        weights = xp.asarray(self.label_weights)
        return _divide_no_nan(xp, (by_label * weights).sum(), weights.sum())

    def _compute(self, tp, fp, tn, fn):
        xp = array_module(tp)
        n = self.num_thresholds
        if self.curve == "PR" and self.summation_method == "interpolation":
            dtp = tp[:n - 1] - tp[1:]
            p = tp + fp
            dp = p[:n - 1] - p[1:]
            slope = _divide_no_nan(xp, dtp, xp.maximum(dp, 0))
            intercept = tp[1:] - slope * p[1:]
            ratio = xp.where((p[:n - 1] > 0) & (p[1:] > 0),
                             _divide_no_nan(xp, p[:n - 1], xp.maximum(p[1:], 0)),
                             xp.ones_like(p[1:]))
            terms = _divide_no_nan(xp, slope * (dtp + intercept * xp.log(ratio)),
                                   xp.maximum(tp[1:] + fn[1:], 0))
            return xp.asarray(self._by_label(xp, terms), self.dtype)
        recall = _divide_no_nan(xp, tp, tp + fn)
        if self.curve == "ROC":
            x, y = _divide_no_nan(xp, fp, fp + tn), recall
        elif self.curve == "PR":
            x, y = recall, _divide_no_nan(xp, tp, tp + fp)
        else:
            scale = _divide_no_nan(xp, tp + fn, tn + fp)
            gain_r = 1.0 - scale * _divide_no_nan(xp, fn, tp)
            gain_p = 1.0 - scale * _divide_no_nan(xp, fp, tp)
            x = xp.maximum(xp.where(tp == 0, 0.0, gain_r), 0.0).astype(self.dtype)
            y = xp.where(tp == 0, 1.0, gain_p).astype(self.dtype)
        if self.summation_method == "interpolation":
            heights = (y[:n - 1] + y[1:]) / 2.0
        elif self.summation_method == "minoring":
            heights = xp.minimum(y[:n - 1], y[1:])
        else:
            heights = xp.maximum(y[:n - 1], y[1:])
        return xp.asarray(self._by_label(xp, (x[:n - 1] - x[1:]) * heights), self.dtype)

    def get_config(self) -> dict:
        config = {**super().get_config(), "num_thresholds": self.num_thresholds,
                  "curve": self.curve, "summation_method": self.summation_method,
                  "multi_label": self.multi_label, "num_labels": self.num_labels,
                  "label_weights": None if self.label_weights is None else
                  self.label_weights.tolist(), "from_logits": self._from_logits}
        if self._init_from_thresholds:
            config["thresholds"] = self.thresholds[1:-1]
        return config
