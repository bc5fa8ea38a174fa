"""Adversarial tests of ``strategy.run`` and the replica/collective machinery.

Failures before, inside and after collectives in every replica, replicas that disagree
on their collectives, BaseExceptions, interrupts, re-use after failures, concurrent
callers, thread lifetimes and interpreter exit. Anything that could hang has a timeout.
"""

import gc
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.distribute import runner as runner_mod

pytestmark = pytest.mark.timeout(30)


def cpus(n):
    return [f"cpu:{i}" for i in range(n)]


def rid():
    return gs.get_replica_context().replica_id_in_sync_group


def all_reduce(v, op="sum"):
    return gs.get_replica_context().all_reduce(op, v)


def ctrl_c_after(seconds):
    """A real SIGINT to this process (as Ctrl-C), which interrupts a blocking wait."""
    t = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGINT))
    t.start()
    return t


def local(s, out):
    """Every replica's result: ``run`` returns every leaf per replica."""
    return s.experimental_local_results(out)


def all_reduce_in_new_thread(ctx, errors, delay=0.0):
    """Start a thread that issues ``ctx.all_reduce`` and keeps the error it raises."""
    def issue():
        time.sleep(delay)
        try:
            ctx.all_reduce("sum", 1.0)
        except Exception as e:
            errors.append(e)
    t = threading.Thread(target=issue)
    t.start()
    return t


def check_usable(s):
    """The strategy still gives right results, inline and through a collective."""
    n = s.num_replicas_in_sync
    assert s.experimental_local_results(s.run(lambda: rid() * 2)) == tuple(
        2 * i for i in range(n))
    out = s.run(lambda: all_reduce(float(rid())))
    assert s.experimental_local_results(out) == (float(sum(range(n))),) * n
    out = s.run(lambda: (all_reduce(1.0), all_reduce(np.arange(3) + rid(), "max")))
    for a, b in s.experimental_local_results(out):
        assert a == float(n)
        np.testing.assert_array_equal(b, np.arange(3) + n - 1)


@pytest.fixture(params=[2, 3, 4], ids=lambda n: f"{n}rep")
def strategy(request):
    s = gs.MirroredStrategy(cpus(request.param))
    yield s
    s.close()


class Boom(Exception):
    pass


# --- one replica fails, at every position, the others in a collective ----------------

@pytest.mark.parametrize("where", ["before", "between", "after"])
@pytest.mark.parametrize("long_step", [False, True], ids=["short", "long"])
def test_failure_in_any_replica_at_any_position(strategy, where, long_step):
    n = strategy.num_replicas_in_sync
    for bad in range(n):
        def fn():
            r = rid()
            if long_step:
                time.sleep(0.001)
            if r == bad and where == "before":
                raise Boom(f"replica {r}")
            a = all_reduce(1.0)
            if r == bad and where == "between":
                raise Boom(f"replica {r}")
            b = all_reduce(2.0)
            if r == bad and where == "after":
                raise Boom(f"replica {r}")
            return a + b
        with pytest.raises(Boom, match=f"replica {bad}") as ei:
            strategy.run(fn)
        assert ei.value.__notes__[-1] == f"(raised in replica {bad} on cpu:{bad})"
        check_usable(strategy)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exceptions_in_a_replica_reach_the_caller(strategy, exc):
    n = strategy.num_replicas_in_sync
    for bad in (0, n - 1):
        def fn():
            if rid() == bad:
                raise exc("stop")
            return all_reduce(1.0)
        with pytest.raises(exc) as ei:
            strategy.run(fn)
        assert f"(raised in replica {bad} on cpu:{bad})" in ei.value.__notes__
        check_usable(strategy)


# --- replicas that disagree on their collectives ------------------------------------

def test_collective_in_a_later_replica_only_short_and_long_steps(strategy):
    n = strategy.num_replicas_in_sync
    for sleep in (0, 0.001):
        def fn():
            time.sleep(sleep)
            if rid() == n - 1:
                return all_reduce(1.0)
            return 0.0
        with pytest.raises(ValueError, match="same collectives in the same order") as ei:
            strategy.run(fn)
        assert f"(raised in replica {n - 1} on cpu:{n - 1})" in ei.value.__notes__
        check_usable(strategy)


def test_collective_in_the_first_replica_only(strategy):
    def fn():
        if rid() == 0:
            return all_reduce(1.0)
        return 0.0
    with pytest.raises(ValueError, match="same collectives in the same order"):
        strategy.run(fn)
    check_usable(strategy)


@pytest.mark.parametrize("extra", range(4))
def test_one_replica_issues_one_more_collective(strategy, extra):
    n = strategy.num_replicas_in_sync
    extra %= n

    def fn():
        v = all_reduce(1.0)
        if rid() == extra:
            v = all_reduce(v)
        return v
    with pytest.raises(ValueError, match="same collectives in the same order") as ei:
        strategy.run(fn)
    # The message names who returned early.
    assert "returned" in str(ei.value)
    check_usable(strategy)


@pytest.mark.parametrize("odd", [
    lambda ctx: ctx.all_reduce("max", 1.0),
    lambda ctx: ctx.all_gather(np.ones(2), 0),
    lambda ctx: ctx.all_reduce("sum", np.ones(3)),
    lambda ctx: ctx.all_reduce("sum", np.ones(2, np.float32)),
    lambda ctx: ctx.all_reduce("sum", (1.0, 1.0)),
], ids=["op", "kind", "shape", "dtype", "leaves"])
def test_different_collectives_at_the_same_point(strategy, odd):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = gs.get_replica_context()
        if rid() == n - 1:
            return odd(ctx)
        return ctx.all_reduce("sum", np.ones(2))
    with pytest.raises(ValueError, match="replicas issued different collectives"):
        strategy.run(fn)
    check_usable(strategy)


def test_all_gather_axes_differ(strategy):
    def fn():
        return gs.get_replica_context().all_gather(np.ones((2, 3)), rid() % 2)
    with pytest.raises(ValueError, match="replicas issued different collectives"):
        strategy.run(fn)
    check_usable(strategy)


def test_different_collectives_are_named_in_words():
    # The signatures read as calls, with each leaf's dtype and shape (they were raw
    # tuples, an all_gather's showing shape () for a (2,) array).
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])

    def fn():
        ctx = gs.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.all_gather(np.ones((2, 3)), axis=0)
        return ctx.all_reduce("sum", np.ones(2))
    with pytest.raises(ValueError, match=re.escape(
            "replica 0 called all_gather(axis=0) on float64 of shape (3,) besides the "
            "gathered axis but replica 1 called all_reduce(SUM) on float64 (2,)")):
        s.run(fn)
    s.close()


@pytest.mark.parametrize("other", [
    {"a": 1.0, "c": 2.0},        # same leaves, other keys: was reduced by position
    [1.0, 2.0],                  # a list where the others give a dict
    (1.0, 2.0),
], ids=["keys", "list", "tuple"])
@pytest.mark.parametrize("kind", ["all_reduce", "all_gather"])
def test_nested_structures_that_differ_are_an_error(strategy, other, kind):
    n = strategy.num_replicas_in_sync

    def fn():
        ctx = gs.get_replica_context()
        v = other if rid() == n - 1 else {"a": 1.0, "b": 2.0}
        if kind == "all_gather":
            v = {k: np.ones(1) for k in v} if isinstance(v, dict) else \
                type(v)(np.ones(1) for _ in v)
            out = ctx.all_gather(v, 0)
        else:
            out = ctx.all_reduce("sum", v)
        # Flat results, so that only the collective can notice the difference.
        return [np.asarray(x).sum() for x in (out.values() if isinstance(out, dict) else out)]
    with pytest.raises(ValueError, match=f"all_[a-z]+: replica {n - 1} gave a structure"):
        strategy.run(fn)
    check_usable(strategy)


def test_nested_structures_that_match_reduce_right(strategy):
    n = strategy.num_replicas_in_sync
    out = strategy.run(lambda: all_reduce({"b": [1.0, np.ones(2) * rid()], "a": (2,)}))
    for v in strategy.experimental_local_results(out):
        assert list(v) == ["b", "a"] and v["a"] == (2 * n,) and v["b"][0] == n
        np.testing.assert_array_equal(v["b"][1], np.full(2, sum(range(n))))


def test_one_replica_context_used_from_two_threads_is_an_error():
    # A user thread given replica 0's context issues a second collective for replica 0
    # while replica 0 itself is in one: it must be refused, not counted as replica 1.
    s = gs.MirroredStrategy(cpus(2))

    def fn():
        ctx = gs.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            errors = []
            t = all_reduce_in_new_thread(ctx, errors)
            v = ctx.all_reduce("sum", 1.0)
            t.join(5)
            if errors:
                raise errors[0]
            return v
        time.sleep(0.05)  # let both replica-0 collectives arrive first
        return ctx.all_reduce("sum", 1.0)
    with pytest.raises((ValueError, runner_mod.ReplicaAborted)) as ei:
        s.run(fn)
    assert "at once" in str(ei.value) or "at once" in str(ei.value.__cause__)
    check_usable(s)


# --- long steps, re-use, nesting, misuse ---------------------------------------------

def test_long_step_then_collective(strategy):
    n = strategy.num_replicas_in_sync

    def fn():
        time.sleep(0.001)
        return all_reduce(rid() + 1)
    out = strategy.run(fn)
    assert local(strategy, out) == (n * (n + 1) // 2,) * n


def test_long_step_in_a_later_replica_only(strategy):
    def fn():
        if rid() == 1:
            time.sleep(0.002)
        return all_reduce(1)
    for _ in range(3):
        assert set(local(strategy, strategy.run(fn))) == {
            strategy.num_replicas_in_sync}


def test_run_reduce_scope_inside_run_are_refused_and_strategy_stays_usable(strategy):
    for bad, message in (
            (lambda: strategy.run(lambda: 1), "already running in a replica context"),
            (lambda: strategy.reduce("sum", 1.0, axis=None),
             r"strategy\.reduce must be called in cross-replica context"),
            (lambda: strategy.gather(np.ones(1), 0),
             r"strategy\.gather must be called in cross-replica context"),
            (lambda: strategy.scope().__enter__(),
             r"strategy\.scope\(\) cannot be entered inside strategy\.run")):
        def fn():
            all_reduce(1.0)
            if rid() == 1:
                bad()
            return 1
        # The refusal itself, raised in replica 1, not some other RuntimeError (such as
        # the abort the other replicas see).
        with pytest.raises(RuntimeError, match=message) as ei:
            strategy.run(fn)
        assert not isinstance(ei.value, runner_mod.ReplicaAborted), ei.value
        assert "(raised in replica 1 on cpu:1)" in getattr(ei.value, "__notes__", []), ei.value
        check_usable(strategy)
    assert not gs.has_strategy()


def test_other_strategy_run_inside_run_is_refused():
    a, b = gs.MirroredStrategy(cpus(2)), gs.MirroredStrategy(cpus(2))
    with pytest.raises(RuntimeError, match="already running in a replica context"):
        a.run(lambda: b.run(lambda: 1))
    check_usable(a)
    check_usable(b)


def test_fn_results_of_any_kind(strategy):
    n = strategy.num_replicas_in_sync
    assert strategy.run(lambda: None) is None
    gens = strategy.experimental_local_results(strategy.run(lambda: (i for i in range(rid() + 1))))
    assert [len(list(g)) for g in gens] == list(range(1, n + 1))
    out = strategy.run(lambda: {"x": [rid(), None, "s"], "y": (1, rid())})
    assert out["x"][1] is None and out["x"][2].values == ("s",) * n
    assert out["y"][0].values == (1,) * n and out["x"][0].values == tuple(range(n))


def test_replica_context_outside_run_and_in_user_threads():
    # Outside run: the default strategy's context (replica 0 of 1), as tf.distribute.
    s = gs.MirroredStrategy(cpus(2))
    assert gs.get_replica_context().num_replicas_in_sync == 1
    with s.scope():
        assert gs.get_replica_context() is None

    # A thread the user starts inside fn does not inherit the replica context (the
    # context is per thread, as in TensorFlow): it sees the default strategy.
    def fn():
        seen = []
        t = threading.Thread(target=lambda: seen.append(gs.get_replica_context()))
        t.start()
        t.join()
        return seen[0].num_replicas_in_sync, gs.get_strategy() is s
    out = s.run(fn)
    assert local(s, out) == ((1, True), (1, True))


# --- concurrency and thread lifetime ---------------------------------------------

def test_two_threads_run_one_strategy_at_once():
    s = gs.MirroredStrategy(cpus(3))
    errors, results = [], []

    def worker(k):
        try:
            for i in range(50):
                def fn(i=i):
                    if i % 3 == 0:
                        time.sleep(0.0005)
                    return all_reduce(float(k * 1000 + i)) if i % 2 else rid() + k
                out = local(s, s.run(fn))
                want = (3.0 * (k * 1000 + i),) * 3 if i % 2 else tuple(j + k for j in range(3))
                results.append(out == want)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert not errors and len(results) == 100 and all(results)


def test_two_strategies_run_at_once():
    a, b = gs.MirroredStrategy(cpus(2)), gs.MirroredStrategy(cpus(3))
    errors = []

    def loop(s):
        try:
            for i in range(100):
                out = s.run(lambda i=i: all_reduce(float(i)))
                assert local(s, out) == (
                    float(i) * s.num_replicas_in_sync,) * s.num_replicas_in_sync
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
    ts = [threading.Thread(target=loop, args=(s,)) for s in (a, b)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(20)
    assert not errors


def _wait_for_thread_count(n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while threading.active_count() > n and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.01)
    return threading.active_count()


def test_dropped_strategies_release_their_threads():
    gc.collect()
    before = threading.active_count()
    refs = []
    for _ in range(10):
        s = gs.MirroredStrategy(cpus(3))
        s.run(lambda: all_reduce(1.0))  # starts the replica threads
        s.run(lambda: time.sleep(0.001))  # and a long step through them
        refs.append(weakref.ref(s))
        del s
    assert _wait_for_thread_count(before) == before
    assert all(r() is None for r in refs)


def test_dropped_strategy_after_a_failure_releases_its_threads():
    gc.collect()
    before = threading.active_count()
    s = gs.MirroredStrategy(cpus(2))
    with pytest.raises(Boom):
        s.run(lambda: all_reduce(1.0) if rid() == 0 else (_ for _ in ()).throw(Boom()))
    ref = weakref.ref(s)
    del s
    assert _wait_for_thread_count(before) == before and ref() is None


def test_close_stops_threads_and_run_after_close_is_an_error():
    gc.collect()
    before = threading.active_count()
    s = gs.MirroredStrategy(cpus(3))
    s.run(lambda: all_reduce(1.0))
    assert threading.active_count() == before + 2
    s.close()
    assert threading.active_count() == before
    s.close()  # twice is harmless
    for fn in (lambda: all_reduce(1.0), lambda: 1):
        with pytest.raises(RuntimeError, match="closed"):
            s.run(fn)


def _run_script(code, timeout=20):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], timeout=timeout,
                          capture_output=True, text=True)


def test_interpreter_exits_promptly_with_replica_threads_alive():
    t0 = time.monotonic()
    p = _run_script("""
        import gpustrat as gs
        s = gs.MirroredStrategy([f"cpu:{i}" for i in range(4)])
        out = s.run(lambda: gs.get_replica_context().all_reduce("sum", 1.0))
        print(s.experimental_local_results(out))
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "(4.0, 4.0, 4.0, 4.0)"
    assert time.monotonic() - t0 < 15


def test_interpreter_exits_promptly_when_a_replica_is_stuck():
    # Replica 1 blocks for good; Ctrl-C (here: interrupt_main) reaches the caller,
    # which must raise, and the process must still exit at once.
    t0 = time.monotonic()
    p = _run_script("""
        import os, signal, threading, time
        import gpustrat as gs
        s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
        never = threading.Event()
        def fn():
            if gs.get_replica_context().replica_id_in_sync_group == 1:
                never.wait()
            time.sleep(0.001)
            return 1
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            s.run(fn)
        except KeyboardInterrupt:
            print("interrupted")
    """)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "interrupted"
    assert time.monotonic() - t0 < 4


# --- interrupts in the caller ------------------------------------------------------

def test_interrupt_while_waiting_for_replicas_then_run_again():
    # Ctrl-C while the caller waits for the replica threads: the next run must not pick
    # up the interrupted step's results, and must not hang.
    s = gs.MirroredStrategy(cpus(3))
    release = threading.Event()

    def slow():
        if rid() > 0:
            release.wait(5)
            return "old"
        time.sleep(0.001)  # a long step: replicas 1 and 2 run in their threads
        return "old"
    ctrl_c_after(0.2)
    with pytest.raises(KeyboardInterrupt):
        s.run(slow)
    threading.Timer(0.2, release.set).start()
    out = s.run(lambda: ("new", rid()))
    assert s.experimental_local_results(out) == (("new", 0), ("new", 1), ("new", 2))
    check_usable(s)


def test_interrupt_while_replica_0_waits_in_a_collective():
    s = gs.MirroredStrategy(cpus(2))
    release = threading.Event()

    def fn():
        if rid() == 1:
            release.wait(5)
        return all_reduce(1.0)
    ctrl_c_after(0.2)
    threading.Timer(0.4, release.set).start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        s.run(fn)
    # The caller released replica 0's collective, then waited for replica 1 to return.
    assert 0.35 < time.monotonic() - t0 < 3
    check_usable(s)


def test_replica_context_kept_past_run_cannot_issue_collectives():
    # Used after run returned, a replica's context would wait for replicas that never
    # come; it raises instead.
    s = gs.MirroredStrategy(cpus(2))
    ctxs = s.experimental_local_results(s.run(gs.get_replica_context))
    for ctx in ctxs:
        with pytest.raises(RuntimeError, match="outside strategy.run"):
            ctx.all_reduce("sum", 1.0)
    s.run(lambda: all_reduce(1.0))  # the threads exist now
    for ctx in ctxs:
        with pytest.raises(RuntimeError, match="outside strategy.run"):
            ctx.all_gather(np.ones(1), 0)
    check_usable(s)
    # One replica's context used by a thread that outlives the replica's function.
    threads, errors = [], []

    def fn():
        if rid() == 1:
            threads.append(all_reduce_in_new_thread(gs.get_replica_context(), errors, 0.05))
        return all_reduce(1.0)
    s.run(fn)
    threads[0].join(5)
    assert isinstance(errors[0], RuntimeError) and "outside strategy.run" in str(errors[0])
    check_usable(s)


@pytest.mark.parametrize("delay", [0.0, 0.002], ids=["short", "long"])
def test_a_string_in_one_replicas_collective_is_a_type_error_naming_it(strategy, delay):
    # Only the last replica gives a string; the others wait in the collective and are
    # released, and the error names that replica and its leaf.
    n = strategy.num_replicas_in_sync

    def fn():
        time.sleep(delay)
        return all_reduce({"loss": 1.0, "tag": f"r{rid()}" if rid() == n - 1 else 0.0})
    with pytest.raises(TypeError, match=rf"str 'r{n - 1}' \(replica {n - 1}\) is not a "
                                        rf"number") as info:
        strategy.run(fn)
    assert f"(raised in replica {n - 1} on cpu:{n - 1})" in info.value.__notes__
    check_usable(strategy)

