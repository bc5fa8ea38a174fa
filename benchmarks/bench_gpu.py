"""Check and time the GPU paths end to end: kernels, NCCL collectives, fusion.

1. Kernels (split, gather+split, fixed-shape split, pack, unpack):
   each result is checked against its NumPy reference, then timed with CUDA events
   and reported as effective bandwidth (bytes read + written per second) next to a
   device-to-device copy of the same bytes. Target: split and pack at least 85% of
   the copy.
2. Collectives over every visible GPU with the NCCL communicator (or the host-staged
   one with ``--staged``), checked against NumPy, in an nccl-tests style table: size,
   count, dtype, time, algbw, busbw (busbw factors as in nccl-tests: all_reduce
   2(n-1)/n, all_gather and reduce_scatter (n-1)/n, broadcast 1).

Each kernel row has a CuPy-native row beside it (``cupy: ...``): the one CuPy call
that does the same (fancy indexing, ``concatenate``), so a kernel is kept only where
it wins (the sum of K buffers did not, and is CuPy's ``a + b + ...`` now). The host
cost of a launch alone, without a GPU, is ``benchmarks/bench_launch.py``.

3. A ResNet-50-layout optimizer step on 1 GPU (161 tensors, 25.6 M parameters, SGD with
   momentum): ``apply_gradients`` in ``strategy.run`` against the same update written
   by hand in CuPy (three operations per tensor), steps per second with the clock
   stopped when the device has finished; the weights of both are checked equal.
   Target: at least 0.9x the hand-written throughput. (The demo's step beside its
   hand-written CuPy step is ``benchmarks/bench_function.py``'s GPU row, run here too.)
4. Per training step (distributed input, ``run`` with an all-reduce of gradients,
   ``reduce`` of the loss), the stream-ordering sanitizer's counts: host
   synchronizations, launches, copies, NCCL calls. ``--sanitizer`` runs the whole
   benchmark on the sanitizer's fake GPUs (no timings: correctness and counts only),
   which is what a machine without a GPU can run.

Without a GPU (or CuPy) and without ``--sanitizer`` it prints why and exits 0.

    python benchmarks/bench_gpu.py [--quick] [--staged] [--sanitizer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

COPY_TARGET = 0.85
OPTIMIZER_HAND = "ResNet-50-layout SGD momentum step on 1 GPU vs hand-written CuPy"
OPTIMIZER_TARGET = 0.9


def _gpu_or_reason():
    try:
        from gpustrat.devices import cupy, gpu_count
        if gpu_count() == 0:
            return None, "no CUDA GPU is visible (or CuPy is not installed)"
        from numba import cuda
        if not cuda.is_available():
            return None, "numba.cuda finds no usable CUDA driver"
        return cupy(), None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def time_gpu(cp, fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on the current stream, timed with CUDA events."""
    for _ in range(warmup):
        fn()
    cp.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def time_kernel(cp, fn, repeats: int, inner: int = 8, warmup: int = 3):
    """``(alone, queued, host)`` seconds per call of ``fn()``: ``alone`` is one call
    between two CUDA events (its launch cost included, the GPU idle while Python
    prepares it); ``queued`` is ``inner`` calls back to back between two events, per
    call (the GPU's time when calls queue up, as in a training loop); ``host`` is the
    Python time per call in that loop. Medians over ``repeats``."""
    import time
    alone = time_gpu(cp, fn, repeats, warmup)
    queued, host = [], []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        host.append((time.perf_counter() - t0) / inner)
        stop.record()
        stop.synchronize()
        queued.append(cp.cuda.get_elapsed_time(start, stop) / 1e3 / inner)
    return alone, float(np.median(queued)), float(np.median(host))


def _check(name, got, want):
    got = [g.get() for g in got] if isinstance(got, (list, tuple)) else [got.get()]
    want = want if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want):
        if g.shape != w.shape or not np.array_equal(g, w):
            raise AssertionError(f"{name}: the GPU result differs from the NumPy reference")


def _launch_only(cp, plans, out=None):
    """A call that launches the kernel of the newest plan in ``plans`` (a launcher's
    ``_launch.Plans``) again, writing ``out`` where the plan takes its output at each
    launch: the kernel's own speed, without its launcher's Python."""
    from gpustrat.kernels import _launch
    plan = next(reversed(plans._plans.values()))
    args = plan.args
    if out is not None:
        args = args[:plan.slot] + (_launch.word(cp, out.data.ptr),) + args[plan.slot + 1:]
    return lambda: plan.function(plan.grid, plan.block, args)


def bench_kernels(cp, nbytes: int, repeats: int) -> list[dict]:
    from gpustrat.kernels.pack import pack, pack_reference, unpack, unpack_reference
    from gpustrat.kernels import pack as pack_mod, split as split_mod
    from gpustrat.kernels.split import split, split_reference
    rows = []
    rng = np.random.default_rng(0)
    n_rows, width = nbytes // (4 * 256), 256
    host = rng.standard_normal((n_rows, width)).astype(np.float32)
    batch = cp.asarray(host)
    dst = cp.empty_like(batch)
    copy_s = time_kernel(cp, lambda: dst.data.copy_from_device_async(
        batch.data, batch.nbytes), repeats)

    def row(name, times, moved):
        # Bandwidth from the queued time: the GPU's own speed, the launch overlapped.
        alone, queued, host = times
        seconds, copy = max(queued, 1e-12), max(copy_s[1], 1e-12)   # 0 on fake GPUs
        bw = moved / seconds / 1e9
        copy_bw = 2 * batch.nbytes / copy / 1e9
        rows.append({"kernel": name, "bytes": int(moved // 2), "time_us": seconds * 1e6,
                     "alone_us": alone * 1e6, "host_us": host * 1e6,
                     "GB_s": bw, "copy_GB_s": copy_bw, "vs_copy": bw / copy_bw})

    row("d2d copy", copy_s, 2 * batch.nbytes)
    replicas = 4
    res = split(batch, replicas)
    _check("split", res.pieces, split_reference(host, replicas).pieces)
    row("split", time_kernel(cp, lambda: split(batch, replicas), repeats), 2 * batch.nbytes)
    row("cupy: split = views + copy", time_kernel(cp, lambda: [
        batch[a:a + c].copy() for a, c in zip(
            np.cumsum([0] + split_reference(host[:, :1], replicas).counts[:-1]),
            split_reference(host[:, :1], replicas).counts)], repeats), 2 * batch.nbytes)
    index_h = rng.permutation(n_rows)
    index = cp.asarray(index_h)
    _check("gather split", split(batch, replicas, index=index).pieces,
           split_reference(host, replicas, index=index_h).pieces)
    row("split+gather", time_kernel(cp, lambda: split(batch, replicas, index=index,
                                                   check_index=False), repeats),
        2 * batch.nbytes)
    row("cupy: batch[index]", time_kernel(cp, lambda: batch[index], repeats), 2 * batch.nbytes)
    chunk = split_mod.split_sizes(n_rows, replicas)[0]
    gathered = cp.empty((replicas, chunk, width), np.float32)
    row("split+gather kernel alone", time_kernel(cp, _launch_only(cp, split_mod._plans,
                                                                  gathered), repeats),
        2 * batch.nbytes)
    pad = -(-n_rows // replicas) + 1
    _check("fixed-shape split", split(batch, replicas, pad_to=pad).pieces,
           split_reference(host, replicas, pad_to=pad).pieces)
    row("split fixed-shape", time_kernel(cp, lambda: split(batch, replicas, pad_to=pad),
                                      repeats), 2 * batch.nbytes)
    # Pack: 1,000 tensors of nbytes / 1000 each (fusion-sized pieces).
    per = max(nbytes // 4 // 1000, 1)
    tensors_h = [rng.standard_normal(per).astype(np.float32) for _ in range(1000)]
    tensors = [cp.asarray(t) for t in tensors_h]
    buf = pack(tensors)
    _check("pack", buf, pack_reference(tensors_h))
    _check("pack scaled", pack(tensors, scale=0.5), pack_reference(tensors_h, scale=0.5))
    out = cp.empty_like(buf)
    row("pack (1000 tensors)", time_kernel(cp, lambda: pack(tensors, out=out), repeats),
        2 * buf.nbytes)
    row("pack kernel alone", time_kernel(cp, _launch_only(cp, pack_mod._pack_plans),
                                         repeats), 2 * buf.nbytes)
    row("cupy: concatenate", time_kernel(cp, lambda: cp.concatenate(
        [t.ravel() for t in tensors]), repeats), 2 * buf.nbytes)
    shapes = [t.shape for t in tensors_h]
    outs = [cp.empty_like(t) for t in tensors]
    _check("unpack", unpack(buf, shapes), unpack_reference(pack_reference(tensors_h), shapes))
    row("unpack (1000 tensors)", time_kernel(cp, lambda: unpack(buf, shapes, out=outs),
                                          repeats), 2 * buf.nbytes)
    return rows


def step_counts(steps: int = 6, replicas: int = 2) -> list[dict]:
    """The sanitizer's counts for each step of a small training loop on fake GPUs."""
    import gpustrat as gs
    from gpustrat import testing
    from gpustrat.data import Dataset
    out = []
    with testing.sanitize(seed=0) as san:
        s = gs.MirroredStrategy([f"gpu:{i}" for i in range(replicas)])
        rows = 4 * replicas
        data = np.arange(steps * rows * 8, dtype=np.float32).reshape(steps * rows, 8)
        w = s.experimental_distribute_values_from_function(
            lambda ctx: np.ones((8,), np.float32))

        def step(x, w):
            y = x * w
            grads = [y.sum(axis=0), y.mean(axis=0), y.max(axis=0)]
            reduced = gs.get_replica_context().all_reduce("mean", grads)
            return reduced[0].sum()
        for x in s.experimental_distribute_dataset(Dataset.from_tensor_slices(data).batch(rows)):
            with san.measure() as c:
                s.reduce("mean", s.run(step, args=(x, w)), axis=None)
            sites = c.pop("sync_sites")
            c["host_syncs_step_threads"] = sum(t != "gpustrat-placer" for t, _, _ in sites)
            out.append(c)
        s.close()
    return out


def print_step_counts(counts: list[dict]) -> None:
    print(f"\nper training step ({len(counts)} steps, 2 replicas; sanitizer counts)")
    keys = ("host_syncs_step_threads", "host_syncs", "launches", "copies", "nccl_calls",
            "event_waits", "allocations")
    print("step " + " ".join(f"{k:>24}" for k in keys))
    for i, c in enumerate(counts):
        print(f"{i:>4} " + " ".join(f"{c.get(k, 0):>24}" for k in keys))


BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "reduce_scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def bench_collectives(cp, staged: bool, sizes, repeats: int) -> list[dict]:
    from gpustrat.collectives.host import HostCommunicator
    from gpustrat.devices import Device, gpu_count
    n = gpu_count()
    devices = [Device("gpu", i) for i in range(n)]
    if staged:
        from gpustrat.collectives.staged import StagedCommunicator
        comm = StagedCommunicator(devices, HostCommunicator(devices))
        name = "staged"
    else:
        from gpustrat.collectives.nccl import NcclCommunicator, is_available
        if not is_available():
            print("NCCL: cupy.cuda.nccl is not available; rerun with --staged")
            return []
        comm = NcclCommunicator(devices)
        name = "nccl"
    rows = []
    rng = np.random.default_rng(1)
    for nbytes in sizes:
        count = max(nbytes // 4 // n * n, n)
        host = [rng.integers(-8, 8, count).astype(np.float32) for _ in range(n)]
        bufs = []
        for i, h in enumerate(host):
            with cp.cuda.Device(i):
                bufs.append(cp.asarray(h))
        total = np.sum(host, axis=0, dtype=np.float32)
        checks = {
            "all_reduce": (lambda: comm.all_reduce(bufs, "sum"), [total] * n),
            "all_gather": (lambda: comm.all_gather(bufs, 0), [np.concatenate(host)] * n),
            "reduce_scatter": (lambda: comm.reduce_scatter(bufs, "sum"),
                               list(np.split(total, n))),
            "broadcast": (lambda: comm.broadcast(bufs, 0), [host[0]] * n),
        }
        for op, (fn, want) in checks.items():
            _check(f"{name} {op}", fn(), want)
            t = time_gpu(cp, fn, repeats)
            size = count * 4 if op != "all_gather" else count * 4 * n
            algbw = size / t / 1e9
            rows.append({"comm": name, "op": op, "size": size, "count": count,
                         "dtype": "float32", "time_us": t * 1e6, "algbw": algbw,
                         "busbw": algbw * BUS_FACTOR[op](n), "gpus": n})
    comm.close()
    return rows


def optimizer_rows(cp, shapes, steps: int, timed: bool = True) -> dict:
    """Steps per second of ``apply_gradients`` (SGD, momentum 0.9) in ``strategy.run`` on
    gpu:0 and of the hand-written update, the same gradients every step; raises if
    their weights differ afterwards. ``timed=False``: check only (the sanitizer)."""
    import time

    import gpustrat as gs
    lr, momentum = 0.01, 0.9
    rng = np.random.default_rng(0)
    init = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads_host = [(rng.standard_normal(s) * 1e-2).astype(np.float32) for s in shapes]

    def clock(step) -> float:
        for _ in range(3 if timed else 1):
            step()
        cp.cuda.Device(0).synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        cp.cuda.Device(0).synchronize()
        return steps / (time.perf_counter() - t0)

    strategy = gs.MirroredStrategy(["gpu:0"])
    try:
        with strategy.scope():
            variables = [gs.Variable(v, name=f"v{k}") for k, v in enumerate(init)]
            opt = gs.optimizers.SGD(lr, momentum=momentum)
        with cp.cuda.Device(0):
            grads = [cp.asarray(g) for g in grads_host]
        pairs = list(zip(grads, variables))
        ours = clock(lambda: strategy.run(lambda: opt.apply_gradients(pairs)))
        got = [np.asarray(gs.devices.to_host(v.value())) for v in variables]
    finally:
        strategy.close()
    with cp.cuda.Device(0):
        params = [cp.asarray(v) for v in init]
        velocity = [cp.zeros_like(p) for p in params]

    def hand():
        with cp.cuda.Device(0):
            for p, v, g in zip(params, velocity, grads):
                v *= momentum
                v -= lr * g
                p += v
    theirs = clock(hand)
    for k, (a, p) in enumerate(zip(got, params)):
        b = cp.asnumpy(p)
        if not np.allclose(a, b, rtol=1e-5, atol=1e-6):
            raise AssertionError(f"tensor {k} {a.shape}: gpustrat's SGD and the hand-written "
                                 f"update differ by up to {np.abs(a - b).max():.3g}")
    return {"tensors": len(shapes), "parameters": int(sum(int(np.prod(s)) for s in shapes)),
            "steps": steps, "gpustrat_steps_s": ours, "hand_steps_s": theirs,
            "ratio": ours / theirs}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    ap.add_argument("--staged", action="store_true",
                    help="time the host-staged communicator instead of NCCL")
    ap.add_argument("--sanitizer", action="store_true",
                    help="run on the stream-ordering sanitizer's fake GPUs (no timings)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    counts = step_counts()
    if args.sanitizer:
        from gpustrat import testing
        with testing.sanitize(seed=0):
            from gpustrat.devices import cupy
            kernels = bench_kernels(cupy(), 1 << 16, 1)
            optimizer_rows(cupy(), [(3, 3, 4, 8), (8,), (8,), (32, 10), (10,)], 3,
                           timed=False)
        print("kernels on the sanitizer (checked against their references; no timings):")
        for r in kernels:
            print(f"  {r['kernel']}: ok")
        print("the optimizer step's weights match the hand-written update: ok")
        print_step_counts(counts)
        return {"suite": "gpu", "sanitizer": True, "step_counts": counts}
    cp, reason = _gpu_or_reason()
    if cp is None:
        print(f"bench_gpu: skipped: {reason} (--sanitizer runs it on fake GPUs)")
        print_step_counts(counts)
        verdicts = [targets.not_measured(f"{k} vs device-to-device copy", COPY_TARGET * 100,
                                         reason, "%") for k in ("split", "pack (1000 tensors)")]
        verdicts.append(targets.not_measured(OPTIMIZER_HAND, OPTIMIZER_TARGET, reason, "x"))
        return {"suite": "gpu", "skipped": reason, "verdicts": verdicts, "step_counts": counts}
    repeats = 5 if args.quick else 20
    nbytes = (16 << 20) if args.quick else (256 << 20)
    kernels = bench_kernels(cp, nbytes, repeats)
    print(f"kernels ({cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}), "
          f"target: split and pack >= {COPY_TARGET:.0%} of a device-to-device copy")
    print("time: per call with calls queued back to back (GB/s and vs copy from it); "
          "alone: one call between two events, its launch included; host: Python per call")
    print(f"{'kernel':<26} {'bytes':>10} {'time (us)':>10} {'GB/s':>8} {'vs copy':>8} "
          f"{'alone (us)':>11} {'host (us)':>10}")
    for r in kernels:
        print(f"{r['kernel']:<26} {r['bytes']:>10} {r['time_us']:>10.1f} {r['GB_s']:>8.1f} "
              f"{r['vs_copy']:>7.0%} {r['alone_us']:>11.1f} {r['host_us']:>10.1f}")
    verdicts = [targets.check(f"{r['kernel']} vs device-to-device copy", r["vs_copy"] * 100,
                              COPY_TARGET * 100, "%")
                for r in kernels if r["kernel"] in ("split", "pack (1000 tensors)")]
    sizes = [1 << 10, 1 << 16, 1 << 20, 16 << 20] + ([] if args.quick else [256 << 20])
    colls = bench_collectives(cp, args.staged, sizes, repeats)
    if colls:
        print(f"\ncollectives over {colls[0]['gpus']} GPU(s), {colls[0]['comm']}")
        print(f"{'op':<15} {'size (B)':>12} {'count':>11} {'type':>8} {'time (us)':>10} "
              f"{'algbw':>8} {'busbw':>8}")
        for r in colls:
            print(f"{r['op']:<15} {r['size']:>12} {r['count']:>11} {r['dtype']:>8} "
                  f"{r['time_us']:>10.1f} {r['algbw']:>8.2f} {r['busbw']:>8.2f}")
    try:
        from benchmarks import bench_function  # gs.function's rows: captured and eager
    except ImportError:
        import bench_function
    function_rows, function_verdicts = bench_function.gpu_rows(cp, args.quick)
    verdicts += function_verdicts
    try:
        from benchmarks.bench_gpu_host import resnet50_shapes
    except ImportError:
        from bench_gpu_host import resnet50_shapes
    opt_row = optimizer_rows(cp, resnet50_shapes(), 20 if args.quick else 100)
    print(f"\nResNet-50-layout SGD momentum step on 1 GPU ({opt_row['tensors']} tensors, "
          f"{opt_row['parameters'] / 1e6:.1f} M parameters), steps/s: gpustrat "
          f"{opt_row['gpustrat_steps_s']:.1f}, hand-written CuPy {opt_row['hand_steps_s']:.1f}")
    verdicts.append(targets.check(OPTIMIZER_HAND, opt_row["ratio"], OPTIMIZER_TARGET, "x"))
    print_step_counts(counts)
    result = {"suite": "gpu", "kernels": kernels, "collectives": colls, "verdicts": verdicts,
              "step_counts": counts, "function": function_rows, "optimizer": opt_row}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
