"""``shuffle``: tf.data's shuffle buffer, with an order fixed by the seed and the epoch.

Words:
    epoch (of a shuffle): the number of times this shuffle node has been iterated,
        counted per node. The order of epoch ``e`` is drawn from a NumPy generator seeded
        with ``(seed, e)``, so a fixed seed gives the same first-epoch order in every
        process, and later epochs differ (unless ``reshuffle_each_iteration=False``,
        which keeps epoch 0's order).
"""

from __future__ import annotations

import copy
import itertools
import os

import numpy as np

from gpustrat.data.dataset import _check_positive
from gpustrat.data.iterator_state import (StateIterator, pack_elements, resume_epochs,
                                          unpack_elements)
from gpustrat.data.unary import _MISSING, UnaryDataset, _close


class ShuffleDataset(UnaryDataset):
    """``shuffle(buffer_size, seed, reshuffle_each_iteration)`` with tf.data's buffer."""

    def __init__(self, input_dataset, buffer_size: int, seed, reshuffle_each_iteration: bool):
        super().__init__(input_dataset)
        self._buffer_size = _check_positive("buffer_size", buffer_size, "shuffle")
        # An unseeded shuffle draws a seed here; distributing the dataset under the DATA
        # policy replaces it with one agreed by every worker
        # (autoshard.same_order_everywhere).
        self._seeded = seed is not None
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"shuffle: seed must be a non-negative int or None, got {seed!r}")
        self._seed = int(seed)
        self._reshuffle = bool(reshuffle_each_iteration)
        self._epochs = itertools.count()

    def _with_inputs(self, inputs):
        new = super()._with_inputs(inputs)
        new._epochs = itertools.count()
        return new

    def _with_seed(self, seed: int) -> "ShuffleDataset":
        """The same shuffle with another seed, counting its epochs from 0."""
        new = copy.copy(self)
        new._seed, new._seeded, new._agreed = int(seed), True, True
        new._epochs = itertools.count()
        return new

    def _iter(self, ctx):
        epoch = 0 if (ctx.peek or not self._reshuffle) else next(self._epochs)
        rng = np.random.default_rng([self._seed, epoch])
        it = self._input._iter(ctx)
        try:
            buf = list(itertools.islice(it, self._buffer_size))
            exhausted = len(buf) < self._buffer_size
            # Uniform draws in batches: one NumPy call per 1024 picks.
            draws, k = rng.random(1024).tolist(), 0
            while buf:
                if k == 1024:
                    draws, k = rng.random(1024).tolist(), 0
                idx = int(draws[k] * len(buf))
                k += 1
                out = buf[idx]
                nxt = _MISSING if exhausted else next(it, _MISSING)
                if nxt is _MISSING:
                    exhausted = True
                    buf[idx] = buf[-1]
                    buf.pop()
                else:
                    buf[idx] = nxt
                yield out
        finally:
            _close(it)

    def _state_iter(self, ctx):
        return _ShuffleIterator(self, self._input._state_iter(ctx))

    def _epoch_restored(self, epoch: int, seed: int) -> None:
        """A restored iterator is at ``epoch`` of ``seed``: later iterations reshuffle
        from the next epoch, with that seed (an unseeded shuffle keeps the seed the
        saved job drew)."""
        resume_epochs(self, epoch, seed)


class _ShuffleIterator(StateIterator):
    """``shuffle`` with the same draws as ``ShuffleDataset._iter``; the state is the
    buffer, the generator's state, the unused draws and the input's state."""

    def __init__(self, node: ShuffleDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._started = False
        # The epoch and seed are fixed when the iterator is made, so that the position
        # saved before the first element already says which order the epoch has.
        self._epoch = next(node._epochs) if node._reshuffle else 0
        self._seed = node._seed
        self._rng = None
        self._buf: list = []
        self._exhausted = False
        self._draws, self._k = [], 0

    def _start(self):
        node = self._node
        self._rng = np.random.default_rng([self._seed, self._epoch])
        source = self._inputs[0]
        self._buf = list(itertools.islice(source, node._buffer_size))
        self._exhausted = len(self._buf) < node._buffer_size
        self._draws, self._k = self._rng.random(1024).tolist(), 0
        self._started = True

    def __next__(self):
        if not self._started:
            self._start()
        buf = self._buf
        if not buf:
            raise StopIteration
        if self._k == 1024:
            self._draws, self._k = self._rng.random(1024).tolist(), 0
        idx = int(self._draws[self._k] * len(buf))
        self._k += 1
        out = buf[idx]
        nxt = _MISSING if self._exhausted else next(self._inputs[0], _MISSING)
        if nxt is _MISSING:
            self._exhausted = True
            buf[idx] = buf[-1]
            buf.pop()
        else:
            buf[idx] = nxt
        return out

    def save(self):
        if not self._started:
            return {"started": False, "epoch": self._epoch, "seed": self._seed,
                    "input": self._inputs[0].save()}
        return {"started": True, "epoch": self._epoch, "seed": self._seed,
                "rng": self._rng.bit_generator.state,
                "buffer": pack_elements(self._buf), "exhausted": self._exhausted,
                "draws": np.asarray(self._draws[self._k:], np.float64),
                "input": self._inputs[0].save()}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        self._epoch, self._seed = int(state["epoch"]), int(state["seed"])
        self._node._epoch_restored(self._epoch, self._seed)
        if not state["started"]:
            return
        self._started = True
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self._buf = unpack_elements(state["buffer"])
        self._exhausted = bool(state["exhausted"])
        self._draws = state["draws"].tolist()
        self._k = 1024 - len(self._draws)
        self._draws = [0.0] * self._k + self._draws
