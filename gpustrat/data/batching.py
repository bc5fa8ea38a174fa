"""``batch`` and ``unbatch``: elements stacked into batches, and batches split into rows."""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterable

import numpy as np

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import UNKNOWN_CARDINALITY, rows_of_batches
from gpustrat.data.iterator_state import (FunctionIterator, StateIterator, load_element,
                                          save_element)
from gpustrat.data.unary import _MISSING, UnaryDataset, _close


def _stacker(first: Any) -> Callable[[list], Any]:
    """The function that stacks a list of elements shaped like ``first`` into a batch."""
    flatten, pack = st.make_plan(first)
    if len(flatten(first)) == 1 and not nest.is_nested(first):
        return st.stack

    def build(chunk):
        columns = zip(*[flatten(e) for e in chunk])
        return pack([st.stack(list(c)) for c in columns])
    return build


class BatchDataset(UnaryDataset):
    """``batch(b, drop_remainder)`` by stacking elements (sources that can slice fuse instead)."""

    def __init__(self, input_dataset, batch_size: int, drop_remainder: bool):
        super().__init__(input_dataset)
        self._batch_size, self._drop = batch_size, drop_remainder

    def batch_rows(self):
        return rows_of_batches(self._input.cardinality(), self._batch_size, self._drop)

    def _iter(self, ctx):
        b = self._batch_size
        it = self._input._iter(ctx)
        try:
            first = next(it, _MISSING)
            if first is _MISSING:
                return
            build = _stacker(first)
            chunk = []
            for element in itertools.chain((first,), it):
                chunk.append(element)
                if len(chunk) == b:
                    out, chunk = build(chunk), []
                    yield out
            if chunk and not self._drop:
                yield build(chunk)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        # A batch is built inside one next(): between calls there is no partial buffer,
        # so the state is the input's.
        b, drop = self._batch_size, self._drop
        plan = []

        def build(chunk):
            if not plan:
                plan.append(_stacker(chunk[0]))
            return plan[0](chunk)

        def step_fn(it):
            if it.fields["done"]:
                raise StopIteration
            chunk = []
            for element in it._inputs[0]:
                chunk.append(element)
                if len(chunk) == b:
                    return build(chunk)
            it.fields["done"] = True
            if chunk and not drop:
                return build(chunk)
            raise StopIteration
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, done=False)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._batch_size if self._drop else math.ceil(n / self._batch_size)

    def _compute_spec(self):
        dim = self._batch_size if self._drop else None
        return nest.map_structure(lambda s: s._batched(dim), self._input.element_spec)


def _check_unbatchable(spec: Any) -> None:
    """Refuse to unbatch elements whose spec shows components with different leading
    sizes (every element would fail, or an empty input would pass unnoticed)."""
    sizes = []
    for s in nest.flatten(spec):
        if not s.shape:
            raise ValueError(f"unbatch: component {s} is a scalar; unbatching needs a "
                             f"leading dimension in every component (element_spec {spec})")
        if s.shape[0] is not None and s.shape[0] not in sizes:
            sizes.append(s.shape[0])
    if len(sizes) > 1:
        raise ValueError(f"unbatch: the components' leading dimensions are known to differ "
                         f"({' and '.join(map(str, sizes))}, element_spec {spec}); every "
                         "component must have the same number of rows")


def _rows(element: Any, plan: list) -> Iterable:
    """The rows of one element to unbatch. ``plan`` is the flatten and pack functions
    of the elements' structure, made from the first nested element and kept there."""
    if not nest.is_nested(element):
        if np.ndim(element) == 0:
            raise ValueError("unbatch: element is a scalar; unbatching needs a "
                             "leading dimension")
        return element
    if not plan:
        plan.extend(st.make_plan(element))
    flatten, pack = plan
    leaves = flatten(element)
    dims = [st.leading_dim(v) for v in leaves]
    if len(set(dims)) != 1:
        raise ValueError(f"unbatch: components have different leading "
                         f"dimensions {dims}; they must all be equal")
    return map(pack, zip(*leaves))


class UnbatchDataset(UnaryDataset):
    """``unbatch()``: every row of every element becomes an element."""

    def _input_spec(self) -> Any:
        try:
            spec = self._input.element_spec
        except ValueError:
            return None  # an input too empty to have a spec has nothing to unbatch
        _check_unbatchable(spec)
        return spec

    def _iter(self, ctx):
        self._input_spec()
        it = self._input._iter(ctx)
        try:
            plan = []
            for element in it:
                yield from _rows(element, plan)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        self._input_spec()
        return _UnbatchIterator(self._input._state_iter(ctx))

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        # As tf.data: known only when every component has the same known, non-zero
        # leading dimension (an empty input with an unknown batch dimension is unknown).
        dims = {s.shape[0] for s in nest.flatten(self._input_spec() or ()) if s.shape}
        if len(dims) == 1 and dims != {None} and dims != {0}:
            return n * dims.pop()
        return UNKNOWN_CARDINALITY

    def _compute_spec(self):
        spec = self._input.element_spec
        _check_unbatchable(spec)
        return nest.map_structure(lambda s: s._unbatched(), spec)


class _UnbatchIterator(StateIterator):
    """``unbatch``: the state is the input's plus the batch being split and the next row."""

    def __init__(self, source: StateIterator):
        self._inputs = (source,)
        self._element, self._rows, self._row = None, [], 0
        self._plan = []

    def __next__(self):
        while self._element is None or self._row >= len(self._rows):
            self._set(next(self._inputs[0]), 0)
        row = self._rows[self._row]
        self._row += 1
        return row

    def _set(self, element, row: int) -> None:
        rows = list(_rows(element, self._plan))
        self._element, self._rows, self._row = element, rows, row

    def save(self):
        current = None if self._element is None or self._row >= len(self._rows) \
            else {"element": save_element(self._element), "row": self._row}
        return {"input": self._inputs[0].save(), "current": current}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        if state["current"] is not None:
            self._set(load_element(state["current"]["element"]),
                      int(state["current"]["row"]))
