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
   (``INLINE_STEP_LIMIT_S``). A collective in such a replica is a mismatch and raises
   at once, where TensorFlow would hang.

Collectives meet in a :class:`Rendezvous`: the last replica to arrive computes the
collective for everybody. If a replica raises, the rendezvous is broken so that
replicas waiting in a collective stop instead of hanging, and the caller re-raises the
first error with a note naming the replica.
"""

from __future__ import annotations

import _thread
import contextlib
import threading
import time
import weakref
from typing import Any, Callable, Sequence

from gpustrat.devices import Device, new_stream, synchronize, wait_for_current

#: A replica-0 step shorter than this runs the other replicas inline, in the caller.
INLINE_STEP_LIMIT_S = 200e-6


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
        self._cond = threading.Condition(threading.Lock())
        self._slots: list = [None] * n
        self._sigs: list = [None] * n
        self._count = 0
        self._generation = 0
        self._outcome: tuple = (None, None)
        self._broken: BaseException | None = None
        #: Called (outside the lock) by a replica about to wait for the others.
        self.on_wait: Callable[[], None] | None = None
        #: Set while replicas run one at a time after replica 0 issued no collective.
        self.solo_replica: int | None = None
        #: On GPUs: ``settle(index)`` waits for replica ``index``'s queued work before
        #: its value is handed to another thread, ``settle(None)`` for the work the
        #: combining thread queued before the results are handed back.
        self.settle: Callable[[int | None], None] | None = None

    def exchange(self, index: int, signature: Any, value: Any,
                 combine: Callable[[list], list]) -> Any:
        if self.solo_replica is not None:
            raise ValueError(
                f"replica {self.solo_replica} called a collective ({signature[0]}, "
                f"{signature[1]}) that replica 0 never called in this step; every replica "
                "must issue the same collectives in the same order")
        if self.settle is not None:
            self.settle(index)
        if self._count + 1 < self.n and self.on_wait is not None:
            self.on_wait()
        with self._cond:
            if self._broken is not None:
                raise ReplicaAborted("another replica failed") from self._broken
            gen = self._generation
            self._slots[index] = value
            self._sigs[index] = signature
            self._count += 1
            if self._count == self.n:
                values, sigs = self._slots, self._sigs
                self._slots, self._sigs, self._count = [None] * self.n, [None] * self.n, 0
                try:
                    _check_signatures(sigs)
                    self._outcome = (combine(values), None)
                    if self.settle is not None:
                        self.settle(None)
                except BaseException as e:  # every replica gets the same error
                    self._outcome = (None, e)
                self._generation += 1
                self._cond.notify_all()
            else:
                while self._generation == gen and self._broken is None:
                    self._cond.wait()
                if self._generation == gen:
                    raise ReplicaAborted("another replica failed") from self._broken
            results, error = self._outcome
        if error is not None:
            raise error
        return results[index]

    def abort(self, error: BaseException) -> None:
        with self._cond:
            if self._broken is None:
                self._broken = error
            self._cond.notify_all()

    def reset(self) -> None:
        with self._cond:
            self._slots, self._sigs, self._count = [None] * self.n, [None] * self.n, 0
            self._broken = None


def _check_signatures(sigs: list) -> None:
    for i, s in enumerate(sigs[1:], 1):
        if s != sigs[0]:
            raise ValueError(
                f"replicas issued different collectives at the same point: replica 0 called "
                f"{sigs[0]} but replica {i} called {s}; every replica must issue the same "
                "collectives in the same order")


class _ReplicaThread(threading.Thread):
    def __init__(self, runner: "ReplicaRunner", index: int, device: Device):
        super().__init__(name=f"gpustrat-replica-{index}-{device.name}", daemon=True)
        self.index = index
        self.device = device
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.task: tuple | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.stop = False
        self._rendezvous = runner.rendezvous
        self._context = lambda: runner.replica_context_manager(index)

    def run(self):
        go, done = self.go, self.done
        while True:
            go.acquire()
            if self.stop:
                done.release()
                return
            fn, args, kwargs, enter, leave = self.task
            try:
                # Device and stream are entered per task, not for the thread's life: the
                # caller may run this replica inline in another call, and a CuPy stream
                # object must not be entered by two threads at once.
                with self._context():
                    enter(self.index)
                    try:
                        self.result = fn(*args, **kwargs)
                    finally:
                        leave()
            except BaseException as e:
                self.error = e
                self._rendezvous.abort(e)
            done.release()


class ReplicaRunner:
    """Runs a function once per local replica (see the module docstring)."""

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)
        self.rendezvous = Rendezvous(len(self.devices))
        # One stream per GPU replica, made now (a strategy's creation, not import time).
        self._streams = [new_stream(d) for d in self.devices]
        if any(s is not None for s in self._streams):
            self.rendezvous.settle = self._settle
        self._threads = [_ReplicaThread(self, i, d) for i, d in enumerate(self.devices)][1:]
        self._call_lock = threading.Lock()
        self._started = False
        self._dispatched = False
        self._task: tuple | None = None
        self._finalizer = weakref.finalize(self, _stop_threads, self._threads)

    def replica_context_manager(self, index: int):
        """Make replica ``index``'s device and stream current (nothing for CPUs)."""
        dev = self.devices[index]
        if not dev.is_gpu:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(dev.activate())
        stack.enter_context(self._streams[index])
        return stack

    def _settle(self, index: int | None) -> None:
        # CuPy's current stream is per thread and per device: a replica's work is on
        # its own stream, the combining thread's on its current stream of each device.
        if index is not None:
            if self._streams[index] is not None:
                self._streams[index].synchronize()
            return
        for d in self.devices:
            synchronize(d)

    def _dispatch_rest(self) -> None:
        # Start replicas 1..n-1 in their threads (once per call).
        if self._dispatched:
            return
        self._dispatched = True
        if not self._started:
            for t in self._threads:
                t.start()
            self._started = True
        fn, per_args, per_kwargs, enter, leave = self._task
        for t in self._threads:
            t.task = (fn, per_args[t.index], per_kwargs[t.index], enter, leave)
            t.error = None
            t.go.release()

    def _run_inline(self, index: int, fn, args, kwargs, enter, leave):
        with self.replica_context_manager(index):
            enter(index)
            try:
                return fn(*args, **kwargs)
            finally:
                leave()

    def call(self, fn: Callable, per_replica_args: Sequence[tuple],
             per_replica_kwargs: Sequence[dict], enter: Callable[[int], None],
             leave: Callable[[], None]) -> list:
        """Run ``fn(*args[i], **kwargs[i])`` for every local replica i.

        ``enter(i)``/``leave()`` are called around each replica's ``fn`` in the thread
        that runs it (they set the replica context). Returns the results in replica order.

        Raises:
            The first error (lowest replica that did not merely abort), with a note
            naming the replica and its device.
        """
        with self._call_lock:
            n = len(self.devices)
            rv = self.rendezvous
            self._task = (fn, per_replica_args, per_replica_kwargs, enter, leave)
            self._dispatched = False
            results: list = [None] * n
            errors: dict[int, BaseException] = {}
            rv.on_wait = self._dispatch_rest
            # The arguments were written on the caller's streams; the replica streams
            # are non-blocking, so they wait for those first (no host wait).
            for d, s in zip(self.devices, self._streams):
                wait_for_current(d, s)
            t0 = time.perf_counter()
            try:
                results[0] = self._run_inline(0, fn, per_replica_args[0],
                                              per_replica_kwargs[0], enter, leave)
            except BaseException as e:
                errors[0] = e
                rv.abort(e)
            rv.on_wait = None
            if not self._dispatched and not errors and n > 1:
                if time.perf_counter() - t0 < INLINE_STEP_LIMIT_S:
                    for i in range(1, n):
                        rv.solo_replica = i
                        try:
                            results[i] = self._run_inline(i, fn, per_replica_args[i],
                                                          per_replica_kwargs[i], enter, leave)
                        except BaseException as e:
                            errors[i] = e
                            break
                        finally:
                            rv.solo_replica = None
                else:
                    self._dispatch_rest()
            if self._dispatched:
                for t in self._threads:
                    t.done.acquire()
                    if t.error is not None:
                        errors[t.index] = t.error
                    results[t.index] = t.result
                    t.task = t.result = t.error = None
            self._task = None
            if errors:
                rv.reset()
                raise _primary_error(errors, self.devices)
            # The caller reads the results (and frees the inputs) on its own streams.
            for s in self._streams:
                if s is not None:
                    s.synchronize()
            return results

    def close(self) -> None:
        self._finalizer()


def _primary_error(errors: dict, devices) -> BaseException:
    index = next((i for i in sorted(errors) if not isinstance(errors[i], ReplicaAborted)),
                 min(errors))
    err = errors[index]
    note = f"(raised in replica {index} on {devices[index].name})"
    if note not in getattr(err, "__notes__", ()):
        err.add_note(note)
    return err


def _stop_threads(threads) -> None:
    for t in threads:
        if t.is_alive():
            t.stop = True
            t.go.release()
    for t in threads:
        if t.is_alive():
            t.join(timeout=5)
