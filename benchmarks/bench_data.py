"""Benchmark of gpustrat.data: iteration rate, parallel map speed-up and
streaming memory.

1. ``slices``: ``from_tensor_slices`` of a 20,000 x 8 float32 array batched by 32, full
   iteration, in batches per second (target: >= 50,000 on a 2-core machine).
2. ``parallel_map``: ``map`` of a Python function sleeping 1 ms per element, serial
   versus ``num_parallel_calls=8``; the speed-up (target: >= 6x).
3. ``npy_rss``: peak resident memory (VmHWM) of a fresh process iterating a 2 GiB
   ``.npy`` file in 64 MiB batches (prefetch 2, every batch read), in MiB (target:
   < 512). The file is written to a temporary directory and removed afterwards.

4. ``processes``: ``map(..., use_processes=True)`` (worker processes):

   - a Python function that holds the GIL for about 5 ms per element (calibrated in
     this run), on 2 processes versus serial (target: >= 1.8x), with the thread pool's
     speed beside it (the GIL's ceiling, which TensorFlow's ``py_function`` shares);
     the same function (``peers.python_work``) against TensorFlow's
     ``map(py_function, num_parallel_calls=AUTOTUNE)`` (>= 1.8x) and PyTorch's
     ``DataLoader(num_workers=2)`` (>= 1.0x), run in a child process of the interpreter
     ``--peers-python`` (or ``$GPUSTRAT_PEERS_PYTHON``; this one by default), so that
     the peers can be installed in a virtual environment of their own and are never
     imported here; a peer that does not import there is "not installed";
   - the per-element cost of a trivial function (target: <= 50 us);
   - 1 MiB NumPy output per element, in GB/s delivered to the consumer (>= 1 GB/s).

   Speeds are the steady state, the fastest of 3 epochs (serial, threads and
   processes interleaved, one epoch of each per round): the clock starts after the
   first element, once the pool's processes have started. Every epoch starts a new
   pool, as a user's does; the start (to the first element) is reported apart. Each
   round also times two plain processes sharing the same calls (``peers.
   two_core_ceiling``): what the machine's 2 cores give this function at that moment,
   the ceiling of any pipeline (on a shared virtual machine it moves between runs),
   with their processor time per call beside serial's (what a call costs when both
   cores are busy). The load average is printed with them: on a shared machine they are noisy.

``--quick`` uses small sizes (a few seconds in all). If TensorFlow imports here,
tf.data's numbers for the pipelines of 1 and 2 are printed beside ours. ``main(argv)`` returns the
results as a dict, for ``python -m gpustrat bench``.

Usage: python benchmarks/bench_data.py [--quick] [--json [FILE]] [--peers-python PYTHON]
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


def _peers():
    try:
        from benchmarks import peers  # noqa: PLC0415 - imported as benchmarks.bench_data
    except ImportError:
        import peers  # noqa: PLC0415 - run as a script: benchmarks/ is on sys.path
    return peers


def _gil_bound(x, loops: int):
    return np.int64(_peers().python_work(int(x), loops))


def _best_call(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _calibrate(seconds: float) -> int:
    """Loops of :func:`peers.python_work` that take about ``seconds`` here (the fastest
    of a few timings: on a loaded machine the others include waits for a core)."""
    work = _peers().python_work
    loops = 10_000
    while True:
        spent = _best_call(lambda: work(1, loops))
        if spent > 0.02:
            return max(1, int(loops * seconds / spent))
        loops *= 4


def _epoch(ds, elements: int) -> tuple[float, float]:
    """(seconds to the first element, seconds for the rest) of one epoch of ``ds``."""
    t0 = time.perf_counter()
    it = iter(ds)
    next(it)
    t1 = time.perf_counter()
    n = 1 + sum(1 for _ in it)
    t2 = time.perf_counter()
    assert n == elements, (n, elements)
    return t1 - t0, t2 - t1


def _steady(ds, elements: int, repeats: int = 1) -> tuple[float, float]:
    """(seconds to the first element, seconds for the rest) of an epoch of ``ds``: the
    fastest of ``repeats`` epochs (a shared machine slows some of them)."""
    first = rest = float("inf")
    for _ in range(repeats):
        f, r = _epoch(ds, elements)
        first, rest = min(first, f), min(rest, r)
    return first, rest


def _trivial(x):
    return x


def _one_mib(x):
    return np.full(MIB // 8, x, np.int64)


def bench_processes(elements: int, trivial: int, big: int, repeats: int,
                    peers_python: str | None = None) -> dict:
    """Worker-process ``map`` against serial, threads and, in a child process of
    ``peers_python`` (this interpreter when None), TensorFlow and PyTorch.

    Serial, threads and processes run in ``repeats`` interleaved rounds (one epoch of
    each per round), so that a slow spell of the shared machine slows all three; each
    figure is the fastest epoch, and the speed-up is also given per round. An epoch on
    processes starts a new pool (as every epoch a user iterates does); its speed is the
    steady state after the first element, and the pool's start (to the first element)
    is reported apart.
    """
    import functools  # noqa: PLC0415

    from gpustrat.data import Dataset  # noqa: PLC0415
    loops = _calibrate(0.005)
    fn = functools.partial(_gil_bound, loops=loops)
    base = Dataset.range(elements)
    serial_ds = base.map(fn)
    threads_ds = base.map(fn, num_parallel_calls=2)
    procs_ds = base.map(fn, num_parallel_calls=2, use_processes=True)
    serial = threads = procs = start = float("inf")
    rounds, ceilings, busy_cpu = [], [], []
    c_serial = 0.0
    n = elements - 1
    for _ in range(repeats):
        c0 = time.process_time()
        _, s = _epoch(serial_ds, elements)
        c_serial += time.process_time() - c0
        _, t = _epoch(threads_ds, elements)
        f, p = _epoch(procs_ds, elements)
        both, per_call = _peers().two_core_ceiling(loops, n)
        ceilings.append(s / both)
        busy_cpu.extend(per_call)
        rounds.append(s / p)
        serial, threads, procs, start = min(serial, s), min(threads, t), min(procs, p), \
            min(start, f)
    out = {"elements": elements, "loops": loops, "call_ms": serial / n * 1e3,
           "serial_s": serial, "threads_s": threads, "processes_s": procs,
           "pool_start_s": start, "speedup": serial / procs,
           "speedup_per_round": rounds, "two_core_ceiling_per_round": ceilings,
           "threads_speedup": serial / threads,
           "per_element_ms": {"serial": serial / n * 1e3, "processes": procs / n * 1e3}}
    consumer, workers = _cpu_per_element(procs_ds, elements)
    out["cpu_ms_per_element"] = {"serial": c_serial / (repeats * elements) * 1e3,
                                 "consumer": consumer, "workers": workers,
                                 "two_plain_processes": [c * 1e3 for c in busy_cpu]}
    python = peers_python or os.environ.get("GPUSTRAT_PEERS_PYTHON") or sys.executable
    peer = _peers().run_gil_map(python, loops, elements, repeats)
    out["peers"] = dict(peer, interpreter=python)
    if "tf_s" in peer:
        out["vs_tf"] = peer["tf_s"] / procs
    if "torch_s" in peer:
        out["vs_torch"] = peer["torch_s"] / procs
    # The per-element cost of a trivial function: processes against iterating the
    # source alone, in the same run.
    src = Dataset.range(trivial)
    _, bare = _steady(src, trivial, repeats)
    _, small = _steady(src.map(_trivial, num_parallel_calls=2, use_processes=True),
                       trivial, repeats)
    out["trivial_elements"] = trivial
    out["overhead_us"] = max(0.0, small - bare) / (trivial - 1) * 1e6
    # 1 MiB outputs: what the consumer receives per second (the first element,
    # waiting for the pool, left out).
    _, spent = _steady(Dataset.range(big).map(_one_mib, num_parallel_calls=2,
                                              use_processes=True), big, repeats)
    out["big_elements"] = big
    out["big_gb_per_s"] = (big - 1) * MIB / spent / 1e9
    out.update(_cpu_per_mib(Dataset.range(big).map(_one_mib, num_parallel_calls=2,
                                                   use_processes=True), big))
    out["loadavg"] = list(os.getloadavg())
    return out


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_per_element(ds, elements: int) -> tuple[float, float]:
    """Processor time per element (ms) of a map on processes, in the consumer and in
    its workers together (what a loaded machine changes little, unlike wall time)."""
    it = iter(ds)
    next(it)
    workers = [w.proc.pid for w in it._state._run.pool.workers]
    c0, w0 = time.process_time(), sum(_cpu_seconds(p) for p in workers)
    for _ in range(elements - 2):
        next(it)
    c1, w1 = time.process_time(), sum(_cpu_seconds(p) for p in workers)
    it.close()
    n = elements - 2
    return (c1 - c0) / n * 1e3, (w1 - w0) / n * 1e3


def _cpu_per_mib(ds, elements: int) -> dict:
    """Processor time per MiB delivered, in the consumer and in the workers: the rate
    two free cores would give is 2 / (their sum) per millisecond."""
    consumer, worker = _cpu_per_element(ds, elements)
    return {"big_consumer_cpu_ms_per_mib": consumer, "big_workers_cpu_ms_per_mib": worker,
            "big_gb_per_s_on_2_free_cores": 2 * MIB / ((consumer + worker) * 1e-3) / 1e9
            if consumer + worker > 0 else float("inf")}


def _peer_missing(name: str, peer: dict) -> str:
    if "error" in peer:
        return f"{name}: the peers' child process failed ({peer['error']})"
    return (f"{name} is not installed for {peer.get('interpreter')} (not a dependency; "
            "give an interpreter that has it with --peers-python or "
            "GPUSTRAT_PEERS_PYTHON)")


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
    parser.add_argument("--peers-python", metavar="PYTHON",
                        help="interpreter with TensorFlow and/or PyTorch installed, for the "
                             "GIL-bound map's peer rows, run in a child process (default: "
                             "$GPUSTRAT_PEERS_PYTHON, else this interpreter)")
    args = parser.parse_args(argv)
    if args.quick:
        results = {"slices": bench_slices(20_000, 3),
                   "parallel_map": bench_parallel_map(160),
                   "npy_rss": bench_npy_rss(256 * MIB, 16 * MIB),
                   "processes": bench_processes(80, 5000, 100, 2,
                                                args.peers_python)}
    else:
        results = {"slices": bench_slices(20_000, 20),
                   "parallel_map": bench_parallel_map(1000),
                   "npy_rss": bench_npy_rss(2048 * MIB, 64 * MIB),
                   "processes": bench_processes(400, 50_000, 1000, 3,
                                                args.peers_python)}
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
        p = results["processes"]
        print(f"map of a {p['call_ms']:.1f} ms GIL-bound function, {p['elements']} elements: "
              f"serial {p['serial_s']:.2f} s, 2 threads {p['threads_s']:.2f} s "
              f"({p['threads_speedup']:.2f}x), 2 processes {p['processes_s']:.2f} s "
              f"({p['speedup']:.2f}x; pool start {p['pool_start_s']:.2f} s); processor time "
              f"per element: serial {p['cpu_ms_per_element']['serial']:.2f} ms, processes "
              f"{p['cpu_ms_per_element']['workers']:.2f} ms in workers + "
              f"{p['cpu_ms_per_element']['consumer']:.3f} ms here; speed-up per round "
              + " ".join(f"{v:.2f}x" for v in p["speedup_per_round"])
              + " (two plain processes, no pipeline: "
              + " ".join(f"{v:.2f}x" for v in p["two_core_ceiling_per_round"])
              + "; their processor time per call: "
              + " ".join(f"{v:.2f}" for v in p["cpu_ms_per_element"]["two_plain_processes"])
              + " ms)")
        q = p["peers"]
        if "error" in q:
            print(f"peers: {q['error']}")
        else:
            tf_p = (f"tf.data map(py_function, AUTOTUNE) {q['tf_s']:.2f} s "
                    f"({p['vs_tf']:.2f}x slower than 2 processes)" if "tf_s" in q
                    else "TensorFlow not installed")
            torch_p = (f"torch DataLoader(num_workers=2) {q['torch_s']:.2f} s "
                       f"({p['vs_torch']:.2f}x; its workers' start "
                       f"{q['torch_first_s']:.2f} s)" if "torch_s" in q
                       else "PyTorch not installed")
            print(f"peers ({q['interpreter']}, same function and elements, steady state): "
                  f"serial there {q['serial_s']:.2f} s; {tf_p}; {torch_p}")
        print(f"map on processes: trivial function {p['overhead_us']:.1f} us/element; "
              f"1 MiB outputs {p['big_gb_per_s']:.2f} GB/s (processor time per MiB: "
              f"consumer {p['big_consumer_cpu_ms_per_mib']:.2f} ms, workers "
              f"{p['big_workers_cpu_ms_per_mib']:.2f} ms: "
              f"{p['big_gb_per_s_on_2_free_cores']:.1f} GB/s on 2 free cores); load average "
              + " ".join(f"{v:.2f}" for v in p["loadavg"]))
    results["verdicts"] = [
        targets.check("from_tensor_slices batches/s", results["slices"]["batches_per_s"],
                      50_000, echo=table),
        targets.check("parallel map speed-up", results["parallel_map"]["speedup"], 6, "x",
                      echo=table),
        targets.check(f".npy {results['npy_rss']['file_mib']:.0f} MiB peak RSS",
                      results["npy_rss"]["peak_rss_mib"], 512, "MiB", higher_is_better=False,
                      echo=table)]
    p = results["processes"]
    results["verdicts"] += [
        targets.check("GIL-bound 5 ms map, 2 processes vs serial", p["speedup"], 1.8, "x",
                      echo=table),
        targets.check("GIL-bound 5 ms map, 2 processes vs tf.data py_function AUTOTUNE",
                      p["vs_tf"], 1.8, "x", echo=table) if "vs_tf" in p else
        targets.not_measured("GIL-bound 5 ms map, 2 processes vs tf.data py_function "
                             "AUTOTUNE", 1.8, _peer_missing("TensorFlow", p["peers"]), "x",
                             echo=table),
        targets.check("GIL-bound 5 ms map, 2 processes vs torch DataLoader(num_workers=2)",
                      p["vs_torch"], 1.0, "x", echo=table) if "vs_torch" in p else
        targets.not_measured("GIL-bound 5 ms map, 2 processes vs torch DataLoader"
                             "(num_workers=2)", 1.0, _peer_missing("PyTorch", p["peers"]), "x",
                             echo=table),
        targets.check("map on processes, trivial function overhead", p["overhead_us"], 50,
                      "us", higher_is_better=False, echo=table),
        targets.check("map on processes, 1 MiB outputs", p["big_gb_per_s"], 1.0, "GB/s",
                      echo=table)]
    if args.json and args.json != "-":
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.json == "-":
        print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
