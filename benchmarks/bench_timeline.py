"""What the timeline costs: the demo's step time with the timeline off and on
(2 CPU replicas in one process; under ``mpiexec -n W`` the same over W workers), and
the cost of the hooks when it is off.

Steps recorded and not alternate within each epoch (one recording stays open and
``timeline.ON`` is switched between steps), so that another job on a shared machine
weighs on both alike. Targets: on, at most 5% more per demo step than off, in the
median of the process's CPU time per step (every thread, the timeline's writer
included: what the timeline adds to the work; the median wall time is printed beside;
a step not recorded still passes through the timed communicator methods, one Python
call each); off, the hooks a step passes (one test of a module flag each) at most 0.5%
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
    trains one epoch, recording every other step (``timeline.ON`` toggled between
    steps, with one recording open throughout), and gives each step's ``(recorded,
    wall seconds, CPU seconds)``."""
    import numpy as np  # noqa: PLC0415
    from gpustrat import demo, timeline  # noqa: PLC0415
    from gpustrat.data import Dataset  # noqa: PLC0415
    x, y = demo.make_dataset(samples)
    init = demo.init_weights(x.shape[1], demo.HIDDEN, 1, demo.INIT_SEED)
    weights, optimizer, loss = demo.build_model(strategy, init, demo.LEARNING_RATE,
                                                np.float64)
    step = demo.make_train_step(weights, optimizer, loss)
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(demo.GLOBAL_BATCH))

    def epoch(first_on: bool) -> list:
        out = []
        it = iter(dist)
        on = first_on
        while True:
            timeline.ON = on
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                batch = next(it)
            except StopIteration:
                break
            strategy.run(step, args=(batch,))
            out.append((on, time.perf_counter() - t0, time.process_time() - c0))
            on = not on
        timeline.ON = True
        loss.result()
        loss.reset_state()
        return out
    return epoch


def measure(samples: int, epochs: int) -> dict:
    from gpustrat import demo, timeline  # noqa: PLC0415
    from gpustrat.launch import detect_launch  # noqa: PLC0415
    multi = detect_launch() is not None and detect_launch().size > 1
    strategy = demo.make_strategy(["cpu:0", "cpu:1"] if not multi else None,
                                  multi_worker=multi)
    folder = tempfile.mkdtemp(prefix="gpustrat-bench-timeline-")
    if multi:
        folder = strategy.workers.bcast(folder, root=0)
    train = _demo_loop(strategy, samples)
    train(False)                                        # warm up
    steps: list = []
    with timeline.record(os.path.join(folder, "t.json")):
        for k in range(epochs):
            # Every rank toggles alike (their collectives pair up either way); the
            # first step of each epoch alternates between recorded and not.
            steps += train(k % 2 == 1)
    on = [s for s in steps if s[0]]
    off = [s for s in steps if not s[0]]
    flag = min(timeit.repeat("tl.ON", setup="from gpustrat import timeline as tl",
                             number=200_000, repeat=5)) / 200_000
    return {"workers": strategy.num_workers, "replicas": strategy.num_replicas_in_sync,
            "rank": strategy.worker_index, "steps": len(steps),
            "off_step_us": statistics.median(t for _, t, _ in off) * 1e6,
            "on_step_us": statistics.median(t for _, t, _ in on) * 1e6,
            "off_cpu_us": statistics.median(c for _, _, c in off) * 1e6,
            "on_cpu_us": statistics.median(c for _, _, c in on) * 1e6,
            "flag_test_ns": flag * 1e9, "trace_folder": folder}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps, for CI")
    ap.add_argument("--json", help="write results here")
    args = ap.parse_args(argv)
    row = measure(samples=4000 if args.quick else 20000, epochs=2 if args.quick else 20)
    echo = row["rank"] == 0
    wall = row["on_step_us"] / row["off_step_us"] - 1
    overhead = row["on_cpu_us"] / row["off_cpu_us"] - 1
    off_cost = HOOKS_PER_STEP * row["flag_test_ns"] / 1e3 / row["off_step_us"]
    if echo:
        print(f"demo, {row['workers']} worker(s), {row['replicas']} replicas, "
              f"{row['steps']} steps, every other one recorded; medians; load "
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
