"""``interleave``: map elements to datasets and interleave them, in tf.data's order.

Words:
    cycle: ``cycle_length`` slots, each holding an open iterator over the dataset
        ``map_func(x)`` of one input element ``x``, or nothing.
    block: up to ``block_length`` consecutive elements taken from one slot before moving
        to the next slot.

The order is tf.data's (``InterleaveDatasetOp``): at the current slot, an open iterator
gives its next element (after ``block_length`` of them, move on); an exhausted one is
dropped and we move on; an empty slot takes the next input element and opens its dataset
there, unless the input is exhausted, in which case we move on. The end comes when the
input is exhausted and no slot is open. With ``num_parallel_calls``, every open slot is
read ahead by its own background thread (``block_length`` elements ahead, at least 2);
the order of elements is unchanged, so ``deterministic`` has no effect on the result.
"""

from __future__ import annotations

import copy
import itertools
import os
from typing import Callable

from gpustrat.data import autoshard, parallel
from gpustrat.data import structure as st
from gpustrat.data.iterator_state import (PrefetchIterator, StateIterator,
                                          load_element, save_element, state_iter_of)
from gpustrat.data.dataset import (AUTOTUNE, UNKNOWN_CARDINALITY, Dataset, _check_positive,
                                   _IterContext)
from gpustrat.data.mapping import (_function_spec, _resolve_parallelism, check_use_processes,
                                   processes_for)
from gpustrat.data.process_stages import InterleavePool
from gpustrat.data.unary import UnaryDataset, _close


def _default_cycle_length() -> int:
    return os.cpu_count() or 1


class InterleaveDataset(UnaryDataset):
    """``interleave(map_func, cycle_length, block_length, num_parallel_calls, deterministic)``."""

    def __init__(self, input_dataset: Dataset, map_func: Callable, cycle_length=None,
                 block_length=None, num_parallel_calls=None, deterministic=None,
                 use_processes=None):
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"interleave: map_func must be callable, got "
                            f"{type(map_func).__name__}")
        self._fn = map_func
        fixed = cycle_length is not None and cycle_length != AUTOTUNE
        if cycle_length is None or cycle_length == AUTOTUNE:
            cycle_length = _default_cycle_length()
        self._cycle = _check_positive("cycle_length", cycle_length, "interleave")
        self._block = 1 if block_length is None else _check_positive(
            "block_length", block_length, "interleave")
        self._parallelism = _resolve_parallelism(num_parallel_calls, "interleave")
        if fixed and num_parallel_calls != AUTOTUNE and self._parallelism is not None \
                and self._parallelism > self._cycle:
            # As tf.data: calls beyond the open slots would never run.
            raise ValueError(
                f"interleave: num_parallel_calls {num_parallel_calls} is more than the "
                f"fixed cycle_length {cycle_length}; give at most {cycle_length}, or "
                "AUTOTUNE")
        self._deterministic = deterministic
        self._autotune = num_parallel_calls == AUTOTUNE
        self._use_processes = check_use_processes(use_processes, num_parallel_calls,
                                                  "interleave")
        # The datasets map_func returns may shuffle without a seed. Distributing under
        # the DATA policy gives this node a seed agreed by every worker (_with_seed),
        # from which their shuffles are seeded alike on every worker; until then they
        # draw their own, and _seed is only what worker 0 would offer.
        self._seeded = False
        self._seed = int.from_bytes(os.urandom(8), "little")
        self._agreed_seed = None
        self._epochs = itertools.count()

    def _with_seed(self, seed: int) -> "InterleaveDataset":
        """This interleave seeding the shuffles of the datasets ``map_func`` returns from
        ``seed``, its epoch and the element's index, counting its epochs from 0."""
        new = copy.copy(self)
        new._seed, new._seeded, new._agreed_seed = int(seed), True, int(seed)
        new._agreed = True
        new._epochs = itertools.count()
        return new

    def _pool(self, ctx) -> "InterleavePool | None":
        """The worker processes of one iteration (None: the datasets are made here)."""
        if ctx.peek:
            return None
        n = processes_for(self._parallelism, self._autotune, self._use_processes,
                          ctx.options(self))
        return None if n is None else InterleavePool(self._fn, n, max(2, self._block),
                                                     "interleave")

    def _open(self, element, ctx: _IterContext, key: tuple | None = None, pool=None):
        if pool is not None:
            return pool.open(element, key).start()
        ds = st.call_with_element(self._fn, element)
        if not isinstance(ds, Dataset):
            raise TypeError(f"interleave: map_func must return a Dataset, got "
                            f"{type(ds).__name__}")
        if key is not None:
            ds = autoshard.seeded_like_every_worker(ds, key)
        it = ds._iter(ctx)
        if self._parallelism is not None and not ctx.peek:
            return parallel.Prefetcher(it, max(2, self._block), name="gpustrat-interleave")
        return it

    def _iter(self, ctx):
        cycle, block = self._cycle, self._block
        slots: list = [None] * cycle
        source = self._input._iter(ctx)
        end_of_input = False
        num_open = 0
        index = 0       # current slot
        taken = 0       # elements taken from the current slot in this block
        opened = 0      # datasets opened so far this epoch
        agreed = self._agreed_seed
        epoch = None if agreed is None else (0 if ctx.peek else next(self._epochs))
        pool = self._pool(ctx)
        try:
            while not end_of_input or num_open > 0:
                it = slots[index]
                if it is not None:
                    try:
                        element = next(it)
                    except StopIteration:
                        _close(it)
                        slots[index] = None
                        num_open -= 1
                        index, taken = (index + 1) % cycle, 0
                        continue
                    taken += 1
                    if taken == block:
                        index, taken = (index + 1) % cycle, 0
                    yield element
                elif not end_of_input:
                    try:
                        x = next(source)
                    except StopIteration:
                        end_of_input = True
                        continue
                    slots[index] = self._open(
                        x, ctx, None if agreed is None else (agreed, epoch, opened), pool)
                    opened += 1
                    num_open += 1
                else:
                    index, taken = (index + 1) % cycle, 0
        finally:
            for it in slots:
                if it is not None:
                    _close(it)
            if pool is not None:
                pool.close()
            _close(source)

    def _state_iter(self, ctx):
        return _InterleaveIterator(self, ctx)

    def _open_state(self, element, ctx: _IterContext, key: tuple | None,
                    state: dict | None = None, pool=None):
        """The state iterator of the dataset ``map_func`` returns for ``element`` (a
        plain one whose ``save`` raises, naming the node, when that dataset cannot
        save its position: iteration goes on, only saving is refused)."""
        if pool is not None:
            return pool.open(element, key, state, True,
                             "interleave: a dataset that map_func returned").start()
        ds = st.call_with_element(self._fn, element)
        if not isinstance(ds, Dataset):
            raise TypeError(f"interleave: map_func must return a Dataset, got "
                            f"{type(ds).__name__}")
        if key is not None:
            ds = autoshard.seeded_like_every_worker(ds, key)
        it = state_iter_of(ds, ctx, "interleave: a dataset that map_func returned")
        if self._parallelism is not None:
            it = PrefetchIterator(it, max(2, self._block), False, 0.0, 0)
        if state is not None:
            it.restore(state)
        if self._parallelism is not None:
            it.start()   # every open slot reads ahead at once, as the parallel interleave does
        return it

    def _cardinality(self):
        return UNKNOWN_CARDINALITY  # as tf.data, even for an empty input

    def _compute_spec(self):
        # The specs of the datasets map_func returns for the first elements and probes
        # of the input (see mapping._function_spec), merged.
        def dataset_spec(element):
            ds = st.call_with_element(self._fn, element)
            if not isinstance(ds, Dataset):
                raise TypeError(f"interleave: map_func must return a Dataset, got "
                                f"{type(ds).__name__}")
            return ds.element_spec
        return _function_spec(self._input, dataset_spec)


class _InterleaveIterator(StateIterator):
    """``interleave``: the state is the input's, the cursor (slot, elements taken in the
    block, datasets opened) and, for each open slot, the input element that opened it
    and its dataset's state: a restore opens the slot again from that element."""

    def __init__(self, node: InterleaveDataset, ctx):
        self._node, self._ctx = node, ctx
        self._source = node._input._state_iter(ctx)
        self._slots: list = [None] * node._cycle     # (element, key, iterator)
        self._end_of_input = False
        self._index = self._taken = self._opened = 0
        agreed = node._agreed_seed
        self._epoch = None if agreed is None else next(node._epochs)
        self._pool = node._pool(ctx)

    @property
    def _inputs(self):
        return [self._source] + [s[2] for s in self._slots if s is not None]

    def _key(self, opened: int):
        agreed = self._node._agreed_seed
        return None if agreed is None else (agreed, self._epoch, opened)

    def __next__(self):
        cycle, block = self._node._cycle, self._node._block
        while not self._end_of_input or any(s is not None for s in self._slots):
            slot = self._slots[self._index]
            if slot is not None:
                try:
                    element = next(slot[2])
                except StopIteration:
                    slot[2].close()
                    self._slots[self._index] = None
                    self._index, self._taken = (self._index + 1) % cycle, 0
                    continue
                self._taken += 1
                if self._taken == block:
                    self._index, self._taken = (self._index + 1) % cycle, 0
                return element
            if not self._end_of_input:
                try:
                    x = next(self._source)
                except StopIteration:
                    self._end_of_input = True
                    continue
                key = self._key(self._opened)
                self._slots[self._index] = (x, self._opened, self._node._open_state(
                    x, self._ctx, key, None, self._pool))
                self._opened += 1
            else:
                self._index, self._taken = (self._index + 1) % cycle, 0
        raise StopIteration

    def save(self):
        return {"input": self._source.save(), "end_of_input": self._end_of_input,
                "index": self._index, "taken": self._taken, "opened": self._opened,
                "epoch": self._epoch,
                "slots": [None if s is None else {"element": save_element(s[0]),
                                                  "opened": s[1], "state": s[2].save()}
                          for s in self._slots]}

    def restore(self, state):
        self._source.restore(state["input"])
        self._end_of_input = bool(state["end_of_input"])
        self._index, self._taken = int(state["index"]), int(state["taken"])
        self._opened, self._epoch = int(state["opened"]), state["epoch"]
        for i, saved in enumerate(state["slots"]):
            if saved is None:
                continue
            element = load_element(saved["element"])
            it = self._node._open_state(element, self._ctx, self._key(int(saved["opened"])),
                                        saved["state"], self._pool)
            self._slots[i] = (element, int(saved["opened"]), it)

    def close(self):
        for s in self._slots:
            if s is not None:
                s[2].close()
        if self._pool is not None:
            self._pool.close()
        self._source.close()
