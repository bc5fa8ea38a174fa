"""Variables, sync-on-read reads, metrics and optimizer steps on two fake GPUs, under the
stream-ordering sanitizer (:func:`gpustrat.testing.sanitize`): every component is an
array on its replica's device, updates write it in place there, the values are those
NumPy computes, no op races or reuses memory another stream may still use, and a
steady training step waits for the device from no step thread."""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing
from gpustrat.devices import Device

SEEDS = (0, 1, 2)


def _strategy(n: int = 2):
    return gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])


@contextlib.contextmanager
def _sanitized(seed: int, names=("gpu:0", "gpu:1")):
    """CuPy and a strategy on ``names`` under the sanitizer (reports collected, not
    raised), closed and drained on the way out; no report may remain."""
    with testing.sanitize(seed=seed, check=False) as san:
        s = gs.MirroredStrategy(list(names))
        try:
            yield devices.cupy(), s
        finally:
            s.close()
        san.drain()
    assert not san.reports, [str(x) for x in san.reports[:3]]


def _local(strategy, v) -> list:
    return [c._array for c in strategy.experimental_local_results(v)]


def _host(arrays) -> list:
    return [devices.to_host(a) for a in arrays]


def _step_thread_syncs(c) -> list:
    # The input pipeline's placer thread waits for its own copies by design; the step's
    # threads (the caller, the replicas) must not wait at all.
    return [s for s in c["sync_sites"] if s[0] != "gpustrat-placer"]


# --- variables --------------------------------------------------------------------------

@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "staged"])
def test_components_are_arrays_on_their_replicas_devices(nccl):
    with testing.sanitize(seed=0, nccl=nccl) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            with s.scope():
                v = gs.Variable(np.arange(3.0, dtype=np.float32), aggregation="mean")
                r = gs.Variable(np.zeros((2, 2), np.float32), synchronization="on_read",
                                aggregation="sum")
            for var in (v, r):
                comps = s.experimental_local_results(var)
                assert [c.device for c in comps] == ["gpu:0", "gpu:1"]
                assert all(type(c._array) is cp.ndarray for c in comps)
                assert [c._array.device.id for c in comps] == [0, 1]
            assert [h.tolist() for h in _host(_local(s, v))] == [[0.0, 1.0, 2.0]] * 2
        finally:
            s.close()
    assert not san.reports


@pytest.mark.parametrize("seed", SEEDS)
def test_replica_updates_write_each_component_in_place_on_its_device(seed):
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            with s.scope():
                v = gs.Variable(np.zeros(4, np.float32), aggregation="sum")
                m = gs.Variable(np.ones(4, np.float32), aggregation="mean")
            ptrs = [a.data.ptr for a in _local(s, v) + _local(s, m)]

            def step():
                r = gs.get_replica_context().replica_id_in_sync_group
                g = cp.full((4,), r + 1.0, dtype=np.float32)
                v.assign_add(g)
                m.assign_sub(g * 2)
            for _ in range(3):
                s.run(step)
            assert [a.data.ptr for a in _local(s, v) + _local(s, m)] == ptrs
            # sum: 3 steps of (1 + 2); mean: 1 - 3 steps of mean(2, 4)
            assert [h.tolist() for h in _host(_local(s, v))] == [[9.0] * 4] * 2
            assert [h.tolist() for h in _host(_local(s, m))] == [[-8.0] * 4] * 2
        finally:
            s.close()
    assert not san.reports       # no race, no reuse, no array used on another device


@pytest.mark.parametrize("seed", SEEDS)
def test_sync_on_read_reads_sum_every_replicas_component(seed):
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            with s.scope():
                total = gs.Variable(np.zeros(3, np.float32), synchronization="on_read",
                                    aggregation="sum")
                avg = gs.Variable(np.zeros(3, np.float32), synchronization="on_read",
                                  aggregation="mean")

            def step(k):
                r = gs.get_replica_context().replica_id_in_sync_group
                x = cp.full((3,), 10.0 * k + r, dtype=np.float32)
                total.assign_add(x)
                avg.assign_add(x)
                return total.read_value()          # the replica's own component
            for k in range(1, 4):
                own = s.run(step, args=(k,))
            assert [h.tolist() for h in _host(s.experimental_local_results(own))] == \
                [[60.0] * 3, [63.0] * 3]
            with s.scope():
                summed, mean = total.read_value(), avg.read_value()
            assert isinstance(summed, cp.ndarray) and summed.device.id == 0
            assert devices.to_host(summed).tolist() == [123.0] * 3
            assert devices.to_host(mean).tolist() == [61.5] * 3
            # The components were not changed by reading.
            assert [h.tolist() for h in _host(_local(s, total))] == [[60.0] * 3, [63.0] * 3]
        finally:
            s.close()
    assert not san.reports


def test_a_scalar_keeps_its_shape_on_a_gpu():
    # to_device once made 0-d host values 1-d (np.ascontiguousarray returns ndim >= 1),
    # so a scalar variable (an optimizer's iterations) was not a scalar on a GPU.
    with testing.sanitize(seed=0) as san:
        out = devices.to_device(np.float32(2.5), Device("gpu", 1))
        assert out.shape == () and out.device.id == 1
        s = _strategy()
        try:
            with s.scope():
                opt = gs.optimizers.SGD(0.1)
            assert [c.shape for c in s.experimental_local_results(opt.iterations)] == \
                [(), ()]
        finally:
            s.close()
    assert not san.reports


@pytest.mark.parametrize("seed", SEEDS)
def test_a_plain_gpu_variable_is_read_on_its_own_device(seed):
    # CuPy's copy() copies onto the current device, on its stream: read_value() and
    # numpy() with gpu:0 current once read gpu:1's value there, unordered after the
    # update queued on gpu:1 (a race, and a stale or garbage value).
    with testing.sanitize(seed=seed, check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            v = gs.Variable(cp.asarray(np.arange(4, dtype=np.float32)))
        v.assign_add(np.ones(4, np.float32))             # queued on gpu:1's stream
        r = v.read_value()                              # gpu:0 is current
        assert r.device.id == 1
        assert v.numpy().tolist() == [1.0, 2.0, 3.0, 4.0]
        assert np.asarray(v).tolist() == [1.0, 2.0, 3.0, 4.0]
        assert devices.to_host(r).tolist() == [1.0, 2.0, 3.0, 4.0]
        san.drain()
    assert not san.reports, [str(x) for x in san.reports[:3]]


@pytest.mark.parametrize("seed", SEEDS)
def test_cross_replica_reads_on_gpus_other_than_the_current_one(seed):
    with _sanitized(seed, ["gpu:1", "gpu:2"]) as (cp, s):
        with s.scope():
            v = gs.Variable(np.zeros(4, np.float32), aggregation="sum")
            opt = gs.optimizers.SGD(0.1)

        def step():
            v.assign_add(cp.ones(4, np.float32))
        s.run(step)
        v.assign_add(np.ones(4, np.float32))        # on gpu:1's and gpu:2's streams
        r = v.read_value()
        assert r.device.id == 1
        assert devices.to_host(r).tolist() == [3.0] * 4
        assert v.numpy().tolist() == [3.0] * 4
        opt.iterations.assign_add(np.int64(2).astype(opt.iterations.dtype))
        assert int(opt.iterations.numpy()) == 2


@pytest.mark.parametrize("seed", SEEDS)
def test_read_value_inside_merge_call_copies_on_the_variables_device(seed):
    # The merge runs in the last replica's thread: the copy once ran on that replica's
    # device and stream, unordered after replica 0's update of its own component.
    got = {}
    with _sanitized(seed) as (cp, s):
        with s.scope():
            v = gs.Variable(np.zeros(4, np.float32), synchronization="on_read",
                            aggregation="only_first_replica")
            m = gs.Variable(np.zeros(4, np.float32), aggregation="sum")

        def step():
            ctx = gs.get_replica_context()
            m.assign_add(cp.ones(4, np.float32))
            v.assign_add(cp.ones(4, np.float32) * (ctx.replica_id_in_sync_group + 1))
            if ctx.replica_id_in_sync_group == 1:
                time.sleep(0.02)            # replica 1 arrives last: it runs the merge

            def merge(strategy):
                r, q = v.read_value(), m.read_value()
                got["devices"] = (r.device.id, q.device.id)
                got["values"] = (devices.to_host(r).tolist(), v.numpy().tolist(),
                                 devices.to_host(q).tolist(), m.numpy().tolist())
            ctx.merge_call(merge)
        s.run(step)
    assert got["devices"] == (0, 0)
    assert got["values"] == ([1.0] * 4, [1.0] * 4, [2.0] * 4, [2.0] * 4)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_cross_replica_assign_of_a_value_on_another_gpu_is_computed_there(seed):
    # A sync-on-read SUM assign divides the value by the number of replicas: on the
    # value's device, after the work that wrote it.
    with _sanitized(seed) as (cp, s):
        with s.scope():
            total = gs.Variable(np.zeros(3, np.float32), synchronization="on_read",
                                aggregation="sum")
            w = gs.Variable(np.zeros(3, np.float32))
        with cp.cuda.Device(1):
            x = cp.full((3,), 4.0, np.float32) * 2          # on gpu:1's stream
            d = cp.full((3,), 2, np.int32) * 1
        total.assign(x)                                    # gpu:0 is current
        w.assign(d)                                        # cast on gpu:1
        assert devices.to_host(total.read_value()).tolist() == [8.0] * 3
        assert w.numpy().tolist() == [2.0] * 3


@pytest.mark.parametrize("seed", SEEDS)
def test_a_variable_made_from_a_device_value_copies_it_on_that_device(seed):
    # Inside run, the replica combining the creation (the last to arrive) copied replica
    # 0's value onto its own device, unordered after replica 0's stream; likewise a
    # value on gpu:1 in the scope with gpu:0 current.
    out = {}
    with _sanitized(seed) as (cp, s):
        def step():
            out["v"] = gs.Variable(cp.full((4,), 7.0, np.float32) * 2)
        s.run(step)
        with cp.cuda.Device(1):
            init = cp.full((4,), 3.0, np.float32) * 1      # on gpu:1's stream
        with s.scope():
            w = gs.Variable(init)
            w64 = gs.Variable(init, dtype=np.float64)
            u = gs.Variable(w)                              # from a variable
        plain = gs.Variable(init)
        assert [c.numpy().tolist() for c in out["v"].values] == [[14.0] * 4] * 2
        for var in (w, w64, u):
            assert [c.device for c in var.values] == ["gpu:0", "gpu:1"]
            assert [c.numpy().tolist() for c in var.values] == [[3.0] * 4] * 2
        assert plain.device == "gpu:1" and plain.numpy().tolist() == [3.0] * 4


# --- metrics ----------------------------------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_metrics_accumulate_on_each_device_and_sum_over_replicas(seed):
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((4, 2, 5)).astype(np.float32)     # step, replica, batch
    weights = rng.uniform(0.5, 2.0, (4, 2, 5)).astype(np.float32)
    labels = rng.integers(0, 3, (4, 2, 5))
    scores = rng.standard_normal((4, 2, 5, 3)).astype(np.float32)
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            with s.scope():
                mean = gs.metrics.Mean()
                total = gs.metrics.Sum()
                acc = gs.metrics.SparseCategoricalAccuracy()
            empty = mean.result()
            assert isinstance(empty, cp.ndarray) and devices.to_host(empty) == 0.0

            def step(k):
                r = gs.get_replica_context().replica_id_in_sync_group
                mean.update_state(cp.asarray(values[k, r]), cp.asarray(weights[k, r]))
                total.update_state(cp.asarray(values[k, r]))
                acc.update_state(cp.asarray(labels[k, r]), cp.asarray(scores[k, r]))
                return mean.result()                     # this replica's own mean
            for k in range(4):
                own = s.run(step, args=(k,))
            for c in s.experimental_local_results(own):
                assert isinstance(c, cp.ndarray)
            for metric in (mean, total, acc):
                for v in metric.variables:
                    assert [a.device.id for a in _local(s, v)] == [0, 1]
            with san.measure() as c:
                results = [m.result() for m in (mean, total, acc)]   # fused reductions
            assert c["host_syncs"] == 0, c["sync_sites"]             # read below, on the host
            assert all(isinstance(r, cp.ndarray) and r.shape == () for r in results)
            got = [devices.to_host(r) for r in results]
            replica1 = devices.to_host(s.experimental_local_results(own)[1])
            for m in (mean, total, acc):
                m.reset_state()
            assert [devices.to_host(m.result()) for m in (mean, total, acc)] == [0, 0, 0]
        finally:
            s.close()
    assert not san.reports
    np.testing.assert_allclose(got[0], (values * weights).sum() / weights.sum(), rtol=1e-5)
    np.testing.assert_allclose(got[1], values.sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], (scores.argmax(-1) == labels).mean(), rtol=1e-6)
    np.testing.assert_allclose(replica1, (values[:, 1] * weights[:, 1]).sum()
                               / weights[:, 1].sum(), rtol=1e-5)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_metric_result_is_computed_on_its_states_device(seed):
    # With gpu:0 current and the replicas on gpu:1 and gpu:2, result() used to do its
    # arithmetic on gpu:0, reading the reduced state across devices, unordered after the
    # reduction that wrote it.
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:1", "gpu:2"])
        try:
            with s.scope():
                metrics = [gs.metrics.Mean(), gs.metrics.Sum(dtype=np.float64),
                           gs.metrics.SparseCategoricalAccuracy()]
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full(4, ctx.replica_id_in_sync_group + 1.0, np.float32))

            def step(v):
                metrics[0].update_state(v)
                metrics[1].update_state(v)
                metrics[2].update_state(cp.zeros(4, cp.int64), cp.ones((4, 2), cp.float32))
            s.run(step, args=(x,))
            results = [m.result() for m in metrics]
            assert [r.device.id for r in results] == [1, 1, 1]
            got = [float(devices.to_host(r)) for r in results]
        finally:
            s.close()
    assert not san.reports, san.reports
    assert got == [1.5, 12.0, 1.0]


# --- optimizers -------------------------------------------------------------------------

def _sgd_reference(w, g, slots, lr, t, momentum=0.9):
    m = slots.setdefault("m", np.zeros_like(w))
    m[...] = momentum * m - lr * g
    w += m


def _adam_reference(w, g, slots, lr, t, b1=0.9, b2=0.999, eps=1e-7):
    m = slots.setdefault("m", np.zeros_like(w))
    v = slots.setdefault("v", np.zeros_like(w))
    m += (g - m) * (1 - b1)
    v += (g * g - v) * (1 - b2)
    w -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(v) + eps)


def _amsgrad_reference(w, g, slots, lr, t, b1=0.9, b2=0.999, eps=1e-7):
    m = slots.setdefault("m", np.zeros_like(w))
    v = slots.setdefault("v", np.zeros_like(w))
    vhat = slots.setdefault("vhat", np.zeros_like(w))
    m += (g - m) * (1 - b1)
    v += (g * g - v) * (1 - b2)
    np.maximum(vhat, v, out=vhat)
    w -= lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) * m / (np.sqrt(vhat) + eps)


def _adamw_reference(w, g, slots, lr, t, wd=0.1):
    if w.ndim:                          # the bias ("b", a scalar) is excluded
        w -= w * (wd * lr)
    _adam_reference(w, g, slots, lr, t)


def _rmsprop_clipnorm_reference(w, g, slots, lr, t, rho=0.9, eps=1e-7, clipnorm=0.5):
    g = g * clipnorm / max(float(np.sqrt(np.sum(np.square(g)))), clipnorm)
    v = slots.setdefault("velocity", np.zeros_like(w))
    m = slots.setdefault("momentum", np.zeros_like(w))
    v[...] = rho * v + (1 - rho) * g * g
    m[...] = 0.5 * m + lr * g / np.sqrt(v + eps)
    w -= m


OPTIMIZERS = {
    # Clipping of each replica's summed gradient, on its device.
    "rmsprop_clipnorm": (lambda: gs.optimizers.RMSprop(0.05, momentum=0.5, clipnorm=0.5),
                         _rmsprop_clipnorm_reference, 2e-5),
    "sgd_momentum": (lambda: gs.optimizers.SGD(0.05, momentum=0.9), _sgd_reference, 2e-5),
    "adam": (lambda: gs.optimizers.Adam(0.05), _adam_reference, 2e-5),
    # Gradients on the wire as bfloat16 (8 bits of mantissa): close to float32 training.
    "sgd_bfloat16": (lambda: gs.optimizers.SGD(0.05, momentum=0.9, compression="bfloat16"),
                     _sgd_reference, 2e-2),
    "adam_float16": (lambda: gs.optimizers.Adam(0.05, compression="float16"),
                     _adam_reference, 2e-2),
    "adam_amsgrad": (lambda: gs.optimizers.Adam(0.05, amsgrad=True), _amsgrad_reference,
                     2e-5),
    # A variable excluded from the decay: each variable is updated on its own (no flat
    # buffers), from the fused reduction's per-variable views.
    "adamw_excluding_b": (lambda: gs.optimizers.AdamW(0.05, weight_decay=0.1,
                                                      exclude_from_weight_decay=["b"]),
                          _adamw_reference, 2e-5),
}


def _linear_data(seed, steps, rows):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * rows, 3)).astype(np.float32)
    y = (x @ np.array([1.5, -2.0, 0.5], np.float32) + 0.25).astype(np.float32)
    return x, y


def _train(s, opt, metric, x, y, rows, san, buffers=False):
    """Linear regression as users write it: per-replica gradients of a loss scaled by
    the global batch, one apply_gradients, a loss metric (``buffers``: the gradients
    are written into ``opt.gradient_buffers``). Returns the variables, the pointers of
    the weights' and slots' components after the first step, and each step's counts."""
    from gpustrat.data import Dataset
    with s.scope():
        w = gs.Variable(np.zeros(3, np.float32), name="w")
        b = gs.Variable(np.zeros((), np.float32), name="b")

    def step(xb, yb):
        err = (xb * w.value()).sum(axis=1) + b.value() - yb
        scale = 2.0 / rows
        gw = (xb * err.reshape(-1, 1)).sum(axis=0) * scale
        gb = err.sum() * scale
        if buffers:
            bw, bb = opt.gradient_buffers([w, b])
            bw[...] = gw
            bb[...] = gb
            gw, gb = bw, bb
        opt.apply_gradients([(gw, w), (gb, b)])
        return metric(err * err)            # update_state, then this replica's result

    counts, ptrs = [], None
    dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices((x, y)).batch(rows))
    for xb, yb in dist:
        with san.measure() as c:
            s.run(step, args=(xb, yb))
        counts.append(c)
        if ptrs is None:
            ptrs = _pointers(s, opt, w, b)
    return w, b, ptrs, counts


def _pointers(s, opt, w, b) -> list:
    return [a.data.ptr for v in [w, b] + [opt.get_slot(w, n) for n in opt.slot_names]
            for a in _local(s, v)]


def _train_reference(x, y, rows, reference, lr):
    w, b = np.zeros(3, np.float32), np.zeros((), np.float32)
    slots_w, slots_b, losses = {}, {}, []
    for k in range(len(x) // rows):
        xb, yb = x[k * rows:(k + 1) * rows], y[k * rows:(k + 1) * rows]
        err = xb @ w + b - yb
        losses.append(err * err)
        reference(w, (xb * err[:, None]).sum(axis=0) * 2.0 / rows, slots_w, lr, k + 1)
        reference(b, np.float32(err.sum() * 2.0 / rows), slots_b, lr, k + 1)
    return w, b, np.concatenate(losses).mean()


def _train_checked(algo, seed, nccl=True, replicas=2, steps=6, run_probability=0.5,
                   buffers=False):
    make, reference, rtol = OPTIMIZERS[algo]
    rows = 4 * replicas
    x, y = _linear_data(seed, steps, rows)
    with testing.sanitize(seed=seed, nccl=nccl, run_probability=run_probability) as san:
        cp = devices.cupy()
        s = _strategy(replicas)
        try:
            with s.scope():
                opt = make()
                loss = gs.metrics.Mean()
            w, b, ptrs, counts = _train(s, opt, loss, x, y, rows, san, buffers)
            slots = [opt.get_slot(v, n) for v in (w, b) for n in opt.slot_names]
            arrays = [a for v in [w, b] + slots for a in _local(s, v)]
            assert all(type(a) is cp.ndarray for a in arrays)
            assert [a.device.id for a in arrays] == list(range(replicas)) * (2 + len(slots))
            assert _pointers(s, opt, w, b) == ptrs        # updated in place, every step
            got = {"w": _host(_local(s, w)), "b": _host(_local(s, b)),
                   "iterations": _host(_local(s, opt.iterations)),
                   "loss": devices.to_host(loss.result())}
        finally:
            s.close()
    assert not san.reports, san.reports
    want = _train_reference(x, y, rows, reference, 0.05)
    for i in range(replicas):
        np.testing.assert_allclose(got["w"][i], want[0], rtol=rtol, atol=rtol / 20)
        np.testing.assert_allclose(got["b"][i], want[1], rtol=rtol, atol=rtol / 20)
        np.testing.assert_array_equal(got["w"][i], got["w"][0])   # replicas agree exactly
        assert got["iterations"][i] == steps
    np.testing.assert_allclose(got["loss"], want[2], rtol=rtol / 2)
    return counts


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algo", sorted(OPTIMIZERS))
def test_training_steps_update_in_place_on_each_device_and_match_numpy(algo, seed):
    _train_checked(algo, seed)


@pytest.mark.parametrize("algo", sorted(OPTIMIZERS))
def test_training_on_the_host_staged_path_and_three_gpus(algo):
    _train_checked(algo, 0, nccl=False)
    _train_checked(algo, 1, replicas=3, steps=4)


@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "staged"])
@pytest.mark.parametrize("algo", ["sgd_momentum", "adam_float16", "sgd_bfloat16",
                                  "adamw_excluding_b"])
def test_gradient_buffers_on_each_device_match_numpy_and_wait_for_nothing(algo, nccl):
    # The buffers are reused every step: writing the next step's gradients must be
    # ordered after the last step's reduction and update on every replica's stream
    # (the sanitizer checks). Over NCCL no step waits for a device; the staged path
    # copies through the host by design.
    counts = _train_checked(algo, 1, nccl=nccl, buffers=True)
    for c in counts if nccl else ():
        assert _step_thread_syncs(c) == [], _step_thread_syncs(c)


@pytest.mark.parametrize("run_probability", [0.0, 1.0])
@pytest.mark.parametrize("algo", sorted(OPTIMIZERS))
def test_training_with_one_bucket_per_variable_and_extreme_schedules(
        algo, run_probability, monkeypatch):
    # 4-byte buckets: w (12 bytes) and b (4) are reduced in buckets of their own, and
    # the flat update runs once per bucket on its slice of each replica's buffers. The
    # scheduler runs queued work never (until forced) or at every chance.
    monkeypatch.setenv("GPUSTRAT_FUSION_BUCKET_BYTES", "4")
    counts = _train_checked(algo, 3, run_probability=run_probability)
    if algo != "sgd_bfloat16":         # (bfloat16 plans its own, 2-byte, buckets)
        assert all(c["nccl_calls"] == 2 * 2 for c in counts), counts


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("algo", sorted(OPTIMIZERS))
def test_a_steady_training_step_with_an_optimizer_and_a_metric_waits_for_no_device(
        algo, seed):
    counts = _train_checked(algo, seed)
    assert len(counts) == 6
    for c in counts:                 # the steady state, and the first steps too
        assert _step_thread_syncs(c) == [], _step_thread_syncs(c)
        assert c["nccl_calls"] == 2, c["nccl_calls"]    # one fused bucket per replica


@pytest.mark.parametrize("seed", SEEDS)
def test_gradients_of_another_dtype_are_cast_on_their_replicas_device(seed):
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            with s.scope():
                w = gs.Variable(np.ones(4, np.float32))
                opt = gs.optimizers.SGD(0.5)

            def step():
                r = gs.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(cp.full((4,), r + 1.0, dtype=np.float64), w)])
            with cp.cuda.Device(1):            # the caller's device is not replica 0's
                s.run(step)
            assert [h.tolist() for h in _host(_local(s, w))] == [[-0.5] * 4] * 2
        finally:
            s.close()
    assert not san.reports, san.reports


# --- loss helpers and scalar reductions ---------------------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_average_loss_counts_the_global_batch_without_a_host_wait(seed):
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = _strategy()
        try:
            def step(rows):
                r = gs.get_replica_context().replica_id_in_sync_group
                loss = cp.full((rows[r],), r + 1.0, dtype=np.float32)
                return gs.nn.compute_average_loss(loss)
            s.run(step, args=((3, 1),))
            with san.measure() as c:
                out = s.run(step, args=((3, 1),))        # 3 + 1 examples: / 4
                empty = s.run(step, args=((0, 0),))      # an empty global batch: 0
            assert c["host_syncs"] == 0, c["sync_sites"]
            got = [devices.to_host(v).item() for v in s.experimental_local_results(out)]
            assert got == [0.75, 0.5]
            assert [a.device.id for a in s.experimental_local_results(out)] == [0, 1]
            assert [devices.to_host(v).item()
                    for v in s.experimental_local_results(empty)] == [0.0, 0.0]
        finally:
            s.close()
    assert not san.reports, san.reports


@pytest.mark.parametrize("seed", SEEDS)
def test_a_python_number_reduced_on_gpus_is_read_on_each_replicas_device(seed):
    # A Python number in gives a Python number out: each replica's result is read back
    # from its own device, after the reduction that wrote it.
    with testing.sanitize(seed=seed) as san:
        s = _strategy()
        try:
            out = s.run(lambda: gs.get_replica_context().all_reduce(
                "sum", 1.5 + gs.get_replica_context().replica_id_in_sync_group))
            assert s.experimental_local_results(out) == (4.0, 4.0)
        finally:
            s.close()
    assert not san.reports, san.reports
