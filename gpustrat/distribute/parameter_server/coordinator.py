"""ClusterCoordinator: schedules functions on the workers and collects their results.

A dispatcher thread on the coordinator gives each idle worker the next queued
function (one at a time per worker) and receives results. Delivery is
*at-least-once*: when a worker's function process dies (a crash, a kill,
``os._exit``) the function it was running is queued again, for another worker when
there is one, so a function may run more than once (its variable updates too). A
function whose process dies ``max_retries`` times is reported as failed. An exception
raised by a function is raised by ``join()``/``done()``/``fetch()`` (and the next
``schedule``), naming the worker.
"""

from __future__ import annotations

import collections
import itertools
import logging
import pickle
import threading
import time

from gpustrat import nest
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.channel import (TAG_RESULT, TAG_RESULT_DATA,
                                                           Backoff, ServerLostError)

log = logging.getLogger("gpustrat.distribute.coordinator")

#: Functions a worker may have at once: the one running and the next.
_DEPTH = 2


class RemoteValue:
    """The future result of a scheduled function (``tf.distribute.experimental.
    coordinator.RemoteValue``)."""

    def __init__(self, name: str):
        self._name = name
        self._event = threading.Event()
        self._value = None
        self._error = None

    def _set(self, value) -> None:
        self._value = value
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    def fetch(self):
        """Wait for the function and return its result (NumPy values), or raise its
        error."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self):
        """The same as :meth:`fetch`."""
        return self.fetch()

    def __reduce__(self):
        # As an argument of a scheduled function: its result, once there is one.
        if self._ready() and self._error is None:
            return (_identity, (self._value,))
        raise TypeError(f"the RemoteValue of {self._name} is not ready (or failed): pass "
                        "remote_value.fetch() to a scheduled function, not the RemoteValue")

    def _ready(self) -> bool:
        return self._event.is_set()

    def __repr__(self) -> str:
        state = "ready" if self._ready() else "pending"
        return f"<RemoteValue of {self._name} ({state})>"


class _Closure:
    __slots__ = ("id", "name", "blob", "arrays", "value", "lost_on")

    def __init__(self, ident, name, blob, arrays):
        self.id = ident
        self.name = name
        self.blob = blob
        self.arrays = arrays
        self.value = RemoteValue(name)
        self.lost_on: list = []


class PerWorkerDataset:
    """A dataset made on every worker (``create_per_worker_dataset``); ``iter()`` gives
    a :class:`PerWorkerIterator`."""

    def __init__(self, coordinator, ident: int):
        self._coordinator = coordinator
        self._id = ident

    def __iter__(self) -> "PerWorkerIterator":
        return self._coordinator._make_iterator(self._id)

    def __reduce__(self):
        raise TypeError("pass iter(per_worker_dataset) to scheduled functions, not the "
                        "per-worker dataset itself")


class PerWorkerIterator:
    """An iterator on every worker; inside a scheduled function ``next()`` takes the
    next element from the worker running it."""

    def __init__(self, ident: int):
        self._id = ident

    def __reduce__(self):
        return (PerWorkerIterator, (self._id,))

    def __iter__(self):
        return self

    def __next__(self):
        from gpustrat.distribute.parameter_server import executor  # noqa: PLC0415
        it = executor.state["iterators"].get(self._id)
        if it is None:
            raise RuntimeError("a per-worker iterator is read inside a scheduled function "
                               "(on a worker), not on the coordinator")
        return next(it)

    def get_next(self):
        return next(self)

    def __repr__(self) -> str:
        return f"<PerWorkerIterator #{self._id}>"


class ClusterCoordinator:
    """Schedules functions on the workers of a ParameterServerStrategy
    (``tf.distribute.coordinator.ClusterCoordinator``).

    Args:
        strategy: the coordinator's ParameterServerStrategy.
        max_retries: how many times a function is run again after its worker's process
            died before it is reported as failed (default 3).
    """

    def __init__(self, strategy, max_retries: int = 3):
        from gpustrat.distribute.parameter_server.strategy import (  # noqa: PLC0415
            ParameterServerStrategy, WorkerSideStrategy)
        if not isinstance(strategy, ParameterServerStrategy) or \
                isinstance(strategy, WorkerSideStrategy):
            raise TypeError(f"ClusterCoordinator needs the coordinator's "
                            f"ParameterServerStrategy, got {strategy!r}")
        if strategy._coordinator is not None:
            raise ValueError("this ParameterServerStrategy already has a "
                             "ClusterCoordinator: make one per strategy")
        strategy._coordinator = self
        self.strategy = strategy
        self.max_retries = int(max_retries)
        self._ch = strategy._channel
        self._n = strategy.num_workers
        self._queue: collections.deque = collections.deque()
        #: Per worker, the functions sent to it and not yet answered, oldest first: up
        #: to _DEPTH, so that a worker finds its next function waiting when one ends.
        self._busy: list = [collections.deque() for _ in range(self._n)]
        self._errors: list = []
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._setup_ids = itertools.count()
        self._setup_replies: dict = {}
        self._stop = False
        self._broken = None
        self._thread = threading.Thread(target=self._dispatch, name="gpustrat-coordinator",
                                        daemon=True)
        self._thread.start()

    # --- scheduling -------------------------------------------------------------------
    def schedule(self, fn, args=None, kwargs=None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns its RemoteValue.

        Per-worker iterators and values among the arguments become the running worker's.

        Raises:
            TypeError: ``fn`` is not callable, or it (or an argument, or a global it
                uses) cannot be sent to a worker.
            The error of a previously scheduled function not yet raised by join/done.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable, got {fn!r}")
        self._raise_error()
        if self._broken is not None:
            raise self._broken
        name = f"function {wire.describe_function(fn)!r}"
        blob, arrays = wire.pack((fn, tuple(args or ()), dict(kwargs or {})), name)
        with self._cv:
            c = _Closure(next(self._ids), name, blob, arrays)
            self._queue.append(c)
            self._cv.notify_all()
        return c.value

    def join(self) -> None:
        """Wait until every scheduled function has finished; raise the first error of
        one (once)."""
        with self._cv:
            while self._queue or any(self._busy):
                self._cv.wait(0.1)
        self._raise_error()

    def done(self) -> bool:
        """Whether every scheduled function has finished (raises a function's error)."""
        self._raise_error()
        with self._cv:
            return not self._queue and not any(self._busy)

    def fetch(self, val):
        """``val`` with every RemoteValue replaced by its result (waiting for it)."""
        return nest.map_structure(
            lambda v: v.fetch() if isinstance(v, RemoteValue) else v, val)

    def _raise_error(self) -> None:
        with self._cv:
            if not self._errors:
                return
            err = self._errors[0]
            self._errors.clear()
        raise err

    # --- per-worker datasets ----------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Make a dataset on every worker: ``dataset_fn()`` (no argument) is called there,
        or a dataset (or a distributed dataset of the strategy) is sent there.

        Raises:
            TypeError: it cannot be sent, or it did not give a dataset (on the worker
                named).
        """
        ident = next(self._setup_ids)
        blob, arrays = wire.pack(dataset_fn, "the dataset function")
        self._setup_all("dataset", ident, blob, arrays)
        return PerWorkerDataset(self, ident)

    def _make_iterator(self, ds_id: int) -> PerWorkerIterator:
        ident = next(self._setup_ids)
        self._setup_all("iter", ident, ds_id, [])
        return PerWorkerIterator(ident)

    def _setup_all(self, kind: str, ident: int, payload, arrays) -> None:
        with self._cv:
            self._setup_replies[ident] = {}
        for w in range(self._n):
            self.strategy._send_to_worker(w, ("setup", kind, ident, payload), arrays)
        deadline = time.monotonic() + self._ch.timeout
        with self._cv:
            while len(self._setup_replies[ident]) < self._n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"workers did not make the {kind} within "
                                       f"{self._ch.timeout:g} s")
                self._cv.wait(0.1)
            replies = self._setup_replies.pop(ident)
        bad = sorted((w, e) for w, e in replies.items() if e is not None)
        if bad:
            kinds = {e[0] for _, e in bad}
            cls = TypeError if kinds == {"TypeError"} else RuntimeError
            raise cls("making the per-worker " + ("dataset" if kind == "dataset" else
                                                  "iterator") + " failed on " +
                      "; ".join(f"worker {w}: {e[1]}" for w, e in bad))

    # --- the dispatcher thread ----------------------------------------------------------
    def _stop_dispatcher(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def _dispatch(self) -> None:
        try:
            self._dispatch_loop()
        except BaseException as e:  # noqa: BLE001 - join() must not wait forever
            err = RuntimeError(f"the coordinator's dispatcher thread failed ({e!r}); the "
                               "functions queued and running were abandoned")
            with self._cv:
                for c in list(self._queue) + [c for b in self._busy for c in b]:
                    c.value._fail(err)
                self._queue.clear()
                for b in self._busy:
                    b.clear()
                self._errors.insert(0, err)
                self._broken = err
                self._cv.notify_all()

    def _dispatch_loop(self) -> None:
        comm = self._ch.comm
        first_worker = 1 + self.strategy.num_ps
        backoff = Backoff()
        any_source, status = _any_source(), _status()
        while True:
            with self._cv:
                if self._stop:
                    return
                sends = self._assign()
                in_flight = any(self._busy) or self._setup_replies
                if not sends and not in_flight and not self._queue:
                    self._cv.wait(0.05)
                    continue
            for w, c in sends:
                self.strategy._send_to_worker(w, ("run", c.id, c.blob), c.arrays)
            msg = comm.improbe(source=any_source, tag=TAG_RESULT, status=status)
            if msg is None:
                if sends:
                    backoff.reset()
                else:
                    backoff()
                continue
            backoff.reset()
            source = status.Get_source()
            header, ms = msg.recv()
            arrays = wire.mpi_recv_arrays(comm, source, TAG_RESULT_DATA, ms) if ms else []
            self._handle(source - first_worker, header, arrays)

    def _assign(self) -> list:
        """Pair idle workers with queued functions (under the lock)."""
        sends = []
        for level in range(_DEPTH):  # idle workers first
            for w in range(self._n):
                if len(self._busy[w]) != level or not self._queue:
                    continue
                pick = None
                for c in self._queue:
                    # A function whose process died here goes elsewhere when it can.
                    if w not in c.lost_on or all(x in c.lost_on for x in range(self._n)):
                        pick = c
                        break
                if pick is None:
                    continue
                self._queue.remove(pick)
                self._busy[w].append(pick)
                sends.append((w, pick))
        return sends

    def _answered(self, w: int, task: int) -> _Closure:
        busy = self._busy[w]
        c = busy.popleft()
        if c.id != task:  # a worker answers in order; anything else is a bug here
            raise RuntimeError(f"worker {w} answered function #{task} but #{c.id} was "
                               "its oldest")
        return c

    def _handle(self, w: int, header, arrays) -> None:
        kind = header[0]
        with self._cv:
            if kind == "done":
                c = self._answered(w, header[1])
                try:
                    c.value._set(wire.unpack(header[2], arrays))
                except Exception as e:  # noqa: BLE001
                    self._record(c, RuntimeError(f"the result of {c.name} from worker {w} "
                                                 f"cannot be read here: {e}"))
            elif kind == "error":
                c = self._answered(w, header[1])
                self._record(c, _remote_error(header[2], header[3], c.name, w))
            elif kind == "lost":
                _, running, queued, code = header
                c = self._answered(w, running) if running is not None else None
                # Those sent behind the running one had not started: queued again as
                # they were, ahead of the rest.
                behind = [self._answered(w, t) for t in queued]
                for b in reversed(behind):
                    self._queue.appendleft(b)
                what = f"while running {c.name}" if c is not None else "while idle"
                log.warning("worker %d (rank %d) lost its function process (exit code %s) "
                            "%s; a replacement process was started", w,
                            self._ch.worker_ranks[w], code, what)
                if c is not None:
                    c.lost_on.append(w)
                    if len(c.lost_on) > self.max_retries:
                        self._record(c, RuntimeError(
                            f"{c.name} lost its worker's process {len(c.lost_on)} times "
                            f"(on workers {c.lost_on}, exit codes such as {code}): it "
                            "probably crashes or exits the process itself (os._exit, a "
                            "signal, memory exhaustion)"))
                    else:
                        log.warning("rescheduling %s (attempt %d)", c.name,
                                    len(c.lost_on) + 1)
                        self._queue.appendleft(c)
            elif kind == "server_lost":
                # The job cannot go on: every queued function fails with the error.
                _, rank, text = header
                self._ch.lost.add(rank)
                err = ServerLostError(f"{text} (seen by worker {w})")
                while self._queue:
                    self._queue.popleft().value._fail(err)
                self._errors.insert(0, err)
            elif kind == "setup_done":
                _, ident, err = header
                if ident in self._setup_replies:
                    self._setup_replies[ident][w] = err
            self._cv.notify_all()

    def _record(self, c: _Closure, err: BaseException) -> None:
        c.value._fail(err)
        self._errors.append(err)

    def __reduce__(self):
        raise TypeError("a ClusterCoordinator cannot be used inside a scheduled function: "
                        "schedule from the coordinator")


def _identity(x):
    return x


def _remote_error(blob, text: str, name: str, worker: int) -> BaseException:
    where = f"{name} failed on worker {worker}"
    err = None
    if blob is not None:
        try:
            err = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            err = None
    if isinstance(err, BaseException):
        first = str(err.args[0]) if err.args else ""
        try:
            err.args = (f"{first} ({where})",) + tuple(err.args[1:])
        except Exception:  # noqa: BLE001
            pass
        err.add_note(f"{where}; its traceback there:\n{text}")
        return err
    last = text.strip().splitlines()[-1] if text.strip() else "unknown error"
    return RuntimeError(f"{where}: {last}\n{text}")


def _any_source() -> int:
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().ANY_SOURCE


def _status():
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().Status()
