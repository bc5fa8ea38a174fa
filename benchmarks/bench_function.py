"""Host cost of a gs.function step replayed as CUDA graphs, beside the same step eager,
on the stand-in backend (no GPU needed).

The step is TensorFlow's custom training loop: ``strategy.run`` of a replica step that
makes one gradient per variable and applies them (SGD with momentum, or Adam: one fused
reduction and update), then ``strategy.reduce`` of the replicas' device losses; its argument is a
per-replica batch. Timed: the host CPU time of the process per call (every thread's)
and wall-clock, median of the steady calls, both variants in the same run taking
turns.

The stand-in backend (``gpustrat.testing.stand_in``) has no stream capture: this
suite gives its streams ``begin_capture``/``end_capture`` (nothing is recorded: the
stand-in's arrays have no values) and a graph whose ``launch`` counts one launch, and
accepts CuPy's allocator calls. So the replayed row is the host cost of gs.function's
replay path itself (guards, input copies, one launch per GPU, the joins, the output
copies), not of the driver's ``cudaGraphLaunch`` (a few microseconds on a GPU).

The GPU rows (the demo's step captured / eager, and against a hand-written CuPy step)
are measured by ``bench_gpu.py`` on a GPU; here they are listed as not measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import targets  # noqa: E402

F32 = np.float32


# The layouts the host-cost suite measures, the same here.
from bench_gpu_host import MLP_SHAPES, resnet50_shapes  # noqa: E402,F401

RESNET_4 = "replayed step, ResNet-50 layout (161 tensors), 4 GPUs"
RESNET_ADAM_4 = "replayed step (Adam), ResNet-50 layout, 4 GPUs"
MLP_1 = "replayed step, small MLP (8 tensors), 1 GPU"
MLP_4 = "replayed step, small MLP (8 tensors), 4 GPUs"
#: case -> most host us per replayed step
TARGETS = {RESNET_4: 100.0, MLP_1: 50.0}
DEMO_CAPTURED = "demo MLP step throughput, captured / eager (bench_gpu.py)"
DEMO_HAND = "demo MLP step throughput, captured / hand-written CuPy step (bench_gpu.py)"
DEMO_EAGER_HAND = "demo MLP step throughput, eager / hand-written CuPy step (bench_gpu.py)"
#: what gpu_rows measures on a GPU: most captured (or eager) / other throughput
GPU_TARGETS = {DEMO_CAPTURED: 2.0, DEMO_HAND: 1.5, DEMO_EAGER_HAND: 0.9}


def _add_capture(cp) -> None:
    """Give the stand-in's CuPy what capture calls (see the module docstring)."""
    cuda = cp.cuda
    if hasattr(cuda.Stream, "begin_capture"):
        return
    model = cp.model

    class Graph:
        def launch(self, stream=None):
            model.count("launches")       # one cudaGraphLaunch

        def upload(self, stream=None):
            pass

    def begin_capture(self, mode=None):
        self._capturing = True

    def end_capture(self):
        self._capturing = False
        return Graph()

    class MemoryPool:
        def malloc(self, size):
            raise TypeError("not called on the stand-in")

    cuda.Stream.begin_capture = begin_capture
    cuda.Stream.end_capture = end_capture
    cuda.Stream.is_capturing = lambda self: getattr(self, "_capturing", False)
    cuda.graph = types.SimpleNamespace(Graph=Graph)
    cuda.MemoryPool = MemoryPool
    cuda.get_allocator = lambda: MemoryPool().malloc
    cuda.set_allocator = lambda allocator=None: None
    cuda.using_allocator = lambda allocator=None: contextlib.nullcontext()


def make_step(gs, cp, n_dev, shapes, capture, optimizer="sgd"):
    strategy = gs.MirroredStrategy([f"gpu:{i}" for i in range(n_dev)])
    with strategy.scope():
        variables = [gs.Variable(np.zeros(s, F32), name=f"v{k}") for k, s in enumerate(shapes)]
        opt = (gs.optimizers.SGD(0.01, momentum=0.9) if optimizer == "sgd"
               else gs.optimizers.Adam(0.001))

    def replica_step(batch):
        grads = [cp.full(s, 1e-3, F32) for s in shapes]
        opt.apply_gradients(zip(grads, variables))
        return batch.sum()

    @gs.function(capture=capture)
    def train_step(batch):
        per_replica = strategy.run(replica_step, args=(batch,))
        return strategy.reduce("sum", per_replica, axis=None)

    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: cp.full((32, 10), 1.0, F32))
    return strategy, (lambda: train_step(batch)), train_step


def _times(fns: dict, steps: int, rounds: int) -> dict:
    out = {k: {"wall": [], "cpu": []} for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            gc.collect()
            for _ in range(steps):
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(10):
                    fn()
                out[k]["wall"].append((time.perf_counter() - t0) / 10)
                out[k]["cpu"].append((time.process_time() - c0) / 10)
    return out


def measure(quick: bool = False) -> dict:
    import gpustrat as gs
    from gpustrat import devices, testing
    if not hasattr(testing, "stand_in"):
        raise RuntimeError("the stand-in backend (gpustrat.testing.stand_in) is not in "
                           "this checkout")
    steps, rounds = (3, 2) if quick else (20, 4)
    rows = []
    with testing.stand_in(num_devices=4) as gpus:
        cp = devices.cupy()
        _add_capture(cp)
        for name, n_dev, shapes, opt in ((RESNET_4, 4, resnet50_shapes(), "sgd"),
                                         (RESNET_ADAM_4, 4, resnet50_shapes(), "adam"),
                                         (MLP_1, 1, MLP_SHAPES, "sgd"),
                                         (MLP_4, 4, MLP_SHAPES, "sgd")):
            targets.progress(name)
            made = {k: make_step(gs, cp, n_dev, shapes, c, opt)
                    for k, c in (("replayed", True), ("eager", False))}
            fns = {k: v[1] for k, v in made.items()}
            for _ in range(4):               # warm-up calls, then the capture
                for fn in fns.values():
                    fn()
            assert made["replayed"][2].experimental_get_tracing_count() == 1
            with gpus.measure() as c:
                fns["replayed"]()
            t = _times(fns, steps, rounds)
            rows.append({"case": name,
                         "replayed_us": statistics.median(t["replayed"]["cpu"]) * 1e6,
                         "eager_us": statistics.median(t["eager"]["cpu"]) * 1e6,
                         "replayed_wall_us": statistics.median(t["replayed"]["wall"]) * 1e6,
                         "eager_wall_us": statistics.median(t["eager"]["wall"]) * 1e6,
                         "counts": {k: v for k, v in c.items() if k != "sync_sites"}})
            for strategy, _, _ in made.values():
                strategy.close()
            del made, fns
            gc.collect()
    return {"rows": rows}


# --- on a GPU (bench_gpu.py runs these) ------------------------------------------------

def _throughput(cp, fn, batches, rows: int) -> float:
    """Samples per second of ``fn(batch)`` over ``batches``, host and device: the clock
    stops when the device has finished."""
    for b in batches[:5]:
        fn(b)
    cp.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for b in batches:
        fn(b)
    cp.cuda.Device().synchronize()
    return len(batches) * rows / (time.perf_counter() - t0)


def gpu_rows(cp, quick: bool = False) -> tuple[list, list]:
    """The demo's training step on one GPU: through gs.function captured and eager, and
    the same MLP step written by hand in CuPy (forward, backward, SGD), each fed the
    same batches already on the device. Returns (rows, verdicts)."""
    import gpustrat as gs
    from gpustrat import demo
    from gpustrat.data import Dataset
    steps = 50 if quick else 400
    rows_per_batch = demo.GLOBAL_BATCH
    x, y = demo.make_dataset(steps * rows_per_batch)
    init = demo.init_weights()
    strategy = gs.MirroredStrategy(["gpu:0"])
    try:
        ds = Dataset.from_tensor_slices((x, y)).batch(rows_per_batch)
        batches = list(strategy.experimental_distribute_dataset(ds))
        out = {}
        functions = {}
        for name, capture in (("captured", "auto"), ("eager", False)):
            weights, opt, train_loss = demo.build_model(strategy, init, demo.LEARNING_RATE)
            step = demo.make_train_step(weights, opt, train_loss)

            def train_step(batch, step=step):
                per_replica = strategy.run(step, args=(batch,))
                return strategy.reduce("sum", per_replica, axis=None)
            functions[name] = gs.function(train_step, capture=capture)
            out[name] = _throughput(cp, functions[name], batches, rows_per_batch)
        w = {k: cp.asarray(v) for k, v in init.items()}

        def hand(batch):
            xb, yb = batch
            _, grads = demo.forward_backward(w, xb, yb)
            for k in demo.WEIGHT_NAMES:
                w[k] -= (demo.LEARNING_RATE / xb.shape[0]) * grads[k]
        out["hand"] = _throughput(cp, hand, [tuple(b) for b in batches], rows_per_batch)
    finally:
        strategy.close()
    states = functions["captured"]._traces.values()
    why = next((st.eager_reason for st in states if st.eager_reason), None)
    print(f"\ndemo MLP step on 1 GPU (samples/s): captured {out['captured']:.0f}, eager "
          f"{out['eager']:.0f}, hand-written CuPy {out['hand']:.0f}"
          + (f"; not captured: {why}" if why else ""))
    verdicts = [targets.check(DEMO_CAPTURED, out["captured"] / out["eager"],
                              GPU_TARGETS[DEMO_CAPTURED], "x"),
                targets.check(DEMO_HAND, out["captured"] / out["hand"], GPU_TARGETS[DEMO_HAND],
                              "x"),
                targets.check(DEMO_EAGER_HAND, out["eager"] / out["hand"],
                              GPU_TARGETS[DEMO_EAGER_HAND], "x")]
    return [out], verdicts


def report(result: dict) -> list:
    print(f"load average: {' '.join(open('/proc/loadavg').read().split()[:3])} "
          f"({os.cpu_count()} cores)")
    print("host us per call (median): CPU time of the process, and wall-clock; the same "
          "step through gs.function, replayed and eager, same stand-ins, same run")
    print(f"{'case':<58} {'replayed':>9} {'eager':>9} {'ratio':>6} {'wall: replayed':>15} "
          f"{'eager':>9} {'syncs':>5} {'launches':>8}")
    verdicts = []
    for r in result["rows"]:
        c = r["counts"]
        print(f"{r['case']:<58} {r['replayed_us']:>9.0f} {r['eager_us']:>9.0f} "
              f"{r['eager_us'] / r['replayed_us']:>5.0f}x {r['replayed_wall_us']:>15.0f} "
              f"{r['eager_wall_us']:>9.0f} {c.get('host_syncs', 0):>5} "
              f"{c.get('launches', 0):>8}")
        if r["case"] in TARGETS:
            verdicts.append(targets.check(f"{r['case']}: host us", r["replayed_us"],
                                          TARGETS[r["case"]], "us", higher_is_better=False))
    for name, goal in GPU_TARGETS.items():
        verdicts.append(targets.not_measured(name, goal, "needs a GPU: run "
                                             "benchmarks/bench_gpu.py where one is", "x"))
    return verdicts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for CI")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    try:
        result = measure(quick=args.quick)
    except RuntimeError as e:
        if "stand-in" not in str(e):
            raise
        print(f"not measured: {e}")
        verdicts = [targets.not_measured(f"{case}: host us", goal, str(e), "us",
                                         higher_is_better=False)
                    for case, goal in TARGETS.items()]
        verdicts += [targets.not_measured(name, goal, "needs a GPU", "x")
                     for name, goal in GPU_TARGETS.items()]
        return {"suite": "function", "skipped": str(e), "verdicts": verdicts}
    verdicts = report(result)
    result.update({"suite": "function", "verdicts": verdicts,
                   "loadavg": open("/proc/loadavg").read().split()[:3]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return result


if __name__ == "__main__":
    main()
