"""Mirrored and sync-on-read variables: one component per local replica.

See :mod:`gpustrat.distribute.variables` for the words and the rules. This module holds
the update paths:

- replica context, mirrored: every replica calls the update (it is a collective); the
  replicas meet in the strategy's rendezvous, the last to arrive aggregates the values
  over every replica in sync (SUM, MEAN: one all-reduce; ONLY_FIRST_REPLICA: a
  broadcast from global replica 0) and writes the result into every component.
- replica context, sync-on-read: the replica's own component, no communication.
- cross-replica context: every component; across workers, one small collective checks
  that every worker writes the same value (a checksum), so that copies cannot diverge.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import numpy as np

from gpustrat.devices import device_of, on_device_of, to_device, to_host
from gpustrat.distribute import context
from gpustrat.distribute.variables import (_AGG_OPS, Variable, VariableAggregation,
                                           VariableSynchronization, checksum,
                                           initial_array, note_creation)
from gpustrat.reduce_util import ReduceOp

_ON_READ = VariableSynchronization.ON_READ
_HINT_SAME_UPDATES = ("every worker must make the same variable updates, in the same "
                      "order, with values of the same shape and dtype")


SAME_READS_HINT = ("every worker must read the same sync-on-read variables and metric "
                    "results, in the same order (each read combines every worker's copy)")
_NOTHING = contextlib.nullcontext()

_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _next_key(strategy) -> int:
    # Per strategy: workers that make their variables in the same order number them
    # the same, whatever else each process made before.
    n = _made.get(strategy, 0)
    _made[strategy] = n + 1
    return n


def create(strategy, replica_ctx, initial_value, trainable: bool, name: str, dtype,
           sync: VariableSynchronization, agg: VariableAggregation) -> "DistributedVariable":
    """A distributed variable of ``strategy`` (its scope, or its ``run``)."""
    make = getattr(strategy, "_create_variable", None)
    if make is not None:  # a strategy that keeps variables elsewhere (parameter servers)
        return make(replica_ctx, initial_value, trainable, name, dtype, sync, agg)
    if sync is VariableSynchronization.NONE:
        raise ValueError(
            f"variable {name!r}: synchronization NONE is not supported under a strategy "
            "(as in tf.distribute): use AUTO/ON_WRITE (mirrored) or ON_READ (sync-on-read), "
            "or make the variable outside strategy.scope()")
    if replica_ctx is None:
        return _create_here(strategy, initial_value, trainable, name, dtype, sync, agg)
    # Inside run: every replica makes the variable; global replica 0's initial value is
    # used, and every replica gets the same variable.
    value = initial_array(initial_value, dtype)
    sig = ("create variable", name, ())

    def combine(values):
        context.push(strategy, None)
        try:
            v = _create_here(strategy, values[0], trainable, name, None, sync, agg)
        finally:
            context.pop()
        return [v] * len(values)
    return replica_ctx._exchange(sig, value, combine)


def _create_here(strategy, initial_value, trainable, name, dtype, sync, agg):
    arr = initial_array(initial_value, dtype)
    if agg is VariableAggregation.MEAN and arr.dtype.kind not in "fc":
        raise ValueError(
            f"variable {name!r}: aggregation MEAN needs a floating dtype, got {arr.dtype} "
            "(as in tf.distribute): use SUM or ONLY_FIRST_REPLICA, or a float dtype")
    comm = strategy.communicator
    devices = strategy.local_devices
    if strategy.num_workers > 1:
        # Worker 0's initial value everywhere, so that a per-rank seed cannot make the
        # copies differ.
        comm.agree_layout(("Variable", name) + tuple(arr.shape), arr.dtype,
                          f"creating variable {name!r}",
                          "every worker must make the same variables, in the same order")
        comps = comm.broadcast([to_device(arr, d) for d in devices], root=0)
    else:
        comps = [to_device(arr, d, copy=True) for d in devices]
    cls = SyncOnReadVariable if sync is _ON_READ else MirroredVariable
    if sync is VariableSynchronization.AUTO:
        sync = VariableSynchronization.ON_WRITE
    return cls._from_components(strategy, comps, trainable, name, sync, agg)


class DistributedVariable(Variable):
    """A variable with one component per local replica (see the module docstring)."""

    #: One object serves every local replica: ``run`` hands it back as it is.
    shared_by_replicas = True

    _kind = "DistributedVariable"

    @classmethod
    def _from_components(cls, strategy, arrays, trainable: bool, name: str, sync, agg):
        v = object.__new__(cls)
        v._strategy = strategy
        v._name = name
        v._trainable = trainable
        v._sync = sync
        v._agg = agg
        v._parent = None
        v._key = f"{name}#{_next_key(strategy)}"
        v._values = tuple(Variable._plain(a, trainable, name, sync, agg, device=d, parent=v)
                          for a, d in zip(arrays, strategy.local_devices))
        v._array = v._values[0]._array
        v._device = strategy.local_devices[0]
        note_creation(v)
        return v

    # --- what it is -----------------------------------------------------------------
    @property
    def values(self) -> tuple:
        """The components (plain variables), one per local replica, in replica order."""
        return self._values

    @property
    def distribute_strategy(self):
        return self._strategy

    @property
    def dtype(self) -> np.dtype:
        return self._values[0]._array.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self._values[0]._array.shape)

    @property
    def device(self) -> str:
        """The device of the component read here (replica context) or of the first."""
        ctx = self._context("read")
        return self._values[ctx.local_index if ctx is not None else 0].device

    #: Whether a read or write in replica context first waits for the replica's
    #: pending merges (an optimizer's step, which updates mirrored variables).
    _settles = True

    def _context(self, what: str):
        """The replica context of this variable's strategy, None in cross-replica
        context (or outside any scope, as TensorFlow enters the variable's strategy).
        In replica context, the optimizer steps this replica issued have run."""
        strategy, ctx = context.current()
        if strategy is not None and strategy is not self._strategy:
            raise ValueError(
                f"variable {self._name!r} was made under {self._strategy!r} and cannot be "
                f"{what} under another strategy, {strategy!r}: use each variable with "
                "the strategy whose scope made it")
        if ctx is not None and self._settles:
            ctx._rendezvous.settle(ctx.local_index)
        return ctx

    # --- reading --------------------------------------------------------------------
    def value(self):
        ctx = self._context("read")
        if ctx is not None:
            return self._values[ctx.local_index].value()
        return self._cross_replica_value()

    def read_value(self):
        ctx = self._context("read")
        if ctx is not None:
            return self._values[ctx.local_index].read_value()
        value = self._cross_replica_value()
        device = device_of(value)
        return value.copy() if device is None else to_device(value, device, copy=True)

    def _cross_replica_value(self):
        return self._values[0].value()

    # --- updating -------------------------------------------------------------------
    def _update(self, op: str, value) -> "DistributedVariable":
        ctx = self._context("updated")
        if ctx is None:
            self._update_cross_replica(op, value)
        else:
            self._update_replica(ctx, op, value)
        return self

    def _update_cross_replica(self, op: str, value) -> None:
        arr = self._coerce(value, op)
        self._agree_value(op, arr)
        for c in self._values:
            c._write(op, arr)

    def _agree_value(self, op: str, arr) -> None:
        """Across workers: every worker writes the same value, or all raise."""
        if self._strategy.num_workers == 1:
            return
        self._strategy.communicator.agree(
            (f"{self._key}.{op}", f"value checksum {checksum(arr)}", str(arr.dtype))
            + tuple(arr.shape), f"{op} of variable {self._name!r} in cross-replica context",
            "every worker must write the same value into a variable (compute it the "
            "same way everywhere, or reduce it first)")

    def _update_replica(self, ctx, op: str, value) -> None:
        raise NotImplementedError

    def _write_all(self, op: str, values) -> None:
        for c, v in zip(self._values, values):
            c._write(op, v)

    # --- array protocol ---------------------------------------------------------------
    def _read_for_array(self):
        return self.value()

    def __repr__(self) -> str:
        body = ", ".join(f"{i}: {to_host(c._array)!r}" for i, c in enumerate(self._values))
        return (f"<gs.{self._kind} {self._name!r} shape={self.shape} dtype={self.dtype} "
                f"aggregation={self._agg.name}, values={{{body}}}>")


class MirroredVariable(DistributedVariable):
    """Equal components, kept equal by aggregating every update over the replicas."""

    _kind = "MirroredVariable"

    def _update_replica(self, ctx, op: str, value) -> None:
        if self._agg is VariableAggregation.NONE:
            if self._strategy.num_replicas_in_sync == 1:
                # One component (OneDeviceStrategy): nothing to combine or diverge, as
                # TensorFlow updates it.
                self._values[0]._update(op, value)
                return
            raise ValueError(
                f"{op} of mirrored variable {self._name!r} in replica context needs an "
                "aggregation to combine the replicas' values, and it has NONE (TensorFlow "
                "would let the copies diverge): create it with aggregation=SUM, MEAN or "
                "ONLY_FIRST_REPLICA, or update it in cross-replica context "
                "(strategy.extended.update or a merge_call)")
        try:
            item = (self._coerce(value, op), None, value)
        except (TypeError, ValueError) as e:  # raised after the workers agree, on all
            item = (None, e, value)
        sig = ("variable update", f"{self._key}.{op}", ())
        ctx._exchange(sig, item, lambda items: self._combine(op, items))

    def _same_value_summed(self, items: list) -> ValueError | None:
        """TensorFlow's refusal to SUM one value that every local replica passed (the
        same object: a Python number, an array made outside the replica function),
        since the sum would count it once per replica; zeros sum to zeros and pass."""
        first = items[0][2]
        if self._agg is not VariableAggregation.SUM or len(items) < 2 or \
                any(raw is not first for _, _, raw in items[1:]) or items[0][0] is None:
            return None
        if not to_host(items[0][0]).any():
            return None
        return ValueError(
            f"A non-DistributedValues value {first!r} cannot be reduced with the given "
            f"reduce op ReduceOp.SUM (variable {self._name!r}, aggregation SUM: every "
            f"replica passed the same value, and their sum would count it "
            f"{self._strategy.num_replicas_in_sync} times, as TensorFlow refuses). Give "
            "each replica its own value (a per-replica value, or one computed in the "
            "replica function), or update the variable in cross-replica context, or use "
            "aggregation MEAN or ONLY_FIRST_REPLICA")

    def _combine(self, op: str, items: list) -> list:
        # Runs once per worker, in the thread of the last replica to arrive.
        errors = [e for _, e, _ in items if e is not None]
        if not errors:
            same = self._same_value_summed(items)
            if same is not None:
                errors = [same]
        strategy = self._strategy
        comm = strategy.communicator
        if strategy.num_workers > 1:
            state = "bad value" if errors else "ok"
            comm.agree((f"{self._key}.{op}", state, str(self.dtype)) + self.shape,
                       f"{op} of variable {self._name!r} in replica context",
                       _HINT_SAME_UPDATES)
        if errors:
            raise errors[0]
        arrays = [to_device(a, d) for (a, _, _), d in zip(items, strategy.local_devices)]
        if self._agg is VariableAggregation.ONLY_FIRST_REPLICA:
            reduced = comm.broadcast(arrays, root=0)
        else:
            reduced = comm.all_reduce(arrays, _AGG_OPS[self._agg])
        if reduced[0].dtype != self.dtype:  # never for floats; kept for safety
            reduced = [_cast(r, self.dtype) for r in reduced]
        self._write_all(op, reduced)
        return [None] * len(items)


class SyncOnReadVariable(DistributedVariable):
    """Per-replica components, aggregated when read in cross-replica context."""

    # Each replica's own component (a metric's count): no optimizer step updates it.
    _settles = False

    _kind = "SyncOnReadVariable"

    def _update_replica(self, ctx, op: str, value) -> None:
        self._values[ctx.local_index]._update(op, value)

    def _cross_replica_value(self):
        agg = self._agg
        strategy = self._strategy
        if agg is VariableAggregation.NONE:
            raise ValueError(self._no_aggregation("read"))
        if agg is VariableAggregation.ONLY_FIRST_REPLICA and strategy.num_workers == 1:
            return self._values[0].value()
        comm = strategy.communicator
        # Across workers the read is a collective: which variable each worker reads
        # rides with it, so that reads made in different orders raise on every worker
        # instead of combining one variable with another.
        with comm.agreeing((f"read {self._key}",), f"reading sync-on-read variable "
                           f"{self._name!r}", SAME_READS_HINT) \
                if strategy.num_workers > 1 else _NOTHING:
            if agg is VariableAggregation.ONLY_FIRST_REPLICA:
                return comm.broadcast([c._array for c in self._values], root=0)[0]
            from gpustrat.distribute import reduction  # noqa: PLC0415
            return reduction.reduce_components(comm, _AGG_OPS[agg],
                                               [c._array for c in self._values], None)

    def read_value(self):
        ctx = self._context("read")
        if ctx is not None:
            return self._values[ctx.local_index].read_value()
        if self._agg is VariableAggregation.ONLY_FIRST_REPLICA and \
                self._strategy.num_workers == 1:
            return self._values[0].read_value()
        return self._cross_replica_value()  # a new array: the reduction's result

    def _no_aggregation(self, what: str) -> str:
        return (f"sync-on-read variable {self._name!r} has aggregation NONE, so it cannot "
                f"be {what} in cross-replica context (its replicas' values differ and "
                "nothing says how to combine them): do it inside strategy.run, or create "
                "it with aggregation SUM, MEAN or ONLY_FIRST_REPLICA")

    def _update_cross_replica(self, op: str, value) -> None:
        agg = self._agg
        if agg is VariableAggregation.NONE:
            raise ValueError(self._no_aggregation("updated"))
        if agg is VariableAggregation.SUM and op != "assign":
            raise ValueError(
                f"{op} of sync-on-read variable {self._name!r} in cross-replica context is "
                "not supported with aggregation SUM (as in tf.distribute): the sum over "
                "replicas cannot be changed by a delta on every replica; read it, then "
                "assign the new total, or update it inside strategy.run")
        arr = self._coerce(value, op)
        if agg is VariableAggregation.SUM:
            # Each replica holds total / n, so that the aggregated read gives the total
            # back (integers truncate toward zero, as TensorFlow's cast does).
            n = self._strategy.num_replicas_in_sync
            with on_device_of(arr):   # a GPU value: on its device, after its producer
                share = arr / n
                arr = share.astype(self.dtype) if self.dtype.kind in "iub" else \
                    share.astype(self.dtype, copy=False)
        self._agree_value(op, arr)
        for c in self._values:
            c._write(op, arr)


def _cast(x, dtype):
    """``x.astype(dtype)`` on ``x``'s device (a combine runs with any device current)."""
    with on_device_of(x):
        return x.astype(dtype)


def local_arrays(v: DistributedVariable) -> tuple:
    """The component arrays of ``v``, in local replica order."""
    return tuple(c._array for c in v._values)


def as_components(value: Any):
    """A distributed variable as the per-replica arrays of its components; anything
    else unchanged (for ``strategy.reduce``/``gather``)."""
    if isinstance(value, DistributedVariable):
        from gpustrat.values import PerReplica  # noqa: PLC0415
        return PerReplica(local_arrays(value), devices=value._strategy.local_devices)
    return value


def replica_reduce_op(agg: VariableAggregation) -> ReduceOp:
    return _AGG_OPS[agg]


def zeros(strategy, shape, dtype, name: str, sync=VariableSynchronization.ON_WRITE,
          agg=VariableAggregation.NONE, trainable: bool = False) -> Variable:
    """A variable of zeros made without communication (zeros are equal everywhere):
    distributed under ``strategy``, plain when ``strategy`` is None. For state that
    optimizers and metrics own (slots, counters, totals)."""
    arr = np.zeros(shape, dtype)
    make = getattr(strategy, "_create_variable", None)
    if make is not None:
        return make(None, arr, trainable, name, None, sync, agg)
    if strategy is None:
        return Variable._plain(arr, trainable, name, sync, agg)
    comps = [to_device(arr, d, copy=True) for d in strategy.local_devices]
    cls = SyncOnReadVariable if sync is _ON_READ else MirroredVariable
    return cls._from_components(strategy, comps, trainable, name, sync, agg)


def strategy_of(v: Variable):
    """The strategy that made ``v``, None for a plain variable."""
    return v._strategy if isinstance(v, DistributedVariable) else None
