"""gs.function on GPU strategies, on the stream-ordering sanitizer: a step captured as
one CUDA graph per GPU and replayed gives what the eager step gives, bit for bit; what
cannot be captured is refused with the operation and the line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing
from gpustrat.data import Dataset
from gpustrat.function import CaptureError

STEPS = 10


def _data(n, steps=STEPS, extra=0):
    rows = 4 * n
    x = (np.arange((steps * rows + extra) * 3, dtype=np.float32).reshape(-1, 3) % 7) / 7
    y = (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)
    return x, y, rows


def _optimizer(kind, lr=None):
    if kind == "sgd":
        return gs.optimizers.SGD(0.1 if lr is None else lr, momentum=0.9)
    return gs.optimizers.Adam(0.01 if lr is None else lr)


class _Loop:
    """A linear regression trained as the seeds' custom loops are: a distributed
    dataset, ``strategy.run`` of a step that applies its gradients, ``strategy.reduce``
    of the loss, all in one decorated function."""

    def __init__(self, n, kind, capture, lr=None, extra=0, **options):
        self.s = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])
        with self.s.scope():
            self.w = gs.Variable(np.zeros(3, np.float32), name="w")
            self.opt = _optimizer(kind, lr)
        self.x, self.y, rows = _data(n, extra=extra)

        def step(xb, yb):
            err = (xb * self.w.value()).sum(axis=1) - yb
            grad = (xb * err.reshape(-1, 1)).sum(axis=0) * (2.0 / rows)
            self.opt.apply_gradients([(grad, self.w)])
            return (err * err).sum()

        @gs.function(capture=capture, **options)
        def train_step(inputs):
            per_replica = self.s.run(step, args=inputs)
            return self.s.reduce("sum", per_replica, axis=None)
        self.train_step = train_step
        self.rows = rows

    def batches(self, start=0, stop=None):
        ds = Dataset.from_tensor_slices((self.x, self.y)).batch(self.rows)
        it = iter(self.s.experimental_distribute_dataset(ds))
        for k, inputs in enumerate(it):
            if k >= start and (stop is None or k < stop):
                yield inputs

    def weights(self):
        return [devices.to_host(v._array) for v in self.s.experimental_local_results(self.w)]

    def close(self):
        self.s.close()


def _run(n, kind, capture, seed=0, **kw):
    with testing.sanitize(seed=seed) as san:
        loop = _Loop(n, kind, capture, **kw)
        try:
            losses, counts = [], []
            for inputs in loop.batches():
                with san.measure() as c:
                    losses.append(loop.train_step(inputs))
                counts.append(c)
            kept = losses[3]
            losses = [float(devices.to_host(v)) for v in losses]
            return (loop.weights(), losses, counts, loop.train_step.experimental_get_tracing_count(),
                    int(loop.opt.iterations.numpy()), float(devices.to_host(kept)))
        finally:
            loop.close()


@pytest.mark.parametrize("n", [1, 4])
def test_sgd_with_momentum_captured_and_replayed_matches_the_eager_step_bit_for_bit(n):
    eager = _run(n, "sgd", False)
    captured = _run(n, "sgd", True, seed=1)
    for a, b in zip(eager[0], captured[0]):
        assert np.array_equal(a, b)
    assert eager[1] == captured[1]                    # the losses, each step's own
    assert captured[5] == eager[1][3]                 # a kept result is not overwritten
    assert captured[3] == 1                           # one trace: captured once
    assert captured[4] == eager[4] == STEPS           # iterations advanced on the device
    for c in captured[2][3:]:                         # the replays
        assert c["host_syncs"] == 0, c["sync_sites"]
        assert c["nccl_calls"] == eager[2][-1]["nccl_calls"]


@pytest.mark.parametrize("n", [1, 4])
def test_adam_captured_and_replayed_matches_the_eager_step_bit_for_bit(n):
    eager = _run(n, "adam", False)
    captured = _run(n, "adam", True, seed=2)
    for a, b in zip(eager[0], captured[0]):
        assert np.array_equal(a, b)
    assert eager[1] == captured[1] and captured[4] == STEPS
    # Captured once: the step size of each step is a device scalar the replays set.
    assert captured[3] == 1


def test_an_optimizer_whose_update_holds_the_step_as_a_host_value_ends_in_eager_steps():
    class StepScaledSGD(gs.optimizers.SGD):
        def update_step(self, param, grad, slots, lr, step, name):
            param -= (lr / step) * grad           # the step count, a host number
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with testing.sanitize(seed=0):
            loops = [_Loop(2, "sgd", c) for c in (True, False)]
            try:
                for loop in loops:
                    with loop.s.scope():
                        loop.opt = StepScaledSGD(0.1)
                for a, b in zip(*(loop.batches() for loop in loops)):
                    loops[0].train_step(a)
                    loops[1].train_step(b)
                assert all(np.array_equal(p, q) for p, q in
                           zip(loops[0].weights(), loops[1].weights()))
                # Captured at steps 3, 4 and 5 (each run through its graph), then eager.
                assert loops[0].train_step.experimental_get_tracing_count() == 1 + 3
            finally:
                for loop in loops:
                    loop.close()
    assert any("reads the step count" in str(w.message) for w in caught)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_changed_learning_rate_and_a_schedule_reach_the_replays_without_a_capture(kind):
    class Schedule(gs.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.02 if step < 6 else 0.01

    schedule = Schedule()
    for lr, change in ((None, True), (schedule, False)):
        with testing.sanitize(seed=0) as san:
            loop = _Loop(2, kind, True, lr=lr)
            ref = _Loop(2, kind, False, lr=lr)
            try:
                for k, (a, b) in enumerate(zip(loop.batches(), ref.batches())):
                    if k == 6 and change:
                        loop.opt.learning_rate = ref.opt.learning_rate = 0.005
                    loop.train_step(a)
                    ref.train_step(b)
                assert all(np.array_equal(p, q)
                           for p, q in zip(loop.weights(), ref.weights()))
                # The rate is a device scalar the replays set: captured once.
                assert loop.train_step.experimental_get_tracing_count() == 1
            finally:
                loop.close()
                ref.close()
        assert not san.reports


def test_with_weight_decay_a_changed_learning_rate_is_a_new_capture_as_in_tf_function():
    with testing.sanitize(seed=0) as san:
        loops = [_Loop(2, "sgd", c) for c in (True, False)]
        try:
            for loop in loops:
                with loop.s.scope():
                    loop.opt = gs.optimizers.SGD(0.1, momentum=0.9, weight_decay=0.01)
            for k, (a, b) in enumerate(zip(*(loop.batches() for loop in loops))):
                if k == 6:
                    for loop in loops:
                        loop.opt.learning_rate = 0.05
                loops[0].train_step(a)
                loops[1].train_step(b)
            assert all(np.array_equal(p, q)
                       for p, q in zip(loops[0].weights(), loops[1].weights()))
            assert loops[0].train_step.experimental_get_tracing_count() == 2
        finally:
            for loop in loops:
                loop.close()
    assert not san.reports


def test_the_partial_last_batch_runs_eagerly_then_is_captured_as_second_graphs():
    with testing.sanitize(seed=0):
        loop = _Loop(2, "sgd", True, extra=3)
        ref = _Loop(2, "sgd", False, extra=3)
        try:
            for epoch in range(4):
                for a, b in zip(loop.batches(), ref.batches()):
                    loop.train_step(a)
                    ref.train_step(b)
                assert all(np.array_equal(p, q) for p, q in zip(loop.weights(), ref.weights()))
                captured = [st for st in loop.train_step._traces.values()
                            if st.graphs is not None]
                # The partial batch's third call (epoch 3) is captured.
                assert len(captured) == (1 if epoch < 2 else 2)
            assert loop.train_step.experimental_get_tracing_count() == 2
        finally:
            loop.close()
            ref.close()


@pytest.mark.parametrize("captured_first", [True, False])
def test_a_checkpoint_of_a_captured_loop_restores_into_an_eager_one_and_back(tmp_path,
                                                                          captured_first):
    with testing.sanitize(seed=0):
        ref = _Loop(2, "sgd", False)
        first = _Loop(2, "sgd", captured_first)
        second = _Loop(2, "sgd", not captured_first)
        try:
            for inputs in ref.batches():
                ref.train_step(inputs)
            for inputs in first.batches(0, 6):
                first.train_step(inputs)
            path = gs.train.Checkpoint(w=first.w, opt=first.opt).save(str(tmp_path / "ck"))
            # The second loop takes the same steps' layout, then restores and goes on.
            for inputs in second.batches(0, 3):
                second.train_step(inputs)
            gs.train.Checkpoint(w=second.w, opt=second.opt).restore(path)
            for inputs in second.batches(6):
                second.train_step(inputs)
            assert all(np.array_equal(p, q) for p, q in zip(second.weights(), ref.weights()))
            assert int(second.opt.iterations.numpy()) == STEPS
        finally:
            for loop in (ref, first, second):
                loop.close()


def test_a_fused_all_reduce_of_fresh_gradients_captures_its_launch_tables_outside():
    """Fresh arrays each step, reduced in one fused all_reduce: captured once, replayed
    with the eager results, nothing reported (a launch table first needed inside the
    capture is uploaded outside it; an upload captured from CuPy's staging buffers
    would be reported)."""
    def step(v):
        ctx = gs.get_replica_context()
        grads = [v * 2, v[:3] + 1, (v * v).sum(axis=0, keepdims=True)]
        return ctx.all_reduce("sum", grads)

    def train(capture):
        with testing.sanitize(seed=0) as san:
            s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
            try:
                f = gs.function(lambda v: s.run(step, args=(v,)), capture=capture)
                outs = []
                for k in range(5):
                    x = s.experimental_distribute_values_from_function(
                        lambda ctx: np.arange(8, dtype=np.float32) + k +
                        ctx.replica_id_in_sync_group)
                    outs.append([[c.get() for c in r] for r in s.experimental_local_results(f(x))])
                return outs, f.experimental_get_tracing_count(), list(san.reports)
            finally:
                s.close()
    (eager, _, _), (captured, traces, reports) = train(False), train(True)
    assert traces == 1 and not reports
    assert all(np.array_equal(a, b) for e, c in zip(eager, captured)
               for ra, rb in zip(e, c) for a, b in zip(ra, rb))


def test_a_kernels_launch_table_first_needed_in_a_capture_is_uploaded_outside_it():
    from gpustrat.kernels.pack import pack

    def step(v):
        return pack([v * 2, v[:3] + 1, v * v], scale=0.5)

    def train(capture):
        with testing.sanitize(seed=0) as san:        # raises on a captured upload
            s = gs.OneDeviceStrategy("gpu:1")
            try:
                f = gs.function(lambda v: s.run(step, args=(v,)), capture=capture)
                cp = devices.cupy()
                outs = []
                for k in range(5):
                    with cp.cuda.Device(1):
                        x = cp.asarray(np.arange(6, dtype=np.float32) + k)
                    outs.append(devices.to_host(f(x)))
                return outs, f.experimental_get_tracing_count(), list(san.reports)
            finally:
                s.close()
    (eager, _, _), (captured, traces, reports) = train(False), train(True)
    assert traces == 1 and not reports
    assert all(np.array_equal(a, b) for a, b in zip(eager, captured))


# --- refusals ----------------------------------------------------------------------------

def _refused(body, n=2, match=None, returns=False):
    """Warm up and capture a step whose replicas call ``body(x)``; the CaptureError."""
    with testing.sanitize(seed=0, check=False):
        s = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full((4,), ctx.replica_id_in_sync_group + 1.0, np.float32))

            @gs.function(capture=True)
            def f(v):
                out = s.run(body, args=(v,))
                return s.reduce("sum", out, axis=None) if returns else out
            f(x)
            f(x)
            with pytest.raises(CaptureError, match=match) as e:
                f(x)
            return str(e.value)
        finally:
            s.close()


def test_an_item_of_device_data_in_a_captured_step_is_refused_with_the_line():
    msg = _refused(lambda v: v * float(v.sum().item()), match="host read of device data")
    assert "test_function_capture.py" in msg and ".item()" in msg
    assert "cudaErrorStreamCaptureUnsupported" in msg


def test_a_get_and_a_synchronize_in_a_captured_step_are_refused():
    _refused(lambda v: v + float(v.get()[0]), match="host read of device data")

    def sync(v):
        devices.cupy().cuda.get_current_stream().synchronize()
        return v * 2
    msg = _refused(sync, match="a host synchronization")
    assert "synchronize()" in msg


def test_an_allocation_outside_the_capture_pool_is_refused():
    def elsewhere(v):
        cp = devices.cupy()
        with cp.cuda.using_allocator(cp.get_default_memory_pool().malloc):
            return v * 2
    _refused(elsewhere, match="allocation outside the capture's private memory pool")


def test_replicas_issuing_different_collectives_raise_as_eagerly():
    def differ(v):
        ctx = gs.get_replica_context()
        if ctx.replica_id_in_sync_group == 0:
            return ctx.all_reduce("sum", v)
        return ctx.all_reduce("max", v)
    with testing.sanitize(seed=0, check=False):
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.ones((4,), np.float32))
            f = gs.function(lambda v: s.run(differ, args=(v,)), capture=True, warmup_steps=1)
            with pytest.raises(ValueError, match="different collectives"):
                f(x)          # eagerly, in warm-up
            with pytest.raises(ValueError, match="different collectives") as e:
                f(x)          # while capturing
            assert any("captured the step" in n for n in getattr(e.value, "__notes__", []))
        finally:
            s.close()


def test_a_returned_python_number_and_a_numpy_argument_are_refused():
    _refused(lambda v: float(3.0), match="returned a host value")
    with testing.sanitize(seed=0, check=False):
        s = gs.MirroredStrategy(["gpu:0"])
        try:
            f = gs.function(lambda a: s.run(lambda b: b * 2, args=(a,)), capture=True)
            a = np.ones(3, np.float32)
            f(a)
            f(a)
            with pytest.raises(CaptureError, match="NumPy array"):
                f(a)
        finally:
            s.close()


def test_a_watchdog_failure_is_refused_before_a_replay():
    from gpustrat.errors import CollectiveTimeout
    with testing.sanitize(seed=0, check=False):
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.ones((4,), np.float32))
            f = gs.function(lambda v: s.run(
                lambda u: gs.get_replica_context().all_reduce("sum", u), args=(v,)),
                capture=True)
            for _ in range(4):
                f(x)
            s.communicator._watchdog.failure = CollectiveTimeout("a peer died")
            with pytest.raises(CaptureError, match="watchdog found a failure"):
                f(x)
        finally:
            s.communicator._watchdog.failure = None
            s.close()


def test_auto_capture_warns_once_and_runs_an_uncapturable_step_eagerly():
    with testing.sanitize(seed=0, check=False):
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full((4,), 2.0, np.float32))
            f = gs.function(lambda v: s.run(lambda u: u * float(u.sum().item()), args=(v,)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                outs = [f(x) for _ in range(5)]
            assert sum("runs eagerly" in str(w.message) for w in caught) == 1
            for out in outs:
                for c in s.experimental_local_results(out):
                    np.testing.assert_array_equal(c.get(), np.full(4, 16.0))
        finally:
            s.close()


def test_a_refused_capture_leaves_the_optimizer_as_if_only_eager_steps_ran():
    def train(capture):
        with testing.sanitize(seed=0, check=False):
            loop = _Loop(2, "adam", capture)
            step = loop.train_step.python_function

            def returns_a_number(inputs):
                step(inputs)
                return 1.0            # a host value: the capture is refused
            f = gs.function(returns_a_number, capture=capture)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    for inputs in loop.batches():
                        f(inputs)
                return loop.weights(), int(loop.opt.iterations.numpy())
            finally:
                loop.close()
    (we, ie), (wa, ia) = train(False), train("auto")
    assert ie == ia == STEPS
    assert all(np.array_equal(a, b) for a, b in zip(we, wa))


def test_the_demos_step_under_auto_capture_trains_as_eagerly():
    """Captured or (where its step reads device data on the host) refused and run
    eagerly: the weights are the eager ones either way."""
    from gpustrat import demo

    def train(capture):
        with testing.sanitize(seed=0):
            s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
            try:
                x, y = demo.make_dataset(320)
                weights, opt, loss = demo.build_model(s, demo.init_weights(), 0.1)
                step = demo.make_train_step(weights, opt, loss)
                f = gs.function(lambda b: s.reduce("sum", s.run(step, args=(b,)), axis=None),
                                capture=capture)
                ds = Dataset.from_tensor_slices((x, y)).batch(32)
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for b in s.experimental_distribute_dataset(ds):
                        f(b)
                return {k: v.numpy() for k, v in weights.items()}, caught
            finally:
                s.close()
    (eager, _), (auto, caught) = train(False), train("auto")
    assert all(np.array_equal(eager[k], auto[k]) for k in eager)
    for w in caught:     # a refusal names the demo's line
        assert "demo.py" in str(w.message), str(w.message)


def test_a_function_looping_over_a_dataset_is_refused_once_and_runs_every_batch_eagerly():
    with testing.sanitize(seed=0):
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = np.arange(48, dtype=np.float32).reshape(16, 3)
            dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(4))

            @gs.function
            def epoch(ds):
                total = None
                for b in ds:
                    r = s.reduce("sum", s.run(lambda v: v.sum(), args=(b,)), axis=None)
                    total = r if total is None else total + r
                return total
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                totals = [float(devices.to_host(epoch(dist))) for _ in range(4)]
            assert totals == [float(x.sum())] * 4
            msgs = [str(w.message) for w in caught if "runs eagerly" in str(w.message)]
            assert len(msgs) == 1 and "outside the capture" in msgs[0]
        finally:
            s.close()


def test_on_cpu_devices_auto_capture_calls_the_function_every_time():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        calls = []

        @gs.function
        def f(v):
            calls.append(1)
            return s.run(lambda u: u * 2, args=(v,))
        x = s.experimental_distribute_values_from_function(lambda ctx: np.ones(2))
        for _ in range(5):
            f(x)
        assert len(calls) == 5 and f.experimental_get_tracing_count() == 1
        with pytest.raises(CaptureError, match="CPU devices"):
            g = gs.function(f.python_function, capture=True)
            for _ in range(3):
                g(x)
    finally:
        s.close()
