"""The replica context: what a function run by ``strategy.run`` sees of its replica."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from gpustrat.distribute import collective_ops, context, reduction
from gpustrat.reduce_util import OPS_BY_KEY, ReduceOp
from gpustrat import nest
from gpustrat.devices import gpu_array_type
from gpustrat.values import PerReplica, regroup, select_replica

_merge = threading.local()
# By id: an Enum member's .name and hash run Python code on every collective.
_OP_NAMES = {id(op): op.name for op in ReduceOp}
# What the communicator's header calls a replica's all_reduce (the same string objects
# every time: its plan is remembered by them).
_KINDS = {id(op): f"all_reduce({op.name})" for op in ReduceOp}
_NUMERIC = "biufc"  # NumPy dtype kinds that need no per-leaf check


def in_merge_call() -> bool:
    """True while this thread runs a ``merge_call`` function."""
    return getattr(_merge, "depth", 0) > 0


class ReplicaContext:
    """One replica's view inside ``strategy.run``.

    Collectives (:meth:`all_reduce`, :meth:`all_gather`) must be called by every replica,
    in the same order; they block until all replicas of all workers have arrived.
    """

    def __init__(self, strategy, local_index: int, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._local_index = local_index
        self._replica_id = replica_id_in_sync_group
        # One CPU replica on this worker: a collective on one NumPy array of numbers
        # goes straight to the communicator (no signature to compare, no structure to
        # walk); a mismatch between workers is caught by the communicator's header.
        rv = self._rendezvous = strategy._rendezvous
        self._communicator = strategy._communicator
        self._alone = rv.n == 1 and rv.streams is None and \
            not strategy.local_devices[local_index].is_gpu
        # The only replica in sync, on a GPU: a flat list of float arrays has nothing
        # to be combined with, and is returned as it is (no copy, no launch).
        self._only_gpu = self._communicator.num_replicas == 1 and \
            strategy.local_devices[local_index].is_gpu

    @property
    def strategy(self):
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def local_index(self) -> int:
        """This replica's index among its worker's local replicas."""
        return self._local_index

    @property
    def devices(self) -> tuple:
        return (self._strategy.local_devices[self._local_index],)

    def _exchange(self, signature, value, combine):
        return self._strategy._rendezvous.exchange(self._local_index, signature, value, combine)

    def all_reduce(self, reduce_op, value: Any) -> Any:
        """Reduce ``value`` (any nested structure) over every replica in sync; every
        replica receives the same result. ``reduce_op`` is a ReduceOp or its name.

        A list or tuple of arrays (a model's gradients) is reduced with one fused
        collective per bucket, planned once per layout; its results are views of the
        fusion buffers, which the next call with the same layout fills again unless
        something still refers to one of them. On a GPU that is the only replica in
        sync, such a list of floating-point arrays comes back as it is: a new list of
        the same arrays (nothing to combine, nothing copied). Python numbers are
        reduced on the host."""
        if self._alone and type(value) is np.ndarray and value.dtype.kind in "iufc":
            t = type(reduce_op)
            op = OPS_BY_KEY.get(id(reduce_op)) if t is ReduceOp else \
                OPS_BY_KEY.get(reduce_op) if t is str else None
            if op is not None and (value.dtype.kind != "c" or op is ReduceOp.SUM
                                   or op is ReduceOp.MEAN):
                # This replica's reduce is every local replica's all_reduce.
                return self._rendezvous.call_alone(
                    self._local_index, "all_reduce", _OP_NAMES[id(op)],
                    self._communicator.reduce_named, value, op, _KINDS[id(op)])
        op = ReduceOp.from_value(reduce_op)
        comm = self._strategy.communicator
        name = _OP_NAMES[id(op)]
        device = self._strategy.local_devices[self._local_index]
        if device.is_gpu:
            dtypes = collective_ops.flat_dtypes(value, gpu_array_type(), device.index, name)
        else:
            dtypes = collective_ops.flat_dtypes(value, np.ndarray, None, name)
        if dtypes is not None and self._only_gpu and self._rendezvous.returned is None and \
                (op is not ReduceOp.MEAN or all(d.kind in "fc" for d in set(dtypes))):
            return list(value) if type(value) is list else value
        if dtypes is not None:
            flat = collective_ops.flat_layout_of(value, dtypes)
            # A flat list of arrays (a model's gradients): its layout is the signature,
            # compared whole, and the reduction is planned once per layout.
            return self._exchange(
                ("all_reduce", name, flat),
                value, lambda vals: collective_ops.all_reduce_flat(comm, vals, op, flat))
        sig = collective_ops.leaf_signature("all_reduce", name, value)
        reduction.check_leaves(sig, value, op, "all_reduce", self._replica_id)
        return self._exchange(
            sig, value, lambda vals: collective_ops.all_reduce_structures(comm, vals, op))

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` (any nested structure) from every replica along ``axis``,
        in replica order; shapes may differ only along ``axis``."""
        if type(axis) is not int:
            axis = reduction.check_axis(axis, "all_gather in strategy.run", False)
        if self._alone and type(value) is np.ndarray and value.ndim and \
                type(axis) is int and value.dtype.kind in _NUMERIC:
            return self._rendezvous.call_alone(
                self._local_index, "all_gather", axis, self._communicator.gather, [value],
                axis)
        comm = self._strategy.communicator
        sig = collective_ops.leaf_signature("all_gather", str(axis), value, skip_axis=axis)
        reduction.check_leaves(sig, value, None, "all_gather", self._replica_id)
        return self._exchange(
            sig, value, lambda vals: collective_ops.all_gather_structures(comm, vals, axis))

    def merge_call(self, merge_fn: Callable, args: tuple = (), kwargs: dict | None = None
                   ) -> Any:
        """Call ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context,
        with every local replica's arguments merged.

        Every replica must call it (it is a collective). Each argument that differs
        between replicas reaches ``merge_fn`` as a :class:`~gpustrat.PerReplica` of the
        replicas' values; one that is the same object on every replica (a variable, a
        constant) as itself. Replica 0's ``merge_fn`` is the one called. Each replica
        gets ``merge_fn``'s result, with distributed values replaced by that replica's
        component. Inside ``merge_fn``, ``strategy.reduce``, ``strategy.extended`` and
        variable updates work as in cross-replica context; ``strategy.run`` does not.
        """
        if not callable(merge_fn):
            raise TypeError(f"merge_call needs a callable merge_fn, got {merge_fn!r}")
        if not isinstance(args, (tuple, list)):
            args = (args,)
        name = getattr(merge_fn, "__qualname__", type(merge_fn).__name__)
        sig = ("merge_call", name, ())
        return self._exchange(sig, (merge_fn, tuple(args), dict(kwargs or {})),
                              self._merge_combine)

    def merge_call_later(self, merge_fn: Callable, args: tuple = ()) -> None:
        """:meth:`merge_call` of a merge whose result no replica needs (an optimizer's
        step): this replica goes on at once, and ``merge_fn`` runs (once per worker,
        with every local replica's arguments merged) when the last local replica has
        called. A replica that reads or writes a mirrored variable of the strategy
        before that first waits for it, so it reads what the merge wrote."""
        name = getattr(merge_fn, "__qualname__", type(merge_fn).__name__)
        self._rendezvous.deposit(self._local_index, ("merge_call", name, ()),
                                 (merge_fn, tuple(args), {}), self._merge_combine)

    def _merge_combine(self, items: list) -> list:
        # Runs once per worker, in the thread of the last replica to arrive.
        strategy = self._strategy
        merge_fn = items[0][0]
        if len(items) == 1:
            args, kwargs = items[0][1], items[0][2]
        else:
            args = _merge_args([a for _, a, _ in items])
            kwargs = [k for _, _, k in items]
            # No keyword arguments (the common merge): nothing to regroup.
            kwargs = regroup(kwargs, keep_shared=True) if any(kwargs) else {}
        context.push(strategy, None)
        _merge.depth = getattr(_merge, "depth", 0) + 1
        try:
            result = merge_fn(strategy, *args, **kwargs)
        finally:
            _merge.depth -= 1
            context.pop()
        return [select_replica(i, result) for i in range(len(items))]

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def _merge_args(per_replica: list) -> tuple:
    """The replicas' argument tuples merged (as ``regroup`` does), with a fast path for
    the common arguments of a merge: the same object everywhere, or flat lists of
    leaves (an optimizer's gradients and variables), walked without ``nest``."""
    if any(len(a) != len(per_replica[0]) for a in per_replica):
        return regroup(per_replica, keep_shared=True)
    merged = []
    for values in zip(*per_replica):
        first = values[0]
        if all(v is first for v in values):
            merged.append(first)
            continue
        kind = type(first)
        if kind in (list, tuple) and all(type(v) is kind and len(v) == len(first)
                                         for v in values):
            columns = list(zip(*values))
            if not any(nest.is_nested(c[0]) for c in columns):
                merged.append(kind(c[0] if all(x is c[0] for x in c) else PerReplica(c)
                                   for c in columns))
                continue
        merged.append(regroup(list(values), keep_shared=True))
    return tuple(merged)


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
