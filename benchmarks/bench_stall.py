"""The stall inspector's cost: a training step's time with it on against off, same run.

Run: ``mpiexec -n 2 python benchmarks/bench_stall.py [--quick]``; rank 0 prints the table.

The step is a small training loop's: ``strategy.run`` of a function that all-reduces a
gradient (1,000 float32) inside the replica, then ``strategy.reduce`` of the loss (one
float). Each round makes a ``MultiWorkerMirroredStrategy`` with the inspector on
(``GPUSTRAT_STALL_WARNING`` at its default) and one with it off, times the same steps on
each and closes it, so that the inspector's thread runs only while its rows are timed;
the order alternates between rounds. The figures are the medians over rounds of the
time per step, and the verdict's ratio the median of each round's on/off ratio (the
pair ran back to back, under one load); target: the inspector adds at most 3% to the
step (its thread looks for a
question four times a second and reads no stack unless asked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

RATIO_TARGET = 1.03  # step time with the inspector / without, at most


def main(argv=None) -> dict:
    """Run the benchmark on every rank; return the results (rank 0 also prints them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    p.add_argument("--rounds", type=int, default=0, help="rounds (default 40, quick 3)")
    args = p.parse_args(argv)

    import numpy as np  # noqa: PLC0415

    import gpustrat as gs  # noqa: PLC0415
    from gpustrat.collectives.mpi import mpi_world  # noqa: PLC0415
    from gpustrat.collectives.mpi.stall import ENV_STALL_WARNING  # noqa: PLC0415

    world = mpi_world()
    rank = world.Get_rank()
    rounds = args.rounds or (3 if args.quick else 40)
    steps = 100 if args.quick else 300
    grad = np.ones(1000, np.float32)
    ctx = gs.get_replica_context
    old = os.environ.get(ENV_STALL_WARNING)

    def make(setting):
        if setting is None:
            os.environ.pop(ENV_STALL_WARNING, None)
        else:
            os.environ[ENV_STALL_WARNING] = setting
        return gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])

    def step_time(s) -> float:
        def replica():
            g = ctx().all_reduce("sum", grad)
            return np.float32(g[0])
        for _ in range(steps // 10):  # warm the plans
            s.reduce("sum", s.run(replica), axis=None)
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            s.reduce("sum", s.run(replica), axis=None)
        return (time.perf_counter() - t0) / steps

    samples = {"on": [], "off": []}
    try:
        for i in range(rounds):
            for which in (("on", "off") if i % 2 == 0 else ("off", "on")):
                s = make(None if which == "on" else "off")
                on = s.workers.exits.inspector is not None
                assert on == (which == "on"), (which, on)
                samples[which].append(step_time(s))
                s.close()
    finally:
        if old is None:
            os.environ.pop(ENV_STALL_WARNING, None)
        else:
            os.environ[ENV_STALL_WARNING] = old
    on, off = (statistics.median(samples[k]) for k in ("on", "off"))
    best = min(samples["on"]) / min(samples["off"])
    # Each round's pair ran back to back, so its ratio sees one machine load.
    ratio = statistics.median(a / b for a, b in zip(samples["on"], samples["off"]))
    verdicts = [targets.check("training step with the stall inspector on vs off", ratio,
                              RATIO_TARGET, "x", higher_is_better=False, echo=rank == 0)]
    if rank == 0:
        print(f"stall inspector, {world.Get_size()} workers x 1 replica, median of {rounds} "
              f"rounds of {steps} steps (ratio: median of the rounds' ratios) [best rounds']")
        print(f"{'step':40} {'off us':>9} {'on us':>9} {'ratio':>14}")
        print(f"{'run(all_reduce 1000 floats) + reduce':40} {off * 1e6:9.1f} {on * 1e6:9.1f} "
              f"{f'{ratio:.3f} [{best:.3f}]':>14}")
        sys.stdout.flush()
    return {"workers": world.Get_size(), "step_us_off": off * 1e6, "step_us_on": on * 1e6,
            "ratio": ratio, "verdicts": verdicts}


if __name__ == "__main__":
    main(sys.argv[1:])
