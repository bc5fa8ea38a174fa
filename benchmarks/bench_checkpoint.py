"""Checkpoint speed: ``gs.train.Checkpoint.write`` of 256 MiB of variables against the
disk's write speed, the time a save blocks the training loop (synchronous and
asynchronous), and the size of an iterator position.

Targets:
- ``Checkpoint.write`` of 64 float32 variables of 4 MiB (256 MiB) at least 0.5x the
  write speed of ``numpy.save`` of the same bytes to the same directory, flushed to disk
  (``fsync``) as the checkpoint is: the disk's speed, measured in the same run;
- an asynchronous save (``CheckpointOptions(enable_async=True)``) of the same variables
  blocks the caller at most 0.1x as long as a synchronous one, measured in the same run
  (the steady state: a save after the first, whose host buffers are already allocated;
  the first is reported beside it). The caller is blocked while the state is copied:
  host variables by a memory copy, GPU variables only while a device-to-host copy is
  queued (``--gpu``, when CuPy sees a GPU);
- the position of a 1 M-element ``range(...).shuffle(10_000).batch(32)`` iterator at
  most 1 MiB beyond its shuffle buffer (encoded JSON plus arrays, as written).

Times are the best of several repeats (the spread is printed), the writers interleaved.

    python benchmarks/bench_checkpoint.py [--quick] [--dir PATH] [--gpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.targets import check, not_measured  # noqa: E402

TARGET_DISK_RATIO = 0.5
TARGET_ASYNC_RATIO = 0.1
TARGET_STATE_BYTES = 1 << 20


def _numpy_save(path: str, arrays: list) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            np.save(f, a)
        f.flush()
        os.fsync(f.fileno())


def measure_write(directory: str, n_vars: int, elements: int, repeats: int) -> dict:
    import gpustrat as gs
    arrays = [np.random.default_rng(i).standard_normal(elements).astype(np.float32)
              for i in range(n_vars)]
    variables = {f"v{i}": gs.Variable(a, name=f"v{i}") for i, a in enumerate(arrays)}
    ckpt = gs.train.Checkpoint(**variables)
    nbytes = sum(a.nbytes for a in arrays)
    best_ckpt = best_np = float("inf")
    for r in range(repeats):
        path = os.path.join(directory, f"np-{r}.npy")
        t0 = time.perf_counter()
        _numpy_save(path, arrays)
        best_np = min(best_np, time.perf_counter() - t0)
        os.remove(path)
        prefix = os.path.join(directory, f"ck-{r}")
        t0 = time.perf_counter()
        ckpt.write(prefix)
        best_ckpt = min(best_ckpt, time.perf_counter() - t0)
        for f in os.listdir(directory):
            os.remove(os.path.join(directory, f))
    return {"bytes": nbytes, "numpy_s": best_np, "checkpoint_s": best_ckpt,
            "numpy_GBps": nbytes / best_np / 1e9, "checkpoint_GBps": nbytes / best_ckpt / 1e9,
            "ratio": best_np / best_ckpt}


def measure_blocking(directory: str, n_vars: int, elements: int, repeats: int,
                     device: str = "cpu:0") -> dict:
    """Seconds ``Checkpoint.write`` blocks its caller, synchronous and asynchronous
    (the background write and commit waited for outside the timing), interleaved."""
    import gpustrat as gs
    arrays = [np.random.default_rng(i).standard_normal(elements).astype(np.float32)
              for i in range(n_vars)]
    strategy = gs.MirroredStrategy([device])
    with strategy.scope():
        variables = {f"v{i}": gs.Variable(a, name=f"v{i}") for i, a in enumerate(arrays)}
    ckpt = gs.train.Checkpoint(**variables)
    options = gs.train.CheckpointOptions(enable_async=True)
    sync_s, async_s, done_s = [], [], []
    first = None
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        ckpt.write(os.path.join(directory, f"a-{r}"), options=options)
        t1 = time.perf_counter()
        ckpt.sync()
        t2 = time.perf_counter()
        if r == 0:
            first = t1 - t0   # allocates the host (pinned) buffers the next saves reuse
        else:
            async_s.append(t1 - t0)
            done_s.append(t2 - t0)
        t0 = time.perf_counter()
        ckpt.write(os.path.join(directory, f"s-{r}"))
        if r:
            sync_s.append(time.perf_counter() - t0)
        for f in os.listdir(directory):
            os.remove(os.path.join(directory, f))
    return {"device": device, "bytes": sum(a.nbytes for a in arrays),
            "sync_s": sync_s, "async_s": async_s, "async_done_s": done_s,
            "async_first_s": first, "ratio": min(async_s) / min(sync_s)}


def _spread(xs: list) -> str:
    return f"best {min(xs) * 1e3:.1f} ms, median {float(np.median(xs)) * 1e3:.1f}, " \
           f"worst {max(xs) * 1e3:.1f}"


def _has_gpu() -> bool:
    try:
        from gpustrat.devices import gpu_count
        return gpu_count() > 0
    except Exception:
        return False


def measure_state(elements: int, buffer: int) -> dict:
    from gpustrat.data import Dataset
    from gpustrat.train import format as fmt
    it = iter(Dataset.range(elements).shuffle(buffer, seed=1).batch(32))
    for _ in range(1000):
        next(it)
    arrays: dict = {}
    tree = fmt.encode(it.get_state(), arrays, "it")
    total = len(json.dumps(tree)) + sum(a.nbytes for a in arrays.values())
    return {"elements": elements, "buffer_bytes": buffer * 8, "state_bytes": total,
            "beyond_buffer": total - buffer * 8}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32 MiB, 2 repeats")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary "
                                                "directory)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--gpu", action="store_true", help="also save GPU variables (gpu:0)")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    n_vars, elements = (8, 1 << 20) if args.quick else (64, 1 << 20)
    directory = tempfile.mkdtemp(prefix="gpustrat-bench-ckpt-", dir=args.dir)
    try:
        row = measure_write(directory, n_vars, elements, repeats)
        blocking = [measure_blocking(directory, n_vars, elements, repeats + 2)]
        if args.gpu and _has_gpu():
            blocking.append(measure_blocking(directory, n_vars, elements, repeats + 2,
                                             "gpu:0"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    state = measure_state(1_000_000, 10_000)
    mib = row["bytes"] / (1 << 20)
    print(f"saving {n_vars} float32 variables, {mib:.0f} MiB (best of {repeats}):")
    print(f"  numpy.save + fsync (the disk)   {row['numpy_s'] * 1e3:8.1f} ms  "
          f"{row['numpy_GBps']:.2f} GB/s")
    print(f"  Checkpoint.write                {row['checkpoint_s'] * 1e3:8.1f} ms  "
          f"{row['checkpoint_GBps']:.2f} GB/s  ({row['ratio']:.2f}x the disk)")
    for b in blocking:
        print(f"training loop blocked by a save, variables on {b['device']} "
              f"({len(b['sync_s'])} saves each, interleaved):")
        print(f"  synchronous                     {_spread(b['sync_s'])}")
        print(f"  asynchronous                    {_spread(b['async_s'])}  "
              f"({b['ratio']:.3f}x the synchronous; the first save "
              f"{b['async_first_s'] * 1e3:.1f} ms)")
        print(f"  asynchronous, until committed   {_spread(b['async_done_s'])}")
    print(f"iterator position of range(1M).shuffle(10000).batch(32): "
          f"{state['state_bytes']:,} bytes, {state['beyond_buffer']:,} beyond the buffer")
    verdicts = [
        check("checkpoint write vs numpy.save (disk)", row["ratio"], TARGET_DISK_RATIO, "x"),
    ]
    for b in blocking:
        verdicts.append(check(f"asynchronous save ({b['device']} variables): blocked time "
                              "vs synchronous", b["ratio"], TARGET_ASYNC_RATIO, "x",
                              higher_is_better=False))
    if len(blocking) == 1:
        verdicts.append(not_measured(
            "asynchronous save (gpu:0 variables): blocked time vs synchronous",
            TARGET_ASYNC_RATIO, "no GPU here" if args.gpu else "run with --gpu", "x",
            higher_is_better=False))
    verdicts.append(check("iterator position beyond the shuffle buffer",
                          state["beyond_buffer"], TARGET_STATE_BYTES, "bytes",
                          higher_is_better=False))
    result = {"suite": "checkpoint", "write": row, "blocking": blocking, "state": state,
              "verdicts": verdicts}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
