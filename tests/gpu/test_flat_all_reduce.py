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


# --- a Python number, reduced on the host -----------------------------------------------

@pytest.mark.parametrize("op, expected", [("sum", 1.5 + 2.5 + 3.5 + 4.5), ("mean", 3.0),
                                          ("max", 4.5), ("min", 1.5)])
def test_a_python_number_is_reduced_on_the_host_with_no_device_work(op, expected):
    with testing.sanitize(num_devices=4) as san:
        strategy = gs.MirroredStrategy([f"gpu:{i}" for i in range(4)])

        def step():
            ctx = gs.distribute.get_replica_context()
            return ctx.all_reduce(op, 1.5 + ctx.replica_id_in_sync_group)

        strategy.run(step)
        with san.measure() as c:
            out = strategy.run(step)
        assert [type(v) for v in out.values] == [float] * 4
        assert out.values == (expected,) * 4
        assert c["host_syncs"] == 0 and c["nccl_calls"] == 0 and c["copies"] == 0
    assert not san.reports


def test_python_ints_and_a_structure_mixing_numbers_and_arrays():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])

        def step():
            ctx = gs.distribute.get_replica_context()
            i = ctx.replica_id_in_sync_group
            out = ctx.all_reduce("sum", {"n": 3 + i, "x": cp.full((2,), float(i), np.float32),
                                         "mean_of_ints": 7})
            return out["n"], devices.to_host(out["x"]), out["mean_of_ints"]

        with san.measure() as c:
            n, x, m = strategy.run(step)
        assert n.values == (7, 7) and type(n.values[0]) is int
        np.testing.assert_array_equal(x.values[1], [1.0, 1.0])
        assert m.values == (14, 14)
        assert c["nccl_calls"] == 2          # the array's reduction only (one per GPU)

        def mean():
            return gs.distribute.get_replica_context().all_reduce("mean", 3)
        assert strategy.run(mean).values == (3.0, 3.0)
    assert not san.reports


def test_numbers_between_workers_combine_every_workers_part_in_rank_order():
    from gpustrat.collectives.base import Communicator, LocalWorkerGroup
    from gpustrat.reduce_util import ReduceOp

    class Parts(LocalWorkerGroup):      # what allgather gives on a 3-worker job
        size = 3

        def allgather(self, obj):
            return [obj, obj * 10, obj * 100]

    class ThreeWorkers(Communicator):
        devices = [devices.Device("gpu", 0), devices.Device("gpu", 1)]
        num_workers, worker_index = 3, 0
        all_reduce = all_gather = broadcast = reduce_scatter = agree_layout = None

        def number_group(self):
            return Parts()

    comm = ThreeWorkers()
    assert comm.reduce_numbers([1, 2], ReduceOp.SUM) == 333
    assert comm.reduce_numbers([1.0, 2.0], ReduceOp.MEAN) == pytest.approx(333 / 6)
    assert comm.reduce_numbers([1, 2], ReduceOp.MAX) == 200
    assert comm.reduce_numbers([1.5, 2.5], ReduceOp.MIN) == 1.5
