"""The base of the transformations of one input dataset, and the two that hand its
elements through unchanged (``prefetch`` and ``with_options``).

Words used in the transformation modules:
    input: the dataset a transformation reads (``_input``), or several for ``zip`` and
        ``concatenate``.
"""

from __future__ import annotations

import copy

import numpy as np

from gpustrat.data import parallel
from gpustrat.data.dataset import AUTOTUNE, Dataset
from gpustrat.data.iterator_state import PrefetchIterator
from gpustrat.data.options import Options

# What ``next(iterator, _MISSING)`` gives at the end: no element.
_MISSING = object()


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


class UnaryDataset(Dataset):
    """A transformation of one input dataset."""

    def __init__(self, input_dataset: Dataset):
        if not isinstance(input_dataset, Dataset):
            raise TypeError(f"expected a Dataset as input, got {type(input_dataset).__name__}")
        self._input = input_dataset

    def _inputs(self):
        return (self._input,)

    def _with_inputs(self, inputs):
        new = copy.copy(self)
        new._input = inputs[0]
        new.__dict__.pop("_spec_cache", None)
        return new

    def _cardinality(self):
        return self._input._cardinality()

    def _compute_spec(self):
        return self._input.element_spec


class PrefetchDataset(UnaryDataset):
    """``prefetch(n)``: a background thread keeps up to ``n`` elements ready.

    ``adaptive`` (what ``prefetch(AUTOTUNE)`` gives, with 2 elements) starts the thread
    only when producing an element costs more than handing it over from a thread
    (:func:`gpustrat.data.parallel.adaptive_prefetch`).
    """

    def __init__(self, input_dataset, buffer_size: int, adaptive: bool = False):
        super().__init__(input_dataset)
        self._adaptive = adaptive or buffer_size == AUTOTUNE
        if buffer_size == AUTOTUNE:
            buffer_size = 2
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) \
                or buffer_size < 0:
            raise ValueError(f"prefetch: buffer_size must be a non-negative int or AUTOTUNE, "
                             f"got {buffer_size!r}")
        self._buffer_size = int(buffer_size)

    def batch_rows(self):
        return self._input.batch_rows()

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        if self._buffer_size == 0 or ctx.peek:
            return it
        if self._adaptive:
            return parallel.adaptive_prefetch(it, self._buffer_size)
        return parallel.prefetch(it, self._buffer_size)

    def _state_iter(self, ctx):
        it = self._input._state_iter(ctx)
        if self._buffer_size == 0:
            return it
        return PrefetchIterator(it, self._buffer_size, self._adaptive,
                                parallel.ADAPTIVE_MIN_COST_S, parallel.ADAPTIVE_PROBE)


class OptionsDataset(UnaryDataset):
    """``with_options(options)``: the input, with options attached."""

    def __init__(self, input_dataset, options: Options):
        super().__init__(input_dataset)
        if not isinstance(options, Options):
            raise TypeError(f"with_options needs an Options object, got {type(options).__name__}")
        self._own_options = options

    def batch_rows(self):
        return self._input.batch_rows()

    def _iter(self, ctx):
        return self._input._iter(ctx)

    def _state_iter(self, ctx):
        return self._input._state_iter(ctx)
