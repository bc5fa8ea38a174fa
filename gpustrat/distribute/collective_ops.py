"""Collectives on nested structures, for the replica context and ``strategy.reduce``.

The replica threads meet in the runner's rendezvous; the last to arrive calls one of
these functions with every local replica's contribution. They flatten the structures,
turn Python scalars into arrays, call the strategy's communicator once per leaf (or
once per fusion bucket), and give each replica its structure back.
"""

from __future__ import annotations

import contextlib
import operator
import sys

from typing import Any, Sequence

import numpy as np

from gpustrat import nest
from gpustrat.collectives.base import Communicator
from gpustrat.collectives.fusion import fused_all_reduce, fused_all_reduce_columns, layout_of
from gpustrat.devices import Device, is_array, is_gpu_array, to_device, to_host
from gpustrat.reduce_util import ReduceOp

_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE_ID = operator.attrgetter("data.device_id")   # (no Device object made)


def as_array(x: Any, device: Device):
    """An array on ``device`` for a leaf: arrays move if needed, scalars become 0-d."""
    if x is None:
        raise TypeError("a None leaf cannot be reduced or gathered over replicas; leave it "
                        "out of the structure or give it a value")
    if is_array(x) or hasattr(x, "__array__") or hasattr(x, "__cuda_array_interface__") \
            or hasattr(x, "__dlpack__"):
        return to_device(x, device)
    return to_device(np.asarray(x), device)


def _restore_scalar(template: Any, value: Any) -> Any:
    # A Python number in gives a Python number out, as a user printing it expects.
    # Read on the value's own device (to_host makes it current), so that the copy is
    # ordered after the reduction that wrote it there.
    if isinstance(template, (bool, int, float, complex)) and not is_array(template):
        return to_host(value).item() if hasattr(value, "item") else value
    return value


_dtype_names: dict = {}


def _dtype_name(dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


def leaf_signature(kind: str, op: str, values: Any, skip_axis: int | None = None) -> tuple:
    """What the replicas must agree on for a collective: kind, op, structure, layout."""
    if type(values) is np.ndarray:  # one array: the common case
        shape = values.shape
        if skip_axis is not None and shape:
            ax = skip_axis % len(shape)
            shape = shape[:ax] + shape[ax + 1:]
        return (kind, op, ((shape, _dtype_name(values.dtype)),))
    sig = []
    for leaf in nest.flatten(values):
        shape = tuple(getattr(leaf, "shape", ()))
        if skip_axis is not None and shape:
            shape = tuple(s for i, s in enumerate(shape) if i != skip_axis % len(shape))
        dtype = str(getattr(leaf, "dtype", type(leaf).__name__))
        sig.append((shape, dtype))
    return (kind, op, tuple(sig))


class FlatLayout:
    """What the replicas of a collective on a flat list or tuple of arrays must agree
    on: the sequence type, every array's shape and dtype. Compared as a whole (tuple
    compares, in C); spelled out as ``(shape, dtype name)`` pairs only for an error."""

    __slots__ = ("kind", "shapes", "dtypes")

    def __init__(self, kind: type, shapes: tuple, dtypes: tuple):
        self.kind, self.shapes, self.dtypes = kind, shapes, dtypes

    def __eq__(self, other) -> bool:
        return type(other) is FlatLayout and self.kind is other.kind and \
            self.shapes == other.shapes and self.dtypes == other.dtypes

    def __ne__(self, other) -> bool:
        return not self == other

    __hash__ = None

    def __iter__(self):
        return iter([(shape, str(dtype)) for shape, dtype in zip(self.shapes, self.dtypes)])

    def __len__(self) -> int:
        return len(self.shapes)


#: dtype kinds a flat all_reduce takes without a per-leaf check, by op: numbers (bool
#: only with MAX/MIN, complex not with them).
_FLAT_KINDS = {"SUM": frozenset("iufc"), "MEAN": frozenset("iufc"),
               "MAX": frozenset("iufb"), "MIN": frozenset("iufb")}


def flat_dtypes(value, array_type, device_index: int | None, op_name: str
                ) -> tuple | None:
    """The dtypes of ``value`` when it is a list or tuple of two or more arrays of
    exactly ``array_type``, all on GPU ``device_index`` (None: host arrays), of dtypes
    ``op_name`` reduces; else None (the general path checks and converts). One C-level
    pass per attribute, no per-leaf Python."""
    kind = type(value)
    if (kind is not list and kind is not tuple) or len(value) < 2 or \
            set(map(type, value)) != {array_type}:
        return None
    if device_index is not None and set(map(_DEVICE_ID, value)) != {device_index}:
        return None
    dtypes = tuple(map(_DTYPE, value))
    kinds = _FLAT_KINDS[op_name]
    if not all(d.kind in kinds for d in set(dtypes)):
        return None
    return dtypes


def flat_layout_of(value, dtypes: tuple) -> FlatLayout:
    """The :class:`FlatLayout` of ``value``, whose :func:`flat_dtypes` are ``dtypes``."""
    return FlatLayout(type(value), tuple(map(_SHAPE, value)), dtypes)


class _FlatPlan:
    """The fusion layout of one :class:`FlatLayout` on one communicator, and the last
    step's GPU results, handed out again while nothing outside holds them (a training
    loop drops a step's reduced gradients before the next step): then the next step
    packs into the same fusion buffers and returns the same views, with no view made
    per tensor."""

    __slots__ = ("fusion", "held", "refs", "structure")

    def __init__(self, layout: FlatLayout, value):
        self.fusion = layout_of(list(layout.shapes), list(layout.dtypes))
        #: What several workers agree on besides the layout (see
        #: :func:`same_structure_everywhere`), spelled once.
        self.structure = (f"structure {nest.describe(value)}",)
        self.held = None   # (buffers[bucket][replica], results[replica])
        self.refs = None

    def reusable(self):
        """The held ``(buffers, results)`` when only this plan refers to them."""
        held = self.held
        if held is None or _flat_refs(held) != self.refs:
            return None
        return held

    def keep(self, buffers: list, results: list) -> None:
        if not all(map(is_gpu_array, buffers[0])):
            return   # host buffers come from the fusion's own pooled arenas
        if any(b.dtype != spec[5] for row, spec in zip(buffers, self.fusion.buckets)
               for b in row):
            return   # a reduction into new arrays (integer MEAN gives floats)
        held = self.held = (buffers, results)
        self.refs = _flat_refs(held)


def _flat_refs(held) -> tuple:
    """References to the held results: to each replica's list, the most to one of its
    views, and to each buffer's memory (every view of a buffer refers to it, the
    user's own views of a result too). Unchanged from when they were kept unless
    something outside the plan holds one of them."""
    buffers, results = held
    return (tuple(map(sys.getrefcount, results)),
            max(max(map(sys.getrefcount, r)) for r in results),
            tuple(sys.getrefcount(b.data.mem) for row in buffers for b in row))


def all_reduce_flat(comm: Communicator, values: Sequence, op: ReduceOp,
                    layout: FlatLayout) -> list:
    """:func:`all_reduce_structures` of flat lists (or tuples) of arrays whose
    :class:`FlatLayout` every replica gave as ``layout`` (checked by the rendezvous):
    one fused reduction, planned once per layout and communicator."""
    # The communicator keeps its plans (they hold its devices' buffers).
    plans = comm.__dict__.get("_flat_plans")
    if plans is None:
        plans = comm.__dict__["_flat_plans"] = {}
    key = (layout.kind, layout.shapes, layout.dtypes)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 64:
            plans.clear()
        plan = plans[key] = _FlatPlan(layout, values[0])
    held = plan.reusable()
    with _NO_AGREEMENT if comm.num_workers == 1 else comm.agreeing(
            plan.structure, f"all_reduce({op.name}) of a nested structure", _SAME_STRUCTURE):
        buffers, results = fused_all_reduce_columns(
            comm, values, op, plan.fusion, None if held is None else held[0])
    if results is None:
        results = held[1]
    else:
        if layout.kind is tuple:
            results = [tuple(r) for r in results]
        plan.held = None
        plan.keep(buffers, results)
    # Each replica gets a list of its own (a tuple is immutable: the held one itself).
    return results if layout.kind is tuple else [list(r) for r in results]


def check_same_structures(kind: str, values: Sequence[Any]) -> None:
    """Every replica's structure must be replica 0's: leaves pair up by position, so
    ``{"a", "b"}`` against ``{"a", "c"}`` would otherwise be combined silently."""
    for i in range(1, len(values)):
        try:
            nest.assert_same_structure(values[0], values[i])
        except ValueError as e:
            raise ValueError(f"{kind}: replica {i} gave a structure that differs from "
                             f"replica 0's ({e}); every replica must pass the same "
                             "structure") from None


def _numeric_host_array(x: Any, comm: Communicator) -> bool:
    """Whether ``x`` may skip the structure walk: one NumPy array of numbers on a CPU
    replica (anything else takes the general path and its checks)."""
    return type(x) is np.ndarray and x.dtype.kind in "biufc" and not comm.devices[0].is_gpu


_NO_AGREEMENT = contextlib.nullcontext()
_SAME_STRUCTURE = ("every worker must pass the same structure (the same dict keys, sequence "
                   "lengths and nesting): the leaves pair up by position")


def same_structure_everywhere(comm: Communicator, kind: str, value: Any):
    """A context for the collectives of a nested ``value``'s leaves: under several
    workers the first one's header also carries the structure (:func:`nest.describe`),
    so that workers whose leaves would pair up differently (other dict keys, another
    leaf count) raise on every worker instead of combining the wrong leaves."""
    if comm.num_workers == 1 or not nest.is_nested(value):
        return contextlib.nullcontext()
    return comm.agreeing((f"structure {nest.describe(value)}",),
                         f"{kind} of a nested structure", _SAME_STRUCTURE)


def all_reduce_structures(comm: Communicator, values: Sequence[Any], op: ReduceOp) -> list:
    """One reduced structure per local replica (``values[i]`` is replica i's)."""
    if len(values) == 1 and _numeric_host_array(values[0], comm):
        return comm.all_reduce(values, op)  # one host array: nothing to flatten
    check_same_structures("all_reduce", values)
    flats = [nest.flatten(v) for v in values]
    n = len(flats[0])
    reduced: list = [None] * n
    # On GPUs a Python number the host holds is reduced on the host: sent up to the
    # devices, through NCCL and read back, it would make the host wait for the GPUs.
    numbers = [j for j in range(n) if _host_number(flats[0][j])] \
        if comm.devices[0].is_gpu else ()
    with same_structure_everywhere(comm, f"all_reduce({op.name})", values[0]):
        for j in numbers:
            column = [flat[j] for flat in flats]
            if all(map(_host_number, column)):
                reduced[j] = [comm.reduce_numbers(column, op)] * len(values)
        rest = [j for j in range(n) if reduced[j] is None]
        tensors = [[as_array(flats[i][j], comm.devices[i]) for i in range(len(values))]
                   for j in rest]
        # Many leaves (a model's gradients) go in fusion buckets: one collective per
        # bucket.
        if len(tensors) > 1:
            out = fused_all_reduce(comm, tensors, op)
        else:
            out = [comm.all_reduce(t, op) for t in tensors]
    for j, r in zip(rest, out):
        reduced[j] = r
    return [nest.pack_sequence_as(values[i], [_restore_scalar(flats[i][j], reduced[j][i])
                                              for j in range(n)])
            for i in range(len(values))]


def _host_number(x) -> bool:
    """A Python int or float (not a bool: NumPy adds booleans as a logical or)."""
    t = type(x)
    return t is float or t is int


def all_gather_structures(comm: Communicator, values: Sequence[Any], axis: int) -> list:
    """Each leaf concatenated along ``axis`` over every replica in sync."""
    if len(values) == 1 and _numeric_host_array(values[0], comm) and values[0].ndim:
        return comm.all_gather(values, axis)  # one host array: nothing to flatten
    check_same_structures("all_gather", values)
    flats = [nest.flatten(v) for v in values]
    out_leaves = []
    with same_structure_everywhere(comm, "all_gather", values[0]):
        for j in range(len(flats[0])):
            bufs = [as_array(flats[i][j], comm.devices[i]) for i in range(len(values))]
            if bufs[0].ndim == 0:
                raise ValueError("all_gather needs arrays with at least one dimension to "
                                 f"concatenate along axis {axis}; got a scalar (0-d) value")
            out_leaves.append(comm.all_gather(bufs, axis))
    return [nest.pack_sequence_as(values[i], [leaf[i] for leaf in out_leaves])
            for i in range(len(values))]
