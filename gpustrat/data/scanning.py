"""``scan``: a map that carries a state from one element to the next.

``ds.scan(initial_state, scan_func)`` calls ``scan_func(state, element)`` (the element
as one argument, tuples included, as ``tf.data``), which returns ``(new_state,
output)``; the outputs are the elements. The new state must have the initial state's
structure and dtypes (its shapes may change). The output spec is that of the first
two outputs, with the dimensions in which they differ None (for an empty input, that of
``scan_func(initial_state, zeros)``); the cardinality is the input's.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import Dataset, _IterContext
from gpustrat.data.iterator_state import StateIterator, load_element, save_element
from gpustrat.data.spec import merge_specs, spec_of, zeros_like_spec
from gpustrat.data.unary import UnaryDataset, _close


def _dtype_name(leaf) -> str:
    return "string" if isinstance(leaf, bytes) else np.asarray(leaf).dtype.name


class ScanDataset(UnaryDataset):
    """``scan(initial_state, scan_func)``."""

    def __init__(self, input_dataset: Dataset, initial_state: Any, scan_func: Callable):
        super().__init__(input_dataset)
        if not callable(scan_func):
            raise TypeError(f"scan: scan_func must be callable, got {type(scan_func).__name__}")
        self._initial = st.normalize(tuple(initial_state) if type(initial_state) is list
                                     else initial_state)
        self._state_spec = spec_of(self._initial)
        self._fn = scan_func

    def _step(self, state: Any, element: Any) -> tuple[Any, Any]:
        out = self._fn(state, element)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"scan: scan_func must return a pair (new_state, output), got "
                            f"{type(out).__name__} {out!r}"[:300])
        new_state, value = out
        new_state = st.normalize(tuple(new_state) if type(new_state) is list else new_state)
        try:
            nest.assert_same_structure(self._initial, new_state)
        except (ValueError, TypeError):
            raise TypeError(f"scan: the new state {new_state!r} does not have the structure "
                            f"of the initial state {self._initial!r}") from None
        for old, new in zip(nest.flatten(self._initial), nest.flatten(new_state)):
            if _dtype_name(old) != _dtype_name(new):
                raise TypeError(f"scan: the new state's dtypes must match the initial "
                                f"state's: expected {_dtype_name(old)}, got "
                                f"{_dtype_name(new)} (cast it, or start from a state of "
                                "that dtype)")
        if type(value) is list:
            value = tuple(value)
        return new_state, st.normalize(value)

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        state = self._initial
        try:
            for element in it:
                state, value = self._step(state, element)
                yield value
        finally:
            _close(it)

    def _state_iter(self, ctx):
        return _ScanIterator(self, self._input._state_iter(ctx))

    def _compute_spec(self):
        gen = self._iter(_IterContext(peek=True))
        try:
            outputs = [v for v, _ in zip(gen, range(2))]
        finally:
            gen.close()
        if not outputs:
            zeros = zeros_like_spec(self._input.element_spec)
            return spec_of(self._step(self._initial, zeros)[1])
        spec = spec_of(outputs[0])
        for v in outputs[1:]:
            spec = merge_specs(spec, spec_of(v))
        return spec


class _ScanIterator(StateIterator):
    """``scan``: the state is the input's and the scan state's value (its leaves, put
    back into the initial state's structure on restore)."""

    def __init__(self, node: ScanDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._value = node._initial
        self._gen = self._elements()

    def _elements(self):
        step = self._node._step   # a generator started after any restore
        for element in self._inputs[0].fast_iter():
            self._value, out = step(self._value, element)
            yield out

    def fast_iter(self):
        return self._gen

    def __next__(self):
        return next(self._gen)

    def save(self):
        return {"input": self._inputs[0].save(),
                "value": [save_element(leaf) for leaf in nest.flatten(self._value)]}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        leaves = [load_element(leaf) for leaf in state["value"]]
        initial = self._node._initial
        self._value = nest.pack_sequence_as(initial, leaves) if nest.is_nested(initial) \
            else leaves[0]
