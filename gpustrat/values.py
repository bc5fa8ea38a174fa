"""Distributed values: one component per local replica.

- :class:`PerReplica`: components that may differ between replicas (a batch piece, a
  per-replica loss).
- :class:`Mirrored`: components that hold the same value on every replica (an
  all-reduced gradient).

Both are leaves for :mod:`gpustrat.nest`: a structure of per-replica values is a
structure, a per-replica value of structures is not (``run`` regroups results so that
per-replica values sit at the leaves).
"""

from __future__ import annotations

from typing import Any, Sequence

from gpustrat import nest


class DistributedValues:
    """Base of per-replica and mirrored values: ``values`` holds one component per
    local replica, in replica order."""

    __slots__ = ("_values",)
    _kind = "DistributedValues"

    def __init__(self, values: Sequence[Any]):
        self._values = tuple(values)
        if not self._values:
            raise ValueError(f"a {type(self).__name__} needs at least one component")

    @property
    def values(self) -> tuple:
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def _format(self, fmt) -> str:
        body = ", ".join(f"{i}: {fmt(v)}" for i, v in enumerate(self._values))
        return f"{self._kind}:{{{body}}}"

    def __repr__(self) -> str:
        return self._format(repr)

    def __str__(self) -> str:
        return self._format(str)


class PerReplica(DistributedValues):
    """Components that may differ between replicas."""

    __slots__ = ()
    _kind = "PerReplica"


class Mirrored(DistributedValues):
    """Components that are equal on every replica."""

    __slots__ = ()
    _kind = "Mirrored"


def select_replica(index: int, structure: Any) -> Any:
    """Replace every distributed value in ``structure`` by its ``index``-th component."""
    if isinstance(structure, DistributedValues):
        return structure.values[index]
    if not nest.is_nested(structure):
        return structure
    return nest.map_structure(
        lambda v: v.values[index] if isinstance(v, DistributedValues) else v, structure)


def regroup(per_replica_results: Sequence[Any], wrap=PerReplica, always_wrap: bool = False
            ) -> Any:
    """Turn one structure per replica into one structure of per-replica values.

    Unless ``always_wrap``, a leaf that is the same object on every replica (``None``, a
    shared constant) stays a plain leaf, and a single replica's result is returned
    unchanged.

    Raises:
        ValueError: replicas returned structures of different shapes.
    """
    if len(per_replica_results) == 1 and not always_wrap:
        return per_replica_results[0]
    first = per_replica_results[0]
    flats = []
    for i, r in enumerate(per_replica_results):
        try:
            nest.assert_same_structure(first, r)
        except ValueError as e:
            raise ValueError(f"replica {i} returned a structure unlike replica 0's: {e}") from None
        flats.append(nest.flatten(r))
    leaves = []
    for column in zip(*flats):
        c0 = column[0]
        same = not always_wrap and all(c is c0 for c in column)
        leaves.append(c0 if same else wrap(column))
    return nest.pack_sequence_as(first, leaves)
