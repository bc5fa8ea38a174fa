"""Cleanup that finalizers hand to a thread of its own.

A finalizer (``__del__``, a ``weakref.finalize`` callback) runs wherever the garbage
collector happens to run: on any thread, between any two bytecodes, possibly while
that thread holds a lock the cleanup needs; and a thread the cleanup joins may be
waiting for that very lock. A cleanup that records on streams, takes locks, joins
threads or waits is therefore handed to :func:`defer`, which only queues the call
(``queue.SimpleQueue.put`` is safe inside a finalizer), and one daemon thread runs the
queued calls in order. :func:`start` starts that thread; call it where the object that
may need it is made, never in its finalizer (a finalizer's call queued before then
waits for the next start).
"""

from __future__ import annotations

import queue
import threading

_calls: queue.SimpleQueue = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def start() -> None:
    """Start the thread that runs deferred cleanups, if it is not running (after a fork,
    the child starts its own)."""
    global _thread
    if _thread is not None and _thread.is_alive():
        return
    with _start_lock:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="gpustrat-finalizer", daemon=True)
            _thread.start()


def defer(fn, *args) -> None:
    """Run ``fn(*args)`` on the cleanup thread. Safe inside a finalizer."""
    _calls.put((fn, args))


def wait(timeout: float = 10.0) -> bool:
    """Wait until the cleanups queued so far have run; False if ``timeout`` seconds
    passed first (or the thread was never started)."""
    if _thread is None or not _thread.is_alive():
        return False
    done = threading.Event()
    _calls.put((done.set, ()))
    return done.wait(timeout)


def _run() -> None:
    while True:
        fn, args = _calls.get()
        try:
            fn(*args)
        except Exception:   # as in a finalizer: a cleanup's failure stops nothing else
            pass
        del fn, args
