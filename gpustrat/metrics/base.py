"""The base of the metrics: named state variables on sync-on-read variables, the
cross-replica read, checkpointing (see :mod:`gpustrat.metrics`)."""

from __future__ import annotations

import re

import numpy as np

from gpustrat.devices import array_module, on_device_of
from gpustrat.distribute import context
from gpustrat.distribute.distributed_variables import (SAME_READS_HINT, DistributedVariable,
                                                      zeros)
from gpustrat.distribute.variables import (Variable, VariableAggregation,
                                           VariableSynchronization)
from gpustrat.reduce_util import ReduceOp

class Metric:
    """Base of the metrics: named state variables, ``update_state``, ``result``,
    ``reset_state`` (``keras.metrics.Metric``).

    A metric of your own subclasses it as in Keras 3: make its state with
    :meth:`add_variable` in ``__init__``, add to it in ``update_state`` (with the
    variables' ``assign_add``/``assign``, inside ``strategy.run``: each replica adds to
    its own component) and read it in ``result`` (in cross-replica context, each
    variable's read aggregates its components over every replica of every worker).

    Args:
        name: the metric's name.
        dtype: the dtype of its state and result (default float32).
    """

    def __init__(self, name: str | None = None, dtype=None):
        self.name = name or _snake(type(self).__name__)
        self.dtype = np.dtype(np.float32 if dtype is None else dtype)
        if self.dtype.kind != "f":
            raise ValueError(f"metric {self.name!r}: dtype must be floating point, got "
                             f"{self.dtype}")
        self._variables: list = []
        # Resets (and restores) so far, and cross-replica updates since the last one:
        # what every worker must agree on when the result is reduced across workers. A
        # cross-replica update adds its value divided by the number of workers, so
        # every worker must make it; inside run the replicas may update any number of
        # times (the result aggregates every update).
        self._resets = 0
        self._cross_updates = 0

    def add_variable(self, shape=(), initializer="zeros", dtype=None, aggregation="sum",
                     name=None) -> Variable:
        """A state variable (``keras.metrics.Metric.add_variable``): of ``shape``,
        starting at ``initializer`` ("zeros", "ones", a number, an array or a callable
        ``f(shape, dtype)``), of ``dtype`` (default the metric's); sync-on-read under a
        strategy, its cross-replica read the ``aggregation`` of its components ("sum",
        "mean", "only_first_replica"). :meth:`reset_state` sets it to zeros.

        ``add_variable("total")`` (a name alone) makes a scalar of zeros."""
        if isinstance(shape, str):   # add_variable(name): a scalar of zeros
            shape, name = (), shape
        shape = tuple(int(n) for n in np.atleast_1d(shape)) if np.ndim(shape) else             ((int(shape),) if shape != () else ())
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        agg = _AGGREGATIONS.get(str(aggregation).lower())
        if agg is None:
            raise ValueError(f"metric {self.name!r}: aggregation {aggregation!r} is not one "
                             f"of {sorted(_AGGREGATIONS)}")
        value = _initial(initializer, shape, dtype, self.name)
        strategy, replica_ctx = context.current()
        full = f"{self.name}/{name or 'variable'}"
        if replica_ctx is not None or strategy is None:
            # Plain, or made inside run (a collective, like any variable).
            v = Variable(value, trainable=False, name=full,
                         synchronization=VariableSynchronization.ON_READ, aggregation=agg)
        else:
            v = zeros(strategy, shape, dtype, full, VariableSynchronization.ON_READ, agg)
            if value.any():
                for c in _components(v):
                    c._write("assign", value)
        self._variables.append(v)
        return v

    def add_weight(self, name=None, shape=(), aggregation="sum", initializer="zeros",
                   dtype=None) -> Variable:
        """:meth:`add_variable` with Keras's ``add_weight`` argument order."""
        return self.add_variable(shape, initializer, dtype, aggregation, name)

    def get_config(self) -> dict:
        return {"name": self.name, "dtype": str(self.dtype)}

    @classmethod
    def from_config(cls, config: dict):
        return cls(**config)

    @property
    def variables(self) -> list:
        return list(self._variables)

    # --- the three calls ------------------------------------------------------------
    def update_state(self, *args, **kwargs) -> None:
        """Accumulate a batch."""
        raise NotImplementedError

    def result(self):
        """The metric's value: over every replica in sync in cross-replica context,
        this replica's inside ``run``. A 0-d array of the metric's dtype, on the device
        of the metric's state (computed there, on that device's current stream, after
        the reduction that made it)."""
        values = self._read()
        with on_device_of(values[0]):
            return self._compute(*values)

    def reset_state(self) -> None:
        """Back to zero on every component (no communication). Under several workers
        every worker must reset a metric alike (and make the same cross-replica
        updates): the next cross-replica :meth:`result` raises on every worker, naming
        each worker's counts, where they did not (the result would mix one worker's new
        state with another's old one)."""
        for v in self._variables:
            for c in _components(v):
                c._write("assign", np.zeros(v.shape, v.dtype))
        self._restarted()

    def _restarted(self) -> None:
        self._resets += 1
        self._cross_updates = 0

    def _counts_description(self) -> tuple:
        """The ``(key, what, hint)`` of the counts every worker must share at a read."""
        return ((f"{self._resets} resets", f"{self._cross_updates} cross-replica "
                 "updates since the last reset"), f"metric {self.name!r} result()",
                "every worker must call reset_state (or restore the metric) alike, on "
                "every worker or on none, and make the same update_state calls outside "
                "strategy.run (each adds its value divided by the number of workers), "
                "else the result mixes the workers' states")

    def __call__(self, *args, **kwargs):
        """``update_state`` then ``result``."""
        self.update_state(*args, **kwargs)
        return self.result()

    def _compute(self, *values):
        raise NotImplementedError

    # --- state access ---------------------------------------------------------------
    def _add(self, *amounts) -> None:
        """Add ``amounts[k]`` to state variable k: the replica's own component inside
        ``run``; in cross-replica context, ``amounts[k] / num_replicas_in_sync`` to
        every local component (every worker adds, the total grows by the amount once,
        spread evenly over the replicas as a cross-replica assign spreads its value)."""
        strategy, replica_ctx = context.current()
        if replica_ctx is None:
            self._cross_updates += 1
        for v, a in zip(self._variables, amounts):
            comps = _components(v)
            targets = comps[:1]
            if getattr(v, "_atomic_updates", False):
                pass  # held on a parameter server, which applies one update at a time
            elif not isinstance(v, DistributedVariable):
                if replica_ctx is not None and len(strategy.local_devices) > 1:
                    raise ValueError(
                        f"metric {self.name!r} was made outside strategy.scope(), so its "
                        f"state has one copy that {len(strategy.local_devices)} replicas "
                        "would update at once: make the metric inside strategy.scope()")
            else:
                if strategy is not None and strategy is not v.distribute_strategy:
                    v.value()  # raises the error that names both strategies
                if replica_ctx is not None:
                    targets = (comps[replica_ctx.local_index],)
                else:
                    # As Keras 3's metrics under tf.distribute (whose assign_add is an
                    # assign of the new total, divided over the replicas in sync).
                    a = a / v.distribute_strategy.num_replicas_in_sync
                    targets = comps
            share = np.asarray(a, comps[0].dtype) if np.isscalar(a) else \
                a.astype(comps[0].dtype)
            for target in targets:
                target._write("assign_add", share)

    def _read(self) -> list:
        first = self._variables[0]
        strategy, replica_ctx = context.current()
        if not isinstance(first, DistributedVariable) or replica_ctx is not None:
            return [v.read_value() for v in self._variables]
        if strategy is not None and strategy is not first.distribute_strategy:
            first.value()  # raises the error that names both strategies
        if any(v.aggregation is not VariableAggregation.SUM for v in self._variables):
            return [v.read_value() for v in self._variables]   # each by its aggregation
        # Cross-replica: every state variable in one fused reduction over all replicas.
        owner = first.distribute_strategy
        pairs = [(v, None) for v in self._variables]
        # Every worker's counts must agree: that rides with the reduction.
        also = ((self._resets * 0x9E3779B1 + self._cross_updates) & 0xFFFFFFFF,
                self._counts_description)
        context.push(owner, None)
        try:
            reduced = owner.extended._batch_reduce(ReduceOp.SUM, pairs, also, (
                f"metric {self.name!r} result()", SAME_READS_HINT))
        finally:
            context.pop()
        return [r.values[0] if hasattr(r, "values") else r for r in reduced]

    # --- checkpointing ----------------------------------------------------------------
    #: A metric's state is its total over every replica: a checkpoint writes it once.
    _checkpoint_per_worker = False

    def _checkpoint_state(self) -> list:
        """Each state variable's total over every replica in sync, as host arrays (a
        collective under several workers: every worker calls it)."""
        return [v.numpy() for v in self._variables]

    def _restore_checkpoint_state(self, state: list) -> None:
        """Set the state variables so that :meth:`result` gives the saved totals."""
        self._prepare_checkpoint_restore(state)()

    def _prepare_checkpoint_restore(self, state: list):
        """Check ``state`` (:meth:`_checkpoint_state`'s output) against this metric and
        return the function that restores it; raises (ValueError) before anything is
        written. The saved totals must have the metric's dtype: they are never cast."""
        if len(state) != len(self._variables):
            raise ValueError(f"metric {self.name!r} has {len(self._variables)} state "
                             f"variables, the checkpoint has {len(state)}: restore into "
                             "the same metric class")
        values = [np.asarray(value) for value in state]
        for v, value in zip(self._variables, values):
            if value.dtype != v.dtype or value.shape != tuple(v.shape):
                raise ValueError(
                    f"metric {self.name!r}: the checkpoint's {v.name!r} is {value.dtype} "
                    f"of shape {value.shape}, this metric keeps {v.dtype} of shape "
                    f"{tuple(v.shape)}: restore into a metric made with "
                    f"dtype={str(value.dtype)!r} and the saved settings")

        def write() -> None:
            for v, value in zip(self._variables, values):
                v.assign(value)
            self._restarted()
        return write

    def __repr__(self) -> str:
        return f"<gs.metrics.{type(self).__name__} {self.name!r}>"


# --- helpers ------------------------------------------------------------------------------

def _components(v: Variable) -> tuple:
    return v.values if isinstance(v, DistributedVariable) else (v,)


def _same_rank(a, b):
    """``a`` and ``b`` with a trailing axis of size 1 dropped or added where their
    ranks differ by one (Keras's ``squeeze_or_expand_to_same_rank``): ``(n, 1)`` labels
    or weights go with ``(n,)`` values."""
    if a.ndim == b.ndim + 1 and a.shape[-1] == 1:
        if b.ndim == 1:
            b = b[..., None]
        else:
            a = a[..., 0]
    elif b.ndim == a.ndim + 1 and b.shape[-1] == 1:
        if a.ndim == 1:
            a = a[..., None]
        else:
            b = b[..., 0]
    return a, b


def _samplewise(values, sample_weight, dtype, reduce: str):
    """``(total, count)`` to add for a batch, as Keras 3's metrics: the values, weighted,
    reduced (``reduce``: ``"sum"`` or ``"mean"``) to one per example, and summed; the
    count is the sum of the weights (averaged per example) or the number of examples.
    0-d arrays of ``dtype`` on the values' device (no host wait), the count of an
    unweighted batch a Python float."""
    xp = array_module(values)
    x = xp.asarray(values, dtype=dtype)
    count = None
    if sample_weight is not None:
        w = xp.asarray(sample_weight, dtype=dtype)
        x, w = _same_rank(x, w)
        if x.ndim > w.ndim:   # one weight per example (or per leading axes)
            x = getattr(x, reduce)(axis=tuple(range(w.ndim, x.ndim)), dtype=dtype)
        try:
            full = xp.broadcast_to(w, x.shape)
        except ValueError:
            raise ValueError(f"sample_weight of shape {np.shape(sample_weight)} "
                             f"does not broadcast to the values of shape "
                             f"{np.shape(values)}") from None
        x = x * full
        if w.ndim > 1:
            full = getattr(full, reduce)(axis=tuple(range(1, w.ndim)), dtype=dtype)
        count = full.sum(dtype=dtype)
    if x.ndim > 1:
        x = getattr(x, reduce)(axis=tuple(range(1, x.ndim)), dtype=dtype)
    if count is None:
        count = float(x.shape[0]) if x.ndim else 1.0
    return x.sum(dtype=dtype), count


#: Keras's names of a metric variable's aggregations.
_AGGREGATIONS = {"sum": VariableAggregation.SUM, "mean": VariableAggregation.MEAN,
                 "only_first_replica": VariableAggregation.ONLY_FIRST_REPLICA}


def _initial(initializer, shape: tuple, dtype, who: str) -> np.ndarray:
    """A metric variable's starting value (host array of ``shape`` and ``dtype``)."""
    if isinstance(initializer, str):
        fill = {"zeros": 0, "ones": 1}.get(initializer.lower())
        if fill is None:
            raise ValueError(f"metric {who!r}: initializer {initializer!r} is not 'zeros' "
                             "or 'ones'; pass a number, an array or f(shape, dtype)")
        return np.full(shape, fill, dtype)
    value = initializer(shape, dtype) if callable(initializer) else initializer
    value = np.asarray(value, dtype)
    try:
        return np.array(np.broadcast_to(value, shape))
    except ValueError:
        raise ValueError(f"metric {who!r}: the initial value of shape {value.shape} does "
                         f"not fit the variable's shape {shape}") from None


def _on_host_dtype(x, dtype):
    xp = array_module(x)
    return xp.asarray(x, dtype)


def _snake(name: str) -> str:
    """Keras's ``to_snake_case``: "SparseCategoricalAccuracy" ->
    "sparse_categorical_accuracy", "AUC" -> "auc"."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()
