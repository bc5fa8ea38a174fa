"""What the timeline costs: the demo's step time with the timeline off and on
(2 CPU replicas in one process; under ``mpiexec -n W`` the same over W workers), and
the cost of the hooks when it is off.

Targets: on, at most 5% more per demo step than off, in the process's CPU time (every
thread, the timeline's writer included: what the timeline adds to the work, which a
shared machine's load does not inflate as it does wall time; the wall time is printed
beside); off, the hooks a step passes (one test of a module flag each) at most 0.5%
of the demo's step.

    python benchmarks/bench_timeline.py [--quick] [--json FILE]

Started by ``mpiexec -n W`` it measures the same over W workers (one replica each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import timeit

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

#: Hooks one demo step passes with the timeline off: run, get_next, the replica
#: all_reduce's local wait, apply_gradients, its fused reduction, the loss metric's
#: and the all_reduce's collectives' header waits (over MPI), counted generously.
HOOKS_PER_STEP = 12


def _demo_loop(strategy, samples: int):
    """The demo's model, data and step (``gpustrat.demo``); returns a function that
    trains ``epochs`` epochs and gives the seconds per step."""
    import numpy as np  # noqa: PLC0415
    from gpustrat import demo  # noqa: PLC0415
    from gpustrat.data import Dataset  # noqa: PLC0415
    x, y = demo.make_dataset(samples)
    init = demo.init_weights(x.shape[1], demo.HIDDEN, 1, demo.INIT_SEED)
    weights, optimizer, loss = demo.build_model(strategy, init, demo.LEARNING_RATE,
                                                np.float64)
    step = demo.make_train_step(weights, optimizer, loss)
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(demo.GLOBAL_BATCH))

    def epochs(n: int) -> tuple[float, float]:
        steps = 0
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            for batch in dist:
                strategy.run(step, args=(batch,))
                steps += 1
            loss.result()
            loss.reset_state()
        return (time.perf_counter() - t0) / steps, (time.process_time() - c0) / steps
    return epochs


def measure(samples: int, epochs: int, repeats: int) -> dict:
    from gpustrat import demo, timeline  # noqa: PLC0415
    from gpustrat.launch import detect_launch  # noqa: PLC0415
    multi = detect_launch() is not None and detect_launch().size > 1
    strategy = demo.make_strategy(["cpu:0", "cpu:1"] if not multi else None,
                                  multi_worker=multi)
    folder = tempfile.mkdtemp(prefix="gpustrat-bench-timeline-")
    if multi:
        folder = strategy.workers.bcast(folder, root=0)
    train = _demo_loop(strategy, samples)
    train(1)                                            # warm up
    off, on = [], []
    for i in range(repeats):                            # interleaved: drift hits both
        off.append(train(epochs))
        with timeline.record(os.path.join(folder, f"t{i}.json")):
            on.append(train(epochs))
    flag = min(timeit.repeat("tl.ON", setup="from gpustrat import timeline as tl",
                             number=200_000, repeat=5)) / 200_000
    return {"workers": strategy.num_workers, "replicas": strategy.num_replicas_in_sync,
            "rank": strategy.worker_index,
            "off_step_us": statistics.median(t for t, _ in off) * 1e6,
            "on_step_us": statistics.median(t for t, _ in on) * 1e6,
            "off_cpu_us": statistics.median(c for _, c in off) * 1e6,
            "on_cpu_us": statistics.median(c for _, c in on) * 1e6,
            "off_steps_us": [t * 1e6 for t, _ in off], "on_steps_us": [t * 1e6 for t, _ in on],
            "flag_test_ns": flag * 1e9, "trace_folder": folder}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for CI")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    row = measure(samples=4000 if args.quick else 20000, epochs=1 if args.quick else 2,
                  repeats=3 if args.quick else 7)
    echo = row["rank"] == 0
    wall = row["on_step_us"] / row["off_step_us"] - 1
    overhead = row["on_cpu_us"] / row["off_cpu_us"] - 1
    off_cost = HOOKS_PER_STEP * row["flag_test_ns"] / 1e3 / row["off_step_us"]
    if echo:
        print(f"demo, {row['workers']} worker(s), {row['replicas']} replicas, median of "
              f"{len(row['off_steps_us'])} interleaved runs, load "
              f"{open('/proc/loadavg').read().split()[0]} on {os.cpu_count()} CPUs:")
        print(f"  CPU time per step (every thread of the process): "
              f"{row['off_cpu_us']:.0f} us off, {row['on_cpu_us']:.0f} us on "
              f"({overhead:+.1%})")
        print(f"  wall time per step: {row['off_step_us']:.0f} us off, "
              f"{row['on_step_us']:.0f} us on ({wall:+.1%})")
        print(f"off: one hook's flag test {row['flag_test_ns']:.0f} ns; "
              f"{HOOKS_PER_STEP} per step = {off_cost:.3%} of a step")
    verdicts = [
        targets.check("timeline on, demo step overhead", overhead * 100, 5, "%",
                      higher_is_better=False, echo=echo),
        targets.check("timeline off, hooks per demo step", off_cost * 100, 0.5, "%",
                      higher_is_better=False, echo=echo)]
    result = {"suite": "timeline", "rows": [row], "verdicts": verdicts}
    if args.json and echo:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
