"""What a steady GPU step asks of the host, counted on the sanitizer's GPUs: no host
wait, no event made (the ones it records are timing-free and made once), ..."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing


class _Counted:
    """Wraps the fake ``cupy.cuda.Event`` to count the events made, and how."""

    def __init__(self, cp):
        self.made = []
        real = cp.cuda.Event

        def event(*args, **kwargs):
            self.made.append(kwargs.get("disable_timing", args[1] if len(args) > 1
                                        else False))
            return real(*args, **kwargs)

        cp.cuda.Event = event


def _training(strategy, cp, shapes=((4, 3), (3,), (3, 2), (2,))):
    """A step function of a small model trained with SGD with momentum, whose
    gradients are all-reduced in the step and whose loss is a Python float."""
    with strategy.scope():
        variables = [gs.Variable(np.zeros(s, np.float32)) for s in shapes]
        opt = gs.optimizers.SGD(0.1, momentum=0.9)

    def step():
        ctx = gs.distribute.get_replica_context()
        grads = [cp.full(s, 1.0 + ctx.replica_id_in_sync_group, np.float32)
                 for s in shapes]
        summed = ctx.all_reduce("sum", grads)
        opt.apply_gradients(zip(summed, variables))
        return ctx.all_reduce("sum", 0.5)

    return step, variables


@pytest.mark.parametrize("n", (1, 4))
def test_a_steady_step_makes_no_event_and_waits_for_no_device(n):
    with testing.sanitize(num_devices=4, run_probability=1.0) as san:
        cp = devices.cupy()
        counted = _Counted(cp)
        strategy = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])
        step, variables = _training(strategy, cp)
        for _ in range(3):
            strategy.run(step)
        san.drain()
        # One replica runs on the caller's stream: nothing to order, no event at all.
        assert (counted.made if n > 1 else not counted.made) and all(counted.made), \
            "an event keeps timing"
        made = len(counted.made)
        with san.measure() as c:
            for _ in range(10):
                loss = strategy.run(step)
        assert c["host_syncs"] == 0
        # The NCCL watchdog's free list may still grow while it catches up.
        assert len(counted.made) - made <= 2 * n
        assert loss.values[0] if n > 1 else loss == 0.5 * n


def test_the_only_replica_all_reduces_nothing_and_a_mean_of_ints_still_divides():
    with testing.sanitize(num_devices=1) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0"])
        grads = [cp.ones((3,), np.float32), cp.ones((2, 2), np.float64)]

        def step(op, values):
            return gs.distribute.get_replica_context().all_reduce(op, values)

        with san.measure() as c:
            out = strategy.run(step, args=("sum", grads))
            same = strategy.run(step, args=("mean", tuple(grads)))
        assert type(out) is list and out is not grads and all(map(np.equal, map(id, out),
                                                                  map(id, grads)))
        assert type(same) is tuple and same[0] is grads[0]
        assert c["launches"] == 0 and c["nccl_calls"] == 0 and c["copies"] == 0
        ints = strategy.run(step, args=("mean", [cp.full((2,), 3, np.int32)] * 2))
        assert ints[0].dtype == np.float64
        np.testing.assert_array_equal(devices.to_host(ints[1]), [3.0, 3.0])
    assert not san.reports


@pytest.mark.parametrize("op", ("sum", "mean", "max", "min"))
def test_strategy_reduce_over_gpus_makes_one_result_on_the_first(op):
    with testing.sanitize(num_devices=4) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy([f"gpu:{i}" for i in range(4)])
        losses = strategy.run(lambda: cp.full((), 1.0 + gs.distribute.get_replica_context()
                                              .replica_id_in_sync_group, np.float32))
        vectors = strategy.run(lambda: cp.full((3,), 2.0 + gs.distribute.get_replica_context()
                                               .replica_id_in_sync_group, np.float64))
        with san.measure() as c:
            loss = strategy.reduce(op, losses, axis=None)
            vector = strategy.reduce(op, vectors, axis=None)
        assert c["allocations"] == 2 and c["host_syncs"] == 0
        assert loss.device.id == 0 and loss.shape == () and loss.dtype == np.float32
        combine = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}[op]
        assert float(devices.to_host(loss)) == combine([1.0, 2.0, 3.0, 4.0])
        np.testing.assert_array_equal(devices.to_host(vector),
                                      [combine([2.0, 3.0, 4.0, 5.0])] * 3)
    assert not san.reports


def test_iterations_count_on_the_gpus_without_an_upload_per_step():
    with testing.sanitize(num_devices=2) as san:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        step, variables = _training(strategy, cp)
        strategy.run(step)
        with strategy.scope():
            counter = gs.Variable(np.zeros((), np.int64))
        with san.measure() as c:
            for _ in range(3):
                counter.assign_add(np.ones((), np.int64))
        assert c["copies"] == 0 and c["launches"] == 3 * 2
        assert [int(c.numpy()) for c in counter.values] == [3, 3]
    assert not san.reports
