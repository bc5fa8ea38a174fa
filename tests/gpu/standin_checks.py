"""Checks of the stand-in backend (gpustrat.testing.stand_in), each run by
test_standin.py in a child process whose PYTHONPATH selects the real CuPy 14 and NCCL
wheels (``python tests/conformance/install_cupy.py``): the test process itself never
imports CuPy.

    PYTHONPATH=.conformance/cupy14:.conformance/nccl:. python tests/gpu/standin_checks.py NAME
"""

from __future__ import annotations

import sys
import threading

import numpy as np

import gpustrat as gs
from gpustrat import devices, testing

F32 = np.float32
GPUS = ["gpu:0", "gpu:1", "gpu:2", "gpu:3"]


def check_arrays_are_real_cupy_arrays_and_operations_count_launches():
    import cupy
    with testing.stand_in(num_devices=2) as gpus:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            a = cp.zeros((3, 4), F32)
            b = cp.ones((4,), F32)
        assert isinstance(a, cupy.ndarray) and isinstance(a, cp.ndarray)
        assert devices.is_gpu_array(a) and devices.device_of(a).index == 1
        with gpus.measure() as c:
            v = a[1:, ::2]                         # views: CuPy's own code, no launch
            r = a.reshape(12)
            t = a.T
        assert (v.shape, r.shape, t.shape) == ((2, 2), (12,), (4, 3))
        assert type(v) is cp.ndarray and v.data.ptr == a.data.ptr + 16
        assert c["launches"] == 0 and c["allocations"] == 0
        with gpus.measure() as c, cp.cuda.Device(1):
            s = a + b                              # broadcast
            h = a * 0.5                            # a Python float keeps float32
            w = a * np.float64(2)                  # a NumPy float64 does not
            q = cp.arange(6, dtype=np.int32).reshape(2, 3) / 2
            m = a @ cp.zeros((4, 5), F32)
            e = a == 0
            red = a.sum(axis=0)
            keep = a.mean(axis=1, keepdims=True)
            tot = a.sum()
            sq = cp.sqrt(a)
            wh = cp.where(e, a, 0.0)
            g = cp.exp(a)                          # any NumPy ufunc by name
            cast = a.astype(np.float16)
        assert (s.shape, s.dtype) == ((3, 4), F32)
        assert h.dtype == F32 and w.dtype == np.float64 and q.dtype == np.float64
        assert m.shape == (3, 5) and e.dtype == np.bool_
        assert red.shape == (4,) and keep.shape == (3, 1) and tot.shape == ()
        assert sq.shape == wh.shape == g.shape == (3, 4) and cast.dtype == np.float16
        assert all(x.device.id == 1 for x in (s, h, m, red, tot, cast))
        assert c["launches"] == 13 and c["host_syncs"] == 0
        with gpus.measure() as c, cp.cuda.Device(1):
            before = a.data.ptr
            a += b                                 # in place: no allocation
            a *= 2
        assert a.data.ptr == before and c["launches"] == 2 and c["allocations"] == 0
        with gpus.measure() as c:
            idx = cp.zeros((2,), np.int64)
            shapes = [x.shape for x in (cp.concatenate([a, a], axis=1), cp.stack([a, a], axis=1),
                                        a.take(idx, axis=1), a[idx], a.T.ravel(),
                                        cp.broadcast_to(b, (2, 3, 4)), cp.moveaxis(a, 0, 1))]
        assert shapes == [(3, 8), (3, 2, 4), (3, 2), (2, 4), (12,), (2, 3, 4), (4, 3)], shapes
        assert c["host_syncs"] == 0
        with gpus.measure() as c:
            a[a > 0]                               # the result's size is on the device
        assert c["host_syncs"] == 1
        with cp.cuda.Device(1):
            b + a                                  # broadcasts; in place it cannot
        try:
            b += a
        except ValueError as err:
            assert "broadcast" in str(err)
        else:
            raise AssertionError("b += a wrote a (3, 4) result into a (4,) array")
        try:
            a += cp.zeros((5,), F32)
        except ValueError as err:
            assert "broadcast" in str(err)
        else:
            raise AssertionError("a non-broadcastable in-place operation was accepted")
        try:
            np.asarray(a)
        except TypeError as err:
            assert "get()" in str(err)
        else:
            raise AssertionError("an implicit conversion to NumPy was accepted")


def check_host_synchronizations_are_counted_with_their_sites():
    with testing.stand_in(num_devices=2) as gpus:
        cp = devices.cupy()
        x = cp.zeros((4,), F32)
        pinned = devices.pinned_empty((4,), F32)
        s = cp.cuda.Stream(non_blocking=True)
        with gpus.measure() as c:
            x.get(stream=s, out=pinned, blocking=False)      # asynchronous: no wait
            x.set(pinned, stream=s)                          # from pinned memory
            devices.to_host_async(x, pinned)
        assert c["host_syncs"] == 0 and c["copies"] == 3, c
        with gpus.measure() as c:
            host = x.get()
            float(x.sum())
            cp.asnumpy(x)
            x.set(np.zeros(4, F32))                          # from pageable memory
            s.synchronize()
            cp.cuda.Event().synchronize()
            cp.cuda.Device(1).synchronize()
        assert c["host_syncs"] == 7, c
        assert isinstance(host, np.ndarray) and host.shape == (4,) and not host.any()
        sites = c["sync_sites"]
        assert [what for _, what, _ in sites][:2] == ["get", "item"]
        assert all("standin_checks.py" in site for _, _, site in sites), sites
        gpus.reset()
        assert not any(gpus.counts().values()) and gpus.sync_sites == []


def check_devices_streams_and_events_are_per_thread_and_counted():
    with testing.stand_in(num_devices=4) as gpus:
        cp = devices.cupy()
        seen = {}
        with gpus.measure() as c:
            with cp.cuda.Device(2):
                s = cp.cuda.Stream(non_blocking=True)
                with s:
                    assert cp.cuda.get_current_stream() is s
                    y = cp.empty((2,), F32)

                    def other():
                        seen["device"] = cp.cuda.Device().id
                        seen["stream"] = cp.cuda.get_current_stream().ptr
                    t = threading.Thread(target=other)
                    t.start()
                    t.join()
                    ev = s.record()                  # CuPy's record: a timing event
                    quiet = cp.cuda.Event(disable_timing=True)
                    quiet.record(s)
                    cp.cuda.get_current_stream().wait_event(ev)
                assert cp.cuda.get_current_stream().ptr == 0
            assert cp.cuda.Device().id == 0
        assert seen == {"device": 0, "stream": 0}          # another thread: its own state
        assert y.device.id == 2
        assert (c["device_enters"], c["stream_creations"], c["event_creations"],
                c["timing_events"], c["event_records"], c["event_waits"]) == (1, 1, 2, 1, 2, 1)
        from gpustrat.devices import Device
        with gpus.measure() as c:
            moved = devices.to_device(y, Device("gpu", 3))     # a peer copy, events only
            host = devices.to_device(np.zeros(3, F32), Device("gpu", 1))
        assert moved.device.id == 3 and moved.shape == (2,) and host.device.id == 1
        assert c["host_syncs"] == 0 and c["copies"] == 2 and c["event_waits"] == 2, c
        with cp.cuda.Device(0):
            try:
                s.__enter__()
            except RuntimeError as err:
                assert "differ" in str(err)
            else:
                raise AssertionError("a stream of gpu:2 was entered on gpu:0")
        try:
            cp.cuda.Device(4)
        except RuntimeError as err:
            assert "gpu:4" in str(err)
        else:
            raise AssertionError("gpu:4 of 4 stand-in GPUs was accepted")


def check_the_pool_hands_a_freed_block_out_again_and_live_blocks_never_overlap():
    with testing.stand_in(num_devices=2) as gpus:
        cp = devices.cupy()
        live = [cp.empty((n,), F32) for n in (1, 100, 128, 129, 1000)]
        with cp.cuda.Device(1):
            live.append(cp.empty((100,), F32))
        spans = sorted((a.data.ptr, a.data.ptr + a.nbytes) for a in live)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans
        assert all(a.data.ptr % 512 == 0 for a in live)
        assert live[-1].data.device_id == 1
        ptr = live[2].data.ptr
        view = live[2][3:]
        del live[2]
        assert cp.empty((128,), F32).data.ptr != ptr          # a view keeps it alive
        del view
        assert cp.empty((100,), F32).data.ptr == ptr          # the same rounded size
        assert gpus.counts()["allocations"] == 8


def check_nccl_numba_and_cupy_kernel_calls_are_counted():
    from gpustrat.kernels import pack
    with testing.stand_in(num_devices=2) as gpus:
        cp = devices.cupy()
        nccl = devices.nccl_library()
        comms = nccl.NcclCommunicator.initAll([0, 1])
        bufs = []
        for i in range(2):
            with cp.cuda.Device(i):
                bufs.append(cp.zeros((8,), F32))
        with gpus.measure() as c:
            nccl.groupStart()
            for i, comm in enumerate(comms):
                with cp.cuda.Device(i):
                    comm.allReduce(bufs[i].data.ptr, bufs[i].data.ptr, 8, nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
            nccl.groupEnd()
        assert (c["nccl_calls"], c["nccl_groups"]) == (2, 1)
        assert [comm.device_id() for comm in comms] == [0, 1]
        with cp.cuda.Device(1):
            parts = [cp.zeros((5,), F32), cp.zeros((3, 2), F32)]
        with gpus.measure() as c:
            flat = pack.pack(parts)
        assert c["kernel_launches"] >= 1 and c["host_syncs"] == 0, c
        assert flat.shape == (11,) and flat.device.id == 1
        # CuPy's own user kernels: launches counted, outputs shaped, no compilation.
        with gpus.measure() as c, cp.cuda.Device(1):
            cp.RawKernel("extern \"C\" __global__ void f(float* x) {}", "f")(
                (1,), (32,), (parts[0],))
            cp.RawModule(code="...").get_function("g")((1,), (32,), (parts[0], 5))
            add = cp.ElementwiseKernel("float32 x, float32 y", "float64 z", "z = x + y", "add")
            z = add(parts[1], parts[1])
            total = cp.ReductionKernel("float32 x", "float64 y", "x", "a + b", "y = a", "0",
                                       "total")(parts[1], axis=1)

            @cp.fuse()
            def axpy(a, x, y):
                return a * x + y
            fused = axpy(np.float32(2), parts[1], parts[1])
            mem = cp.cuda.alloc(100)
        assert (c["kernel_launches"], c["launches"], c["host_syncs"]) == (5, 5, 0)
        assert z.shape == (3, 2) and z.dtype == np.float64 and z.device.id == 1
        assert total.shape == (3,) and total.dtype == np.float64
        assert fused.shape == (3, 2) and fused.dtype == np.float32
        assert mem.device_id == 1 and mem.ptr % 512 == 0
        assert cp.cuda.Stream.null.ptr == 0


def check_a_steady_mirrored_training_step_runs_and_is_counted():
    with testing.stand_in(num_devices=4) as gpus:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(GPUS)
        shapes = [(8, 4), (4,), (4, 2), (2,)]
        with strategy.scope():
            variables = [gs.Variable(np.zeros(s, F32)) for s in shapes]
            sgd = gs.optimizers.SGD(0.1, momentum=0.9)
            adam = gs.optimizers.Adam(0.01)

        def step(opt, buffers):
            if buffers:
                grads = opt.gradient_buffers(variables)
                for g in grads:
                    g[...] = 1.0
            else:
                grads = [cp.full(s, 1.0, F32) for s in shapes]
            summed = gs.distribute.get_replica_context().all_reduce("sum", grads)
            assert [g.shape for g in summed] == shapes
            opt.apply_gradients(zip(grads, variables))
            return cp.full((), 1.0, F32)

        for opt in (sgd, adam):
            for buffers in (False, True):
                for _ in range(2):                 # the first step plans
                    loss = strategy.run(step, args=(opt, buffers))
                with gpus.measure() as c:
                    loss = strategy.run(step, args=(opt, buffers))
                    total = strategy.reduce("sum", loss, axis=None)
                assert c["host_syncs"] == 0, c["sync_sites"]
                assert c["nccl_calls"] >= 4 and c["launches"] > 0, c
                assert devices.is_gpu_array(total) and total.shape == ()
        # Values are not computed: reading one back is a host synchronization of zeros.
        with gpus.measure() as c:
            assert int(sgd.iterations.numpy()) == 0
        assert c["host_syncs"] == 1


def check_a_loss_scaled_step_reads_one_number_back_whatever_its_tensors():
    with testing.stand_in(num_devices=4) as gpus:
        cp = devices.cupy()
        strategy = gs.MirroredStrategy(GPUS)
        layouts = {"float32": [((8, 4), F32), ((4,), F32), ((4, 2), F32)],
                   "float32 and float16": [((8, 4), F32), ((4,), F32), ((4, 2), np.float16),
                                           ((2,), np.float16)]}
        for label, layout in layouts.items():
            with strategy.scope():
                variables = [gs.Variable(np.zeros(s, d)) for s, d in layout]
                opt = gs.optimizers.LossScaleOptimizer(gs.optimizers.SGD(0.1))

            def step(buffers):
                if buffers:
                    grads = opt.gradient_buffers(variables)
                    for g in grads:
                        g[...] = 1.0
                else:
                    grads = [cp.full(s, 1.0, d) for s, d in layout]
                opt.apply_gradients(zip(grads, variables))

            for buffers in (False, True):
                for _ in range(2):                 # the first step plans
                    strategy.run(step, args=(buffers,))
                with gpus.measure() as c:
                    strategy.run(step, args=(buffers,))
                # The skip decision: one number for the whole step, not one per tensor
                # or per bucket.
                assert c["host_syncs"] == 1, (label, buffers, c["sync_sites"])
                assert c["nccl_calls"] >= 4, c


def check_the_demo_step_runs():
    from gpustrat import demo
    with testing.stand_in(num_devices=4) as gpus:
        strategy = gs.MirroredStrategy(GPUS)
        x, y = demo.make_dataset(256, 8, 0, np.float64)
        init = demo.init_weights(8, 16, 1, 0, np.float64)
        weights, optimizer, train_loss = demo.build_model(strategy, init, 0.1, np.float64)
        dist = strategy.experimental_distribute_dataset(
            gs.data.Dataset.from_tensor_slices((x, y)).batch(64))
        step = demo.make_train_step(weights, optimizer, train_loss)
        with gpus.measure() as c:
            for batch in dist:
                strategy.run(step, args=(batch,))
        assert c["nccl_calls"] > 0 and c["launches"] > 0, c


def check_without_cupy_the_error_says_how_to_install_it():
    try:
        with testing.stand_in():
            pass
    except RuntimeError as err:
        msg = str(err)
        assert "install_cupy.py" in msg and "GPUSTRAT_CONFORMANCE_DIR" in msg, msg
    else:
        raise AssertionError("the stand-in started without CuPy")


def check_a_modelled_launch_cost_is_spent_per_launch():
    import time
    with testing.stand_in(num_devices=1, launch_us=200) as gpus:
        cp = devices.cupy()
        a = cp.zeros((4,), F32)
        t0 = time.thread_time()
        for _ in range(10):
            a += 1
        spent = time.thread_time() - t0
        assert spent >= 10 * 200e-6, spent
        assert gpus.counts()["launches"] == 10
    from gpustrat.kernels import pack
    with testing.stand_in(num_devices=1, numba_launch_us=300) as gpus:
        cp = devices.cupy()
        parts = [cp.zeros((5,), F32), cp.zeros((3,), F32)]
        with gpus.measure() as c:
            t0 = time.thread_time()
            pack.pack(parts)
            spent = time.thread_time() - t0
        assert spent >= c["kernel_launches"] * 300e-6 and c["kernel_launches"] >= 1, (spent, c)
    try:
        testing.stand_in(launch_us=-1).__enter__()
    except ValueError as err:
        assert "launch_us" in str(err)
    else:
        raise AssertionError("a negative launch cost was accepted")


CHECKS = {name[len("check_"):]: fn for name, fn in dict(globals()).items()
          if name.startswith("check_")}

if __name__ == "__main__":
    CHECKS[sys.argv[1]]()
    print("ok")
