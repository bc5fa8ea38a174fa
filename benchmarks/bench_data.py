"""Benchmark of gpustrat.data: iteration rate, parallel map speed-up and
streaming memory.

1. ``slices``: ``from_tensor_slices`` of a 20,000 x 8 float32 array batched by 32, full
   iteration, in batches per second (target: >= 50,000 on a 2-core machine).
2. ``parallel_map``: ``map`` of a Python function sleeping 1 ms per element, serial
   versus ``num_parallel_calls=8``; the speed-up (target: >= 6x).
3. ``npy_rss``: peak resident memory (VmHWM) of a fresh process iterating a 2 GiB
   ``.npy`` file in 64 MiB batches (prefetch 2, every batch read), in MiB (target:
   < 512). The file is written to a temporary directory and removed afterwards.

``--quick`` uses small sizes (a few seconds in all). If TensorFlow imports, tf.data's
numbers for the same pipelines are printed beside ours. ``main(argv)`` returns the
results as a dict, for ``python -m gpustrat bench``.

Usage: python benchmarks/bench_data.py [--quick] [--json [FILE]]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

MIB = 1 << 20


def _best_rate(make_iter, repeats: int) -> tuple[float, int]:
    best, count = 0.0, 0
    for _ in range(repeats):
        t = time.perf_counter()
        count = 0
        for _ in make_iter():
            count += 1
        best = max(best, count / (time.perf_counter() - t))
    return best, count


def bench_slices(rows: int, repeats: int) -> dict:
    from gpustrat.data import Dataset
    x = np.random.default_rng(0).random((rows, 8), dtype=np.float32)
    ds = Dataset.from_tensor_slices(x).batch(32)
    rate, n = _best_rate(lambda: iter(ds), repeats)
    out = {"batches": n, "batches_per_s": rate, "target_batches_per_s": 50_000}
    tf = _tensorflow()
    if tf is not None:
        tds = tf.data.Dataset.from_tensor_slices(x).batch(32)
        out["tf_batches_per_s"], _ = _best_rate(lambda: iter(tds), repeats)
    return out


def _sleep_1ms(x):
    time.sleep(0.001)
    return x


def bench_parallel_map(elements: int) -> dict:
    from gpustrat.data import Dataset
    base = Dataset.range(elements)

    def run(ds):
        t = time.perf_counter()
        n = sum(1 for _ in ds)
        assert n == elements
        return time.perf_counter() - t

    serial = run(base.map(_sleep_1ms))
    parallel = run(base.map(_sleep_1ms, num_parallel_calls=8))
    out = {"elements": elements, "serial_s": serial, "parallel_s": parallel,
           "speedup": serial / parallel, "target_speedup": 6.0}
    tf = _tensorflow()
    if tf is not None:
        def tf_fn(x):
            return tf.py_function(_sleep_1ms, [x], tf.int64)
        tbase = tf.data.Dataset.range(elements)
        ts = run(tbase.map(tf_fn))
        tp = run(tbase.map(tf_fn, num_parallel_calls=8))
        out["tf_speedup"] = ts / tp
    return out


_RSS_CHILD = r"""
import sys, numpy as np
from gpustrat.data import Dataset
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM:'):
            return int(line.split()[1]) * 1024
path, batch_rows = sys.argv[1], int(sys.argv[2])
before = hwm()
total = 0.0
n = 0
for b in Dataset.from_npy(path).batch(batch_rows).prefetch(2):
    total += float(b[::1024].sum()) + float(b.sum())   # read every page of the batch
    n += 1
print(before, hwm(), n)
"""


def bench_npy_rss(file_bytes: int, batch_bytes: int) -> dict:
    cols = 1024  # float32 rows of 4 KiB
    row_bytes = cols * 4
    rows = file_bytes // row_bytes
    batch_rows = max(1, batch_bytes // row_bytes)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "big.npy")
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.float32)),
                  "fortran_order": False, "shape": (rows, cols)}
        chunk_rows = max(1, (64 * MIB) // row_bytes)
        chunk = np.arange(chunk_rows * cols, dtype=np.float32).reshape(chunk_rows, cols)
        with open(path, "wb") as f:
            np.lib.format.write_array_header_2_0(f, header)
            left = rows
            while left:
                k = min(left, chunk_rows)
                f.write(chunk[:k].tobytes())
                left -= k
        proc = subprocess.run([sys.executable, "-c", _RSS_CHILD, path, str(batch_rows)],
                              capture_output=True, text=True, check=True)
    before, peak, n = map(int, proc.stdout.split())
    return {"file_mib": file_bytes / MIB, "batch_mib": batch_rows * row_bytes / MIB,
            "batches": n, "baseline_rss_mib": before / MIB, "peak_rss_mib": peak / MIB,
            "target_peak_rss_mib": 512}


def _tensorflow():
    try:
        import tensorflow as tf  # noqa: PLC0415 - optional comparison only
        return tf
    except Exception:
        return None


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmarks, print a table and return the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds")
    parser.add_argument("--json", nargs="?", const="-", metavar="FILE",
                        help="write the results as JSON to FILE (no FILE, or '-': print "
                             "them instead of the table), as the other suites do")
    args = parser.parse_args(argv)
    if args.quick:
        results = {"slices": bench_slices(20_000, 3),
                   "parallel_map": bench_parallel_map(160),
                   "npy_rss": bench_npy_rss(256 * MIB, 16 * MIB)}
    else:
        results = {"slices": bench_slices(20_000, 20),
                   "parallel_map": bench_parallel_map(1000),
                   "npy_rss": bench_npy_rss(2048 * MIB, 64 * MIB)}
    table = args.json != "-"
    if table:
        s, m, r = results["slices"], results["parallel_map"], results["npy_rss"]
        tf_s = f"   tf.data: {s['tf_batches_per_s']:,.0f}" if "tf_batches_per_s" in s else ""
        tf_m = f"   tf.data: {m['tf_speedup']:.1f}x" if "tf_speedup" in m else ""
        print(f"from_tensor_slices 20000x8 f32, batch 32: {s['batches_per_s']:,.0f} batches/s"
              f"{tf_s}")
        print(f"map, 1 ms sleep, num_parallel_calls=8: {m['speedup']:.1f}x faster than "
              f"serial ({m['serial_s']:.2f} s -> {m['parallel_s']:.2f} s){tf_m}")
        print(f".npy {r['file_mib']:.0f} MiB in {r['batch_mib']:.0f} MiB batches: peak RSS "
              f"{r['peak_rss_mib']:.0f} MiB (before iterating {r['baseline_rss_mib']:.0f} MiB)")
    results["verdicts"] = [
        targets.check("from_tensor_slices batches/s", results["slices"]["batches_per_s"],
                      50_000, echo=table),
        targets.check("parallel map speed-up", results["parallel_map"]["speedup"], 6, "x",
                      echo=table),
        targets.check(f".npy {results['npy_rss']['file_mib']:.0f} MiB peak RSS",
                      results["npy_rss"]["peak_rss_mib"], 512, "MiB", higher_is_better=False,
                      echo=table)]
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.json == "-":
        print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
