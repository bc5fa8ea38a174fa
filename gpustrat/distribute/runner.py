"""Persistent replica threads: how ``strategy.run`` calls a function once per replica.

Replica 0 runs in the calling thread; every other local replica owns one thread for
the strategy's lifetime (never a new thread per call), bound to its device and, on
GPUs, to its own stream. Waking a thread costs little on a busy CPU but ~35 µs when the
scheduler picks an idle vCPU, so a call decides per step how to run:

1. Replica 0 runs first, in the caller, under its device context.
2. If it reaches a collective, the other replicas' threads are started at that moment
   (they must meet it), and the call waits for them.
3. If it finishes without a collective, the others cannot issue one either (replicas
   issue the same collectives, in the same order). They then run in turn in the
   calling thread under their own device contexts when the step was short, or in
   their threads, in parallel, when it was long enough for parallelism to pay
   (``INLINE_STEP_LIMIT_S``; on GPUs, whose replicas' host work is launches that the
   interpreter's lock serializes anyway, only when replica 0 spent part of its step
   waiting, ``INLINE_WAIT_SHARE``). A collective in such a replica is a mismatch and
   raises at once, where TensorFlow would hang.

A *deposit* (:meth:`Rendezvous.deposit`, what ``apply_gradients`` issues) is a
collective whose replicas need no answer: each gives its part and goes on, and the
last to give runs the combination. It does not make replica 0 wait, so a step whose
only collective is ``apply_gradients`` runs every replica in the caller, with no
thread woken. A replica that then reads or writes a mirrored variable of the strategy
(``Rendezvous.settle``) first waits for the deposits it made to be combined (the
replicas that have not run yet are started in their threads for it), so it reads the
values the update wrote, as after a ``merge_call``. A step ends with every deposit
combined, or raises naming the replicas that did not make it.

Collectives meet in a :class:`Rendezvous`: the last replica to arrive computes the
collective for everybody. On GPUs it does so with every device's replica stream made
current (``Rendezvous.streams``): replica ``i``'s contribution was queued on stream
``i``, the collective's work for device ``i`` is queued after it there, and replica
``i`` continues after it, in stream order, with no host wait and no event. Outputs are
allocated from the pool arena of the stream that uses them. At the end of ``run`` the
caller's current stream of each device waits (an event, not the host) for the replica
stream, and its current stream of the current device for every replica stream (CuPy's
``get()`` copies there), so the caller reads results, and frees inputs, in order.
A lone GPU replica has no stream of its own: it runs in the caller, on the caller's
current stream, so there is nothing to order and no event.

If a replica raises, the rendezvous is broken so that
replicas waiting in a collective stop instead of hanging, and the caller re-raises the
first error with a note naming the replica. Likewise when a replica's function returns,
a collective that waits for it (or is issued after it) can never meet, and raises.

If the caller is interrupted (Ctrl-C) while it waits for the threads, it raises at once
and the next call first waits for that step's threads to finish. A thread left running
a step does not delay the interpreter's exit.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from gpustrat import timeline as _tl
from gpustrat.devices import (Device, cupy, join_streams_into_current, new_stream,
                              wait_for_current)
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout

#: A replica-0 step shorter than this runs the other replicas inline, in the caller.
INLINE_STEP_LIMIT_S = 200e-6
#: On GPUs: a replica-0 step that spent less than this share of its time off the CPU
#: (waiting for the device or for input) runs the other replicas inline, however long.
INLINE_WAIT_SHARE = 0.25


#: ``Rendezvous.returned`` between the steps of a runner: no collective can meet then.
NO_STEP = -1


class ReplicaAborted(RuntimeError):
    """Raised in a replica waiting in a collective when another replica failed."""


class Rendezvous:
    """Where the replica threads of one worker meet for a collective.

    Every replica calls :meth:`exchange` with its index, a signature (what collective,
    on what) and its contribution; the last to arrive checks the signatures agree, runs
    ``combine(contributions)`` (which returns one result per replica) and wakes the rest.
    """

    def __init__(self, n: int):
        self.n = n
        # The condition's lock, also taken directly where nobody waits (a C-level
        # ``with``; the Condition's own __enter__ is Python code).
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._slots: list = [None] * n
        self._sigs: list = [None] * n
        self._count = 0
        self._generation = 0
        self._outcome: tuple = (None, None)
        self._broken: BaseException | None = None
        #: Called (outside the lock) by a replica about to wait for the others.
        self.on_wait: Callable[[], None] | None = None
        #: The first replica whose function returned in this step: a collective issued
        #: after that can never meet (replicas issue the same collectives), so it raises.
        #: ``NO_STEP`` between a runner's steps, None during one before any returned.
        self.returned: int | None = None
        #: On GPUs: a context manager making every replica's stream the current stream
        #: of its device, entered by the thread that combines a collective.
        self.streams: Callable[[], Any] | None = None
        #: Under several workers, the communicator's ``share_error``: replicas of this
        #: worker that issued different collectives fail the step here, while the other
        #: workers may already wait in the collective; they are told (see
        #: ``Communicator.share_error``).
        self.share_error: Callable[[Exception], None] | None = None
        #: Deposits (:meth:`deposit`): how many each replica made in this step, and by
        #: number those some replicas have still to make (``[values, signatures,
        #: count]``); which replicas' functions returned.
        self._deposits = [0] * n
        self._open: dict = {}
        self._finished = [False] * n

    def exchange(self, index: int, signature: Any, value: Any,
                 combine: Callable[[list], list]) -> Any:
        if self.returned is not None:
            raise self._unmatched(index, signature)
        if self.n == 1:
            # One replica: nobody to meet or wake, and no signatures to compare; the
            # lock still orders collectives from threads the function started. Its
            # stream is already current (this is its own thread, under its context).
            with self._cond:
                if self._broken is not None:
                    raise ReplicaAborted("another replica failed") from self._broken
                if self.returned is not None:
                    raise self._unmatched(index, signature)
                return combine([value])[index]
        if self._count + 1 < self.n and self.on_wait is not None:
            self.on_wait()
        with self._cond:
            if self._broken is not None:
                raise ReplicaAborted("another replica failed") from self._broken
            if self.returned is not None:
                raise self._unmatched(index, signature)
            if self._sigs[index] is not None:
                raise ValueError(
                    f"replica {index} issued two collectives at once ({self._sigs[index][0]} "
                    f"and {signature[0]}): a replica's collectives must be issued one after "
                    "the other, from the thread strategy.run called its function in, not "
                    "from threads it starts")
            gen = self._generation
            self._slots[index] = value
            self._sigs[index] = signature
            self._count += 1
            if self._count == self.n:
                values, sigs = self._slots, self._sigs
                self._slots, self._sigs, self._count = [None] * self.n, [None] * self.n, 0
                try:
                    _check_signatures(sigs, self.share_error)
                    if self.streams is None:
                        self._outcome = (combine(values), None)
                    else:
                        with self.streams():
                            self._outcome = (combine(values), None)
                except BaseException as e:  # every replica gets the same error
                    self._outcome = (None, e)
                self._generation += 1
                self._cond.notify_all()
            else:
                t0 = _tl.now() if _tl.ON else 0
                while (self._generation == gen and self._broken is None
                       and self.returned is None):
                    self._cond.wait()
                if t0:
                    _tl.replica_wait(t0, signature)
                if self._generation == gen:
                    if self._broken is not None:
                        raise ReplicaAborted("another replica failed") from self._broken
                    raise self._unmatched(index, signature)
            results, error = self._outcome
        if error is not None:
            raise error
        return results[index]

    def deposit(self, index: int, signature: Any, value: Any,
                combine: Callable[[list], Any]) -> None:
        """A collective whose replicas need no answer: replica ``index`` gives its part
        and goes on; the last replica to give its part runs ``combine(parts)`` (in its
        thread, with every replica's stream current; an error it raises is this
        replica's). The ``k``-th deposits of the replicas are combined together, and
        their signatures must agree."""
        with self._cond:
            if self._broken is not None:
                raise ReplicaAborted("another replica failed") from self._broken
            if self.returned == NO_STEP:
                raise self._unmatched(index, signature)
            if self.n == 1:
                combine([value])
                return
            k = self._deposits[index]
            self._deposits[index] = k + 1
            entry = self._open.get(k)
            if entry is None:
                entry = self._open[k] = [[None] * self.n, [None] * self.n, 0]
            entry[0][index] = value
            entry[1][index] = signature
            entry[2] += 1
            if entry[2] < self.n:
                return
            del self._open[k]
            _check_signatures(entry[1], self.share_error)
            if self.streams is None:
                combine(entry[0])
            else:
                with self.streams():
                    combine(entry[0])
            self._cond.notify_all()      # replicas waiting in settle()

    def settle(self, index: int) -> None:
        """Wait until the deposits replica ``index`` made have been combined (it is
        about to read or write a variable they may update). Replicas that have not
        run yet are started, in their threads, for it (``on_wait``).

        Raises:
            ValueError: a replica whose function returned did not make one of them.
        """
        if self.n == 1 or not self._open:
            return
        if self.on_wait is not None:
            self.on_wait()
        with self._cond:
            mine = self._deposits[index]
            while True:
                if self._broken is not None:
                    raise ReplicaAborted("another replica failed") from self._broken
                waiting = [k for k in self._open if k < mine]
                if not waiting:
                    return
                missing = self._missing(waiting[0])
                if missing:
                    raise self._unmade(waiting[0], missing)
                self._cond.wait()

    def _missing(self, k: int) -> list:
        """The replicas whose functions returned without making deposit ``k``."""
        sigs = self._open[k][1]
        return [j for j in range(self.n) if sigs[j] is None and self._finished[j]]

    def _unmade(self, k: int, missing: list) -> ValueError:
        sigs = self._open[k][1]
        made = [j for j in range(self.n) if sigs[j] is not None]
        kind, name = next(s for s in sigs if s is not None)[:2]
        return ValueError(
            f"replica {made[0]} called {kind} ({name}) but replica {missing[0]} returned "
            "from its function without calling it; every replica must issue the same "
            "collectives in the same order")

    def unmade_deposits(self) -> tuple[int, ValueError] | None:
        """At the end of a step: the first replica that made fewer deposits than
        another, and the error naming it."""
        if not self._open:
            return None
        k = min(self._open)
        self._finished = [True] * self.n
        missing = self._missing(k)
        return missing[0], self._unmade(k, missing)

    def call_alone(self, index: int, kind: str, what: Any, collective: Callable,
                   *args: Any) -> Any:
        """:meth:`exchange` for a worker's only replica on a CPU, given one array:
        ``collective(*args)`` (a communicator's reduce or gather of it: the result for
        this one replica) under the same checks, with no signature built (``kind`` and
        ``what`` name the collective in errors)."""
        with self._lock:
            if self._broken is not None:
                raise ReplicaAborted("another replica failed") from self._broken
            if self.returned is not None:
                raise self._unmatched(index, (kind, what))
            return collective(*args)

    def _unmatched(self, index: int, signature: Any) -> Exception:
        if self.returned == NO_STEP:
            return RuntimeError(
                f"replica {index} called a collective ({signature[0]}, {signature[1]}) "
                "outside strategy.run: a replica context (get_replica_context()) can "
                "only issue collectives from the function run is running")
        error = ValueError(
            f"replica {index} called a collective ({signature[0]}, {signature[1]}) that "
            f"replica {self.returned} never called: replica {self.returned} returned from "
            "its function first; every replica must issue the same collectives in the "
            "same order")
        return error

    def clear_outcome(self) -> None:
        """Drop the last collective's results once every replica has read them."""
        self._outcome = (None, None)

    def leave(self, index: int) -> None:
        """Replica ``index``'s function returned: wake replicas waiting for it in vain."""
        with self._cond:
            if self.returned is None:
                self.returned = index
            self._finished[index] = True
            self._cond.notify_all()

    def begin(self) -> None:
        """A step starts (no replica thread runs yet)."""
        self.returned = None
        if self.n > 1:
            self._deposits = [0] * self.n
            self._open = {}
            self._finished = [False] * self.n

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._slots, self._sigs, self._count = [None] * self.n, [None] * self.n, 0
            self._broken = None
            self.returned = NO_STEP
            self._deposits = [0] * self.n
            self._open = {}
            self._finished = [False] * self.n
            # The last outcome may hold an error whose traceback reaches the strategy.
            self.clear_outcome()


def _check_signatures(sigs: list, share_error=None) -> None:
    for i, s in enumerate(sigs[1:], 1):
        if s != sigs[0]:
            error = ValueError(
                f"replicas issued different collectives at the same point: replica 0 called "
                f"{_shown_signature(sigs[0])} but replica {i} called {_shown_signature(s)}; "
                "every replica must issue the same collectives in the same order")
            if share_error is not None:
                share_error(error)
            raise error


def _shown_signature(sig) -> str:
    """A collective's signature in words (``all_reduce(SUM) on float64 (2,)``), or as
    it is when it is not one of ``(kind, op, ((shape, dtype), ...))``."""
    try:
        kind, op, leaves = sig
        gather = kind == "all_gather"
        call = f"all_gather(axis={op})" if gather else f"{kind}({op})"
        shown = [f"{dtype} of shape {tuple(shape)} besides the gathered axis" if gather
                 else f"{dtype} {tuple(shape)}" for shape, dtype in leaves]
    except (TypeError, ValueError):
        return repr(sig)
    return f"{call} on " + ", ".join(shown) if shown else call


class _ReplicaThread(threading.Thread):
    # Holds no reference to its runner or strategy (a live thread is a GC root): when
    # the strategy is dropped, the runner's finalizer stops the thread.
    def __init__(self, rendezvous: Rendezvous, index: int, device: Device, stream):
        super().__init__(name=f"gpustrat-replica-{index}-{device.name}", daemon=True)
        self.index = index
        self.device = device
        self.stream = stream
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        #: ``(step, fn, args, kwargs, enter, leave)`` from dispatch until collected.
        self.task: tuple | None = None
        #: The step of the last task this thread finished (see ReplicaRunner._drain).
        self.finished = 0
        self.result: Any = None
        self.error: BaseException | None = None
        self.stop = False
        self._rendezvous = rendezvous

    def run(self):
        go, done = self.go, self.done
        while True:
            go.acquire()
            if self.stop:
                done.release()
                return
            self.finished = self._run_task(*self.task)
            done.release()

    def _run_task(self, step, fn, args, kwargs, enter, leave) -> int:
        # A method of its own, so that no reference to fn or its arguments stays in the
        # thread's frame while it waits for the next task.
        try:
            # Device and stream are entered per task, not for the thread's life: the
            # caller may run this replica inline in another call. (CuPy keeps the
            # stream stack per thread, so the thread combining a collective may enter
            # this stream too.)
            with _replica_context(self.device, self.stream):
                enter(self.index)
                try:
                    self.result = fn(*args, **kwargs)
                finally:
                    leave()
            self._rendezvous.leave(self.index)
        except BaseException as e:
            self.error = e
            self._rendezvous.abort(e)
        return step


_NO_CONTEXT = contextlib.nullcontext()


def _replica_context(device: Device, stream):
    """Make a replica's device and stream current (nothing for CPUs)."""
    if not device.is_gpu:
        return _NO_CONTEXT
    if stream is None:           # a lone replica: the caller's current stream
        return cupy().cuda.Device(device.index)
    return _DeviceAndStream(cupy().cuda.Device(device.index), stream)


class _DeviceAndStream:
    """``with device: with stream:`` as one context manager (no ExitStack)."""

    __slots__ = ("device", "stream")

    def __init__(self, device, stream):
        self.device, self.stream = device, stream

    def __enter__(self):
        self.device.__enter__()
        try:
            self.stream.__enter__()
        except BaseException:
            self.device.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        try:
            self.stream.__exit__(*exc)
        finally:
            self.device.__exit__(*exc)


class _replica_streams:
    """CuPy's current stream is per thread and per device: the combining thread makes
    each replica's stream its current stream of that replica's device (entered and
    left in loops: no context manager per device)."""

    __slots__ = ("pairs",)

    def __init__(self, devices, streams):
        self.pairs = [(d.index, s) for d, s in zip(devices, streams) if s is not None]

    def __call__(self):
        return self

    def __enter__(self):
        cp = cupy()
        for index, s in self.pairs:
            with cp.cuda.Device(index):
                s.__enter__()
        return self

    def __exit__(self, *exc):
        cp = cupy()
        for index, s in self.pairs:
            with cp.cuda.Device(index):
                s.__exit__(None, None, None)


class ReplicaRunner:
    """Runs a function once per local replica (see the module docstring)."""

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)
        self.rendezvous = Rendezvous(len(self.devices))
        self.rendezvous.returned = NO_STEP
        # One stream per GPU replica, made now (a strategy's creation, not import time).
        # A lone replica runs in the caller, on the caller's current stream: nothing
        # to order between streams, so no event before and after each call.
        self._streams = [new_stream(d) for d in self.devices] if len(self.devices) > 1 \
            else [None]
        if any(s is not None for s in self._streams):
            # Not a bound method: the threads reach the rendezvous, not the runner.
            self.rendezvous.streams = _replica_streams(self.devices, self._streams)
        self._threads = [_ReplicaThread(self.rendezvous, i, d, st) for i, (d, st)
                         in enumerate(zip(self.devices, self._streams))][1:]
        self._call_lock = threading.Lock()
        self._gpu = any(d.is_gpu for d in self.devices)
        self._next = 1
        self._started = False
        self._dispatched = False
        self._step = 0
        #: Set when the caller stopped waiting for the threads (an interrupt): their
        #: step must finish before the next one starts. Also set by close().
        self._unclean: str | None = None
        self._task: tuple | None = None
        self._finalizer = weakref.finalize(self, _stop_threads, self._threads)

    def replica_context_manager(self, index: int):
        """Make replica ``index``'s device and stream current (nothing for CPUs)."""
        return _replica_context(self.devices[index], self._streams[index])

    def _dispatch_rest(self) -> None:
        # Start the replicas that have not run yet (from self._next) in their threads
        # (once per call).
        if self._dispatched:
            return
        self._dispatched = True
        if not self._started:
            for t in self._threads:
                t.start()
            self._started = True
        fn, per_args, per_kwargs, enter, leave = self._task
        self._step += 1
        for t in self._threads[self._next - 1:]:
            t.task = (self._step, fn, per_args[t.index], per_kwargs[t.index], enter, leave)
            t.error = None
            t.go.release()

    def _inline_pays(self, t0: float, c0: float) -> bool:
        """Whether the replicas after replica 0, which issued no collective that
        waits, run in turn in the caller (else in their threads, in parallel): when its
        step was short, or on GPUs when it spent little of it waiting."""
        wall = time.perf_counter() - t0
        if wall < INLINE_STEP_LIMIT_S:
            return True
        return self._gpu and wall - (time.thread_time() - c0) < INLINE_WAIT_SHARE * wall

    def _run_inline(self, index: int, fn, args, kwargs, enter, leave):
        with self.replica_context_manager(index):
            enter(index)
            try:
                return fn(*args, **kwargs)
            finally:
                leave()

    def _collect(self, results: list, errors: dict) -> None:
        for t in self._threads:
            if t.task is None:      # ran inline in this call
                continue
            t.done.acquire()
            if t.error is not None:
                errors[t.index] = t.error
            results[t.index] = t.result
            t.task = t.result = t.error = None

    def _drain(self) -> None:
        """Wait for the threads of a step whose caller was interrupted, drop their
        results and make the rendezvous ready for the next step."""
        if self._unclean == "closed":
            raise RuntimeError("this strategy was closed (strategy.close()); its replica "
                               "threads are stopped: make a new strategy")
        for t in self._threads:
            if t.task is None:
                continue
            step = t.task[0]
            # ``done`` is released once per task; the interrupted caller may already
            # have taken it without clearing ``task`` (finished == step tells).
            while not t.done.acquire(timeout=0.05):
                if t.finished == step:
                    break
            t.task = t.result = t.error = None
        self.rendezvous.reset()
        self._unclean = None

    def call(self, fn: Callable, per_replica_args: Sequence[tuple],
             per_replica_kwargs: Sequence[dict], enter: Callable[[int], None],
             leave: Callable[[], None]) -> list:
        """Run ``fn(*args[i], **kwargs[i])`` for every local replica i.

        ``enter(i)``/``leave()`` are called around each replica's ``fn`` in the thread
        that runs it (they set the replica context). Returns the results in replica order.

        Raises:
            The first error (lowest replica that did not merely abort), with a note
            naming the replica and its device. RuntimeError after :meth:`close`.
        """
        with self._call_lock:
            if self._unclean is not None:
                self._drain()
            n = len(self.devices)
            rv = self.rendezvous
            rv.begin()
            self._task = (fn, per_replica_args, per_replica_kwargs, enter, leave)
            self._dispatched = False
            self._next = 1          # the first replica neither run nor dispatched
            results: list = [None] * n
            errors: dict[int, BaseException] = {}
            rv.on_wait = self._dispatch_rest
            # The arguments were written on the caller's streams; the replica streams
            # are non-blocking, so they wait for those first (no host wait).
            for d, s in zip(self.devices, self._streams):
                wait_for_current(d, s)
            t0 = time.perf_counter()
            c0 = time.thread_time() if self._gpu else 0.0
            try:
                results[0] = self._run_inline(0, fn, per_replica_args[0],
                                              per_replica_kwargs[0], enter, leave)
            except BaseException as e:
                errors[0] = e
                rv.abort(e)
            if not errors and n > 1:
                rv.leave(0)
                if not self._dispatched:
                    # Replica 0 issued no collective that waits (at most deposits), so
                    # none of the others may.
                    if self._inline_pays(t0, c0):
                        for i in range(1, n):
                            if self._dispatched:    # started by a settle() of replica i-1
                                break
                            self._next = i + 1
                            try:
                                results[i] = self._run_inline(
                                    i, fn, per_replica_args[i], per_replica_kwargs[i],
                                    enter, leave)
                            except BaseException as e:
                                errors[i] = e
                                rv.abort(e)
                                break
                            rv.leave(i)
                    else:
                        self._dispatch_rest()
            rv.on_wait = None
            if self._dispatched:
                try:
                    self._collect(results, errors)
                except BaseException as e:
                    # Interrupted (Ctrl-C) while waiting: release replicas waiting in a
                    # collective; the next call waits for this step's threads first.
                    rv.abort(e)
                    self._unclean = "interrupted"
                    self._task = None
                    raise
                rv.clear_outcome()
            self._task = None
            rv.returned = NO_STEP
            if not errors and n > 1:
                unmade = rv.unmade_deposits()
                if unmade is not None:
                    errors[unmade[0]] = unmade[1]
            # The caller reads the results (and frees the inputs, after an error too) on
            # its own streams: they wait for the replica streams on the device.
            join_streams_into_current(self.devices, self._streams)
            if errors:
                rv.reset()
                error = _primary_error(errors, self.devices)
                _tell_other_workers(rv.share_error, error)
                raise error
            return results

    def close(self) -> None:
        """Stop the replica threads; a later call raises RuntimeError. Not to be called
        while another thread is inside :meth:`call` on this runner."""
        self._unclean = "closed"
        self._finalizer()


def _tell_other_workers(share_error, error: BaseException) -> None:
    """A step that failed on this worker (a replica raised, or its replicas' collectives
    did not match): under several workers the others wait in the step's collectives,
    or would pair their next one with this worker's next one. They are told
    (``Communicator.share_error``), once, so that every worker raises at this step,
    and a script that catches the error on every rank and goes on (skipping the step
    or taking it again) stays in step. Not told: an error every worker already has (a
    collective's disagreement or timeout), one told where it was found, and an
    interruption (KeyboardInterrupt: the launcher interrupts every rank)."""
    if share_error is None or not isinstance(error, Exception) or \
            isinstance(error, (CollectiveMismatch, CollectiveTimeout, ReplicaAborted)) or \
            getattr(error, "_gpustrat_told", False):
        return
    try:
        share_error(error)
    except Exception:  # noqa: BLE001 - the step's own error is the one to raise
        pass


def _primary_error(errors: dict, devices) -> BaseException:
    index = next((i for i in sorted(errors) if not isinstance(errors[i], ReplicaAborted)),
                 min(errors))
    err = errors[index]
    note = f"(raised in replica {index} on {devices[index].name})"
    if note not in getattr(err, "__notes__", ()):
        err.add_note(note)
    return err


def _stop_threads(threads) -> None:
    # A thread still running an interrupted step (task set) stops when that step ends;
    # it is not waited for, so that the interpreter can exit while one is stuck.
    for t in threads:
        if t.is_alive():
            t.stop = True
            with contextlib.suppress(RuntimeError):  # go already released: it will see stop
                t.go.release()
    for t in threads:
        if t.is_alive() and t.task is None:
            t.join(timeout=5)
