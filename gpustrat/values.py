"""Distributed values: one component per local replica.

- :class:`PerReplica`: components that may differ between replicas (a batch piece, a
  per-replica loss).
- :class:`Mirrored`: components that hold the same value on every replica (an
  all-reduced gradient).

Both are leaves for :mod:`gpustrat.nest`: a structure of per-replica values is a
structure, a per-replica value of structures is not (``run`` regroups results so that
per-replica values sit at the leaves).

A value a strategy makes (``run``'s results, distributed dataset elements,
``experimental_distribute_values_from_function``) records the strategy's local devices
in ``devices``; every strategy refuses a value made on other devices, whose components
would otherwise reach replicas on the wrong device. A value built by hand has
``devices`` None and is accepted by any strategy with as many local replicas.
"""

from __future__ import annotations

from typing import Any, Sequence

from gpustrat import nest
from gpustrat.devices import parse_device


class DistributedValues:
    """Base of per-replica and mirrored values: ``values`` holds one component per
    local replica, in replica order.

    Args:
        values: the components.
        devices: the local devices they were made on (names or Devices), one per
            component; None when unknown.
    """

    __slots__ = ("_values", "_devices")
    _kind = "DistributedValues"

    def __init__(self, values: Sequence[Any], devices: Sequence[Any] | None = None):
        self._values = tuple(values)
        if not self._values:
            raise ValueError(f"a {type(self).__name__} needs at least one component")
        if devices is not None:
            devices = tuple(map(parse_device, devices))
            if len(devices) != len(self._values):
                raise ValueError(f"a {type(self).__name__} of {len(self._values)} components "
                                 f"was given {len(devices)} devices")
        self._devices = devices

    @property
    def values(self) -> tuple:
        return self._values

    @property
    def devices(self) -> tuple | None:
        """The local devices the components were made on, or None when unknown."""
        return self._devices

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


def local_components(value: DistributedValues, devices: tuple, what: str) -> tuple:
    """``value``'s components, checked to be one per device of ``devices`` (a strategy's
    local devices) and made there.

    Raises:
        ValueError: another number of components, or components made on other devices
            (naming both device lists).
    """
    comps = value._values
    if len(comps) != len(devices):
        raise ValueError(f"{what} was given a {type(value).__name__} with {len(comps)} "
                         f"components but the strategy has {len(devices)} local replicas "
                         f"({_names(devices)})")
    own = value._devices
    if own is not None and own != devices:
        raise ValueError(
            f"{what} was given a {type(value).__name__} made on devices {_names(own)}, but "
            f"this strategy's local devices are {_names(devices)}: a distributed value "
            "belongs to the strategy that made it. Use this strategy's own values (its run, "
            "distributed datasets, experimental_distribute_values_from_function), or "
            "redistribute the other strategy's experimental_local_results(value) with this "
            "one's experimental_distribute_values_from_function")
    return comps


def _names(devices) -> list:
    return [d.name for d in devices]


def regroup(per_replica_results: Sequence[Any], devices: tuple | None = None,
            always_wrap: bool = False, wrap: type | None = None,
            keep_shared: bool = False) -> Any:
    """Turn one structure per replica into one structure of per-replica values.

    Every leaf becomes a :class:`PerReplica` of the replicas' leaves, whatever they are:
    a Python int or string computed on each replica is per replica whether or not the
    interpreter happens to share the object between them. Unless ``always_wrap``:

    - a leaf that is None on every replica stays None (nothing was returned there);
    - a leaf that is one distributed value or distributed variable on every replica (a
      value ``fn`` captured and returned, a variable made in ``run``) stays that value;
    - with ``keep_shared``, any leaf that is the same object on every replica stays
      that object (``merge_call`` arguments: what the replicas passed, not computed);
    - a single replica's result is returned unchanged.

    ``devices`` are the local devices the results were made on; ``wrap`` is the class
    of the merged leaves (default :class:`PerReplica`).

    Raises:
        ValueError: replicas returned structures of different shapes.
    """
    if len(per_replica_results) == 1 and not always_wrap:
        return per_replica_results[0]
    if not any(map(nest.is_nested, per_replica_results)):
        return _merge_leaf(per_replica_results, devices, always_wrap, wrap, keep_shared)
    first = per_replica_results[0]
    flats = []
    for i, r in enumerate(per_replica_results):
        try:
            nest.assert_same_structure(first, r)
        except ValueError as e:
            raise ValueError(f"replica {i} returned a structure unlike replica 0's: {e}") from None
        flats.append(nest.flatten(r))
    return nest.pack_sequence_as(
        first, [_merge_leaf(column, devices, always_wrap, wrap, keep_shared)
                for column in zip(*flats)])


def _merge_leaf(column: Sequence[Any], devices: tuple | None, always_wrap: bool,
                wrap: type | None = None, keep_shared: bool = False) -> Any:
    if not always_wrap:
        c0 = column[0]
        # None, a distributed value and a distributed variable are not interpreter
        # caching accidents: every replica returned nothing, or the one object it shares.
        if ((keep_shared or c0 is None or isinstance(c0, DistributedValues)
             or getattr(type(c0), "shared_by_replicas", False))
                and all(c is c0 for c in column)):
            return c0
    return (wrap or PerReplica)(column, devices)
