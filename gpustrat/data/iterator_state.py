"""Iterators that can save and restore their position: the state protocol of ``gs.data``.

Words:
    state iterator: one node's iterator over one epoch (a :class:`StateIterator`), made
        by the node's ``_state_iter()``. ``next`` as a generator; ``save()`` returns the
        node's state tree (see :mod:`gpustrat.train.format`) after the elements ``next``
        has returned so far, and ``restore(state)``, called on a fresh iterator of the
        same node before its first ``next``, makes it continue from there. A node's
        state holds its own counters and buffers and its inputs' states.
    position: what ``next`` has returned. Read-ahead (``prefetch``, parallel ``map``)
        never counts: their state holds the upstream position reached by the read-ahead
        plus the elements read but not yet returned, which a restored iterator returns
        first (prefetched elements are handed back, in-flight map calls are re-done).
    saved element: an element held in a saved buffer, as :func:`save_element` gives
        it: itself, unless a leaf is an array of strings (saved as its byte strings) or
        a window's dataset (saved as its elements and spec).

Every node of a pipeline needs a state iterator for ``iter(dataset)`` to be saved; a
node without one (``node._state_unsupported()`` says why) makes ``get_state`` raise an
error naming it, never a wrong position.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import functools
import itertools
import threading
import time
from typing import Any

import numpy as np

from gpustrat import nest


class StateIterator:
    """Base of the state iterators (see the module docstring)."""

    _inputs: tuple = ()

    def __iter__(self) -> "StateIterator":
        return self

    def __next__(self):
        raise NotImplementedError

    def save(self) -> dict:
        raise NotImplementedError

    def restore(self, state: dict) -> None:
        raise NotImplementedError

    def fast_iter(self):
        """What ``next`` may be called on instead of this object (after any
        ``restore``): the same elements, and :meth:`save` still sees the position. By
        default this object; a source returns a C-level iterator whose position
        :meth:`save` reads from the iterator's own counter."""
        return self

    def close(self) -> None:
        for it in self._inputs:
            if it is not None:
                it.close()


def pack_elements(elements: list) -> dict:
    """A list of elements in a compact form: one stacked array per component when every
    element has the same structure of NumPy scalars or arrays of one shape, else the
    list (each element as :func:`save_element` gives it)."""
    if elements:
        first = elements[0]
        flat = [nest.flatten(e) for e in elements]
        leaves0 = flat[0]

        def same(i):
            a = leaves0[i]
            if not isinstance(a, (np.ndarray, np.generic)) or \
                    (isinstance(a, np.ndarray) and a.ndim == 0) or a.dtype.hasobject:
                return False
            return all(len(f) == len(leaves0) and type(f[i]) is type(a) and
                       np.shape(f[i]) == np.shape(a) and f[i].dtype == a.dtype for f in flat)
        if leaves0 and all(same(i) for i in range(len(leaves0))):
            columns = [np.stack([f[i] for f in flat]) for i in range(len(leaves0))]
            return {"template": first, "columns": columns}
    return {"list": [save_element(e) for e in elements]}


def unpack_elements(packed: dict) -> list:
    if "list" in packed:
        return [load_element(e) for e in packed["list"]]
    template, columns = packed["template"], packed["columns"]
    n = len(columns[0])
    if not nest.is_nested(template):
        return [columns[0][i] for i in range(n)]
    return [nest.pack_sequence_as(template, [c[i] for c in columns]) for i in range(n)]


# An element with leaves a state tree cannot hold as they are (a batch of strings, a
# window's dataset) is saved as {_ENCODED: [encoded leaves], "structure": ...}.
_ENCODED = "__gpustrat_element__"


def _special(leaf) -> bool:
    return (isinstance(leaf, np.ndarray) and leaf.dtype.hasobject) or \
        hasattr(leaf, "_elements_state")


def save_element(element):
    """``element`` in a form a state tree holds: itself, unless a leaf is an array of
    strings (saved as its bytes) or a dataset of a window (saved as its elements)."""
    leaves = nest.flatten(element)
    if not any(_special(leaf) for leaf in leaves):
        return element
    return {_ENCODED: [_save_leaf(leaf) for leaf in leaves],
            "structure": nest.map_structure(lambda _: 0, element)}


def load_element(saved):
    """The element :func:`save_element` saved."""
    if type(saved) is not dict or _ENCODED not in saved:
        return saved
    leaves = [_load_leaf(x) for x in saved[_ENCODED]]
    structure = saved["structure"]
    return nest.pack_sequence_as(structure, leaves) if nest.is_nested(structure) \
        else leaves[0]


def _save_leaf(leaf):
    if isinstance(leaf, np.ndarray) and leaf.dtype.hasobject:
        return {"strings": [bytes(x) for x in leaf.reshape(-1)], "shape": list(leaf.shape)}
    if hasattr(leaf, "_elements_state"):
        return {"dataset": leaf._elements_state()}
    return {"leaf": leaf}


def _load_leaf(saved: dict):
    if "strings" in saved:
        out = np.empty(len(saved["strings"]), dtype=object)
        out[:] = list(saved["strings"])
        return out.reshape([int(d) for d in saved["shape"]])
    if "dataset" in saved:
        from gpustrat.data.windowing import ElementsDataset  # noqa: PLC0415
        return ElementsDataset._from_state(saved["dataset"])
    return saved["leaf"]


def same_state(a, b) -> bool:
    """Whether two state trees are equal (arrays by dtype, shape and values)."""
    if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
        a, b = np.asarray(a), np.asarray(b)
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class Replay:
    """Elements to hand out again before reading the input further (a restored
    prefetch buffer, or the inputs of map calls that were in flight)."""

    def __init__(self):
        self.items: collections.deque = collections.deque()

    def set(self, packed: dict) -> None:
        self.items = collections.deque(unpack_elements(packed))


class PrefetchIterator(StateIterator):
    """``prefetch``: a background thread reads ahead; the state is the input's state at
    the read-ahead point plus the elements read and not yet returned (handed back first
    by a restored iterator).

    ``adaptive``: the first ``probe`` elements are timed inline, and the thread starts
    only when they cost at least ``min_cost_s`` each (as the adaptive prefetch does).
    """

    def __init__(self, input_it: StateIterator, buffer_size: int, adaptive: bool,
                 min_cost_s: float, probe: int):
        self._input = input_it
        self._inputs = (input_it,)
        self._buffer_size = buffer_size
        self._lock = threading.Lock()
        self._unreturned: collections.deque = collections.deque()
        self._replay = Replay()
        self._prefetcher = None
        self._threaded = not adaptive
        self._probe_left = probe if adaptive else 0
        self._spent = 0.0
        self._min_cost = min_cost_s
        self._probe = probe

    def _source(self):
        # Runs in the thread: each element is recorded as read-and-unreturned under the
        # lock, atomically with advancing the input, so that save() sees a consistent pair.
        while True:
            with self._lock:
                try:
                    element = next(self._input)
                except StopIteration:
                    return
                self._unreturned.append(element)
            yield element

    def start(self) -> "PrefetchIterator":
        """Start reading ahead now rather than at the first ``next`` (not before a
        ``restore``)."""
        if self._threaded and self._prefetcher is None:
            from gpustrat.data.parallel import Prefetcher  # noqa: PLC0415
            self._prefetcher = Prefetcher(self._source(), self._buffer_size)
        return self

    def __next__(self):
        if self._replay.items:
            return self._replay.items.popleft()
        if self._threaded:
            self.start()
            element = next(self._prefetcher)
            # No lock: save() runs on this (the consuming) thread, never between these
            # two lines, and the producer holds the lock while it reads (maybe slowly).
            self._unreturned.popleft()
            return element
        if not self._probe_left:
            return next(self._input)
        t0 = time.perf_counter()
        element = next(self._input)
        self._spent += time.perf_counter() - t0
        self._probe_left -= 1
        if not self._probe_left and self._spent / self._probe >= self._min_cost:
            self._threaded = True
        return element

    def save(self) -> dict:
        with self._lock:
            pending = list(self._replay.items) + list(self._unreturned)
            return {"input": self._input.save(), "pending": pack_elements(pending),
                    "threaded": self._threaded, "probe_left": self._probe_left,
                    "spent": self._spent}

    def restore(self, state: dict) -> None:
        self._input.restore(state["input"])
        self._replay.set(state["pending"])
        self._threaded = bool(state["threaded"])
        self._probe_left, self._spent = int(state["probe_left"]), float(state["spent"])

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
        super().close()


class ParallelMapIterator(StateIterator):
    """Parallel ``map``: up to ``2 * parallelism`` calls in flight. The state is the
    input's state plus the input elements of the calls in flight, which a restored
    iterator maps again (in their order) before reading further."""

    def __init__(self, input_it: StateIterator, call, parallelism: int, deterministic: bool):
        self._input = input_it
        self._inputs = (input_it,)
        self._call = call
        self._parallelism = parallelism
        self._deterministic = deterministic
        self._executor = None
        self._pending: collections.deque = collections.deque()  # (element, future)
        self._replay = Replay()
        self._exhausted = False

    def _pull(self):
        if self._replay.items:
            return self._replay.items.popleft()
        return next(self._input)

    def __next__(self):
        if self._executor is None:
            self._executor = cf.ThreadPoolExecutor(max_workers=self._parallelism,
                                                   thread_name_prefix="gpustrat-map")
        while not self._exhausted and len(self._pending) < 2 * self._parallelism:
            try:
                element = self._pull()
            except StopIteration:
                self._exhausted = True
                break
            self._pending.append((element, self._executor.submit(self._call, element)))
        if not self._pending:
            raise StopIteration
        if self._deterministic:
            _, future = self._pending.popleft()
        else:
            done, _ = cf.wait([f for _, f in self._pending], return_when=cf.FIRST_COMPLETED)
            k = next(i for i, (_, f) in enumerate(self._pending) if f in done)
            _, future = self._pending[k]
            del self._pending[k]
        return future.result()

    def save(self) -> dict:
        elements = [e for e, _ in self._pending] + list(self._replay.items)
        return {"input": self._input.save(), "in_flight": pack_elements(elements),
                "exhausted": self._exhausted}

    def restore(self, state: dict) -> None:
        self._input.restore(state["input"])
        self._replay.set(state["in_flight"])
        self._exhausted = bool(state["exhausted"]) and not self._replay.items

    def close(self) -> None:
        if self._executor is not None:
            for _, f in self._pending:
                f.cancel()
            self._executor.shutdown(wait=True)
            self._executor = None
        super().close()


class IndexedIterator(StateIterator):
    """A source of ``count`` elements where element ``k`` is ``get(start + k * step)``;
    the state is the next ``k``.

    The keys come from a range iterator, and the elements from ``body(keys)`` (by
    default ``map(get, keys)``, all C; a generator that slices in its own frame is
    as cheap): ``fast_iter`` hands that out, and ``save`` derives the position from
    the range iterator's length hint (what is left), so nothing is counted per
    element. ``body`` must take exactly one key per element it returns. A key whose
    element raised counts as read, as an element the pipeline failed on."""

    __slots__ = ("_count", "_body", "_start", "_step", "_left", "_it")

    def __init__(self, count: int, get=None, start: int = 0, step: int = 1, body=None):
        self._count, self._start, self._step = count, start, step
        self._body = body if body is not None else functools.partial(map, get)
        self._left = iter(range(start, start + count * step, step))
        self._it = self._body(self._left)

    def __next__(self):
        return next(self._it)

    def fast_iter(self):
        return self._it

    def save(self) -> dict:
        return {"pos": self._count - self._left.__length_hint__()}

    def restore(self, state: dict) -> None:
        step = self._step
        self._left = iter(range(self._start + int(state["pos"]) * step,
                                self._start + self._count * step, step))
        self._it = self._body(self._left)


class ListIterator(StateIterator):
    """The elements of a list; the state is the next index, derived from the list
    iterator's length hint (nothing is counted per element)."""

    def __init__(self, elements: list):
        self._list = elements
        self._it = iter(elements)

    def __next__(self):
        return next(self._it)

    def fast_iter(self):
        return self._it

    def save(self) -> dict:
        return {"pos": len(self._list) - self._it.__length_hint__()}

    def restore(self, state: dict) -> None:
        self._it = iter(self._list)
        collections.deque(itertools.islice(self._it, int(state["pos"])), maxlen=0)


class FunctionIterator(StateIterator):
    """A node whose only state is a few counters and its inputs' states: ``step(self)``
    returns the next element (raising StopIteration), ``fields`` are the counters."""

    def __init__(self, inputs, step, **fields):
        self._inputs = list(inputs)
        self._step = step
        self.fields = dict(fields)

    def __next__(self):
        return self._step(self)

    def save(self) -> dict:
        return {"fields": dict(self.fields),
                "inputs": [None if it is None else it.save() for it in self._inputs]}

    def restore(self, state: dict) -> None:
        self.fields.update(state["fields"])
        for it, s in zip(self._inputs, state["inputs"]):
            if it is not None and s is not None:
                it.restore(s)


def walk(dataset):
    """Every node of ``dataset``'s graph once, in a fixed order (depth first, output end
    first)."""
    seen, todo = set(), [dataset]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        todo.extend(node._inputs())


def unsupported_nodes(dataset) -> list[str]:
    """Why each node of ``dataset``'s graph cannot save its position (empty: all can)."""
    return [why for why in (n._state_unsupported() for n in walk(dataset)) if why]


def drawn_seed_nodes(dataset) -> list:
    """The nodes of ``dataset``'s graph whose random seed the user did not give (an
    unseeded ``shuffle``, ``list_files``, ``sample_from_datasets`` or ``interleave``:
    drawn by the node, or agreed by the workers when the dataset was distributed), each
    once, in a fixed walk order. A saved position holds their seeds: a node's iterator
    made only after the save (a ``repeat``'s next pass, a sampled input not yet read)
    must draw the same order in the restored process, where a new seed would be drawn
    or agreed."""
    return [n for n in walk(dataset) if hasattr(n, "_with_seed")
            and (not n._seeded or getattr(n, "_agreed", False))]


def set_drawn_seed(node, seed: int) -> None:
    """Give ``node`` (one of :func:`drawn_seed_nodes`) the seed a saved position holds."""
    node._seed = int(seed)
    if getattr(node, "_agreed_seed", None) is not None:  # an agreed interleave
        node._agreed_seed = int(seed)


def epoch_counts(dataset) -> list:
    """The next epoch number of every node of ``dataset``'s graph that counts its
    iterations (``_epochs``: a reshuffling ``shuffle``, ``sample_from_datasets``,
    ``interleave``), in walk order, read without moving them. A saved position holds
    them: a node's iterator made only after the save (an input a ``repeat`` or a
    sampling opens again after it was exhausted) must take the same epoch in the
    restored process."""
    out = []
    for node in _counting_nodes(dataset):
        nxt = next(node._epochs)
        node._epochs = itertools.count(nxt)
        out.append(nxt)
    return out


def set_epoch_counts(dataset, counts) -> None:
    """Set the counters :func:`epoch_counts` read (after the iterators are restored:
    making them moves the counters)."""
    nodes = _counting_nodes(dataset)
    if len(nodes) != len(counts):
        return   # saved by a version that counted other nodes: the restored counters stand
    for node, nxt in zip(nodes, counts):
        node._epochs = itertools.count(int(nxt))


def _counting_nodes(dataset) -> list:
    return [n for n in walk(dataset)
            if isinstance(getattr(n, "_epochs", None), itertools.count)]


def fingerprint(dataset) -> list:
    """What a saved position must be restored into: each node's type and cardinality,
    depth first (another transformation or another size gives another fingerprint)."""
    out = []

    def walk(node):
        out.append(f"{type(node).__name__}:{node._cardinality()}")
        for i in node._inputs():
            walk(i)
    walk(dataset)
    return out


class Unsaveable(StateIterator):
    """A generator iterated as a state iterator whose position cannot be saved (a
    dataset a user function returned, iterated inside a node that can save)."""

    def __init__(self, gen, why: list, what: str):
        self._gen, self._why, self._what = gen, why, what

    def __next__(self):
        return next(self._gen)

    def save(self):
        raise ValueError(f"{self._what} cannot save its position: " + "; ".join(self._why))

    def close(self):
        close = getattr(self._gen, "close", None)
        if close is not None:
            close()


def state_iter_of(dataset, ctx, what: str) -> StateIterator:
    """A state iterator over a dataset made while iterating (by ``map_func`` or
    ``reduce_func``): its own, or, when a node of it cannot save its position, one that
    iterates all the same and whose ``save`` raises naming the node."""
    why = unsupported_nodes(dataset)
    return Unsaveable(dataset._iter(ctx), why, what) if why else dataset._state_iter(ctx)


def resume_epochs(node, epoch: int, seed: int) -> None:
    """A restored iterator of ``node`` (a node that counts its iterations in
    ``_epochs`` and draws from ``_seed``) is at ``epoch``: later iterations go on from
    the next epoch, with the saved seed (an unseeded node keeps the seed the saved job
    drew)."""
    nxt = next(node._epochs)
    node._epochs = itertools.count(max(nxt, epoch + 1))
    node._seed = int(seed)
