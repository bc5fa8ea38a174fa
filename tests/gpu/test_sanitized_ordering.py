"""GPU paths under the stream-ordering sanitizer (gpustrat.testing): ordering mistakes
are reported, host synchronizations counted, on a machine without a GPU."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing
from gpustrat.devices import Device

SEEDS = (0, 1, 2)


def _reports(san, kind):
    return [r for r in san.reports if r.kind == kind]


# --- the sanitizer itself ------------------------------------------------------------------

def test_an_unordered_read_on_another_stream_is_a_race_and_an_event_orders_it():
    with testing.sanitize(check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
            with a:
                x = cp.full((8,), 3.0, dtype=np.float32)
            with b:
                y = x * 2                                    # no wait: a race
            assert len(_reports(san, "race")) == 1
            b.wait_event(a.record())
            with b:
                z = x * 2                                    # ordered: no new report
            assert len(san.reports) == 1
            np.testing.assert_array_equal(z.get(stream=b), [6.0] * 8)
            del y


def test_a_block_reused_on_its_stream_while_another_stream_reads_it_is_reported():
    with testing.sanitize(check=False, run_probability=0) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
            with a:
                x = cp.full((64,), 1.0, dtype=np.float32)
            b.wait_event(a.record())
            with b:
                y = x + 1                                    # b reads x
            del x
            gc.collect()
            with a:
                cp.empty((64,), np.float32)                  # x's block, while b may read
            assert [r.kind for r in san.reports] == ["reuse"]
            del y


def test_host_synchronizations_are_counted_and_a_hang_is_reported():
    with testing.sanitize(check=False) as san:
        cp = devices.cupy()
        with san.measure() as c:
            x = cp.asarray(np.arange(4.0))
            assert float(x.sum()) == 6.0
            cp.cuda.get_current_stream().synchronize()
        assert c["host_syncs"] == 2 and c["launches"] == 1 and c["copies"] == 2
        nccl = devices.nccl_library()
        comms = nccl.NcclCommunicator.initAll([0, 1])
        s0 = cp.cuda.get_current_stream()
        comms[0].allReduce(x.data.ptr, x.data.ptr, 4, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, s0.ptr)
        with pytest.raises(testing.SanitizerError, match="can never complete"):
            s0.synchronize()                                 # rank 1 never called


# --- ordering mistakes the sanitizer reported in the GPU paths, fixed ---------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_split_on_a_given_stream_waits_for_the_batchs_producer(seed):
    from gpustrat.kernels.split import split, split_reference
    host = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    index_h = np.array([6, 0, 5, 1, 4, 2, 3], np.int64)
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        with cp.cuda.Device(2):
            producer, launch = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
            with producer:
                batch = cp.asarray(host) * 1
                index = cp.asarray(index_h) * 1
                res = split(batch, 3, index=index, stream=launch)
            got = [p.get(stream=launch) for p in res.pieces]
        assert not san.reports, san.reports
    want = split_reference(host, 3, index=index_h).pieces
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_launch_on_a_raw_stream_handle_allocates_from_that_streams_pool():
    from gpustrat.kernels.split import split
    with testing.sanitize(run_probability=0) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            current, other = cp.cuda.get_current_stream(), cp.cuda.Stream(non_blocking=True)
            batch = cp.asarray(np.ones((8, 4), np.float32))
            other.wait_event(current.record())
            for handle in (other.ptr, devices.numba_cuda().external_stream(other.ptr)):
                res = split(batch, 2, pad_to=4, stream=handle)
                del res
                gc.collect()
                # The split's output went back to the pool; the current stream allocating
                # the same size must not get a block the other stream may still write.
                cp.empty((2, 4, 4), np.float32)
        assert not san.reports, san.reports


def _two_gpu_step(strategy, cp):
    def step(x):
        ctx = gs.get_replica_context()
        grads = [x * 2, x.sum(axis=0), x[:1] + 1]
        return ctx.all_reduce("sum", grads)
    return step


@pytest.mark.parametrize("seed", SEEDS)
def test_run_with_collectives_has_no_host_wait_and_no_race(seed):
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:0", "gpu:1", "gpu:2"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full((4, 3), ctx.replica_id_in_sync_group + 1, np.float32))
            step = _two_gpu_step(s, cp)
            s.run(step, args=(x,))                        # warm up
            with san.measure() as c:
                out = s.run(step, args=(x,))
            for i, v in enumerate(s.experimental_local_results(out)):
                assert all(t.device.id == i for t in v)
                np.testing.assert_array_equal(v[0].get(), np.full((4, 3), 12.0))
                np.testing.assert_array_equal(v[1].get(), np.full((3,), 24.0))
                np.testing.assert_array_equal(v[2].get(), np.full((1, 3), 9.0))
        finally:
            s.close()
        assert c["host_syncs"] == 0, c["sync_sites"]
        assert c["nccl_calls"] == 3 * 1                   # one fused bucket, 3 replicas
    assert not san.reports


# --- a training step: distributed input, run with all_reduce of gradients, reduce ---------

def _train(strategy, steps: int, san, measure_from: int = 2):
    """A data-parallel step as users write it; returns the losses and the counts of the
    steps from ``measure_from`` on (the steady state)."""
    from gpustrat.data import Dataset
    cp = devices.cupy()
    n = strategy.num_replicas_in_sync
    rows = 4 * n
    data = np.arange(steps * rows * 3, dtype=np.float32).reshape(steps * rows, 3)
    weights = strategy.experimental_distribute_values_from_function(
        lambda ctx: np.ones((3,), np.float32))

    def step(x, w):
        ctx = gs.get_replica_context()
        y = x * w
        grads = [y.sum(axis=0), y.mean(axis=0) * 2, (y * 0 + 1).sum(axis=0)]
        reduced = ctx.all_reduce("sum", grads)
        return reduced[0].sum() + reduced[1].sum() * 0 + reduced[2].sum() * 0

    losses, counts = [], []
    dist = strategy.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(rows))
    for k, x in enumerate(dist):
        with san.measure() as c:
            loss = strategy.reduce("sum", strategy.run(step, args=(x, weights)), axis=None)
        losses.append(loss)
        if k >= measure_from:
            counts.append(c)
    assert all(isinstance(l, cp.ndarray) for l in losses)
    return [float(l.get()) for l in losses], counts, data


@pytest.mark.parametrize("seed", SEEDS)
def test_a_steady_training_step_has_no_host_synchronization(seed):
    with testing.sanitize(seed=seed) as san:
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            losses, counts, data = _train(s, 6, san)
        finally:
            s.close()
    rows = 8
    want = [float(data[k * rows:(k + 1) * rows].sum()) * 2 for k in range(6)]
    assert losses == want
    for c in counts:
        steps_threads = [t for t, _, _ in c["sync_sites"] if t != "gpustrat-placer"]
        assert steps_threads == [], c["sync_sites"]
        assert c["nccl_calls"] == 2 * 2     # one fused bucket and the loss, 2 replicas
    assert not san.reports


# --- split, scatter, pack and unpack, the staged path -------------------------------------

@pytest.mark.parametrize("seed", SEEDS)
def test_scatter_of_a_contiguous_batch_is_views_and_one_copy_per_piece(seed):
    from gpustrat.kernels.split import scatter, split_reference
    host = np.arange(7 * 2, dtype=np.int32).reshape(7, 2)
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            batch = cp.asarray(host) + 0          # written on gpu:1's current stream
            streams = []
            for d in (0, 1, 2):
                with cp.cuda.Device(d):
                    streams.append(cp.cuda.Stream(non_blocking=True))
            with san.measure() as c:
                res = scatter(batch, ["gpu:0", "gpu:1", "gpu:2"])
            assert c["launches"] == 0 and c["copies"] == 2 and c["host_syncs"] == 0
            assert res.pieces[1].data.ptr == batch[3:].data.ptr    # a view on its device
            got = [p.get() for p in res.pieces]
            # On a stream of its own, gpu:1's piece is one copy too: a view would stay in
            # the current stream's pool, which never waits for that stream's reads.
            with san.measure() as c:
                res = scatter(batch, ["gpu:0", "gpu:1", "gpu:2"], streams=streams)
            assert c["launches"] == 0 and c["copies"] == 3 and c["host_syncs"] == 0
            assert res.pieces[1].data.ptr != batch[3:].data.ptr
            got_on_streams = [p.get(stream=s) for p, s in zip(res.pieces, streams)]
    want = split_reference(host, 3).pieces
    assert [g.tolist() for g in got] == [w.tolist() for w in want]
    assert [g.tolist() for g in got_on_streams] == [w.tolist() for w in want]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pad_to", [None, 4], ids=["views", "kernel"])
def test_scatter_pieces_used_on_their_streams_are_not_reused_under_them(seed, pad_to):
    # The piece for the batch's own device was memory of the current stream's pool,
    # handed to streams[0]: dropped after work queued on streams[0] read it, it went
    # to the current stream's next allocation while that work might still read it.
    from gpustrat.kernels.split import scatter
    with testing.sanitize(seed=seed, run_probability=0, check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            batch = cp.asarray(np.arange(32, dtype=np.float32).reshape(8, 4)) * 1
            streams = []
            for d in (0, 1):
                with cp.cuda.Device(d):
                    streams.append(cp.cuda.Stream(non_blocking=True))
            res = scatter(batch, ["gpu:0", "gpu:1"], pad_to=pad_to, streams=streams)
            with streams[0]:
                y = res.pieces[0] * 2                  # the consumer, on its stream
            with cp.cuda.Device(1), streams[1]:
                y1 = res.pieces[1] * 2
                got1 = y1.get(stream=streams[1])
            del res, batch
            gc.collect()
            # The current stream allocates: the pool may hand out a freed block at once.
            reused = [cp.zeros((8, 4), np.float32), cp.zeros((2, 4, 4), np.float32)]
            got = (y.get(stream=streams[0]), got1)
        san.drain()
    assert not san.reports, [str(r) for r in san.reports[:2]]
    want = np.arange(32, dtype=np.float32).reshape(8, 4) * 2
    assert got[0].tolist() == want[:4].tolist() and got[1].tolist() == want[4:].tolist()
    del reused


@pytest.mark.parametrize("seed", SEEDS)
def test_a_copy_on_another_stream_of_the_arrays_device_is_not_reused_under(seed):
    # to_device(x, x's device, stream=s, copy=True) read x on s while x's block is the
    # current stream's, which never waited for s: dropping x let the current stream's
    # next allocation overwrite it while s still copied from it.
    with testing.sanitize(seed=seed, run_probability=0, check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s = cp.cuda.Stream(non_blocking=True)
            x = cp.asarray(np.arange(64, dtype=np.float32)) * 1     # the current stream
            y = devices.to_device(x, Device("gpu", 0), stream=s, copy=True)
            del x
            gc.collect()
            cp.zeros(64, np.float32)                 # the current stream reuses x's block
            got = y.get(stream=s)
        san.drain()
    assert not san.reports, [str(r) for r in san.reports[:2]]
    assert got.tolist() == list(range(64))


@pytest.mark.parametrize("seed", SEEDS)
def test_pack_and_unpack_kernels_match_their_references(seed):
    from gpustrat.kernels.pack import pack, pack_reference, unpack
    rng = np.random.default_rng(seed)
    hosts = [rng.standard_normal(s).astype(np.float32) for s in ((3,), (5, 2), (1,), (130,))]
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        with cp.cuda.Device(3):
            s = cp.cuda.Stream(non_blocking=True)
            tensors = [cp.asarray(h) for h in hosts]
            s.wait_event(cp.cuda.get_current_stream().record())
            buf = pack(tensors, scale=0.5, stream=s)
            outs = unpack(buf, [h.shape for h in hosts], stream=s)
            got = buf.get(stream=s), [o.get(stream=s) for o in outs]
        assert not san.reports
    np.testing.assert_array_equal(got[0], pack_reference(hosts, scale=0.5))
    for o, h in zip(got[1], hosts):
        np.testing.assert_array_equal(o, h * np.float32(0.5))


@pytest.mark.parametrize("seed", SEEDS)
def test_a_layout_launched_again_reuses_its_plan_and_reads_the_new_values(seed):
    # A training step packs the same tensors (the same addresses) every step with new
    # values in them: from the second step on, nothing is uploaded (no table) and each
    # launcher makes one launch, which reads what the step wrote, not what the plan's
    # first launch saw.
    from gpustrat.kernels.pack import pack, unpack
    from gpustrat.kernels.split import split
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        with cp.cuda.Device(2):
            tensors = [cp.zeros(s, np.float32) for s in ((3,), (4, 2), (1,))]
            outs = [cp.zeros_like(t) for t in tensors]
            batch, index = cp.zeros((6, 2), np.float32), cp.asarray(np.arange(6)[::-1].copy())
            got = []
            for step in range(3):
                for t in tensors:
                    t[...] = t * 0 + step                      # the step's gradients
                batch[...] = batch * 0 + step
                with san.measure() as c:
                    buf = pack(tensors, scale=0.5)
                    unpack(buf, [t.shape for t in tensors], out=outs)
                    pieces = split(batch, 2, index=index, check_index=False).pieces
                got.append(([o.get() for o in outs], [p.get() for p in pieces]))
                del buf, pieces    # the step is over: the pool hands the memory back
                if step:
                    assert c["launches"] == 3 and c["copies"] == 0, c    # no table upload
                    assert c["host_syncs"] == 0, c["sync_sites"]
    for step, (unpacked, pieces) in enumerate(got):
        assert all((o == step * 0.5).all() for o in unpacked)
        assert all((p == step).all() for p in pieces)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_host_staged_path_and_gathers_under_the_sanitizer(seed):
    with testing.sanitize(seed=seed, nccl=False) as san:
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            from gpustrat.collectives.staged import StagedCommunicator
            assert isinstance(s.communicator, StagedCommunicator)
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full((2, 2), ctx.replica_id_in_sync_group, np.float32))

            def step(v):
                ctx = gs.get_replica_context()
                return ctx.all_reduce("mean", [v + 1, v * 2]), ctx.all_gather(v, 0)
            out = s.run(step, args=(x,))
            (mean, doubled), gathered = s.experimental_local_results(out)[1]
            np.testing.assert_array_equal(mean.get(), np.full((2, 2), 1.5))
            np.testing.assert_array_equal(doubled.get(), np.full((2, 2), 1.0))
            np.testing.assert_array_equal(gathered.get()[:, 0], [0, 0, 1, 1])
        finally:
            s.close()
    assert not san.reports


# --- the sanitizer notices when an ordering mechanism is taken away ---------------------------

def _input_steps(san, steps=6):
    """Distributed input consumed by run; every step's pieces are freed at once."""
    from gpustrat.data import Dataset
    s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
    try:
        data = np.arange(steps * 8 * 3, dtype=np.float32).reshape(steps * 8, 3)
        sums = []     # read back at the end: a host read per step would order everything
        for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(8)):
            sums.extend(s.experimental_local_results(s.run(lambda v: (v * 2).sum(), args=(x,))))
            del x
            gc.collect()
        return sum(float(v.get()) for v in sums), float(data.sum() * 2)
    finally:
        s.close()


def test_placement_keeps_pieces_alive_and_waits_and_the_sanitizer_checks_both(monkeypatch):
    from gpustrat.distribute import placement
    with testing.sanitize(seed=0) as san:
        got, want = _input_steps(san)
    assert got == want and not san.reports

    def no_keep_alive(self, placed, ready):          # order the consumer, hold nothing
        cp = devices.cupy()
        for dev, ev in zip(self._devices, ready):
            with cp.cuda.Device(dev.index):
                cp.cuda.get_current_stream().wait_event(ev)
    monkeypatch.setattr(placement.Placer, "_hand_over", no_keep_alive)
    with testing.sanitize(seed=0, check=False) as san:
        _input_steps(san)
    assert _reports(san, "reuse")
    monkeypatch.setattr(placement.Placer, "_hand_over", lambda self, placed, ready: None)
    with testing.sanitize(seed=0, check=False) as san:
        _input_steps(san)
    assert _reports(san, "race")


def test_combining_off_the_replica_streams_would_race(monkeypatch):
    from gpustrat.distribute import runner
    init = runner.ReplicaRunner.__init__

    def without_streams(self, devs):
        init(self, devs)
        self.rendezvous.streams = None
    monkeypatch.setattr(runner.ReplicaRunner, "__init__", without_streams)
    with testing.sanitize(seed=0, check=False) as san:
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.ones((4, 3), np.float32))
            s.run(_two_gpu_step(s, None), args=(x,))
        finally:
            s.close()
    assert _reports(san, "race")


def test_a_collective_whose_peer_never_comes_times_out_in_the_watchdog():
    import time
    from gpustrat.collectives.nccl import NcclCommunicator
    from gpustrat.errors import CollectiveTimeout
    with testing.sanitize(seed=0, check=False) as san:
        cp = devices.cupy()
        comm = NcclCommunicator([Device("gpu", 0), Device("gpu", 1)], timeout=1.0)
        try:
            bufs = []
            for i in (0, 1):
                with cp.cuda.Device(i):
                    bufs.append(cp.ones((5,), np.float32))
            with san.measure() as c:
                comm.all_reduce(bufs, "sum")                # fine: returns without a wait
            assert c["host_syncs"] == 0 and c["nccl_calls"] == 2
            comm._comms[1].allReduce = lambda *a: None      # replica 1's peer is gone
            t0 = time.monotonic()
            comm.all_reduce(bufs, "sum")                    # still returns at once
            assert time.monotonic() - t0 < 1.0
            while comm._watchdog.failure is None and time.monotonic() - t0 < 10:
                time.sleep(0.02)
            with pytest.raises(CollectiveTimeout, match="did not complete within 1 s"):
                comm.all_reduce(bufs, "sum")
            assert all(c.aborted for c in comm._comms)
            san.drain()                                     # the abort ended the stuck call
        finally:
            comm.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_launch_on_another_stream_is_ordered_by_an_event_not_a_host_wait(seed):
    from gpustrat.kernels.pack import pack, unpack
    from gpustrat.kernels.split import split
    hosts = [np.arange(k + 2, dtype=np.float64) for k in range(3)]
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            other = cp.cuda.Stream(non_blocking=True)
            tensors = [cp.asarray(h) * 1 for h in hosts]        # on the current stream
            with san.measure() as c:
                buf = pack(tensors, stream=other)
                outs = unpack(buf, [h.shape for h in hosts], stream=other)
                with other:
                    total = tensors[0] + outs[0]
                gathered = split(tensors[2].reshape(4, 1), 2, index=cp.arange(4)[::-1],
                                 stream=other, check_index=False).pieces
                pieces = split(tensors[2].reshape(4, 1), 2, pad_to=3, stream=other).pieces
            assert c["host_syncs"] == 0, c["sync_sites"]
            got = ([o.get(stream=other) for o in outs], total.get(stream=other),
                   [p.get(stream=other) for p in pieces],
                   [p.get(stream=other) for p in gathered])
    assert [g.tolist() for g in got[0]] == [h.tolist() for h in hosts]
    assert got[1].tolist() == (hosts[0] * 2).tolist()
    assert [p.ravel().tolist() for p in got[2]] == [[0, 1, 0], [2, 3, 0]]
    assert [p.ravel().tolist() for p in got[3]] == [[3, 2], [1, 0]]


@pytest.mark.parametrize("seed", SEEDS)
def test_a_plain_gpu_array_argument_goes_to_each_replicas_device(seed):
    # Every replica once got the array itself: replica 1 read gpu:0's memory on its
    # stream of gpu:1, ordered only after gpu:1's current stream, not gpu:0's.
    with testing.sanitize(seed=seed, check=False) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        mixed = gs.MirroredStrategy(["gpu:2", "cpu:0"])
        try:
            x = cp.full((4,), 3.0, np.float32) * 1          # on gpu:0's current stream

            def fn(x, scale=None):
                return x, x * 2 + (0 if scale is None else scale["k"])
            same, out = s.run(fn, args=(x,))
            assert [v.device.id for v in out.values] == [0, 1]
            assert [v.device.id for v in same.values] == [0, 1]
            assert same.values[0] is x                      # used as is on its device
            got = [devices.to_host(v).tolist() for v in out.values]
            _, nested = s.run(fn, args=(x,), kwargs={"scale": {"k": x}})
            got_nested = [devices.to_host(v).tolist() for v in nested.values]
            _, elsewhere = mixed.run(fn, args=(x,))
            assert elsewhere.values[0].device.id == 2
            assert isinstance(elsewhere.values[1], np.ndarray)
            got_mixed = [devices.to_host(v).tolist() for v in elsewhere.values]
        finally:
            s.close()
            mixed.close()
        san.drain()
    assert not san.reports, [str(r) for r in san.reports[:2]]
    assert got == [[6.0] * 4] * 2 and got_mixed == [[6.0] * 4] * 2
    assert got_nested == [[9.0] * 4] * 2


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "staged"])
def test_mean_along_an_axis_on_gpus_matches_the_cpu_path_without_a_host_wait(seed, nccl):
    # MEAN along an axis divides the summed rows by the summed count, on the device:
    # a partial batch (4 + 2 rows) weighs every row the same, dtypes follow the CPU
    # path's rules (float stays, integers give float64), and nothing waits on the host.
    rng = np.random.default_rng(seed)
    cases = [(rng.standard_normal((4, 3)).astype(np.float32), 0, 2),
             (rng.standard_normal((5, 2)).astype(np.float16), 0, 5),
             (rng.integers(-9, 9, (3, 4)).astype(np.int32), 1, 1),
             ((rng.standard_normal((4, 2)) + 1j).astype(np.complex64), 0, 4),
             (rng.standard_normal((2, 3, 2)), 1, 0)]

    def run_all(s, cp):
        out = []
        for x, axis, rows in cases:
            def values(ctx, x=x, axis=axis, rows=rows):
                # replica 1 holds a partial batch of `rows` along the axis
                return x if ctx.replica_id_in_sync_group == 0 else \
                    np.take(x, range(rows), axis=axis)
            per = s.experimental_distribute_values_from_function(values)
            out.append(s.reduce("mean", per, axis=axis))
        return out
    cpu = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        want = run_all(cpu, np)
    finally:
        cpu.close()
    with testing.sanitize(seed=seed, nccl=nccl) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:1", "gpu:0"])
        try:
            run_all(s, cp)
            with san.measure() as c:
                got = run_all(s, cp)
            if nccl:   # the host-staged path reads every value to the host by design
                assert c["host_syncs"] == 0, c["sync_sites"]
            assert all(isinstance(g, cp.ndarray) and g.device.id == 1 for g in got)
            got = [devices.to_host(g) for g in got]
        finally:
            s.close()
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_host_values_go_to_a_gpu_without_a_host_wait():
    with testing.sanitize(seed=0) as san:
        with san.measure() as c:
            x = devices.to_device(np.arange(6.0).reshape(2, 3), Device("gpu", 1))
            y = devices.to_device(np.float32(2.5), Device("gpu", 2))    # 0-d stays 0-d
        assert c["host_syncs"] == 0, c["sync_sites"]
        assert x.device.id == 1 and y.shape == () and y.dtype == np.float32
        # Read on their own devices (CuPy's get() copies on the current device's stream).
        assert devices.to_host(x).tolist() == [[0, 1, 2], [3, 4, 5]]
        assert devices.to_host(y) == 2.5


def test_inputs_freed_after_a_failed_step_are_not_reused_under_a_running_replica():
    with testing.sanitize(seed=0, run_probability=0) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.ones((64,), np.float32))

            def step(v):
                y = v * 2                                   # reads v on the replica stream
                if gs.get_replica_context().replica_id_in_sync_group == 1:
                    raise ValueError("replica 1 fails")
                return y
            with pytest.raises(ValueError, match="replica 1 fails"):
                s.run(step, args=(x,))
            del x
            gc.collect()
            with cp.cuda.Device(1):
                cp.full((64,), 3.0, dtype=np.float32)       # the caller reuses v's block
        finally:
            s.close()
    assert not san.reports


def test_bench_gpu_runs_on_the_sanitizer_and_counts_no_host_wait_per_step(capsys):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--sanitizer"])
    out = capsys.readouterr().out
    assert "cupy: batch[index]: ok" in out and "pack (1000 tensors): ok" in out
    assert "the optimizer step's weights match the hand-written update: ok" in out
    counts = result["step_counts"]
    assert len(counts) == 6
    assert all(c["host_syncs_step_threads"] == 0 and c["nccl_calls"] == 4 for c in counts)


def test_the_watchdog_stops_with_its_communicator():
    import time
    from gpustrat.collectives.nccl import NcclCommunicator
    with testing.sanitize(seed=0):
        cp = devices.cupy()
        comm = NcclCommunicator([Device("gpu", 0), Device("gpu", 1)])
        bufs = []
        for i in (0, 1):
            with cp.cuda.Device(i):
                bufs.append(cp.ones((3,), np.float32))
        out = comm.all_reduce(bufs, "sum")
        assert devices.to_host(out[1]).tolist() == [2, 2, 2]
        thread = comm._watchdog._thread
        assert thread.is_alive()
        del comm, out
        gc.collect()
        thread.join(timeout=5)
        assert not thread.is_alive()


def test_collectives_cost_their_caller_no_event_and_the_watchdog_one_per_stream_for_a_burst():
    import time
    from gpustrat.collectives.nccl import NcclCommunicator
    with testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        comm = NcclCommunicator([Device("gpu", 0), Device("gpu", 1)])
        try:
            streams = []
            bufs = []
            for i in (0, 1):
                with cp.cuda.Device(i):
                    streams.append(cp.cuda.Stream(non_blocking=True))
            with devices.current_stream(Device("gpu", 0), streams[0]), \
                    devices.current_stream(Device("gpu", 1), streams[1]):
                for i in (0, 1):
                    with cp.cuda.Device(i):
                        bufs.append(cp.ones((5,), np.float32))
                comm.all_reduce(bufs, "sum")           # starts the watchdog
                time.sleep(0.05)
                # While the watchdog cannot record (the lock a capture takes), ten
                # collectives record nothing on the caller's side.
                with devices.capture_lock:
                    with san.measure() as c:
                        for _ in range(10):
                            out = comm.all_reduce(bufs, "sum")
                    assert c["nccl_calls"] == 20 and c["event_records"] == 0
                    assert c["event_waits"] == 0 and c["host_syncs"] == 0
                with san.measure() as c:
                    t0 = time.monotonic()
                    while comm._watchdog._pending and time.monotonic() - t0 < 10:
                        time.sleep(0.005)
                    time.sleep(0.05)
                # The burst: one event per stream (two batches at most: the one the
                # watchdog held when the lock was taken, and the ten).
                assert 2 <= c["event_records"] <= 4
                assert comm._watchdog.failure is None
                assert devices.to_host(out[1]).tolist() == [2.0] * 5
        finally:
            comm.close()


def test_an_event_recorded_on_a_stream_of_another_device_is_refused_as_cuda_does():
    with testing.sanitize(seed=0):
        cp = devices.cupy()
        with cp.cuda.Device(1):
            other = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.Device(0):
            ev = cp.cuda.Event(disable_timing=True)
            with pytest.raises(RuntimeError, match="made on device 0 recorded on a stream "
                                                   "of device 1"):
                ev.record(other)
            ev.record(cp.cuda.get_current_stream())     # device 0's null stream: fine
        with cp.cuda.Device(1):
            with pytest.raises(RuntimeError, match="recorded on a stream of device 1"):
                ev.record(cp.cuda.get_current_stream())  # handle 0 is device 1's here
        # Another device current does not matter for a stream of the event's own.
        with cp.cuda.Device(0):
            mine = cp.cuda.Stream(non_blocking=True)
        with cp.cuda.Device(1):
            ev.record(mine)


def test_the_watchdog_holds_a_collectives_memory_but_not_its_arrays_or_lists():
    # Plans reuse a buffer (a gradient arena, a fusion buffer) when nothing but the plan
    # refers to it: a watchdog holding the arrays, or a list of them, would defeat that.
    import sys
    from gpustrat.collectives.nccl import NcclCommunicator
    with testing.sanitize(seed=0):
        cp = devices.cupy()
        comm = NcclCommunicator([Device("gpu", 0), Device("gpu", 1)])
        try:
            bufs = []
            for i in (0, 1):
                with cp.cuda.Device(i):
                    bufs.append(cp.ones((6,), np.float32))
            comm.all_reduce_inplace(bufs, "sum")
            before = [sys.getrefcount(bufs)] + [sys.getrefcount(b) for b in bufs]
            with devices.capture_lock:        # the watchdog holds the next one meanwhile
                comm.all_reduce_inplace(bufs, "sum")
                comm.all_reduce(bufs, "max")
                assert len(comm._watchdog._pending) >= 1
                after = [sys.getrefcount(bufs)] + [sys.getrefcount(b) for b in bufs]
            assert after == before
            assert devices.to_host(bufs[1]).tolist() == [4.0] * 6
        finally:
            comm.close()


def test_bench_gpus_optimizer_row_refuses_weights_that_differ_from_the_hand_written_update(
        monkeypatch):
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_rows", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shapes = [(4, 3), (3,)]
    with testing.sanitize(seed=0):
        row = bench.optimizer_rows(devices.cupy(), shapes, 2, timed=False)
        assert row["tensors"] == 2 and row["parameters"] == 15
        # An optimizer whose rate is not the hand-written one's is caught.
        real_sgd = gs.optimizers.SGD
        monkeypatch.setattr(gs.optimizers, "SGD",
                            lambda lr, **kw: real_sgd(lr * 2, **kw))
        with pytest.raises(AssertionError, match="differ by up to"):
            bench.optimizer_rows(devices.cupy(), shapes, 2, timed=False)
