"""The cleanup thread that finalizers hand their blocking cleanups to."""

import threading

from gpustrat import finalizers


def test_deferred_cleanups_run_in_order_on_the_cleanup_thread_past_a_failing_one():
    finalizers.start()
    ran = []

    def cleanup(k):
        ran.append((k, threading.current_thread().name))
        if k == 1:
            raise RuntimeError("a cleanup that fails")

    for k in range(4):
        finalizers.defer(cleanup, k)
    assert finalizers.wait()
    assert ran == [(k, "gpustrat-finalizer") for k in range(4)]


def test_a_cleanup_deferred_from_a_finalizer_holding_a_lock_it_needs_runs_once_released():
    finalizers.start()
    lock, ran = threading.Lock(), []

    class Holder:
        def __del__(self):
            finalizers.defer(lambda: lock.acquire() and (ran.append(1), lock.release()))

    with lock:
        h = Holder()
        del h             # the finalizer runs here, with the lock held
        assert not finalizers.wait(0.2)
        assert ran == []
    assert finalizers.wait()
    assert ran == [1]
