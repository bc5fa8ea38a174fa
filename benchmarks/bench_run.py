"""``strategy.run`` overhead per step with a trivial function, 1, 2 and 4 CPU replicas.

Target: at most 30 µs per step with 2 replicas on the 2-core machine.
Reference, same machine: TensorFlow 2.21 MirroredStrategy with 2 logical CPUs, about
335 µs per step inside tf.function and 1,200 µs eagerly. If TensorFlow is importable
it is measured in the same run; if PyTorch is, its peer of a synchronising step (a
one-float gloo ``all_reduce`` over 2 processes, see ``peers.py``) is too.

    python benchmarks/bench_run.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path


def _time_per_step(step, n_steps: int, repeats: int = 5) -> float:
    for _ in range(max(10, n_steps // 10)):
        step()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n_steps):
            step()
        best = min(best, (time.perf_counter() - t0) / n_steps)
    return best * 1e6


def measure(replicas=(1, 2, 4), n_steps=20000) -> list[dict]:
    import gpustrat as gs
    rows = []
    for n in replicas:
        s = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
        trivial = _time_per_step(lambda: s.run(lambda: None), n_steps)
        pr = gs.PerReplica([np.float32(i) for i in range(n)])
        with_arg = _time_per_step(lambda: s.run(lambda x: x, args=(pr,)), n_steps)
        coll = _time_per_step(
            lambda: s.run(lambda: gs.get_replica_context().all_reduce("sum", 1.0)),
            max(200, n_steps // 20))
        rows.append({"replicas": n, "run_us": trivial, "run_per_replica_arg_us": with_arg,
                     "run_all_reduce_us": coll})
        s.close()
    return rows


def measure_tensorflow(n_steps=2000) -> dict | None:
    try:
        import tensorflow as tf
    except Exception:
        return None
    try:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:
        pass  # already configured in this process
    s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    step = tf.function(lambda: s.run(lambda: tf.constant(0.0)))
    return {"replicas": 2, "tf_function_us": _time_per_step(step, n_steps, 3),
            "tf_eager_us": _time_per_step(lambda: s.run(lambda: tf.constant(0.0)),
                                          n_steps // 4, 3)}


def _peers():
    try:
        from benchmarks import peers  # noqa: PLC0415 - imported as benchmarks.bench_run
    except ImportError:
        import peers  # noqa: PLC0415 - run as a script: benchmarks/ is on sys.path
    return peers


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for CI")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    rows = measure(n_steps=500 if args.quick else 20000)
    tf_row = None if args.quick else measure_tensorflow()
    torch_row = None if args.quick else _peers().torch_run_overhead(2)
    print(f"{'replicas':>8} {'run (us)':>10} {'run+arg (us)':>13} {'run+all_reduce (us)':>20}")
    for r in rows:
        print(f"{r['replicas']:>8} {r['run_us']:>10.1f} {r['run_per_replica_arg_us']:>13.1f} "
              f"{r['run_all_reduce_us']:>20.1f}")
    two = next(r for r in rows if r["replicas"] == 2)
    verdicts = [targets.check("run, 2 replicas, per step", two["run_us"], 30, "us",
                              higher_is_better=False)]
    if tf_row:
        print(f"tensorflow MirroredStrategy, 2 CPUs: tf.function {tf_row['tf_function_us']:.0f} us, "
              f"eager {tf_row['tf_eager_us']:.0f} us; ratio tf.function/gpustrat "
              f"{tf_row['tf_function_us'] / two['run_us']:.1f}x")
    if torch_row:
        print(f"torch.distributed (gloo) one-float all_reduce, 2 processes: "
              f"{torch_row['gloo_all_reduce_us']:.0f} us; ratio torch/gpustrat run+all_reduce "
              f"{torch_row['gloo_all_reduce_us'] / two['run_all_reduce_us']:.1f}x")
    result = {"suite": "run", "rows": rows, "tensorflow": tf_row, "torch": torch_row,
              "verdicts": verdicts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
