"""The replica context: what a function run by ``strategy.run`` sees of its replica."""

from __future__ import annotations

from typing import Any

from gpustrat.distribute import collective_ops, reduction
from gpustrat.reduce_util import ReduceOp


class ReplicaContext:
    """One replica's view inside ``strategy.run``.

    Collectives (:meth:`all_reduce`, :meth:`all_gather`) must be called by every replica,
    in the same order; they block until all replicas of all workers have arrived.
    """

    def __init__(self, strategy, local_index: int, replica_id_in_sync_group: int):
        self._strategy = strategy
        self._local_index = local_index
        self._replica_id = replica_id_in_sync_group

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
    def devices(self) -> tuple:
        return (self._strategy.local_devices[self._local_index],)

    def _exchange(self, signature, value, combine):
        return self._strategy._rendezvous.exchange(self._local_index, signature, value, combine)

    def all_reduce(self, reduce_op, value: Any) -> Any:
        """Reduce ``value`` (any nested structure) over every replica in sync; every
        replica receives the same result. ``reduce_op`` is a ReduceOp or its name."""
        op = ReduceOp.from_value(reduce_op)
        comm = self._strategy.communicator
        sig = collective_ops.leaf_signature("all_reduce", op.name, value)
        reduction.check_leaves(sig, value, op, "all_reduce", self._replica_id)
        return self._exchange(
            sig, value, lambda vals: collective_ops.all_reduce_structures(comm, vals, op))

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` (any nested structure) from every replica along ``axis``,
        in replica order; shapes may differ only along ``axis``."""
        comm = self._strategy.communicator
        sig = collective_ops.leaf_signature("all_gather", str(axis), value, skip_axis=axis)
        reduction.check_leaves(sig, value, None, "all_gather", self._replica_id)
        return self._exchange(
            sig, value, lambda vals: collective_ops.all_gather_structures(comm, vals, axis))

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class ValueContext:
    """What ``experimental_distribute_values_from_function`` tells ``value_fn``."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"ValueContext(replica_id_in_sync_group={self.replica_id_in_sync_group}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
