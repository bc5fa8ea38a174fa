"""ClusterCoordinator: schedules functions on the workers and collects their results.

A dispatcher thread on the coordinator gives each idle worker the next queued
function (one at a time per worker) and receives results. Delivery is
*at-least-once*: when a worker's function process dies (a crash, a kill,
``os._exit``) the function it was running is queued again, for another worker when
there is one, so a function may run more than once (its variable updates too). A
function whose process dies ``max_retries`` times is reported as failed. A worker rank
that holds functions and does not answer the dispatcher's liveness check within twice
``GPUSTRAT_TIMEOUT`` is lost: it gets nothing more, and its functions are queued again
for the other workers (the running one counts as an attempt). An exception
raised by a function is raised by ``join()``/``done()``/``fetch()`` (and the next
``schedule``), naming the worker; a function's ``sys.exit`` or ``KeyboardInterrupt``
as a RuntimeError saying so. A parameter server found lost (by a worker's request or
one of the coordinator's) is told to every worker, so that their requests to it fail
at once, as the coordinator's do.
"""

from __future__ import annotations

import collections
import itertools
import logging
import pickle
import threading
import time

from gpustrat import nest
from gpustrat import timeline as _tl
from gpustrat.distribute.parameter_server import doorbell, wire
from gpustrat.distribute.parameter_server.channel import (TAG_RESULT, TAG_RESULT_DATA,
                                                           ServerLostError)
from gpustrat.distribute.parameter_server.values import (  # noqa: F401 - names of the API
    PerWorkerDataset, PerWorkerIterator, PerWorkerValues, RemoteValue, WorkerLocal,
    experimental_get_current_worker_index, find_unplaced, set_coordinator)

log = logging.getLogger("gpustrat.distribute.coordinator")

#: Functions a worker may have at once: the one running and the next.
_DEPTH = 2
#: A worker holding functions that has sent nothing for this long (at most, a quarter
#: of GPUSTRAT_TIMEOUT) is asked whether it is there; it is lost when it has not
#: answered _LOST_AFTER times GPUSTRAT_TIMEOUT after that: longer than a request of it
#: to a server may wait (GPUSTRAT_TIMEOUT), so that a lost server is reported as such,
#: by the worker, and not as the worker's loss.
_PING_AFTER_S = 5.0
_LOST_AFTER = 2.0
#: How often the dispatcher looks at the workers' silences.
_CHECK_S = 0.1


class _Closure:
    __slots__ = ("id", "name", "blob", "arrays", "value", "lost_on")

    def __init__(self, ident, name, blob, arrays):
        self.id = ident
        self.name = name
        self.blob = blob
        self.arrays = arrays
        self.value = RemoteValue(name)
        self.lost_on: list = []


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
        set_coordinator(self)
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
        #: Workers that stopped answering (see _check_workers): they get nothing more.
        self._lost: set = set()
        now = time.monotonic()
        #: Per worker, when it was last heard from (or given work while idle), and when
        #: it was asked whether it is there (None: not asked).
        self._heard = [now] * self._n
        self._pinged: list = [None] * self._n
        self._ping_after = min(_PING_AFTER_S, self._ch.timeout / 4)
        #: Sends to lost workers left at the end (their buffers stay alive).
        self._abandoned: list = []
        self._thread = threading.Thread(target=self._dispatch, name="gpustrat-coordinator",
                                        daemon=True)
        self._thread.start()

    # --- scheduling -------------------------------------------------------------------
    @_tl.traced("ps schedule")
    def schedule(self, fn, args=None, kwargs=None) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` to run on some worker; returns its RemoteValue.

        A :class:`PerWorkerValues` sent with the function (an argument, a global or
        closure value; per-worker iterators too) is the running worker's value there;
        a finished RemoteValue is its result.

        Raises:
            TypeError: ``fn`` is not callable, or it (or an argument, or a global it
                uses) cannot be sent to a worker.
            ValueError: a PerWorkerValues without one value per worker.
            The error of a previously scheduled function not yet raised by join/done.
        """
        if not callable(fn):
            raise TypeError(f"schedule needs a callable, got {fn!r}")
        self._raise_error()
        if self._broken is not None:
            raise self._broken
        name = f"function {wire.describe_function(fn)!r}"
        for values in find_unplaced(args, kwargs):
            self._place(values)
        blob, arrays = wire.pack((fn, tuple(args or ()), dict(kwargs or {})), name)
        with self._cv:
            c = _Closure(next(self._ids), name, blob, arrays)
            self._queue.append(c)
            self._cv.notify_all()
        self._wake_dispatcher()
        return c.value

    def _wake_dispatcher(self) -> None:
        # It may sleep on its doorbell (waiting for results), not on the condition.
        self._ch.ring(self._ch.rank, doorbell.RESULTS)

    @_tl.traced("ps join")
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

    # --- values on the workers ----------------------------------------------------------
    def create_per_worker_dataset(self, dataset_fn) -> PerWorkerDataset:
        """Make a dataset on every worker: ``dataset_fn()`` (no argument) is called there,
        or a dataset (or a distributed dataset of the strategy) is sent there.

        Raises:
            TypeError: it cannot be sent, or it did not give a dataset (on the worker
                named).
        """
        from gpustrat.distribute.parameter_server.executor import make_dataset  # noqa
        return PerWorkerDataset(self, self._create_resources(
            make_dataset, (dataset_fn,), {}, "dataset", "the dataset function"))

    def create_per_worker_resources(self, fn, args=None, kwargs=None) -> PerWorkerValues:
        """Call ``fn(*args, **kwargs)`` on every worker and keep each result there; the
        returned :class:`PerWorkerValues` (of :class:`WorkerLocal` placeholders here)
        passed to ``schedule`` gives each function its worker's object. A worker whose
        function process is replaced calls ``fn`` again.

        Raises:
            TypeError: ``fn`` or an argument cannot be sent to a worker.
            RuntimeError (or the TypeError it raised): ``fn`` failed on some worker
                (each such worker is named).
        """
        if not callable(fn):
            raise TypeError(f"create_per_worker_resources needs a callable, got {fn!r}")
        return self._create_resources(fn, tuple(args or ()), dict(kwargs or {}),
                                      "resource")

    def _create_resources(self, fn, args: tuple, kwargs: dict, what: str,
                          described: str | None = None) -> PerWorkerValues:
        for values in find_unplaced(args, kwargs):
            self._place(values)
        name = described or f"function {wire.describe_function(fn)!r}"
        blob, arrays = wire.pack((fn, args, kwargs), name)
        ident = next(self._setup_ids)
        self._setup("call", ident, [(blob, arrays)] * self._n, what)
        made = PerWorkerValues([WorkerLocal(w, what) for w in range(self._n)])
        made._ident = ident
        made._placed_by = self
        return made

    def _place(self, values: PerWorkerValues) -> None:
        """Send each worker its value of ``values`` (once)."""
        if len(values) != self._n:
            raise ValueError(f"a PerWorkerValues has {len(values)} values but the strategy "
                             f"has {self._n} workers: give exactly one value per worker")
        payloads = [wire.pack(v, f"the value of worker {w} in a PerWorkerValues")
                    for w, v in enumerate(values.values)]
        ident = next(self._setup_ids)
        self._setup("value", ident, payloads, "value")
        values._ident = ident
        values._placed_by = self

    def _setup(self, kind: str, ident: int, payloads: list, what: str) -> None:
        """Make value ``ident`` on every worker (``payloads[w]`` for worker w) and wait
        until each has it."""
        with self._cv:
            self._setup_replies[ident] = {}
            self._cv.notify_all()
        self._wake_dispatcher()
        sends = []
        for w, (blob, arrays) in enumerate(payloads):
            if w in self._lost:  # it runs nothing more: it needs no values
                with self._cv:
                    self._setup_replies[ident][w] = None
                continue
            # Not waited for here: a stopped worker never takes a large value, and the
            # others must still get theirs (a send's buffers live until it completes).
            sends.append(self.strategy._send_to_worker(
                w, ("setup", kind, ident, blob, what, self.max_retries), arrays,
                wait=False))
        try:
            replies = self._setup_wait(ident, what)
        finally:
            # Sends not complete (a lost worker's): their buffers stay alive.
            self._abandoned.extend(self.strategy._channel.done(sends))
        bad = sorted((w, e) for w, e in replies.items() if e is not None)
        if bad:
            kinds = {e[0] for _, e in bad}
            cls = TypeError if kinds == {"TypeError"} else RuntimeError
            raise cls(f"making the per-worker {what} failed on " +
                      "; ".join(f"worker {w}: {e[1]}" for w, e in bad))

    def _setup_wait(self, ident: int, what: str) -> dict:
        """Every worker's reply to setup ``ident`` (see _setup). The deadline counts
        while a worker that has not answered holds no functions: it makes the value after
        the functions it holds, however long they run (one that stops answering meanwhile
        is given up for lost, see _check_workers)."""
        deadline = time.monotonic() + self._ch.timeout
        with self._cv:
            while len(self._setup_replies[ident]) < self._n:
                now = time.monotonic()
                got = self._setup_replies[ident]
                if any(self._busy[w] for w in range(self._n) if w not in got):
                    deadline = max(deadline, now + self._ch.timeout)
                if now > deadline:
                    got = self._setup_replies.pop(ident, {})
                    late = ", ".join(f"worker {w} (rank {self._ch.worker_ranks[w]})"
                                     for w in range(self._n) if w not in got)
                    raise TimeoutError(f"{late} did not make the per-worker {what} within "
                                       f"{self._ch.timeout:g} s (GPUSTRAT_TIMEOUT): the "
                                       "function that makes it may hang there, or the "
                                       "worker is stopped; raise GPUSTRAT_TIMEOUT if it "
                                       "legitimately takes longer")
                self._cv.wait(0.1)
            return self._setup_replies.pop(ident)

    # --- the dispatcher thread ----------------------------------------------------------
    def _stop_dispatcher(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._wake_dispatcher()
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
        backoff = self._ch.backoff()
        sleep = self._ch.sleeper(doorbell.RESULTS)  # workers ring it with each result
        pending: list = []  # sends to workers not yet complete
        next_check = 0.0
        told: set = set()  # lost servers the workers were told of
        any_source, status = _any_source(), _status()
        while True:
            with self._cv:
                stop = self._stop
            if stop:
                # MPI reads a send's buffers until the worker has them: keep them. A lost
                # worker may never take them (the job is ended at exit, see _shutdown).
                for requests, _, rank in pending:
                    if rank not in self._ch.lost:
                        self._ch.wait(requests, rank, "sending a task to a worker",
                                      doorbell.RESULTS)
                self._abandoned.extend(pending)
                return
            with self._cv:
                sends = self._assign()
                in_flight = any(self._busy) or self._setup_replies
                if not sends and not in_flight and not self._queue:
                    self._cv.wait(0.05)
                    continue
            for rank in self._ch.server_ranks:  # told before the tasks sent below
                if rank in self._ch.lost and rank not in told:
                    told.add(rank)
                    pending += self._tell_server_lost(rank)
            for w, c in sends:
                # Not waited for here: the worker may be sending a result meanwhile.
                pending.append((*self.strategy._send_to_worker(
                    w, ("run", c.id, c.blob), c.arrays, wait=False),
                    self._ch.worker_ranks[w]))
            now = time.monotonic()
            if now >= next_check:
                next_check = now + _CHECK_S
                for w in self._check_workers(now):
                    pending.append((*self.strategy._send_to_worker(w, ("ping",),
                                                                   wait=False),
                                    self._ch.worker_ranks[w]))
            if pending:
                pending = self._ch.done(pending)
            msg = comm.improbe(source=any_source, tag=TAG_RESULT, status=status)
            if msg is None:
                if sends:
                    backoff.reset()
                else:
                    backoff(sleep)
                continue
            backoff.reset()
            source = status.Get_source()
            header, ms = msg.recv()
            arrays = self._ch.recv_arrays(source, TAG_RESULT_DATA, ms, doorbell.RESULTS) \
                if ms else []
            w = source - first_worker
            with self._cv:
                self._heard[w] = time.monotonic()
                self._pinged[w] = None
            if w not in self._lost:  # one given up for lost may come back: not heard
                self._handle(w, header, arrays)

    def _tell_server_lost(self, rank: int) -> list:
        """Tell every worker that server rank ``rank`` was lost (found by a worker's
        request or by one of this process), so that their requests to it fail at once;
        returns the pending sends."""
        with self._cv:
            workers = [w for w in range(self._n) if w not in self._lost]
        return [(*self.strategy._send_to_worker(w, ("server_lost", rank), wait=False),
                 self._ch.worker_ranks[w]) for w in workers]

    def _check_workers(self, now: float) -> list:
        """The workers to ask whether they are there (those holding functions that have
        been silent for a while); gives up for lost those that did not answer within
        twice GPUSTRAT_TIMEOUT. A worker rank answers from its own loop, whatever its
        function process does, so a function may run for longer than that."""
        ask = []
        with self._cv:
            for w in range(self._n):
                if w in self._lost or not self._busy[w]:
                    self._pinged[w] = None
                elif self._pinged[w] is None:
                    if now - self._heard[w] > self._ping_after:
                        self._pinged[w] = now
                        ask.append(w)
                elif now - self._pinged[w] > _LOST_AFTER * self._ch.timeout:
                    self._worker_lost(w)
                    self._cv.notify_all()
        return ask

    def _worker_lost(self, w: int) -> None:
        """Give worker ``w`` up for lost and queue its functions again (under the lock).
        At-least-once: the one it was running counts as an attempt, and it may run
        twice should the worker come back (its messages are then ignored)."""
        rank = self._ch.worker_ranks[w]
        self._lost.add(w)
        self._ch.lost.add(rank)
        held = list(self._busy[w])
        self._busy[w].clear()
        log.warning("worker %d (rank %d) did not answer the coordinator within %g s "
                    "(twice GPUSTRAT_TIMEOUT) while holding %d function(s): it is given "
                    "up for lost (stopped, or its machine is unreachable) and gets no "
                    "more functions; its functions are scheduled again on the other "
                    "workers",
                    w, rank, _LOST_AFTER * self._ch.timeout, len(held))
        for ident in list(self._setup_replies):
            self._setup_replies[ident].setdefault(w, None)
        if held:
            first = held[0]
            first.lost_on.append(w)
            if len(first.lost_on) > self.max_retries:
                self._record(first, RuntimeError(
                    f"{first.name} was on a lost worker {len(first.lost_on)} times (on "
                    f"workers {first.lost_on}): it is not run again"))
                held = held[1:]
            for c in reversed(held):
                self._queue.appendleft(c)
        if len(self._lost) == self._n:
            err = RuntimeError(
                f"every worker ({self._n}) stopped answering the coordinator within "
                f"{_LOST_AFTER * self._ch.timeout:g} s (twice GPUSTRAT_TIMEOUT): no "
                "function can run. See the workers' output, restart the job and restore "
                "the variables from a checkpoint")
            while self._queue:
                self._queue.popleft().value._fail(err)
            self._errors.insert(0, err)
            self._broken = err

    def _assign(self) -> list:
        """Pair idle workers with queued functions (under the lock)."""
        sends = []
        for level in range(_DEPTH):  # idle workers first
            for w in range(self._n):
                if len(self._busy[w]) != level or not self._queue or w in self._lost:
                    continue
                if level == 0:  # its silence counts from here (see _check_workers)
                    self._heard[w] = time.monotonic()
                pick = None
                for c in self._queue:
                    # A function whose process died here goes elsewhere when it can.
                    if w not in c.lost_on or all(x in c.lost_on for x in range(self._n)
                                                 if x not in self._lost):
                        pick = c
                        break
                if pick is None:
                    continue
                self._queue.remove(pick)
                self._busy[w].append(pick)
                if _tl.ON:
                    _tl.ps_sent(w, pick)
                sends.append((w, pick))
        return sends

    def _answered(self, w: int, task: int) -> _Closure:
        busy = self._busy[w]
        c = busy.popleft()
        if _tl.ON:
            _tl.ps_answered(w, c)
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
                self._record(c, _remote_error(header[2], header[3], c.name, w,
                                              self._ch.worker_ranks[w]))
            elif kind == "lost":
                _, running, queued, code, setup = header
                c = self._answered(w, running) if running is not None else None
                # Those sent behind the running one had not started: queued again as
                # they were, ahead of the rest.
                behind = [self._answered(w, t) for t in queued]
                for b in reversed(behind):
                    self._queue.appendleft(b)
                if c is not None:
                    doing = f"while running {c.name}"
                elif setup is not None:
                    doing = f"while making the per-worker {setup[0]} #{setup[1]}"
                else:
                    doing = "while idle"
                log.warning("worker %d (rank %d) lost its function process (exit code %s) "
                            "%s; a replacement process was started", w,
                            self._ch.worker_ranks[w], code, doing)
                if setup is not None:
                    what, ident, attempts, gave_up = setup
                    if gave_up:
                        log.warning(
                            "worker %d does not make the per-worker %s #%d again: its "
                            "function process died %d times making it (max_retries=%d); "
                            "functions that use it on worker %d fail", w, what, ident,
                            attempts, self.max_retries, w)
                    else:
                        log.warning("making the per-worker %s #%d again on worker %d "
                                    "(attempt %d)", what, ident, w, attempts + 1)
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
                err = ServerLostError(f"{text} (seen by worker {w})")
                while self._queue:
                    self._queue.popleft().value._fail(err)
                # The first news of the loss goes first; later reports (requests failed at
                # once, as the server was known lost) after it.
                if rank in self._ch.lost:
                    self._errors.append(err)
                else:
                    self._errors.insert(0, err)
                self._ch.lost.add(rank)
            elif kind == "setup_done":
                _, ident, err = header
                if ident in self._setup_replies:
                    self._setup_replies[ident][w] = err
            # "pong" (the answer to _check_workers' question) says only that it is there
            self._cv.notify_all()

    def _record(self, c: _Closure, err: BaseException) -> None:
        c.value._fail(err)
        self._errors.append(err)

    def __reduce__(self):
        raise TypeError("a ClusterCoordinator cannot be used inside a scheduled function: "
                        "schedule from the coordinator")


def _remote_error(blob, text: str, name: str, worker: int, rank: int) -> Exception:
    """The error that ``join``/``fetch`` raise for a function that failed on a worker:
    its own exception (``blob``, pickled) with the function and worker named, or a
    RuntimeError. One that is not an Exception (``sys.exit``, ``KeyboardInterrupt``)
    is a RuntimeError: re-raised here, it would end (or interrupt) the coordinator's
    script as though it had done so itself, quietly for ``sys.exit(0)``."""
    where = f"{name} failed on worker {worker}"
    err = None
    if blob is not None:
        try:
            err = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            err = None
    if isinstance(err, BaseException) and not isinstance(err, Exception):
        from gpustrat.distribute.parameter_server.executor import how_it_ended  # noqa
        out = RuntimeError(f"{name} {how_it_ended(err)} on worker {worker} (rank {rank}): "
                           "a scheduled function that exits fails like one that raises")
        out.add_note(f"its traceback there:\n{text}")
        return out
    if isinstance(err, Exception):
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
