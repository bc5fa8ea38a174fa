"""Host cost of a GPU training step, measured without a GPU on the stand-in backend.

Every case runs through gpustrat's public API under ``gpustrat.testing.stand_in``
(real CuPy arrays over made-up device memory; counting stand-ins for the driver,
streams, events, NCCL and Numba: see docs/benchmarks.md), beside a hand-written
CuPy+NCCL step doing the same work under the same stand-ins in the same run. Times are
host microseconds per steady step (the median over the steps; fresh gradients every
step): the CPU time of the process (every thread's: what the step costs the host,
steady on a loaded machine, where wall-clock time is not; both are printed), their
ratio gpustrat / hand-written (of CPU times), and the stand-in's counts per step.

The hand-written steps are what a competent CuPy user writes without a framework, per
tensor:

- gradients: per device, ``with cp.cuda.Device(i):`` one ``cp.full(shape, g)`` per
  tensor (a launch and an allocation: a fresh gradient, as a backward pass makes);
- combining: one NCCL ``allReduce`` per tensor, in place, all devices' calls in one
  ``groupStart()``/``groupEnd()`` (nothing on one GPU);
- SGD with momentum (Keras's rule): ``v *= m; v -= lr * g; p += v`` per tensor;
  Adam: ``m += (g - m) * (1 - b1); v += (g * g - v) * (1 - b2);
  p -= lr_t * m / (sqrt(v) + eps)`` per tensor, ``lr_t`` computed on the host;
- ``strategy.reduce`` of a 0-d loss: one NCCL ``reduce`` per device to gpu:0, grouped;
- beside ``gradient_buffers``: flat arenas (one parameter, momentum and gradient
  buffer per device, the gradients written into views of it, one NCCL call and three
  update launches per device).

What a launch costs the host on a GPU machine beyond the stand-in's own cost (CuPy's
kernel dispatch, the driver's ``cuLaunchKernel``, Numba's dispatcher) is not in the
figures unless ``--launch-us`` adds it to every launch and NCCL call (and
``--numba-launch-us`` more to a Numba kernel's), a model for seeing how much fewer
launches are worth.

The one-process-per-GPU row is a model, labelled so: a replica's own launches, timed
alone on one GPU (its host time per process when each GPU has its own process, the
processes running in parallel on their own cores), beside the same work on 4
in-process replicas of ``strategy.run``, whose launches the GIL serializes.

    python benchmarks/bench_gpu_host.py [--quick] [--json out.json] [--launch-us US]
                                        [--numba-launch-us US] [--profile TEXT]
    python -m gpustrat bench gpu_host

Needs the real CuPy package (``python tests/conformance/install_cupy.py`` installs it
under .conformance/, no GPU needed).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

F32 = np.float32
LR, MOMENTUM = 0.01, 0.9
B1, B2, EPS = 0.9, 0.999, 1e-7
INTERNAL = ("launches", "kernel_launches", "device_enters", "event_creations",
            "timing_events", "event_records", "event_waits", "allocations", "nccl_calls",
            "copies")


# --- layouts -----------------------------------------------------------------------------

def resnet50_shapes() -> list[tuple]:
    """The 161 trainable tensors of ResNet-50 (Keras order and layout: conv kernels
    (kh, kw, in, out) without bias, BatchNorm gamma and beta, the classifier)."""
    shapes = [(7, 7, 3, 64), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            if b == 0:
                shapes += [(1, 1, cin, 4 * width), (4 * width,), (4 * width,)]
            shapes += [(1, 1, cin, width), (width,), (width,),
                       (3, 3, width, width), (width,), (width,),
                       (1, 1, width, 4 * width), (4 * width,), (4 * width,)]
            cin = 4 * width
    shapes += [(2048, 1000), (1000,)]
    return shapes


MLP_SHAPES = [(784, 512), (512,), (512, 512), (512,), (512, 256), (256,), (256, 10), (10,)]


# --- the cases and their targets ----------------------------------------------------------

APPLY_RESNET = {"sgd": "apply_gradients (SGD momentum), ResNet-50 layout, 4 GPUs",
                "adam": "apply_gradients (Adam), ResNet-50 layout, 4 GPUs"}
APPLY_BUFFERS = ("apply_gradients (SGD momentum, gradient_buffers), ResNet-50, 4 GPUs "
                 "[hand: flat arenas]")
APPLY_MLP = {n: f"apply_gradients (SGD momentum), small MLP (8 tensors), {n} GPU"
                f"{'s' if n > 1 else ''}" for n in (1, 4)}
ALL_REDUCE_4 = "replica-context all_reduce('sum', 161 grads) in run, ResNet-50, 4 GPUs"
REDUCE_4 = "strategy.reduce('sum', loss), 4 GPUs"
REDUCE_1 = "strategy.reduce('sum', loss), 1 GPU (nothing to combine)"
ALL_REDUCE_1 = "all_reduce of 161 tensors, 1 GPU (nothing to combine; the call alone)"
#: case -> ("x", most gpustrat / hand-written) or ("us", most host us per step)
TARGETS = {APPLY_RESNET["sgd"]: ("x", 1.5), APPLY_MLP[1]: ("x", 1.5), APPLY_MLP[4]: ("x", 1.5),
           ALL_REDUCE_4: ("x", 2.0), REDUCE_4: ("x", 2.0), REDUCE_1: ("us", 20.0),
           ALL_REDUCE_1: ("us", 100.0)}
DEMO = "the demo's train_step in run (MLP, 4 GPUs; all_reduce of a Python number)"
#: The cases with nothing to do by hand, or no hand-written step beside them.
ABSOLUTE = (REDUCE_1, ALL_REDUCE_1, DEMO)
NO_HAND = (ALL_REDUCE_1, DEMO)
SYNCS_TARGET = "host synchronizations in any steady step above"


def _target_name(case: str, unit: str) -> str:
    return f"{case}: gpustrat / hand-written" if unit == "x" else f"{case}: host us"


# --- timing ------------------------------------------------------------------------------

def _median_us(samples) -> float:
    return statistics.median(samples) * 1e6


def _alternate(fns: dict, steps: int, rounds: int, batch: int = 1) -> dict:
    """Per-step seconds of each ``fns[name]()``, wall-clock (``"wall"``) and the CPU
    time of the process (``"cpu"``, every thread's), the functions taking turns in
    ``rounds`` blocks of ``steps`` samples (so a change of load hits them alike). A
    sample times ``batch`` steps in a row (the clocks cost about a microsecond)."""
    out = {k: {"wall": [], "cpu": []} for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            gc.collect()
            wall, cpu = out[k]["wall"], out[k]["cpu"]
            for _ in range(steps):
                c0 = time.process_time()
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                wall.append((time.perf_counter() - t0) / batch)
                cpu.append((time.process_time() - c0) / batch)
    return out


def _per_step_counts(gpus, fn, steps: int = 3) -> dict:
    with gpus.measure() as c:
        for _ in range(steps):
            fn()
    sites = c.pop("sync_sites")
    out = {k: v / steps for k, v in c.items()}
    out["sync_sites"] = sorted({f"{what} at {site}" for _, what, site in sites})[:5]
    return out


# --- the cases ---------------------------------------------------------------------------

def _hand_setup(cp, nccl, n_dev, shapes):
    comms = nccl.NcclCommunicator.initAll(list(range(n_dev))) if n_dev > 1 else None
    params, slots = [], []
    for i in range(n_dev):
        with cp.cuda.Device(i):
            params.append([cp.zeros(s, F32) for s in shapes])
            slots.append([(cp.zeros(s, F32), cp.zeros(s, F32)) for s in shapes])
    return comms, params, slots


def _hand_grads(cp, n_dev, shapes):
    grads = []
    for i in range(n_dev):
        with cp.cuda.Device(i):
            grads.append([cp.full(s, 1e-3, F32) for s in shapes])
    return grads


def _hand_all_reduce(cp, nccl, comms, grads):
    if comms is None:
        return
    nccl.groupStart()
    try:
        for i, (comm, gs_) in enumerate(zip(comms, grads)):
            with cp.cuda.Device(i):
                sp = cp.cuda.get_current_stream().ptr
                for g in gs_:
                    comm.allReduce(g.data.ptr, g.data.ptr, g.size, nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, sp)
    finally:
        nccl.groupEnd()


def make_hand_step(cp, nccl, n_dev, shapes, optimizer: str | None):
    comms, params, slots = _hand_setup(cp, nccl, n_dev, shapes)
    t = [0]

    def step():
        grads = _hand_grads(cp, n_dev, shapes)
        _hand_all_reduce(cp, nccl, comms, grads)
        if optimizer is None:
            return grads
        t[0] += 1
        lr_t = LR * (1 - B2 ** t[0]) ** 0.5 / (1 - B1 ** t[0])
        for i in range(n_dev):
            with cp.cuda.Device(i):
                for p, (a, b), g in zip(params[i], slots[i], grads[i]):
                    if optimizer == "sgd":
                        a *= MOMENTUM
                        a -= LR * g
                        p += a
                    else:
                        a += (g - a) * (1 - B1)
                        b += (g * g - b) * (1 - B2)
                        p -= lr_t * a / (cp.sqrt(b) + EPS)
        return grads
    return step


def make_hand_flat_step(cp, nccl, n_dev, shapes):
    """SGD with momentum on flat arenas: per device one parameter, one momentum and one
    gradient buffer; the gradients are written into views of the gradient buffer (one
    ``g[...] = value`` per tensor), reduced by one NCCL call per device, and the update
    is three launches per device (the hand-written equivalent of ``gradient_buffers``)."""
    comms = nccl.NcclCommunicator.initAll(list(range(n_dev))) if n_dev > 1 else None
    sizes = [int(np.prod(s)) for s in shapes]
    total = sum(sizes)
    arenas = []
    for i in range(n_dev):
        with cp.cuda.Device(i):
            flat_g = cp.zeros((total,), F32)
            views, off = [], 0
            for s, n in zip(shapes, sizes):
                views.append(flat_g[off:off + n].reshape(s))
                off += n
            arenas.append((cp.zeros((total,), F32), cp.zeros((total,), F32), flat_g, views))

    def step():
        for i in range(n_dev):
            with cp.cuda.Device(i):
                for g in arenas[i][3]:
                    g[...] = 1e-3
        if comms is not None:
            nccl.groupStart()
            try:
                for i, comm in enumerate(comms):
                    with cp.cuda.Device(i):
                        g = arenas[i][2]
                        comm.allReduce(g.data.ptr, g.data.ptr, g.size, nccl.NCCL_FLOAT32,
                                       nccl.NCCL_SUM, cp.cuda.get_current_stream().ptr)
            finally:
                nccl.groupEnd()
        for i in range(n_dev):
            with cp.cuda.Device(i):
                p, v, g, _ = arenas[i]
                v *= MOMENTUM
                v -= LR * g
                p += v
    return step


def calibrate(cp, nccl, n: int = 2000) -> dict:
    """The stand-in's own host cost of the operations every step is made of (CPU us;
    with ``--launch-us``, the modelled cost included)."""
    a = cp.zeros((256, 256), F32)
    b = cp.zeros((256, 256), F32)
    comm = nccl.NcclCommunicator.initAll([0])[0]
    ops = {"a * 0.5 (a launch and a new array)": lambda: a * 0.5,
           "a -= b (a launch in place)": lambda: a.__isub__(b),
           "a[1:] (a CuPy view)": lambda: a[1:],
           "with cp.cuda.Device(1)": lambda: cp.cuda.Device(1).__enter__().__exit__(),
           "nccl allReduce call": lambda: comm.allReduce(a.data.ptr, a.data.ptr, a.size,
                                                         nccl.NCCL_FLOAT32, nccl.NCCL_SUM, 0)}
    out = {}
    for name, fn in ops.items():
        samples = []
        for _ in range(5):
            t0 = time.process_time()
            for _ in range(n):
                fn()
            samples.append((time.process_time() - t0) / n)
        out[name] = _median_us(samples)
    return out


def make_hand_reduce(cp, nccl, n_dev):
    comms = nccl.NcclCommunicator.initAll(list(range(n_dev))) if n_dev > 1 else None
    losses = []
    for i in range(n_dev):
        with cp.cuda.Device(i):
            losses.append(cp.full((), 1.0, F32))

    def step():
        if comms is None:
            return losses[0]
        with cp.cuda.Device(0):
            out = cp.empty((), F32)
        nccl.groupStart()
        try:
            for i, comm in enumerate(comms):
                with cp.cuda.Device(i):
                    recv = out.data.ptr if i == 0 else losses[i].data.ptr
                    comm.reduce(losses[i].data.ptr, recv, 1, nccl.NCCL_FLOAT32,
                                nccl.NCCL_SUM, 0, cp.cuda.get_current_stream().ptr)
        finally:
            nccl.groupEnd()
        return out
    return step


def make_strategy(gs, n_dev):
    return gs.MirroredStrategy([f"gpu:{i}" for i in range(n_dev)])


def make_gpustrat_apply(gs, cp, n_dev, shapes, optimizer: str, buffers: bool = False):
    strategy = make_strategy(gs, n_dev)
    with strategy.scope():
        variables = [gs.Variable(np.zeros(s, F32), name=f"v{k}") for k, s in enumerate(shapes)]
        opt = (gs.optimizers.SGD(LR, momentum=MOMENTUM) if optimizer == "sgd"
               else gs.optimizers.Adam(LR, beta_1=B1, beta_2=B2, epsilon=EPS))

    def replica_step():
        if buffers:
            grads = opt.gradient_buffers(variables)
            for g in grads:
                g[...] = 1e-3
        else:
            grads = [cp.full(s, 1e-3, F32) for s in shapes]
        opt.apply_gradients(zip(grads, variables))

    def step():
        strategy.run(replica_step)
    return step


def make_gpustrat_all_reduce(gs, cp, n_dev, shapes, inner: dict | None = None):
    """``inner``: where the replica records the call's own seconds (wall, and its
    thread's CPU time)."""
    strategy = make_strategy(gs, n_dev)

    def replica_step():
        grads = [cp.full(s, 1e-3, F32) for s in shapes]
        ctx = gs.distribute.get_replica_context()
        if inner is None:
            return ctx.all_reduce("sum", grads)
        c0 = time.thread_time()
        t0 = time.perf_counter()
        out = ctx.all_reduce("sum", grads)
        inner["wall"].append(time.perf_counter() - t0)
        inner["cpu"].append(time.thread_time() - c0)
        return out

    def step():
        strategy.run(replica_step)
    return step


def make_gpustrat_reduce(gs, cp, n_dev):
    strategy = make_strategy(gs, n_dev)
    losses = strategy.run(lambda: cp.full((), 1.0, F32))

    def step():
        return strategy.reduce("sum", losses, axis=None)
    return step


def make_gpustrat_demo(gs, n_dev):
    """The demo's training step (``python -m gpustrat demo``: an MLP trained with SGD,
    the example count all-reduced as a Python number, a Mean metric), batches from a
    distributed dataset."""
    from gpustrat import demo
    strategy = make_strategy(gs, n_dev)
    x, y = demo.make_dataset(4096, demo.N_FEATURES, demo.DATA_SEED, np.float64)
    init = demo.init_weights(demo.N_FEATURES, demo.HIDDEN, y.shape[1], demo.INIT_SEED,
                             np.float64)
    weights, optimizer, train_loss = demo.build_model(strategy, init, demo.LEARNING_RATE,
                                                      np.float64)
    dataset = gs.data.Dataset.from_tensor_slices((x, y)).repeat().batch(demo.GLOBAL_BATCH)
    batches = iter(strategy.experimental_distribute_dataset(dataset))
    train_step = demo.make_train_step(weights, optimizer, train_loss)

    def step():
        strategy.run(train_step, args=(next(batches),))
    return step


def make_small_launches(gs, cp, n_dev, launches: int):
    """The GIL row: each replica makes ``launches`` small CuPy launches."""
    strategy = make_strategy(gs, n_dev)
    xs = strategy.run(lambda: cp.zeros((16,), F32))

    def replica_step(x):
        for _ in range(launches):
            x = x + 1.0
        return x

    def step():
        strategy.run(replica_step, args=(xs,))
    return step


# --- running -----------------------------------------------------------------------------

def _profile(name: str, fn, steps: int = 5, top: int = 25) -> None:
    """Print where ``fn``'s host time goes (cProfile, by own time) over ``steps`` steps."""
    import cProfile
    import io
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    print(f"profile of {name} ({steps} steps):")
    print(out.getvalue())


def measure(quick: bool = False, launch_us: float = 0.0, numba_launch_us: float = 0.0,
            profile: str | None = None) -> dict:
    import gpustrat as gs
    from gpustrat import devices, testing

    steps = {"resnet": 3 if quick else 12, "small": 5 if quick else 30}
    rounds = 2 if quick else 4
    resnet = resnet50_shapes()
    rows = []
    with testing.stand_in(num_devices=4, launch_us=launch_us,
                          numba_launch_us=numba_launch_us) as gpus:
        cp, nccl = devices.cupy(), devices.nccl_library()
        calibration = calibrate(cp, nccl, 500 if quick else 2000)
        inner = {"wall": [], "cpu": []}
        # Each case is built when it is measured and dropped after, so that the
        # garbage collector's passes do not grow with the cases measured before.
        cases = [(APPLY_RESNET[opt], "resnet",
                  lambda opt=opt: (make_gpustrat_apply(gs, cp, 4, resnet, opt),
                                   make_hand_step(cp, nccl, 4, resnet, opt)))
                 for opt in ("sgd", "adam")]
        cases.append((APPLY_BUFFERS, "resnet",
                      lambda: (make_gpustrat_apply(gs, cp, 4, resnet, "sgd", buffers=True),
                               make_hand_flat_step(cp, nccl, 4, resnet))))
        cases += [(APPLY_MLP[n], "small",
                   lambda n=n: (make_gpustrat_apply(gs, cp, n, MLP_SHAPES, "sgd"),
                                make_hand_step(cp, nccl, n, MLP_SHAPES, "sgd")))
                  for n in (1, 4)]
        cases.append((ALL_REDUCE_4, "resnet",
                      lambda: (make_gpustrat_all_reduce(gs, cp, 4, resnet),
                               make_hand_step(cp, nccl, 4, resnet, None))))
        cases.append((REDUCE_4, "small", lambda: (make_gpustrat_reduce(gs, cp, 4),
                                                  make_hand_reduce(cp, nccl, 4))))
        cases.append((REDUCE_1, "small", lambda: (make_gpustrat_reduce(gs, cp, 1),
                                                  make_hand_reduce(cp, nccl, 1))))
        cases.append((ALL_REDUCE_1, "resnet",
                      lambda: (make_gpustrat_all_reduce(gs, cp, 1, resnet, inner),
                               None)))             # by hand: no call at all

        cases.append((DEMO, "small", lambda: (make_gpustrat_demo(gs, 4), None)))

        for name, size, make in cases:
            targets.progress(name)
            g_fn, h_fn = make()
            fns = {"gpustrat": g_fn} if h_fn is None else {"gpustrat": g_fn, "hand": h_fn}
            for _ in range(2):              # warm up: plans, caches, pools
                for fn in fns.values():
                    fn()
            counts = {k: _per_step_counts(gpus, fn) for k, fn in fns.items()}
            if profile and profile.lower() in name.lower():
                _profile(name, g_fn)
            for v in inner.values():
                v.clear()
            t = _alternate(fns, steps[size], rounds, batch=1 if size == "resnet" else 10)
            g_t = inner if name == ALL_REDUCE_1 else t["gpustrat"]
            g_us = _median_us(g_t["cpu"])
            h_us = _median_us(t["hand"]["cpu"]) if "hand" in t else None
            rows.append({"case": name, "gpustrat_us": g_us, "hand_us": h_us,
                         "ratio": g_us / h_us if h_us and name not in ABSOLUTE else None,
                         "gpustrat_wall_us": _median_us(g_t["wall"]),
                         "hand_wall_us": _median_us(t["hand"]["wall"]) if "hand" in t else None,
                         "target": TARGETS.get(name),
                         "gpustrat_counts": counts["gpustrat"],
                         "hand_counts": counts.get("hand"),
                         "steps": len(g_t["cpu"])})
            del g_fn, h_fn
            gc.collect()

        # One process per GPU vs in-process replicas (a model).
        launches = 200
        one = make_small_launches(gs, cp, 1, launches)
        four = make_small_launches(gs, cp, 4, launches)
        for _ in range(2):
            one()
            four()
        t = _alternate({"one": one, "four": four}, steps["small"], rounds)
        gil = {"launches_per_replica": launches,
               "one_gpu_us": _median_us(t["one"]["cpu"]),
               "four_in_process_us": _median_us(t["four"]["cpu"]),
               "one_gpu_wall_us": _median_us(t["one"]["wall"]),
               "four_in_process_wall_us": _median_us(t["four"]["wall"])}
    return {"rows": rows, "gil": gil, "calibration": calibration, "launch_us": launch_us,
            "numba_launch_us": numba_launch_us}


def _count(x) -> str:
    return f"{x:.0f}" if x == int(x) else f"{x:.1f}"


def _fmt(x):
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:,.1f}"


def report(result: dict) -> list:
    rows, gil = result["rows"], result["gil"]
    print(f"load average: {' '.join(open('/proc/loadavg').read().split()[:3])} "
          f"({os.cpu_count()} cores)")
    print(f"modelled cost added to each launch and NCCL call: {result['launch_us']:g} us "
          f"(--launch-us), and to each Numba kernel launch: {result['numba_launch_us']:g} us "
          "more (--numba-launch-us)")
    print("the stand-in's cost (CPU us, the modelled cost included): " + "; ".join(
        f"{k} {v:.2f}" for k, v in result["calibration"].items()))
    print("host us per steady step (median): CPU time of the process (every thread's), "
          "and wall-clock; gpustrat public API vs hand-written CuPy+NCCL, same stand-ins, "
          "same run; ratio of CPU times")
    print(f"{'case':<86} {'gpustrat':>9} {'hand':>8} {'ratio':>6} {'wall: gpustrat':>15} "
          f"{'hand':>8} {'syncs':>5}")
    verdicts = []
    for r in rows:
        syncs = r["gpustrat_counts"]["host_syncs"]
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.1f}x"
        print(f"{r['case']:<86} {_fmt(r['gpustrat_us']):>9} {_fmt(r['hand_us']):>8} "
              f"{ratio:>6} {_fmt(r['gpustrat_wall_us']):>15} {_fmt(r['hand_wall_us']):>8} "
              f"{_count(syncs):>5}")
        if r["gpustrat_counts"]["sync_sites"]:
            print(f"    host syncs at: {'; '.join(r['gpustrat_counts']['sync_sites'])}")
    print("internal (stand-in counts per step: gpustrat / hand-written; launches include "
          "kernel_launches, the launches of custom kernels)")
    print(f"{'case':<86} " + " ".join(f"{k[:13]:>13}" for k in INTERNAL))
    for r in rows:
        hand = r["hand_counts"]
        cells = [f"{_count(r['gpustrat_counts'][k])}/{'-' if hand is None else _count(hand[k])}"
                 for k in INTERNAL]
        print(f"{r['case']:<86} " + " ".join(f"{c:>13}" for c in cells))
    print(f"one process per GPU vs in-process replicas (a model): "
          f"{gil['launches_per_replica']} small launches per replica in strategy.run. 1 GPU "
          f"(the host time of each process when every GPU has its own process on its own "
          f"core, the processes in parallel): {_fmt(gil['one_gpu_us'])} us per step; 4 "
          f"in-process replicas, their launches serialized by the GIL: "
          f"{_fmt(gil['four_in_process_us'])} us per step "
          f"({gil['four_in_process_us'] / gil['one_gpu_us']:.1f}x; wall-clock "
          f"{_fmt(gil['one_gpu_wall_us'])} and {_fmt(gil['four_in_process_wall_us'])} us)")
    for r in rows:
        if r["target"] is None:
            continue
        unit, goal = r["target"]
        if unit == "x":
            verdicts.append(targets.check(_target_name(r["case"], unit), r["ratio"], goal, "x",
                                          higher_is_better=False))
        else:
            verdicts.append(targets.check(_target_name(r["case"], unit), r["gpustrat_us"], goal,
                                          "us", higher_is_better=False))
    worst = max(rows, key=lambda r: r["gpustrat_counts"]["host_syncs"])
    verdicts.append(targets.check(SYNCS_TARGET, worst["gpustrat_counts"]["host_syncs"], 0, "",
                                  higher_is_better=False))
    if worst["gpustrat_counts"]["host_syncs"]:
        print(f"    most host synchronizations: {worst['case']}")
    return verdicts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for CI")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--launch-us", type=float, default=0.0,
                    help="host us each launch and NCCL call spends beyond the stand-in's own "
                         "cost, a model of CuPy's dispatch and the driver's (default: 0)")
    ap.add_argument("--profile", metavar="TEXT",
                    help="print a profile of gpustrat's step in every case whose name holds "
                         "TEXT, e.g. 'all_reduce' (default: none)")
    ap.add_argument("--numba-launch-us", type=float, default=0.0,
                    help="host us each launch of a Numba kernel spends on top, a model of "
                         "Numba's dispatcher (default: 0)")
    args = ap.parse_args(argv)
    try:
        result = measure(quick=args.quick, launch_us=args.launch_us,
                         numba_launch_us=args.numba_launch_us, profile=args.profile)
    except RuntimeError as e:
        if "stand-in backend needs the real CuPy" not in str(e):
            raise
        print(f"not measured: {e}")
        reason = "the real CuPy package is missing (python tests/conformance/install_cupy.py)"
        verdicts = [targets.not_measured(_target_name(case, unit), goal, reason, unit,
                                         higher_is_better=False)
                    for case, (unit, goal) in TARGETS.items()]
        verdicts.append(targets.not_measured(SYNCS_TARGET, 0, reason, higher_is_better=False))
        return {"suite": "gpu_host", "skipped": str(e), "verdicts": verdicts}
    verdicts = report(result)
    result.update({"suite": "gpu_host", "verdicts": verdicts,
                   "loadavg": open("/proc/loadavg").read().split()[:3]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
