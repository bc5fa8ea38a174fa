"""Background threads of a pipeline: prefetching and parallel ``map``.

Words:
    producer: a thread that runs an input generator and puts its elements into a bounded
        queue; the consumer (the thread iterating the dataset) takes them out.
    owner: the generator (one per node per epoch) that started a thread. Closing the
        owner, explicitly or because its iterator was garbage collected, sets the stop
        flag, unblocks the thread and joins it: no thread outlives its iterator.
    in flight: calls of a mapped function submitted to the thread pool whose results the
        consumer has not taken yet; at most twice the parallelism, so that the workers
        never wait for the consumer to submit more.

An exception raised in a worker travels to the consumer as the exception object itself
(its ``__traceback__`` still holds the worker's frames) and is raised there; the
generator then ends, so the iterator stops cleanly after the error.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import queue
import threading
import time
from typing import Any, Callable, Iterator

_ITEM, _END, _ERROR = 0, 1, 2
# How often a blocked producer looks at its stop flag (seconds).
_POLL = 0.05


class Prefetcher:
    """Runs ``source`` in a background thread, ``buffer_size`` elements ahead.

    The thread starts at construction. ``next`` returns elements in order and raises
    StopIteration at the end or re-raises the source's exception; ``close`` stops and
    joins the thread and closes the source.
    """

    def __init__(self, source: Iterator, buffer_size: int, name: str = "gpustrat-prefetch"):
        self._queue: queue.Queue = queue.Queue(max(1, buffer_size))
        self._stop = threading.Event()
        self._done = False
        # The thread gets only what it needs (not self), so that dropping the owner
        # is enough to have it closed.
        self._thread = threading.Thread(target=_produce, args=(source, self._queue, self._stop),
                                        name=name, daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        kind, value = self._queue.get()
        if kind == _ITEM:
            return value
        self._done = True
        self._thread.join()
        if kind == _END:
            raise StopIteration
        raise value

    def close(self) -> None:
        self._done = True
        self._stop.set()
        while self._thread.is_alive():
            # Make room so that a producer blocked on a full queue sees the stop flag.
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(_POLL)

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


def _put(q: queue.Queue, item, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    try:
        for element in source:
            if not _put(q, (_ITEM, element), stop) or stop.is_set():
                return
        _put(q, (_END, None), stop)
    except Exception as e:  # handed to the consumer, which raises it
        _put(q, (_ERROR, e), stop)
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def prefetch(source: Iterator, buffer_size: int) -> Iterator:
    """Generator over ``source``'s elements, produced ahead by a background thread."""
    p = Prefetcher(source, buffer_size)
    try:
        while True:
            try:
                element = next(p)
            except StopIteration:
                return
            yield element
    finally:
        p.close()


#: An element must take at least this long to produce for a prefetch thread to pay:
#: handing an element from a thread to the consumer costs about 20 µs on the 2-core VM.
ADAPTIVE_MIN_COST_S = 50e-6
#: Elements timed inline at the start of each epoch before deciding.
ADAPTIVE_PROBE = 8


def adaptive_prefetch(source: Iterator, buffer_size: int,
                      min_cost_s: float = ADAPTIVE_MIN_COST_S,
                      probe: int = ADAPTIVE_PROBE) -> Iterator:
    """Prefetch ``buffer_size`` elements in a background thread only when it pays.

    The first ``probe`` elements of the epoch are produced inline and timed. If they
    took ``min_cost_s`` or more each on average (file reading, a Python ``map``), the
    rest of the epoch comes through a :class:`Prefetcher`, overlapping production with
    the consumer's work; otherwise (an in-memory pipeline, where a thread handoff would
    cost more than the element) the rest stays inline.
    """
    spent = 0.0
    for _ in range(probe):
        t0 = time.perf_counter()
        try:
            element = next(source)
        except StopIteration:
            return
        spent += time.perf_counter() - t0
        yield element
    if spent / probe < min_cost_s:
        yield from source
        return
    yield from prefetch(source, buffer_size)


def parallel_map(source: Iterator, call: Callable[[Any], Any], parallelism: int,
                 deterministic: bool) -> Iterator:
    """Generator of ``call(e)`` for ``e`` in ``source``, computed by ``parallelism`` threads.

    Input elements are pulled by the consumer; results come in input order when
    ``deterministic``, else as soon as each is ready.
    """
    executor = cf.ThreadPoolExecutor(max_workers=parallelism,
                                     thread_name_prefix="gpustrat-map")
    depth = 2 * parallelism
    exhausted = False
    pending: collections.deque = collections.deque()
    try:
        while True:
            while not exhausted and len(pending) < depth:
                try:
                    element = next(source)
                except StopIteration:
                    exhausted = True
                    break
                pending.append(executor.submit(call, element))
            if not pending:
                return
            if deterministic:
                future = pending.popleft()
            else:
                done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
                future = next(f for f in pending if f in done)
                pending.remove(future)
            # Raises the worker's exception with the worker's traceback.
            yield future.result()
    finally:
        for f in pending:
            f.cancel()
        executor.shutdown(wait=True, cancel_futures=True)
        close = getattr(source, "close", None)
        if close is not None:
            close()
