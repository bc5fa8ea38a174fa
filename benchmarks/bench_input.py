"""Distributed input throughput: iterate a distributed dataset over 2 CPU replicas and,
each step, run a per-replica sum of the piece and a cross-replica SUM.

Cases: small, 20,000 x 8 float32 with global batch 32 (target at least
10,000 global batches/s on the 2-core machine); large, 2,048 x 65,536 float32 with
global batch 256 (target at least 8 GB/s of data consumed). A plain memcpy of the large
array is timed in the same run as the machine's yardstick. Reference, TensorFlow 2.21
with the same pipeline in tf.function on the same machine: about 500 batches/s and
2.0 GB/s; if TensorFlow is importable it runs here too, and if PyTorch is, a
DataLoader doing the same step (``peers.torch_input_throughput``).

    python benchmarks/bench_input.py [--quick] [--json FILE]
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


def _gs_epoch(strategy, dist):
    steps = 0
    total = 0.0
    for x in dist:
        part = strategy.run(lambda v: v.sum(axis=0), args=(x,))
        total += float(strategy.reduce("sum", part, axis=None)[0])
        steps += 1
    return steps, total


def measure_gpustrat(array: np.ndarray, batch: int, replicas: int = 2, epochs: int = 3) -> dict:
    import gpustrat as gs
    from gpustrat.data import Dataset
    s = gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices(array).batch(batch))
    _gs_epoch(s, dist)  # warm-up: threads, caches
    best = float("inf")
    for _ in range(epochs):
        t0 = time.perf_counter()
        steps, total = _gs_epoch(s, dist)
        best = min(best, time.perf_counter() - t0)
    expected = float(array[:, 0].sum(dtype=np.float64))
    if not np.isclose(total, expected, rtol=1e-3):
        raise AssertionError(f"wrong result: {total} != {expected}")
    s.close()
    return {"steps": steps, "seconds": best, "batches_per_s": steps / best,
            "gb_per_s": array.nbytes / best / 1e9}


def measure_tensorflow(array: np.ndarray, batch: int, epochs: int = 2) -> dict | None:
    try:
        import tensorflow as tf
    except Exception:
        return None
    cpus = tf.config.list_physical_devices("CPU")
    try:
        tf.config.set_logical_device_configuration(
            cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    except RuntimeError:
        pass  # already configured in this process
    s = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    dist = s.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices(array).batch(batch))

    @tf.function
    def step(x):
        part = s.run(lambda v: tf.reduce_sum(v, axis=0), args=(x,))
        return s.reduce("SUM", part, axis=None)

    for x in dist:
        step(x)
    best = float("inf")
    for _ in range(epochs):
        t0 = time.perf_counter()
        steps = 0
        for x in dist:
            step(x)
            steps += 1
        best = min(best, time.perf_counter() - t0)
    return {"steps": steps, "seconds": best, "batches_per_s": steps / best,
            "gb_per_s": array.nbytes / best / 1e9}


def memcpy_gb_per_s(array: np.ndarray) -> float:
    out = np.empty_like(array)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        np.copyto(out, array)
        best = min(best, time.perf_counter() - t0)
    return array.nbytes / best / 1e9


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    small = rng.standard_normal((2000 if args.quick else 20000, 8), dtype=np.float32)
    large = rng.standard_normal((256 if args.quick else 2048, 4096 if args.quick else 65536),
                                dtype=np.float32)
    rows = {
        "small": measure_gpustrat(small, 32),
        "large": measure_gpustrat(large, 256 // (8 if args.quick else 1)),
    }
    memcpy = memcpy_gb_per_s(large)
    tf_rows = None
    if not args.quick:
        tf_small = measure_tensorflow(small, 32)
        if tf_small is not None:
            tf_rows = {"small": tf_small, "large": measure_tensorflow(large, 256)}
    print(f"{'case':>6} {'steps':>6} {'batches/s':>11} {'GB/s':>7}" +
          (f" {'tf batches/s':>13} {'tf GB/s':>8} {'ratio':>6}" if tf_rows else ""))
    for name, r in rows.items():
        line = f"{name:>6} {r['steps']:>6} {r['batches_per_s']:>11.0f} {r['gb_per_s']:>7.2f}"
        if tf_rows:
            t = tf_rows[name]
            line += (f" {t['batches_per_s']:>13.0f} {t['gb_per_s']:>8.2f} "
                     f"{r['batches_per_s'] / t['batches_per_s']:>5.1f}x")
        print(line)
    torch_rows = None
    if not args.quick:
        try:
            from benchmarks import peers  # noqa: PLC0415
        except ImportError:
            import peers  # noqa: PLC0415 - run as a script: benchmarks/ is on sys.path
        torch_small = peers.torch_input_throughput(small, 32)
        if torch_small is not None:
            torch_rows = {"small": torch_small, "large": peers.torch_input_throughput(large, 256)}
            for name, r in rows.items():
                for loader, t in torch_rows[name].items():
                    print(f"torch DataLoader ({loader}), {name}: {t['batches_per_s']:.0f} "
                          f"batches/s, {t['gb_per_s']:.2f} GB/s; ratio gpustrat/torch "
                          f"{r['batches_per_s'] / t['batches_per_s']:.1f}x")
    print(f"memcpy of the large array: {memcpy:.2f} GB/s")
    if args.quick:
        why = "--quick runs too few steps to judge"
        verdicts = [targets.not_measured("small input, batches/s", 1e4, why),
                    targets.not_measured("large input, data consumed", 8, why, "GB/s")]
    else:
        verdicts = [targets.check("small input, batches/s", rows["small"]["batches_per_s"], 1e4),
                    targets.check("large input, data consumed", rows["large"]["gb_per_s"], 8,
                                  "GB/s")]
    result = {"suite": "input", "rows": rows, "memcpy_gb_per_s": memcpy, "tensorflow": tf_rows,
              "torch": torch_rows, "verdicts": verdicts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
