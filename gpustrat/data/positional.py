"""``repeat``, ``take``, ``skip``, ``shard`` and ``enumerate``: transformations decided by
an element's position in the input, never by its value."""

from __future__ import annotations

import itertools

import numpy as np

from gpustrat.data.dataset import (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, _check_int,
                                   _check_positive)
from gpustrat.data.iterator_state import FunctionIterator, StateIterator
from gpustrat.data.spec import TensorSpec
from gpustrat.data.unary import UnaryDataset, _close

_INT64 = np.dtype(np.int64)


class RepeatDataset(UnaryDataset):
    """``repeat(count)``: None or -1 repeats forever (an empty input stays empty)."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = -1 if count is None else _check_int("count", count, "repeat")

    def _iter(self, ctx):
        passes = itertools.count() if self._count < 0 else range(self._count)
        for _ in passes:
            it = self._input._iter(ctx)
            got = False
            try:
                for element in it:
                    got = True
                    yield element
            finally:
                _close(it)
            if not got:
                return

    def _state_iter(self, ctx):
        return _RepeatIterator(self, ctx)

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count < 0:
            return 0 if n == 0 else INFINITE_CARDINALITY
        if self._count == 0:
            return 0
        if n < 0:
            return n
        return n * self._count


class _RepeatIterator(StateIterator):
    """``repeat``: the state is the pass number and the current pass's input state."""

    def __init__(self, node: RepeatDataset, ctx):
        self._node, self._ctx = node, ctx
        self._inputs = [None]
        self._pass, self._got, self._done = 0, False, False

    def __next__(self):
        node = self._node
        while not self._done:
            if self._inputs[0] is None:
                if 0 <= node._count <= self._pass:
                    self._done = True
                    break
                self._inputs[0] = node._input._state_iter(self._ctx)
                self._got = False
            try:
                element = next(self._inputs[0])
            except StopIteration:
                self._inputs[0].close()
                self._inputs[0] = None
                if not self._got:
                    self._done = True
                    break
                self._pass += 1
                continue
            self._got = True
            return element
        raise StopIteration

    def save(self):
        current = self._inputs[0]
        return {"pass": self._pass, "got": self._got, "done": self._done,
                "input": None if current is None else current.save()}

    def restore(self, state):
        self._pass, self._got, self._done = int(state["pass"]), bool(state["got"]), \
            bool(state["done"])
        if state["input"] is not None:
            self._inputs[0] = self._node._input._state_iter(self._ctx)
            self._inputs[0].restore(state["input"])


class TakeDataset(UnaryDataset):
    """``take(count)``: at most ``count`` elements; -1 takes all."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = _check_int("count", count, "take")

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            yield from (it if self._count < 0 else itertools.islice(it, self._count))
        finally:
            _close(it)

    def _state_iter(self, ctx):
        count = self._count

        def step_fn(it):
            if 0 <= count <= it.fields["taken"]:
                raise StopIteration
            element = next(it._inputs[0])
            it.fields["taken"] += 1
            return element
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, taken=0)

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count < 0:
            return n
        if n == UNKNOWN_CARDINALITY:
            return n
        if n == INFINITE_CARDINALITY:
            return self._count
        return min(n, self._count)


class SkipDataset(UnaryDataset):
    """``skip(count)``: drop the first ``count`` elements; -1 drops all."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = _check_int("count", count, "skip")

    def _iter(self, ctx):
        if self._count < 0:
            return
        it = self._input._iter(ctx)
        try:
            yield from itertools.islice(it, self._count, None)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        count = self._count

        def step_fn(it):
            if count < 0:
                raise StopIteration
            source = it._inputs[0]
            while it.fields["skipped"] < count:
                next(source)
                it.fields["skipped"] += 1
            return next(source)
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, skipped=0)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n  # as tf.data, even for skip(-1)
        if self._count < 0:
            return 0
        return max(0, n - self._count)


class ShardDataset(UnaryDataset):
    """``shard(num_shards, index)``: element i goes to shard ``i % num_shards``."""

    def __init__(self, input_dataset, num_shards: int, index: int):
        super().__init__(input_dataset)
        self._num = _check_positive("num_shards", num_shards, "shard")
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"shard: index must be an int, got {index!r}")
        if not 0 <= index < self._num:
            raise ValueError(f"shard: index {index} is out of range for {self._num} shards; "
                             f"it must be in [0, {self._num})")
        self._index = int(index)

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            yield from itertools.islice(it, self._index, None, self._num)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        index, num = self._index, self._num

        def step_fn(it):
            source = it._inputs[0]
            for _ in range(num - 1 if it.fields["started"] else index):
                next(source)
            it.fields["started"] = True
            return next(source)
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, started=False)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._num + (1 if self._index < n % self._num else 0)


class EnumerateDataset(UnaryDataset):
    """``enumerate(start)``: ``(int64 counter, element)`` pairs."""

    def __init__(self, input_dataset, start: int = 0):
        super().__init__(input_dataset)
        self._start = _check_int("start", start, "enumerate")

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            for i, element in zip(itertools.count(self._start), it):
                yield np.int64(i), element
        finally:
            _close(it)

    def _state_iter(self, ctx):
        def step_fn(it):
            element = next(it._inputs[0])
            i = it.fields["i"]
            it.fields["i"] = i + 1
            return np.int64(i), element
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, i=self._start)

    def _compute_spec(self):
        return (TensorSpec((), _INT64), self._input.element_spec)
