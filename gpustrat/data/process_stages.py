"""``map`` and ``interleave`` stages on worker processes (:mod:`gpustrat.data.processes`
runs the pools): what is sent to the workers, in which order results come back, and
what an iterator's saved position holds.

Words:
    unreturned: an input element pulled from the source (in this process) whose
        result the consumer has not received yet: sent to a worker, computed and
        waiting for its turn, or to be replayed after a restore. A saved position
        holds them all, so a restored iterator maps them again first.
    slot on processes: an ``interleave`` slot whose dataset lives in a worker
        (:class:`RemoteSlot`).
"""

from __future__ import annotations

import collections
import itertools
import logging
from typing import Any, Callable

from gpustrat.data.iterator_state import (Replay, StateIterator, pack_elements,
                                          unpack_elements)
from gpustrat.data.processes import _DEPTH, _ERR, _OK, Pool, _short, raise_remote

#: A map task carries about this much work (seconds), so that messages stay few ...
_TASK_S = 2e-3
#: ... and at most this many elements ...
_MAX_BATCH = 256
#: ... and at most this many output bytes (outputs this large travel one per task).
_BATCH_BYTES = 4 << 20
#: Tasks' worth of elements per worker that a map holds unreturned (sent, computed or
#: waiting for their turn in input order): room for a fast worker to go on while a
#: slow one computes the element due first ...
_WINDOW = 4
#: ... when a task's outputs are under this many bytes; larger ones hold _DEPTH tasks'
#: worth (memory stays bounded by what the workers are computing).
_WINDOW_BYTES = 1 << 20

log = logging.getLogger("gpustrat")


class MapRun:
    """One epoch of a ``map`` on processes: input elements come from ``pull()`` (in
    this process: a ``from_generator`` source runs here), the calls run in a
    :class:`Pool`, results come back in input order (``deterministic``) or as they
    are ready.

    ``on_error``: None (a failed call raises its exception), or ``(value, warn)``: a
    failed call gives ``value`` (``ignore_errors``; ``warn`` logs it).
    """

    def __init__(self, fn: Callable, size: int, pull: Callable[[], Any],
                 deterministic: bool, what: str, on_error=None):
        self._fn, self._size, self._pull = fn, size, pull
        self._deterministic = deterministic
        self._what, self._on_error = what, on_error
        self.pool: Pool | None = None
        self.exhausted = False
        self._seq = 0                 # seq of the next input element pulled
        self._inputs: dict = {}       # seq -> input element not yet returned
        self._ready: dict = {}        # seq -> (kind, value) computed, not returned
        self._order: collections.deque = collections.deque()   # ready seqs (any order)
        self._want = 0                # next seq returned (deterministic)
        self._batch = 1
        self._cost = None             # seconds per call, smoothed
        self._out_bytes = 0

    def _describe(self, holds) -> str:
        if holds is None:
            return "an element"
        first, count = holds
        element = self._inputs.get(first)
        return (f"input element {first} of this epoch ({_short(element)})" if count == 1
                else f"input elements {first} to {first + count - 1} of this epoch (the "
                     f"first: {_short(element)})")

    def unreturned(self) -> list:
        """The input elements pulled whose results were not returned, in input order."""
        return [self._inputs[s] for s in sorted(self._inputs)]

    def _feed(self) -> None:
        pool = self.pool
        window = _WINDOW if self._out_bytes * self._batch < _WINDOW_BYTES else _DEPTH
        limit = window * self._size * self._batch
        for w in pool.workers:
            while not self.exhausted and len(w.tasks) < _DEPTH and \
                    len(self._inputs) < limit:
                first, elements = self._seq, []
                for _ in range(self._batch):
                    try:
                        element = self._pull()
                    except StopIteration:
                        self.exhausted = True
                        break
                    self._inputs[self._seq] = element
                    self._seq += 1
                    elements.append(element)
                if not elements:
                    break
                pool.send(w, (first, elements), (first, len(elements)))

    def _take(self):
        if self._deterministic:
            if self._want not in self._ready:
                return None
            seq = self._want
            self._want += 1
        else:
            if not self._order:
                return None
            seq = self._order.popleft()
        kind, value = self._ready.pop(seq)
        element = self._inputs.pop(seq)
        if kind == _OK:
            return (value,)
        if self._on_error is not None:
            failed, warn = self._on_error
            if warn:
                log.warning("ignore_errors: dropped an element: %s: %s", value[1], value[2])
            return (failed,)
        raise_remote(value, f"input element {seq} of this epoch ({_short(element)}) "
                            f"in {self._what}")

    def _learn(self, results: list, elapsed: float) -> None:
        n = len(results)
        cost = elapsed / n
        self._cost = cost if self._cost is None else 0.7 * self._cost + 0.3 * cost
        size = 0
        for kind, value in results[:4]:
            if kind == _OK:
                size = max(size, _nbytes(value))
        self._out_bytes = size
        batch = int(_TASK_S / max(self._cost, 1e-7))
        if size:
            batch = min(batch, _BATCH_BYTES // size)
        self._batch = max(1, min(_MAX_BATCH, batch))

    def __next__(self):
        if self.pool is None:
            self.pool = Pool(self._fn, self._size, "map", self._what)
            self.pool.describe = self._describe
        while True:
            self._feed()
            got = self._take()
            if got is not None:
                return got[0]
            if not any(w.tasks for w in self.pool.workers):
                raise StopIteration
            for _, (first, _), (first_, results, elapsed) in self.pool.receive():
                for i, r in enumerate(results):
                    self._ready[first + i] = r
                if not self._deterministic:
                    self._order.extend(range(first, first + len(results)))
                self._learn(results, elapsed)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _nbytes(value) -> int:
    """The bytes of the arrays in an output (a cheap look, for the task size)."""
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    return 0


def process_map(source, fn: Callable, size: int, deterministic: bool, what: str,
                on_error=None):
    """Generator of ``fn``'s outputs over ``source`` (a ``map`` on processes)."""
    run = MapRun(fn, size, source.__next__, deterministic, what, on_error)
    try:
        while True:
            try:
                out = next(run)
            except StopIteration:
                return
            yield out
    finally:
        run.close()
        close = getattr(source, "close", None)
        if close is not None:
            close()


class InterleavePool:
    """The worker processes of one ``interleave`` iteration: each open slot's dataset is
    made and iterated in a worker (slots dealt to the least loaded), read ahead by
    ``ahead`` elements per request."""

    def __init__(self, fn: Callable, size: int, ahead: int, what: str):
        self._fn, self._size, self._ahead, self._what = fn, size, ahead, what
        self.pool: Pool | None = None
        self._sids = itertools.count()
        self._slots: dict = {}        # sid -> RemoteSlot
        self._load: list = [0] * size

    def _start(self) -> Pool:
        if self.pool is None:
            self.pool = Pool(self._fn, self._size, "interleave", self._what)
            self.pool.describe = lambda holds: (
                "an element" if holds is None else
                f"the dataset of input element {_short(self._slots[holds].element)}"
                if holds in self._slots else "an element")
        return self.pool

    def open(self, element, key, state=None, track: bool = False,
             what: str = "") -> "RemoteSlot":
        slot = RemoteSlot(self, next(self._sids), element, key, track, what)
        if state is not None:
            slot.restore(state)
        return slot

    def _assign(self, slot: "RemoteSlot") -> _Worker:
        pool = self._start()
        i = min(range(self._size), key=self._load.__getitem__)
        self._load[i] += 1
        self._slots[slot.sid] = slot
        return pool.workers[i]

    def pump(self, block: bool) -> None:
        for w, sid, answer in self.pool.receive(block):
            slot = self._slots.get(sid)
            if slot is not None:
                slot._answer(answer)

    def release(self, slot: "RemoteSlot") -> None:
        if self._slots.pop(slot.sid, None) is not None:
            self._load[slot.worker.index] -= 1

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self._slots.clear()


class RemoteSlot:
    """An ``interleave`` slot whose dataset lives in a worker process; iterated, saved
    and restored as a state iterator. Its state is the slot dataset's state after the
    last answer taken plus the elements taken and not returned (handed back first by
    a restored slot), as a prefetch's."""

    def __init__(self, owner: InterleavePool, sid: int, element, key, track: bool,
                 what: str):
        self.owner, self.sid, self.element, self.key = owner, sid, element, key
        self.track, self.what = track, what
        self.worker = None
        self._buffer: collections.deque = collections.deque()
        self._asked = False
        self._ended = False
        self._error = None
        self._state = None            # ("state", tree) | ("unsaveable", why) | None
        self._restored = None

    def start(self) -> "RemoteSlot":
        if self.worker is None:
            self.worker = self.owner._assign(self)
            self._asked = True
            self.owner.pool.send(self.worker, ("open", self.sid, self.element, self.key,
                                               self._restored, self.track, self.what),
                                 self.sid)
        return self

    def _answer(self, answer) -> None:
        _, elements, ended, error, state = answer
        self._asked = False
        self._buffer.extend(elements)
        self._ended = ended
        self._error = error
        if state is not None:
            self._state = state
        if ended:
            self.owner.release(self)

    def __iter__(self):
        return self

    def __next__(self):
        self.start()
        while not self._buffer:
            if self._ended:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise_remote(error, f"the dataset {self.what} for input element "
                                        f"{_short(self.element)}")
                raise StopIteration
            if not self._asked:
                self._ask()
            self.owner.pump(True)
        element = self._buffer.popleft()
        if not self._buffer and not self._ended and not self._asked:
            self._ask()     # read ahead while the consumer uses this element
        return element

    def _ask(self) -> None:
        self._asked = True
        self.owner.pool.send(self.worker, ("next", self.sid, self.owner._ahead), self.sid)

    def save(self) -> dict:
        if self._restored is not None and self._state is None:
            state = self._restored
        elif self._state is not None and self._state[0] == "unsaveable":
            raise ValueError(self._state[1])
        elif self._state is None:
            state = None   # not started: restores as a fresh slot
        else:
            state = self._state[1]
        out = {"pending": pack_elements(list(self._buffer)),
               "ended": self._ended and self._error is None}
        if state is not None:
            out["state"] = state
        return out

    def restore(self, state: dict) -> None:
        self._buffer = collections.deque(unpack_elements(state["pending"]))
        self._restored = state.get("state")
        if bool(state.get("ended")):
            self._ended = True
            self.worker = False   # never opened again

    def close(self) -> None:
        if self.worker and not self._ended and self.owner.pool is not None \
                and self.sid in self.owner._slots:
            self.owner.release(self)
            try:
                self.owner.pool.post(self.worker, ("close", self.sid))
            except OSError:
                pass
        self._ended = True


class ProcessMapIterator(StateIterator):
    """``map`` on processes as a state iterator: the state is the input's state plus
    the input elements pulled whose results were not returned (sent to a worker,
    computed and waiting, or replayed), which a restored iterator maps again, in
    input order, before reading further: nothing in flight is lost or repeated."""

    def __init__(self, input_it: StateIterator, fn: Callable, size: int,
                 deterministic: bool, what: str, on_error=None):
        self._input = input_it
        self._inputs = (input_it,)
        self._replay = Replay()
        self._run = MapRun(fn, size, self._pull, deterministic, what, on_error)

    def _pull(self):
        if self._replay.items:
            return self._replay.items.popleft()
        return next(self._input)

    def __next__(self):
        return next(self._run)

    def save(self) -> dict:
        elements = self._run.unreturned() + list(self._replay.items)
        return {"input": self._input.save(), "in_flight": pack_elements(elements),
                "exhausted": self._run.exhausted}

    def restore(self, state: dict) -> None:
        self._input.restore(state["input"])
        self._replay.set(state["in_flight"])
        self._run.exhausted = bool(state["exhausted"]) and not self._replay.items

    def close(self) -> None:
        self._run.close()
        super().close()
