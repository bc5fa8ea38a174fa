"""``apply_gradients`` inside ``strategy.run`` with several local replicas: each replica
packs its gradients and goes on, the last to call runs the step, so a step whose only
collective is the optimizer's runs every replica in the caller (no thread woken). What
users may do around it keeps the meaning it has under a blocking ``merge_call``:
reading or writing the trained variables, ``iterations`` or the slots after the call,
reusing the gradient arrays, two optimizers in one step, replicas that disagree."""

import threading
import time

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing

pytestmark = pytest.mark.timeout(60)


def cpus(n):
    return [f"cpu:{i}" for i in range(n)]


def rid():
    return gs.get_replica_context().replica_id_in_sync_group


def _model(s, shapes=((3,), (2, 2)), momentum=0.0):
    with s.scope():
        vs = [gs.Variable(np.zeros(sh, np.float32), name=f"v{j}")
              for j, sh in enumerate(shapes)]
        opt = gs.optimizers.SGD(1.0, momentum=momentum)
    return vs, opt


def _grads(vs, r):
    """Replica r's gradients: (r + 1) * (j + 1) for variable j."""
    return [np.full(v.shape, (r + 1.0) * (j + 1), np.float32) for j, v in enumerate(vs)]


def _summed(n, j):
    return sum(r + 1.0 for r in range(n)) * (j + 1)


def _warm(s, vs, opt):
    """The first step makes the plan (and slots); it is not the one under test."""
    s.run(lambda: opt.apply_gradients(zip(_grads(vs, rid()), vs)))


def _warmed(n):
    """A strategy on ``n`` CPUs, two variables and an SGD(1.0) one step in."""
    s = gs.MirroredStrategy(cpus(n))
    vs, opt = _model(s)
    _warm(s, vs, opt)
    return s, vs, opt


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_step_of_only_apply_gradients_runs_every_replica_in_the_caller(n):
    s, vs, opt = _warmed(n)
    threads = []

    def step():
        threads.append(threading.get_ident())
        opt.apply_gradients(zip(_grads(vs, rid()), vs))
    for _ in range(3):
        s.run(step)
    assert set(threads) == {threading.get_ident()}
    for j, v in enumerate(vs):           # SGD(1.0) of the sums, over 4 steps
        for c in s.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -4 * _summed(n, j))
    assert int(np.asarray(opt.iterations)) == 4


@pytest.mark.parametrize("long_step", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize("n", [2, 4])
def test_variables_read_after_apply_gradients_hold_the_update_on_every_replica(
        n, long_step):
    s = gs.MirroredStrategy(cpus(n))
    vs, opt = _model(s, momentum=0.5)
    _warm(s, vs, opt)
    before = [np.asarray(s.experimental_local_results(v)[0]).copy() for v in vs]
    momenta = [np.asarray(s.experimental_local_results(opt.get_slot(v, "momentum"))[0])
               .copy() for v in vs]

    def step():
        if long_step:
            time.sleep(0.002)     # long enough for the replicas to run in their threads
        opt.apply_gradients(zip(_grads(vs, rid()), vs))
        return ([v.numpy() for v in vs], int(opt.iterations.numpy()),
                [np.asarray(opt.get_slot(v, "momentum").value()).copy() for v in vs])
    out = s.experimental_local_results(s.run(step))
    for r in range(n):
        values, iterations, slots = out[r]
        assert iterations == 2
        for j in range(len(vs)):
            m = 0.5 * momenta[j] - _summed(n, j)
            np.testing.assert_array_equal(slots[j], m)
            np.testing.assert_array_equal(values[j], before[j] + m)


def test_a_replica_reading_a_variable_waits_for_replicas_that_have_not_run_yet():
    # Replica 0 reads right after its call: replicas 1..3 have not run (they would run
    # after it, in the caller); they are started in their threads so that the step runs.
    s, vs, opt = _warmed(4)
    threads = {}

    def step():
        opt.apply_gradients(zip(_grads(vs, rid()), vs))
        threads[rid()] = threading.get_ident()
        return vs[0].numpy() if rid() == 0 else None
    got = s.experimental_local_results(s.run(step))[0]
    np.testing.assert_array_equal(got, -2 * _summed(4, 0))
    assert threads[0] == threading.get_ident()
    assert len(set(threads.values())) == 4


def test_a_variable_written_after_apply_gradients_is_written_after_the_update():
    s = gs.MirroredStrategy(cpus(2))
    with s.scope():
        v = gs.Variable(np.zeros(3, np.float32), name="v",
                        aggregation=gs.VariableAggregation.MEAN)
        opt = gs.optimizers.SGD(1.0)
    s.run(lambda: opt.apply_gradients([(np.ones(3, np.float32), v)]))

    def step():
        opt.apply_gradients([(np.ones(3, np.float32), v)])     # v: -2 -> -4
        v.assign(v.value() * 10.0)                               # then -40
    s.run(step)
    for c in s.experimental_local_results(v):
        np.testing.assert_array_equal(np.asarray(c), -40.0)


def test_gradient_arrays_changed_after_the_call_do_not_change_the_step():
    # The step may run after the replica went on: its gradients were taken (packed)
    # when it called, so zeroing or reusing them at once is safe.
    s, vs, opt = _warmed(3)
    kept = [_grads(vs, r) for r in range(3)]

    def step():
        grads = kept[rid()]
        opt.apply_gradients(zip(grads, vs))
        for g in grads:
            g[...] = 1000.0
    s.run(step)
    for j, v in enumerate(vs):
        for c in s.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -2 * _summed(3, j))


def test_two_optimizers_in_one_step_apply_in_order():
    s = gs.MirroredStrategy(cpus(2))
    with s.scope():
        a = gs.Variable(np.zeros(2, np.float32), name="a")
        b = gs.Variable(np.zeros(2, np.float32), name="b")
        opt_a, opt_b = gs.optimizers.SGD(1.0), gs.optimizers.SGD(0.5)

    def step():
        g = np.full(2, rid() + 1.0, np.float32)
        opt_a.apply_gradients([(g, a)])
        opt_b.apply_gradients([(g * 2, b)])
    for _ in range(3):
        s.run(step)
    for c in s.experimental_local_results(a):
        np.testing.assert_array_equal(np.asarray(c), -3 * 3.0)
    for c in s.experimental_local_results(b):
        np.testing.assert_array_equal(np.asarray(c), -3 * 0.5 * 6.0)


def _check_usable(s, vs, opt):
    before = np.asarray(s.experimental_local_results(vs[0])[0]).copy()
    s.run(lambda: opt.apply_gradients(zip(_grads(vs, rid()), vs)))
    for c in s.experimental_local_results(vs[0]):
        np.testing.assert_array_equal(np.asarray(c), before - _summed(
            s.num_replicas_in_sync, 0))
    out = s.run(lambda: gs.get_replica_context().all_reduce("sum", 1.0))
    assert s.experimental_local_results(out) == (float(s.num_replicas_in_sync),) * \
        s.num_replicas_in_sync


@pytest.mark.parametrize("long_step", [False, True], ids=["inline", "threads"])
@pytest.mark.parametrize("odd", [0, 1, 2])
def test_a_replica_that_skips_apply_gradients_fails_the_step_naming_it(odd, long_step):
    s, vs, opt = _warmed(3)
    before = [np.asarray(s.experimental_local_results(v)[0]).copy() for v in vs]

    def step():
        if long_step:
            time.sleep(0.002)
        if rid() != odd:
            opt.apply_gradients(zip(_grads(vs, rid()), vs))
    with pytest.raises(ValueError, match=f"replica {odd} returned from its function "
                                         "without calling it"):
        s.run(step)
    for v, b in zip(vs, before):         # no step was applied
        for c in s.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), b)
    _check_usable(s, vs, opt)


def test_a_replica_reading_while_another_skipped_the_call_fails_instead_of_waiting():
    s, vs, opt = _warmed(3)

    def step():
        if rid() != 1:
            opt.apply_gradients(zip(_grads(vs, rid()), vs))
        if rid() == 2:
            return vs[0].numpy()       # replica 1 returned without the call: never runs
    with pytest.raises(ValueError, match="replica 1 returned from its function"):
        s.run(step)
    _check_usable(s, vs, opt)


def test_one_replica_calling_apply_gradients_twice_fails_the_step():
    s, vs, opt = _warmed(2)

    def step():
        opt.apply_gradients(zip(_grads(vs, rid()), vs))
        if rid() == 0:
            opt.apply_gradients(zip(_grads(vs, rid()), vs))
    with pytest.raises(ValueError, match="replica 1 returned from its function"):
        s.run(step)
    _check_usable(s, vs, opt)


@pytest.mark.parametrize("bad", [0, 2])
def test_a_bad_gradient_in_one_replica_raises_naming_the_variable(bad):
    s, vs, opt = _warmed(3)

    def step():
        grads = _grads(vs, rid())
        if rid() == bad:
            grads[1] = np.ones(5, np.float32)
        opt.apply_gradients(zip(grads, vs))
    with pytest.raises(ValueError, match=r"variable 'v1' has shape \(5,\)") as ei:
        s.run(step)
    assert f"(raised in replica {bad} on cpu:{bad})" in ei.value.__notes__
    _check_usable(s, vs, opt)


def test_gradients_of_another_dtype_or_kind_are_cast_as_before():
    s, vs, opt = _warmed(2)

    def step():
        grads = _grads(vs, rid())
        return opt.apply_gradients([(grads[0].astype(np.float64), vs[0]),
                                    (grads[1].tolist(), vs[1])])
    s.run(step)
    for j, v in enumerate(vs):
        for c in s.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -2 * _summed(2, j))


def test_gradient_buffers_still_hold_the_summed_gradient_inside_the_function():
    s, vs, opt = _warmed(2)
    seen = {}

    def step():
        bufs = opt.gradient_buffers(vs)
        for b, g in zip(bufs, _grads(vs, rid())):
            b[...] = g
        opt.apply_gradients(zip(bufs, vs))
        seen[rid()] = [b.copy() for b in bufs]
    s.run(step)
    s.run(step)
    for r in range(2):
        for j, b in enumerate(seen[r]):
            np.testing.assert_array_equal(b, _summed(2, j))


@pytest.mark.parametrize("n", [2, 4])
def test_on_stand_in_gpus_a_steady_step_runs_in_the_caller_and_waits_for_no_device(n):
    with testing.sanitize(seed=n, check=False) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])
        try:
            with s.scope():
                vs = [gs.Variable(np.zeros(sh, np.float32), name=f"v{j}")
                      for j, sh in enumerate([(3,), (2, 2)])]
                opt = gs.optimizers.SGD(1.0, momentum=0.5)
            threads = []

            def step():
                threads.append(threading.get_ident())
                grads = [cp.full(v.shape, (rid() + 1.0) * (j + 1), np.float32)
                         for j, v in enumerate(vs)]
                opt.apply_gradients(zip(grads, vs))
                for g in grads:      # reused at once: the step took them already
                    g[...] = 1e6
            s.run(step)
            threads.clear()
            with san.measure() as counts:
                for _ in range(3):
                    s.run(step)
            assert set(threads) == {threading.get_ident()}
            assert counts["host_syncs"] == 0, counts["sync_sites"]
            # momentum 0.5: m = -S, -1.5 S, -1.75 S, -1.875 S; v = sum of m
            got = [devices.to_host(c) for c in s.experimental_local_results(vs[1])]
        finally:
            s.close()
        san.drain()
    assert not san.reports, [str(x) for x in san.reports[:3]]
    total = -(1 + 1.5 + 1.75 + 1.875) * _summed(n, 1)
    for g in got:
        np.testing.assert_allclose(g, np.full((2, 2), total), rtol=1e-6)
