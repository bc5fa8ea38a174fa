"""A replica-context ``all_reduce`` of a flat list of arrays (a model's gradients) is
planned once per layout: its values, the reuse of its fusion buffers across steps (and
when a kept result forbids it), its errors, on the sanitizer's GPUs and on CPUs."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing

SHAPES = [(3, 4), (5,), (2, 2, 2), (7,), (1,)]


def _grads(cp, replica: int, step: int, dtype=np.float32):
    return [cp.asarray(np.full(s, (replica + 1) * 10.0 ** j + step, dtype))
            for j, s in enumerate(SHAPES)]


def _expected(n: int, step: int, dtype=np.float32):
    return [np.full(s, sum((i + 1) * 10.0 ** j + step for i in range(n)), dtype)
            for j, s in enumerate(SHAPES)]


@pytest.mark.parametrize("seed", (0, 1))
@pytest.mark.parametrize("n", (1, 2, 4))
def test_a_flat_list_is_summed_over_gpu_replicas_step_after_step(seed, n):
    with testing.sanitize(seed=seed, num_devices=4) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])

        def step(k):
            ctx = gs.distribute.get_replica_context()
            out = ctx.all_reduce("sum", _grads(cp, ctx.replica_id_in_sync_group, k))
            return [devices.to_host(x) for x in out]

        for k in range(4):
            results = strategy.run(step, args=(k,))
            for i in range(n):
                got = [r.values[i] if n > 1 else r for r in results]
                for g, e in zip(got, _expected(n, k)):
                    np.testing.assert_array_equal(g, e)
        assert san.counts()["host_syncs"] >= 1   # the test's own reads
    assert not san.reports


def test_the_second_step_reuses_the_buffers_and_a_kept_result_is_never_overwritten():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step(k):
            ctx = gs.distribute.get_replica_context()
            return ctx.all_reduce("sum", _grads(cp, ctx.replica_id_in_sync_group, k))

        def ptrs(result):
            return [x.values[0].data.ptr for x in result]

        first = ptrs(strategy.run(step, args=(0,)))      # results dropped at once
        gc.collect()
        second = strategy.run(step, args=(1,))
        assert ptrs(second) == first                     # the same buffers, reused
        kept = second                                    # kept: the next step may not reuse
        view = second[0].values[0][1:2]                  # nor while a view of one lives
        third = strategy.run(step, args=(2,))
        assert ptrs(third) != ptrs(kept)
        for j, e in enumerate(_expected(2, 1)):
            np.testing.assert_array_equal(devices.to_host(kept[j].values[0]), e)
        np.testing.assert_array_equal(devices.to_host(view), _expected(2, 1)[0][1:2])
        del kept, second, third
        gc.collect()
        fourth = strategy.run(step, args=(3,))
        for j, e in enumerate(_expected(2, 3)):
            np.testing.assert_array_equal(devices.to_host(fourth[j].values[1]), e)
        del view, fourth
    assert not san.reports


def test_a_kept_derived_view_alone_keeps_the_buffer_from_being_reused():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step(k):
            ctx = gs.distribute.get_replica_context()
            out = ctx.all_reduce("sum", _grads(cp, ctx.replica_id_in_sync_group, k))
            return out[0].reshape(-1)[:3]                # a view of a result, the list dropped

        kept = strategy.run(step, args=(0,))
        gc.collect()
        strategy.run(step, args=(1,))
        np.testing.assert_array_equal(devices.to_host(kept.values[0]),
                                      _expected(2, 0)[0].reshape(-1)[:3])
        del kept
    assert not san.reports


def test_a_tuple_gives_tuples_and_mean_max_divide_and_compare():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step(op):
            ctx = gs.distribute.get_replica_context()
            out = ctx.all_reduce(op, tuple(_grads(cp, ctx.replica_id_in_sync_group, 0)))
            assert type(out) is tuple
            return [devices.to_host(x) for x in out]

        for op, combine in (("mean", lambda a, b: (a + b) / 2), ("max", np.maximum)):
            out = strategy.run(step, args=(op,))
            for j, s in enumerate(SHAPES):
                a = np.full(s, 1 * 10.0 ** j, np.float32)
                b = np.full(s, 2 * 10.0 ** j, np.float32)
                np.testing.assert_allclose(out[j].values[0], combine(a, b))
    assert not san.reports


def test_replicas_with_other_layouts_are_named_in_words():
    with testing.sanitize(num_devices=2, check=False):
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step():
            ctx = gs.distribute.get_replica_context()
            shapes = SHAPES if ctx.replica_id_in_sync_group == 0 else SHAPES[:-1] + [(2,)]
            return ctx.all_reduce("sum", [cp.zeros(s, np.float32) for s in shapes])

        with pytest.raises(ValueError, match=r"replica 0 called all_reduce\(SUM\) on "
                                             r"float32 \(3, 4\).*float32 \(1,\).*replica 1 "
                                             r"called .*float32 \(2,\)"):
            strategy.run(step)


def test_integer_mean_gives_floats_and_is_not_reused_in_place():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step(k):
            ctx = gs.distribute.get_replica_context()
            i = ctx.replica_id_in_sync_group
            out = ctx.all_reduce("mean", [cp.full((3,), i + k, np.int32),
                                          cp.full((2,), 2 * i + k, np.int32)])
            return [devices.to_host(x) for x in out]

        for k in range(3):
            out = strategy.run(step, args=(k,))
            np.testing.assert_array_equal(out[0].values[1], np.full(3, 0.5 + k))
            np.testing.assert_array_equal(out[1].values[0], np.full(2, 1.0 + k))
            assert out[0].values[0].dtype == np.float64
    assert not san.reports


def test_cpu_replicas_take_the_same_plan():
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])

    def step(k):
        ctx = gs.distribute.get_replica_context()
        return ctx.all_reduce("sum", _grads(np, ctx.replica_id_in_sync_group, k))

    kept = strategy.run(step, args=(0,))
    for k in range(1, 3):
        out = strategy.run(step, args=(k,))
        for j, e in enumerate(_expected(3, k)):
            for i in range(3):
                np.testing.assert_array_equal(out[j].values[i], e)
    for j, e in enumerate(_expected(3, 0)):
        np.testing.assert_array_equal(kept[j].values[2], e)
