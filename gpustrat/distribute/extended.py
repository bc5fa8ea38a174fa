"""``strategy.extended``: the extension points optimizers and metrics are written on.

- :meth:`StrategyExtended.update` applies a function to each component of a variable,
  on that component's device, with each replica's share of the arguments.
- :meth:`StrategyExtended.reduce_to` and :meth:`StrategyExtended.batch_reduce_to` reduce
  per-replica values over every replica in sync and give the result to every local
  replica (a :class:`~gpustrat.Mirrored`); ``batch_reduce_to`` does all its values in one
  fused reduction (one collective per fusion bucket, see
  :mod:`gpustrat.collectives.fusion`), which is what makes an optimizer step cheap.

All three are cross-replica operations; called in replica context they go through a
``merge_call`` (so every replica must call them), as in tf.distribute.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Sequence

import numpy as np

from gpustrat.collectives.fusion import (check_layout, fused_all_reduce,
                                         fused_all_reduce_arrays, fused_all_reduce_single,
                                         layout_of)
from gpustrat.distribute import context
from gpustrat.distribute.collective_ops import as_array
from gpustrat.distribute.distributed_variables import DistributedVariable, as_components
from gpustrat.reduce_util import ReduceOp
from gpustrat.values import DistributedValues, Mirrored, regroup, select_replica

_NOTHING = contextlib.nullcontext()
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")


class StrategyExtended:
    """What ``strategy.extended`` offers (``tf.distribute.StrategyExtended``)."""

    def __init__(self, strategy):
        self._strategy = strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def worker_devices(self) -> tuple:
        """This worker's devices, one per local replica (names)."""
        return tuple(d.name for d in self._strategy.local_devices)

    def _replica_context(self):
        strategy, ctx = context.current()
        if strategy is not None and strategy is not self._strategy:
            raise ValueError(f"{self._strategy!r}.extended was used under another "
                             f"strategy, {strategy!r}")
        return ctx

    # --- update -----------------------------------------------------------------------
    def update(self, var, fn: Callable, args: tuple = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Call ``fn(component, *args, **kwargs)`` for each local component of ``var``,
        on its device, with distributed arguments unpacked to that replica's value.

        Returns:
            With ``group``, the results regrouped (a :class:`~gpustrat.Mirrored` for
            several replicas, the value itself for one); else a tuple, one per replica.
        """
        kwargs = kwargs or {}
        ctx = self._replica_context()
        if ctx is not None:
            return ctx.merge_call(
                lambda s, a, k: s.extended.update(var, fn, a, k, group), args=(args, kwargs))
        if isinstance(var, DistributedVariable):
            if var.distribute_strategy is not self._strategy:
                raise ValueError(f"extended.update: variable {var.name!r} belongs to "
                                 f"{var.distribute_strategy!r}, not {self._strategy!r}")
            comps = var.values
        else:
            comps = (var,) * len(self._strategy.local_devices)
        results = []
        for i, (comp, dev) in enumerate(zip(comps, self._strategy.local_devices)):
            with dev.activate():
                results.append(fn(comp, *select_replica(i, tuple(args)),
                                  **select_replica(i, kwargs)))
        if not group:
            return tuple(results)
        return regroup(results, self._strategy.local_devices, wrap=Mirrored)

    # --- reductions -------------------------------------------------------------------
    def reduce_to(self, reduce_op, value: Any, destinations: Any = None,
                  options: Any = None) -> Any:
        """Reduce one per-replica ``value`` over every replica in sync; every local
        replica gets the result (a :class:`~gpustrat.Mirrored`; the array itself for a
        single replica). ``destinations`` is accepted for compatibility: results always
        go to the strategy's local devices."""
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op, value_destination_pairs: Sequence,
                        options: Any = None) -> list:
        """:meth:`reduce_to` of many values in one fused reduction.

        Args:
            reduce_op: a ReduceOp or its name.
            value_destination_pairs: ``(value, destinations)`` pairs; each value is a
                per-replica value, a mirrored variable, or a plain value (the same on
                every replica: MEAN, MAX and MIN give it back, SUM with several local
                replicas is refused as in ``strategy.reduce``).
        Returns:
            One result per pair, in order.
        Raises:
            ValueError: values whose shape or dtype differ between replicas or
                workers (on every worker).
        """
        return self._batch_reduce(reduce_op, value_destination_pairs)

    def _batch_reduce(self, reduce_op, value_destination_pairs: Sequence,
                      also=None, words=None) -> list:
        """:meth:`batch_reduce_to`; ``also`` rides with its agreement (see
        ``Communicator.agreeing``); ``words``: ``(what, hint)`` that name the call in a
        disagreement, instead of batch_reduce_to's."""
        op = ReduceOp.from_value(reduce_op)
        ctx = self._replica_context()
        if ctx is not None:
            return ctx.merge_call(
                lambda s, pairs: s.extended._batch_reduce(op, pairs, also, words),
                args=(list(value_destination_pairs),))
        strategy = self._strategy
        devices = strategy.local_devices
        on_host = not any(d.is_gpu for d in devices)
        single = len(devices) == 1
        values = originals = [value for value, _ in value_destination_pairs]
        if on_host and single and set(map(type, values)) == {np.ndarray}:
            # The common case (one replica's own host arrays, e.g. a gradient step's
            # hundred gradients) needs no placement and no rows per replica: their
            # layout is read in C and they are packed from the list as given.
            if len(values) > 1:
                return self._reduce_host_arrays(op, values)
            tensors = list(zip(values))   # tensors[j] = (value j,): one per replica
            values = ()
        else:
            tensors = []
        for value in values:
            if on_host and single and type(value) is np.ndarray:
                tensors.append([value])
                continue
            comps = _components(strategy, value, op)
            if on_host and all(type(c) is np.ndarray for c in comps):
                tensors.append(list(comps))
            else:
                tensors.append([as_array(c, d) for c, d in zip(comps, devices)])
        if not tensors:
            return []
        what, hint = (f"batch_reduce_to({op.name})", AGREE_HINT) if words is None else words
        comm = strategy.communicator
        # Variables are named in the agreement: workers that reduce different variables
        # of the same layouts (reads in different orders) raise instead of mixing them.
        names = _variable_keys(originals) if strategy.num_workers > 1 else None
        if len(tensors) == 1:
            agree = agreement(strategy, describe_layouts(tensors, names), what, hint)
            with comm.agreeing(*agree, also) if agree else _NOTHING:
                out = [comm.all_reduce(tensors[0], op)]
        else:
            # Checked and planned once, for the agreement and the fusion both.
            tensors, layout = check_layout(comm, tensors)
            if layout.described is None:
                layout.described = _describe(tensors)
            agree = agreement(strategy, layout.described if names is None else
                              describe_layouts(tensors, names), what, hint)
            with comm.agreeing(*agree, also) if agree else _NOTHING:
                if single:
                    return fused_all_reduce_single(comm, tensors, op, layout=layout)
                out = fused_all_reduce(comm, tensors, op, layout=layout)
        return [r[0] if len(r) == 1 else Mirrored(r) for r in out]

    def _reduce_host_arrays(self, op: ReduceOp, values: list) -> list:
        """:meth:`batch_reduce_to` of several host arrays of a worker's one replica."""
        strategy = self._strategy
        layout = layout_of(list(map(_SHAPE, values)), list(map(_DTYPE, values)))
        if layout.described is None:
            layout.described = describe_shapes(layout.shapes, layout.dtypes)
        agree = agreement(strategy, layout.described, f"batch_reduce_to({op.name})")
        comm = strategy.communicator
        with comm.agreeing(*agree) if agree else _NOTHING:
            return fused_all_reduce_arrays(comm, values, op, layout)


def _variable_keys(values: Sequence) -> list | None:
    """Each value's variable key (``name#n``, the same on every worker for the same
    variable) or ``value``; None where no value is a variable."""
    keys = [v._key if isinstance(v, DistributedVariable) else None for v in values]
    if not any(keys):
        return None
    return [k or "value" for k in keys]


def _components(strategy, value: Any, op: ReduceOp) -> tuple:
    value = as_components(value)
    if not isinstance(value, DistributedValues):
        strategy._check_plain(op, value)
    return strategy._components(value, "strategy.extended.batch_reduce_to")


def fused_reduce(comm, tensors: list, op: ReduceOp) -> list:
    """``tensors[j][i]`` (tensor j of local replica i) reduced over every replica in
    sync: one collective per fusion bucket. Returns ``out[j][i]``."""
    if len(tensors) == 1:
        return [comm.all_reduce(tensors[0], op)]
    return fused_all_reduce(comm, tensors, op)


_described: dict = {}


def describe_layouts(tensors: list, names=None) -> tuple:
    """One short string per tensor: ``[name:]shape:dtype`` (remembered: a training loop
    reduces the same layouts every step)."""
    key = (tuple([(t[0].shape, t[0].dtype) for t in tensors]),
           tuple(names) if names else None)
    hit = _described.get(key)
    if hit is None:
        hit = _describe(tensors, names)
        if len(_described) < 256:
            _described[key] = hit
    return hit


def _describe(tensors: list, names=None) -> tuple:
    return describe_shapes([t[0].shape for t in tensors], [t[0].dtype for t in tensors],
                           names)


def describe_shapes(shapes: Sequence[tuple], dtypes: Sequence, names=None) -> tuple:
    """:func:`describe_layouts` of tensors of these shapes and dtypes."""
    return tuple((f"{names[j]}:" if names else "")
                 + f"{'x'.join(map(str, shape)) or 'scalar'}:{dtype}"
                 for j, (shape, dtype) in enumerate(zip(shapes, dtypes)))


#: What to do when workers reduce different values (a fused reduction's agreement).
AGREE_HINT = ("every worker must reduce the same values, in the same order, with the same "
              "shapes and dtypes")


def agreement(strategy, layouts: tuple, what: str, hint: str = AGREE_HINT
              ) -> tuple | None:
    """``(key, what, hint)`` for ``comm.agreeing`` around a fused reduction of tensors
    described by ``layouts`` (what :func:`describe_layouts` gives): every worker must
    reduce the same list of shapes and dtypes (and names, when described), else every
    worker raises; it rides with the reduction's first collective. None on one worker
    (nothing to agree on)."""
    if strategy.num_workers == 1:
        return None
    return (layouts, what, hint)
