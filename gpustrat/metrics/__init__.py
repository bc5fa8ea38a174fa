"""Metrics that accumulate over the steps of an epoch, on sync-on-read variables
(``keras.metrics``).

Made inside ``strategy.scope()``, a metric's state (a total, a count) is a sync-on-read
variable with SUM aggregation: inside ``strategy.run`` each replica adds to its own
component, with no communication; :meth:`Metric.result` in cross-replica context sums
the components over every replica of every worker in one fused reduction (a collective:
every worker must call it) and returns the metric's value. Inside ``run``, ``result()``
is the replica's own. In cross-replica context ``update_state`` adds the value divided
by the number of replicas in sync to every local replica's component: every worker runs
that code, and the total grows by the value once (by the mean of the workers' values
where they differ, as with Keras), spread evenly over the replicas as Keras 3 spreads
it. Made outside any scope, a metric is plain.

Under ``ParameterServerStrategy`` a metric made in the scope keeps its state on the
parameter servers: every update (from any scheduled function, on any worker) is added
there, one at a time, and :meth:`Metric.result` (on the coordinator, or inside a
function) reads the total of every update so far.

Modules: :mod:`~gpustrat.metrics.base` (:class:`Metric`, the state and its reads),
:mod:`~gpustrat.metrics.reduction` (``Sum``, ``Mean``, ``MeanMetricWrapper``),
:mod:`~gpustrat.metrics.accuracy` (the accuracy metrics and functions) and
:mod:`~gpustrat.metrics.confusion` (``Precision``, ``Recall``, ``AUC``).
"""

from gpustrat.metrics.accuracy import (Accuracy, BinaryAccuracy, CategoricalAccuracy,
                                       SparseCategoricalAccuracy,
                                       SparseTopKCategoricalAccuracy,
                                       TopKCategoricalAccuracy, accuracy, binary_accuracy,
                                       categorical_accuracy, sparse_categorical_accuracy,
                                       sparse_top_k_categorical_accuracy,
                                       top_k_categorical_accuracy)
from gpustrat.metrics.base import Metric
from gpustrat.metrics.confusion import AUC, Precision, Recall
from gpustrat.metrics.reduction import Mean, MeanMetricWrapper, Sum

__all__ = ["Metric", "Mean", "Sum", "MeanMetricWrapper", "Accuracy", "BinaryAccuracy",
           "CategoricalAccuracy", "SparseCategoricalAccuracy", "TopKCategoricalAccuracy",
           "SparseTopKCategoricalAccuracy", "Precision", "Recall", "AUC", "accuracy", "binary_accuracy",
           "categorical_accuracy", "sparse_categorical_accuracy",
           "top_k_categorical_accuracy", "sparse_top_k_categorical_accuracy"]
