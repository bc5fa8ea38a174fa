"""``window``: elements grouped into windows, each window a dataset (as ``tf.data``).

Words:
    window: ``size`` elements of the input, taken ``stride`` apart, starting every
        ``shift`` elements (``shift`` defaults to ``size``): window ``j`` holds input
        elements ``j*shift + k*stride`` for ``k < size`` that exist. Windows start
        while their first element exists, so the last ones may be shorter; with
        ``drop_remainder`` only full windows are kept.
    window element: for an input element with several components (a tuple, a dict),
        a window is the same structure with one dataset per component, each holding
        that component's values (``tf.data``'s layout). Use ``flat_map`` to turn
        windows into tensors: ``ds.window(3, 1).flat_map(lambda w: w.batch(3))``, or
        ``flat_map(lambda x, y: Dataset.zip((x.batch(3), y.batch(3))))``.
    DatasetSpec: the spec of a component that is a dataset; ``element_spec`` is the
        spec of that dataset's elements.

Cardinality, as ``tf.data``: ``ceil(n / shift)``, or with ``drop_remainder`` the number
of full windows, ``(n - ((size - 1) * stride + 1)) // shift + 1`` (0 when negative).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import Dataset, _check_positive
from gpustrat.data.iterator_state import (ListIterator, StateIterator, pack_elements,
                                          unpack_elements)
from gpustrat.data.spec import TensorSpec
from gpustrat.data.unary import UnaryDataset, _close


class DatasetSpec:
    """The spec of an element component that is itself a dataset (a window)."""

    __slots__ = ("element_spec",)

    def __init__(self, element_spec: Any):
        self.element_spec = element_spec

    @property
    def shape(self) -> tuple:
        """``()``: a dataset component is one value (as TensorFlow's DatasetSpec)."""
        return ()

    def __eq__(self, other):
        return isinstance(other, DatasetSpec) and other.element_spec == self.element_spec

    def __hash__(self):
        return hash(("DatasetSpec", repr(self.element_spec)))

    def most_specific_compatible(self, other: "DatasetSpec") -> "DatasetSpec":
        from gpustrat.data.spec import merge_specs  # noqa: PLC0415
        if not isinstance(other, DatasetSpec):
            raise TypeError(f"incompatible element specs {self} and {other}")
        return DatasetSpec(merge_specs(self.element_spec, other.element_spec))

    def __repr__(self):
        return f"DatasetSpec({self.element_spec})"


def _save_spec(spec: Any) -> dict:
    """An element spec as a state tree: its leaves' shapes and dtypes, and its structure."""
    def leaf(s):
        if isinstance(s, DatasetSpec):
            return {"dataset": _save_spec(s.element_spec)}
        return {"shape": [-1 if d is None else d for d in s.shape], "dtype": s.dtype.str}
    return {"leaves": [leaf(s) for s in nest.flatten(spec)],
            "structure": nest.map_structure(lambda _: 0, spec)}


def _load_spec(saved: dict) -> Any:
    def leaf(x):
        if "dataset" in x:
            return DatasetSpec(_load_spec(x["dataset"]))
        return TensorSpec([None if d < 0 else d for d in x["shape"]], x["dtype"])
    leaves = [leaf(x) for x in saved["leaves"]]
    structure = saved["structure"]
    return nest.pack_sequence_as(structure, leaves) if nest.is_nested(structure) \
        else leaves[0]


def contains_datasets(spec: Any) -> bool:
    """Whether an element spec has a component that is a dataset."""
    return any(isinstance(s, DatasetSpec) for s in nest.flatten(spec))


class ElementsDataset(Dataset):
    """A dataset over a list of elements already in memory, with a given spec (what a
    window component, or a group of ``group_by_window``, is)."""

    def __init__(self, elements: list, element_spec: Any):
        self._elements = elements
        self.__dict__["_spec_cache"] = element_spec

    def _iter(self, ctx):
        yield from self._elements

    def _state_iter(self, ctx):
        return ListIterator(self._elements)

    def _elements_state(self) -> dict:
        """This dataset as a state tree (a window held in a buffer that is saved)."""
        return {"elements": pack_elements(self._elements),
                "spec": _save_spec(self.__dict__["_spec_cache"])}

    @classmethod
    def _from_state(cls, state: dict) -> "ElementsDataset":
        return cls(unpack_elements(state["elements"]), _load_spec(state["spec"]))

    def _cardinality(self):
        return len(self._elements)

    def _compute_spec(self):  # set at construction
        return self.__dict__["_spec_cache"]


class WindowDataset(UnaryDataset):
    """``window(size, shift=None, stride=1, drop_remainder=False)``."""

    def __init__(self, input_dataset: Dataset, size: int, shift: int | None = None,
                 stride: int = 1, drop_remainder: bool = False):
        super().__init__(input_dataset)
        self._size = _check_positive("size", size, "window")
        self._shift = self._size if shift is None else _check_positive("shift", shift, "window")
        self._stride = _check_positive("stride", stride, "window")
        self._drop = bool(drop_remainder)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        if self._drop:
            rest = n - ((self._size - 1) * self._stride + 1)
            return 0 if rest < 0 else rest // self._shift + 1
        return -(-n // self._shift)

    def _compute_spec(self):
        return nest.map_structure(DatasetSpec, self._input.element_spec)

    def _window(self, elements: list, spec: Any) -> Any:
        if not nest.is_nested(spec):
            return ElementsDataset(elements, spec)
        flatten, pack = st.make_plan(spec)
        columns = list(zip(*[flatten(e) for e in elements])) if elements else \
            [()] * len(nest.flatten(spec))
        specs = nest.flatten(spec)
        return pack([ElementsDataset(list(c), s) for c, s in zip(columns, specs)])

    def _iter(self, ctx):
        size, shift, stride = self._size, self._shift, self._stride
        span = (size - 1) * stride + 1  # input elements one full window covers
        spec = None  # known once there is an element (an empty input may have none)
        it = self._input._iter(ctx)
        buf: collections.deque = collections.deque()
        ended = False
        try:
            while True:
                while len(buf) < span and not ended:
                    element = next(it, None)
                    if element is None:
                        ended = True
                    else:
                        buf.append(element)
                if not buf:
                    return
                if len(buf) < span and self._drop:
                    return
                if spec is None:
                    spec = self._input.element_spec
                yield self._window(list(itertools.islice(buf, 0, span, stride)), spec)
                # Drop `shift` elements: those buffered, then unread ones of the input.
                drop = shift
                while buf and drop:
                    buf.popleft()
                    drop -= 1
                while drop and not ended:
                    if next(it, None) is None:
                        ended = True
                    drop -= 1
        finally:
            _close(it)

    def _state_iter(self, ctx):
        return _WindowIterator(self, self._input._state_iter(ctx))


class _WindowIterator(StateIterator):
    """``window``: the state is the input's, the elements buffered for the next windows
    and the count still to drop before the next window (the window's shift)."""

    def __init__(self, node: WindowDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._buf: collections.deque = collections.deque()
        self._ended = False
        self._drop = 0
        self._spec = None

    def _read(self):
        try:
            return next(self._inputs[0])
        except StopIteration:
            self._ended = True
            return None

    def __next__(self):
        node = self._node
        span = (node._size - 1) * node._stride + 1
        buf = self._buf
        # The previous window's shift: buffered elements first, then unread ones.
        while self._drop and buf:
            buf.popleft()
            self._drop -= 1
        while self._drop and not self._ended:
            self._read()
            self._drop -= 1
        self._drop = 0
        while len(buf) < span and not self._ended:
            element = self._read()
            if element is not None:
                buf.append(element)
        if not buf or (len(buf) < span and node._drop):
            raise StopIteration
        if self._spec is None:
            self._spec = node._input.element_spec
        window = node._window(list(itertools.islice(buf, 0, span, node._stride)), self._spec)
        self._drop = node._shift
        return window

    def save(self):
        return {"input": self._inputs[0].save(), "buffer": pack_elements(list(self._buf)),
                "ended": self._ended, "drop": self._drop}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        self._buf = collections.deque(unpack_elements(state["buffer"]))
        self._ended, self._drop = bool(state["ended"]), int(state["drop"])
