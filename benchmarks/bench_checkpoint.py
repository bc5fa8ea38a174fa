"""Checkpoint speed: ``gs.train.Checkpoint.write`` of 256 MiB of variables against the
disk's write speed, and the size of an iterator position.

Targets:
- ``Checkpoint.write`` of 64 float32 variables of 4 MiB (256 MiB) at least 0.5x the
  write speed of ``numpy.save`` of the same bytes to the same directory, flushed to disk
  (``fsync``) as the checkpoint is: the disk's speed, measured in the same run;
- the position of a 1 M-element ``range(...).shuffle(10_000).batch(32)`` iterator at
  most 1 MiB beyond its shuffle buffer (encoded JSON plus arrays, as written).

The time the training loop is blocked by a save is reported (all of it: saving is
synchronous; an asynchronous save is not built yet, so its target is reported as not
measured). Times are the best of several repeats, the two writers interleaved.

    python benchmarks/bench_checkpoint.py [--quick] [--dir PATH] [--json out.json]
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
            "ratio": best_np / best_ckpt, "blocked_s": best_ckpt}


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
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 3)
    n_vars, elements = (8, 1 << 20) if args.quick else (64, 1 << 20)
    directory = tempfile.mkdtemp(prefix="gpustrat-bench-ckpt-", dir=args.dir)
    try:
        row = measure_write(directory, n_vars, elements, repeats)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    state = measure_state(1_000_000, 10_000)
    mib = row["bytes"] / (1 << 20)
    print(f"saving {n_vars} float32 variables, {mib:.0f} MiB (best of {repeats}):")
    print(f"  numpy.save + fsync (the disk)   {row['numpy_s'] * 1e3:8.1f} ms  "
          f"{row['numpy_GBps']:.2f} GB/s")
    print(f"  Checkpoint.write                {row['checkpoint_s'] * 1e3:8.1f} ms  "
          f"{row['checkpoint_GBps']:.2f} GB/s  ({row['ratio']:.2f}x the disk)")
    print(f"  training loop blocked by a save {row['blocked_s'] * 1e3:8.1f} ms "
          "(synchronous save)")
    print(f"iterator position of range(1M).shuffle(10000).batch(32): "
          f"{state['state_bytes']:,} bytes, {state['beyond_buffer']:,} beyond the buffer")
    verdicts = [
        check("checkpoint write vs numpy.save (disk)", row["ratio"], TARGET_DISK_RATIO, "x"),
        not_measured("asynchronous save: blocked time vs synchronous", 0.1,
                     "asynchronous saving is not built yet", "x", higher_is_better=False),
        check("iterator position beyond the shuffle buffer", state["beyond_buffer"],
              TARGET_STATE_BYTES, "bytes", higher_is_better=False),
    ]
    result = {"suite": "checkpoint", "write": row, "state": state, "verdicts": verdicts}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
