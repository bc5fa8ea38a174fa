"""Metrics that reduce values: :class:`Sum`, :class:`Mean` and
:class:`MeanMetricWrapper` (the mean of a function of ``y_true`` and ``y_pred``)."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.metrics.base import Metric, _on_host_dtype, _samplewise


class Sum(Metric):
    """The (weighted) sum of the values seen.

    With ``sample_weight``, each value is multiplied by its weight first; weights
    broadcast from the first axes of the values (one weight per example), and a
    trailing axis of size 1 on either side is dropped or added to make the ranks
    match, as Keras does.
    """

    def __init__(self, name: str = "sum", dtype=None):
        super().__init__(name, dtype)
        self.total = self.add_variable("total")

    def update_state(self, values, sample_weight=None) -> None:
        total, _ = _samplewise(values, sample_weight, self.dtype, "sum")
        self._add(total)

    def _compute(self, total):
        return _on_host_dtype(total, self.dtype)


class Mean(Metric):
    """The (weighted) mean of the examples seen (0 before any), as Keras 3's.

    Each example (a row of the values: ``values[i]``) counts once, with its weight:
    the result is ``sum(w[i] * mean(values[i])) / sum(w[i])`` over every example of
    every update (a 0-d value is one example). Weights follow :class:`Sum`'s rules;
    weights with an axis per value axis are averaged per example.
    """

    def __init__(self, name: str = "mean", dtype=None):
        super().__init__(name, dtype)
        self.total = self.add_variable("total")
        self.count = self.add_variable("count")

    def update_state(self, values, sample_weight=None) -> None:
        self._add(*_samplewise(values, sample_weight, self.dtype, "mean"))

    def _compute(self, total, count):
        # total / count, and 0 where count is 0, computed on the state's device: no host
        # read of the count (a GPU result stays on the GPU until the caller reads it).
        xp = array_module(total)
        total, count = xp.asarray(total, self.dtype), xp.asarray(count, self.dtype)
        empty = (count == 0).astype(self.dtype)
        return xp.asarray(total / (count + empty) * (1 - empty), self.dtype)




class MeanMetricWrapper(Mean):
    """The (weighted) mean of ``fn(y_true, y_pred, **kwargs)`` over every example seen
    (``keras.metrics.MeanMetricWrapper``): ``fn`` gives one value per example (or per
    element: then each example counts the mean of its values), as :class:`Mean` takes.

    Args:
        fn: ``fn(y_true, y_pred, **kwargs)`` on arrays (NumPy, or CuPy on a GPU
            replica).
        name, dtype: as :class:`Metric`.
        **kwargs: passed to ``fn`` on every update.
    """

    def __init__(self, fn, name: str | None = None, dtype=None, **kwargs):
        super().__init__(name=name or getattr(fn, "__name__", "mean_metric_wrapper"),
                         dtype=dtype)
        self._fn = fn
        self._fn_kwargs = kwargs

    def update_state(self, y_true, y_pred, sample_weight=None) -> None:
        values = self._fn(y_true, y_pred, **self._fn_kwargs)
        super().update_state(values, sample_weight)

    def get_config(self) -> dict:
        return {**super().get_config(), "fn": self._fn, **self._fn_kwargs}

    @classmethod
    def from_config(cls, config: dict):
        if cls is MeanMetricWrapper:
            return cls(**config)
        config = {k: v for k, v in config.items() if k != "fn"}
        return cls(**config)
