"""``padded_batch``: batching elements whose shapes differ, by padding them.

Words:
    padded shape: for one component, the shape every element is padded to before
        stacking. Its entries are ints (pad to exactly that size) or None (pad to the
        largest size of that dimension in the batch). Without ``padded_shapes`` it is
        the component's spec shape: its static dimensions stay, the others are padded
        to the batch's largest, as ``tf.data`` does.
    padding value: the scalar written where an element is padded (0, or ``b""`` for
        strings, unless given).

The spec of a padded batch is ``(batch dim,) + padded shape`` per component, the batch
dimension being the batch size under ``drop_remainder=True`` and None otherwise, so a
dimension is static exactly where the padded shape fixes it: every batch has it.

Fast path: when the input is a source that slices whole batches (``from_tensor_slices``,
``range``, ``.npy`` files: every element of a component has the same shape), a batch is
one slice, and padding it is one allocation and one copy per component (none at all
when no dimension needs padding).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from gpustrat import devices, nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import Dataset, rows_of_batches
from gpustrat.data.spec import STRING, TensorSpec
from gpustrat.data.unary import UnaryDataset, _close


def _as_shape(shape: Any, where: str) -> tuple:
    """A padded shape given by the user: a list or tuple (or array) of ints and None
    (-1 means None), or one int ``n`` for the shape ``(n,)``, as ``tf.TensorShape``
    reads it. Anything that is no shape is a ValueError, an entry of another kind than
    an int a TypeError (TensorFlow's exception types)."""
    if isinstance(shape, TensorSpec):
        shape = shape.shape
    if isinstance(shape, np.ndarray):
        shape = shape.tolist()
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        if shape < 0:
            raise ValueError(f"padded_batch: the padded shape {shape!r} of {where} is "
                             "negative; give a size of at least 0 (or [None] for the "
                             "batch's largest)")
        return (int(shape),)
    if not isinstance(shape, (tuple, list)):
        raise ValueError(f"padded_batch: the padded shape of {where} must be a list or "
                         f"tuple of ints or None (or one int), got {shape!r}")
    out = []
    for d in shape:
        if d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                         and int(d) == -1):
            out.append(None)
        elif isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0:
            out.append(int(d))
        elif isinstance(d, (int, np.integer, tuple, list)) and not isinstance(d, bool):
            raise ValueError(f"padded_batch: the padded shape {shape!r} of {where} has "
                             f"the entry {d!r}; entries must be non-negative ints or None")
        else:
            raise TypeError(f"padded_batch: the padded shape {shape!r} of {where} has the "
                            f"entry {d!r}; entries must be non-negative ints or None")
    return tuple(out)


def _flatten_up_to(spec: Any, value: Any, what: str) -> list:
    """``value``'s entries at the leaf positions of ``spec`` (a shape is a tuple, so
    the walk follows the spec's structure, not the value's). Another kind of structure
    than the elements' is a TypeError, other keys or another length a ValueError."""
    if not nest.is_nested(spec):
        return [value]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise TypeError(f"padded_batch: {what} must be a dict with the keys "
                            f"{sorted(spec)} like the elements, got {value!r}")
        if sorted(value) != sorted(spec):
            raise ValueError(f"padded_batch: {what} has the keys {sorted(value)}, but the "
                             f"elements have the keys {sorted(spec)}")
        return [v for k in sorted(spec) for v in _flatten_up_to(spec[k], value[k], what)]
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"padded_batch: {what} must be a tuple of {len(spec)} like the "
                        f"elements, got {value!r}")
    if len(value) != len(spec):
        raise ValueError(f"padded_batch: {what} has {len(value)} entries, but the "
                         f"elements have {len(spec)} components: give one per component")
    return [v for s, e in zip(spec, value) for v in _flatten_up_to(s, e, what)]


def _padding_value(value: Any, dtype: np.dtype, where: str) -> Any:
    """``value`` as a scalar of ``dtype``; TypeError when it does not convert exactly."""
    if value is None:
        return b"" if dtype == STRING else dtype.type(0)
    if dtype == STRING:
        if isinstance(value, str):
            return value.encode()
        if isinstance(value, (bytes, np.bytes_)):
            return bytes(value)
        raise TypeError(f"padded_batch: the padding value {value!r} of {where} must be a "
                        "string, like the component")
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise ValueError(f"padded_batch: the padding value of {where} must be a scalar, "
                         f"got shape {arr.shape}")
    if arr.dtype.kind in "OSU":
        raise TypeError(f"padded_batch: the padding value {value!r} of {where} does not "
                        f"match the component dtype {dtype.name}")
    conv = arr.astype(dtype)
    exact = bool(conv == arr) or (arr.dtype.kind == "f" and np.isnan(arr))
    if not exact or (isinstance(value, (np.ndarray, np.generic)) and
                     not np.can_cast(arr.dtype, dtype, "same_kind")):
        raise TypeError(f"padded_batch: the padding value {value!r} ({arr.dtype.name}) of "
                        f"{where} does not match the component dtype {dtype.name}")
    return conv[()]


class PaddedBatchDataset(UnaryDataset):
    """``padded_batch(batch_size, padded_shapes, padding_values, drop_remainder)``."""

    def __init__(self, input_dataset: Dataset, batch_size: int, padded_shapes=None,
                 padding_values=None, drop_remainder: bool = False):
        super().__init__(input_dataset)
        self._batch_size, self._drop = batch_size, bool(drop_remainder)
        self._padded_shapes_arg, self._padding_values_arg = padded_shapes, padding_values

    def batch_rows(self):
        return rows_of_batches(self._input.cardinality(), self._batch_size, self._drop)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._batch_size if self._drop else -(-n // self._batch_size)

    def _plan(self) -> tuple[list[TensorSpec], list[tuple], list[tuple], list[Any]]:
        """(component specs, spec shapes, padded shapes, padding values), flat; checked
        once."""
        plan = self.__dict__.get("_plan_cache")
        if plan is not None:
            return plan
        from gpustrat.data.windowing import DatasetSpec  # noqa: PLC0415
        spec = self._input.element_spec
        specs = nest.flatten(spec)
        for s in specs:
            if isinstance(s, DatasetSpec):
                raise TypeError("padded_batch is not supported for datasets of datasets "
                                "(elements made by window): batch each window with "
                                "flat_map(lambda w: w.padded_batch(...)) instead")
        where = [f"component {i}" if len(specs) > 1 else "the elements"
                 for i in range(len(specs))]
        if self._padded_shapes_arg is None:
            shapes = [s.shape for s in specs]
        else:
            given = _flatten_up_to(spec, self._padded_shapes_arg, "padded_shapes")
            shapes = [_as_shape(g, w) for g, w in zip(given, where)]
            for s, p, w in zip(specs, shapes, where):
                fits = len(p) == len(s.shape) and all(
                    a is None or b is None or a >= b for a, b in zip(p, s.shape))
                if not fits:
                    raise ValueError(f"padded_batch: the padded shape {p} of {w} is not "
                                     f"compatible with its shape {s.shape}: it needs the "
                                     "same rank and no dimension smaller than a static one")
        values_arg = self._padding_values_arg
        if values_arg is None:
            values = [None] * len(specs)
        elif nest.is_nested(spec) and not nest.is_nested(values_arg):
            values = [values_arg] * len(specs)
        else:
            values = _flatten_up_to(spec, values_arg, "padding_values")
        values = [_padding_value(v, s.dtype, w) for v, s, w in zip(values, specs, where)]
        # Without padded_shapes every dimension is padded to the batch's largest (the
        # spec keeps the input spec's static dimensions, which every element has).
        padded = [(None,) * len(p) for p in shapes] if self._padded_shapes_arg is None \
            else shapes
        plan = (specs, shapes, padded, values)
        self.__dict__["_plan_cache"] = plan
        return plan

    def _compute_spec(self):
        specs, shapes, _, _ = self._plan()
        dim = self._batch_size if self._drop else None
        flat = [TensorSpec((dim,) + p, s.dtype) for s, p in zip(specs, shapes)]
        return nest.pack_sequence_as(self._input.element_spec, flat)

    def _iter(self, ctx):
        fused = self._input._batch_fused(self._batch_size, self._drop)
        if fused is not None and self._padded_shapes_arg is None:
            return fused._iter(ctx)  # a slicing source's rows have one shape: no padding
        return self._iter_padded(fused, ctx)

    def _state_iter(self, ctx):
        # Each batch is built inside one next(): the state is the input's (or the fused
        # source's) position.
        from gpustrat.data.iterator_state import FunctionIterator  # noqa: PLC0415
        fused = self._input._batch_fused(self._batch_size, self._drop)
        if fused is not None and self._padded_shapes_arg is None:
            return fused._state_iter(ctx)
        plan: list = []

        def step_fn(it):
            source = it._inputs[0]
            if it.fields["done"]:
                raise StopIteration
            if fused is not None:
                batch = next(source)
                if not plan:
                    specs, _, shapes, values = self._plan()
                    flatten, pack = st.make_plan(batch)
                    where = [f"component {i}" if len(specs) > 1 else "the elements"
                             for i in range(len(specs))]
                    targets = [_target([tuple(v.shape[1:])], p, w)
                               for v, p, w in zip(flatten(batch), shapes, where)]
                    plan.extend((flatten, pack, targets, values))
                flatten, pack, targets, values = plan
                return pack([_pad_batch(v, t, c)
                             for v, t, c in zip(flatten(batch), targets, values)])
            chunk = []
            for element in source:
                if not plan:
                    specs, _, shapes, values = self._plan()
                    plan.extend((*st.make_plan(element), specs, shapes, values))
                chunk.append(plan[0](element))
                if len(chunk) == self._batch_size:
                    break
            else:
                it.fields["done"] = True
                if not chunk or self._drop:
                    raise StopIteration
            _, pack, specs, shapes, values = plan
            return pack(_pad_columns(chunk, specs, shapes, values))
        return FunctionIterator(((fused or self._input)._state_iter(ctx),), step_fn,
                                done=False)

    def _iter_padded(self, fused: Dataset | None, ctx):
        it = (fused or self._input)._iter(ctx)
        try:
            first = next(it, None)
            if first is None:
                return  # an empty input has no spec to check, and nothing to pad
            specs, _, shapes, values = self._plan()
            flatten, pack = st.make_plan(first)
            rest = itertools.chain((first,), it)
            if fused is not None:
                # Whole batches sliced by the source, one shape per component: one
                # target each, and one copy per component and batch.
                where = [f"component {i}" if len(specs) > 1 else "the elements"
                         for i in range(len(specs))]
                targets = [_target([tuple(v.shape[1:])], p, w)
                           for v, p, w in zip(flatten(first), shapes, where)]
                for batch in rest:
                    yield pack([_pad_batch(v, t, c)
                                for v, t, c in zip(flatten(batch), targets, values)])
                return
            chunk = []
            for element in rest:
                chunk.append(flatten(element))
                if len(chunk) == self._batch_size:
                    yield pack(_pad_columns(chunk, specs, shapes, values))
                    chunk = []
            if chunk and not self._drop:
                yield pack(_pad_columns(chunk, specs, shapes, values))
        finally:
            _close(it)


def _pad_columns(rows: list, specs: list, shapes: list, values: list) -> list:
    """The padded, stacked components of a batch given as rows of flat leaves."""
    return [_pad_stack(list(c), p, v, s, i, len(specs))
            for i, (c, p, v, s) in enumerate(zip(zip(*rows), shapes, values, specs))]


def _target(shapes: list[tuple], padded: tuple, where: str) -> tuple:
    """The shape a batch's elements are padded to; ValueError when one does not fit."""
    rank = len(padded)
    for shape in shapes:
        if len(shape) != rank:
            raise ValueError(f"padded_batch: an element of {where} has shape {shape}, "
                             f"whose rank differs from the padded shape {padded}")
    target = []
    for d, p in enumerate(padded):
        largest = max(s[d] for s in shapes)
        if p is None:
            target.append(largest)
        elif largest > p:
            raise ValueError(f"padded_batch: an element of {where} has shape "
                             f"{next(s for s in shapes if s[d] > p)}, larger than the "
                             f"padded shape {padded} in dimension {d}: give a larger "
                             "padded shape (or None to pad to the batch's largest)")
        else:
            target.append(p)
    return tuple(target)


def _pad_stack(leaves: list, padded: tuple, value, spec: TensorSpec, index: int,
               count: int) -> Any:
    """Stack leaves of differing shapes, each padded with ``value`` to one shape."""
    where = f"component {index}" if count > 1 else "the elements"
    shapes = [tuple(np.shape(v)) if not isinstance(v, bytes) else () for v in leaves]
    target = _target(shapes, padded, where)
    if all(s == target for s in shapes):
        return st.stack(leaves, "padded_batch")
    first = leaves[0]
    xp = devices.array_module(first)
    dtype = spec.dtype
    out = xp.empty((len(leaves),) + target, dtype=dtype)
    out[...] = value
    for i, (v, s) in enumerate(zip(leaves, shapes)):
        out[(i,) + tuple(slice(0, d) for d in s)] = v
    return out


def _pad_batch(batch: Any, target: tuple, value) -> Any:
    """A batch whose rows all share one shape, padded to the shape ``target``."""
    rows = tuple(batch.shape[1:])
    if target == rows:
        return batch
    xp = devices.array_module(batch)
    out = xp.empty((batch.shape[0],) + target, dtype=batch.dtype)
    out[...] = value
    out[(slice(None),) + tuple(slice(0, d) for d in rows)] = batch
    return out
