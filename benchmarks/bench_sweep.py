"""Throughput against global batch size and replica count (CPU replicas, one process).

Two workloads, each timed over one epoch (best of a few, after a warm-up epoch):
- ``input``: iterate ``experimental_distribute_dataset`` of a float32 array and, each
  step, ``run`` a per-replica column sum and ``reduce`` it (bench_input's step);
- ``train``: the demo's MLP training step (``gpustrat.demo``: forward, hand-written
  backward, an ``all_reduce`` of the row count, ``apply_gradients`` of an SGD optimizer
  on mirrored variables, a Mean metric of the loss), in float64.
Each row gives samples/s (examples of the data set consumed per second). On the 2-core
machine more CPU replicas than cores only add threads: the sweep shows the per-step
overhead that small batches pay and large batches amortise. ``python -m gpustrat bench
sweep --plot FILE.png`` draws the rows (matplotlib).

    python benchmarks/bench_sweep.py [--quick] [--json FILE] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

WORKLOADS = ("input", "train")


def _input_epoch(strategy, dist) -> float:
    total = 0.0
    for x in dist:
        part = strategy.run(lambda v: v.sum(axis=0), args=(x,))
        total += float(strategy.reduce("sum", part, axis=None)[0])
    return total


def _train_epoch(strategy, dist, step, train_loss) -> None:
    for batch in dist:
        strategy.run(step, args=(batch,))
    float(train_loss.result())
    train_loss.reset_state()


def measure(workload: str, replicas: int, batch: int, rows: int, repeats: int) -> dict:
    """Samples/s of one workload on ``replicas`` CPU replicas with global batch ``batch``."""
    import gpustrat as gs  # noqa: PLC0415
    from gpustrat import demo  # noqa: PLC0415
    from gpustrat.data import Dataset  # noqa: PLC0415

    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    try:
        if workload == "input":
            array = np.random.default_rng(0).standard_normal((rows, 32), dtype=np.float32)
            dist = strategy.experimental_distribute_dataset(
                Dataset.from_tensor_slices(array).batch(batch))
            expected = float(array[:, 0].sum(dtype=np.float64))

            def epoch():
                got = _input_epoch(strategy, dist)
                if not np.isclose(got, expected, rtol=1e-3):
                    raise AssertionError(f"input sweep summed {got}, expected {expected}")
        elif workload == "train":
            x, y = demo.make_dataset(rows)
            init = demo.init_weights()
            weights, optimizer, train_loss = demo.build_model(strategy, init,
                                                              demo.LEARNING_RATE)
            dist = strategy.experimental_distribute_dataset(
                Dataset.from_tensor_slices((x, y)).batch(batch))
            step = demo.make_train_step(weights, optimizer, train_loss)

            def epoch():
                _train_epoch(strategy, dist, step, train_loss)
        else:
            raise ValueError(f"unknown workload {workload!r}: choose from {WORKLOADS}")
        epoch()  # warm-up: replica threads, caches
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            epoch()
            best = min(best, time.perf_counter() - t0)
    finally:
        strategy.close()
    steps = -(-rows // batch)
    return {"workload": workload, "replicas": replicas, "batch": batch, "rows": rows,
            "steps": steps, "seconds": best, "samples_per_s": rows / best,
            "steps_per_s": steps / best}


def sweep(replicas=(1, 2, 4), batches=(16, 64, 256, 1024, 4096), rows: int = 32768,
          repeats: int = 3) -> list[dict]:
    return [measure(w, n, b, rows, repeats)
            for w in WORKLOADS for n in replicas for b in batches]


def print_table(rows: list[dict]) -> None:
    for workload in WORKLOADS:
        sel = [r for r in rows if r["workload"] == workload]
        if not sel:
            continue
        reps = sorted({r["replicas"] for r in sel})
        batches = sorted({r["batch"] for r in sel})
        print(f"{workload}: samples/s by global batch (rows) and CPU replicas (columns)")
        print(f"{'batch':>7}" + "".join(f"{f'{n} repl.':>12}" for n in reps))
        for b in batches:
            cells = {r["replicas"]: r["samples_per_s"] for r in sel if r["batch"] == b}
            print(f"{b:>7}" + "".join(f"{cells[n]:>12,.0f}" for n in reps))


def plot(rows: list[dict], path: str) -> None:
    """Draw samples/s against global batch, one line per replica count, one panel per
    workload, into the PNG ``path``.

    Raises:
        ImportError: matplotlib is missing (``pip install -e '.[plot]'``).
    """
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install -e '.[plot]' "
                          "(or pip install matplotlib)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4.2),
                             squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        sel = [r for r in rows if r["workload"] == workload]
        for n in sorted({r["replicas"] for r in sel}):
            pts = sorted((r["batch"], r["samples_per_s"]) for r in sel if r["replicas"] == n)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{n} replica{'s' if n > 1 else ''}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("global batch size")
        ax.set_ylabel("samples/s")
        ax.set_title({"input": "distributed input + run + reduce",
                      "train": "MLP training step (demo)"}[workload])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("gpustrat throughput, CPU replicas")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, for CI")
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--plot", help="draw the sweep into this PNG (needs matplotlib)")
    args = ap.parse_args(argv)
    if args.quick:
        rows = sweep(replicas=(1, 2), batches=(32, 256), rows=2048, repeats=1)
    else:
        rows = sweep()
    print_table(rows)
    result = {"suite": "sweep", "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    return result


if __name__ == "__main__":
    main()
