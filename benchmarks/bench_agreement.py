"""Cost of the end-of-data agreement between workers, per step, over an epoch.

Run under ``mpiexec -n 2 python benchmarks/bench_agreement.py [--quick]``. Each worker
iterates an in-memory stream of steps (so only the agreement is measured) three ways:
bare, with the agreement when step counts are unknown (blocks of 1, 2, 4, ... 64), and
with counts known in advance (one allgather per epoch). The workers hold uneven data,
except in the DATA row: there every worker has the same steps and the agreement also
checks that (the minimum beside the maximum in each block's all-reduce).
Target: at most 5 µs per step on average. The per-step all-reduce that
TensorFlow does is timed beside it for comparison.
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    from gpustrat.collectives.mpi import MpiWorkerGroup
    from gpustrat.distribute import end_of_data
    from gpustrat.reduce_util import ReduceOp

    g = MpiWorkerGroup()
    base = 2000 if args.quick else 20000
    n_steps = base + 37 * g.rank  # uneven on purpose
    piece = np.zeros((4, 8), np.float32)
    data = [[piece] for _ in range(n_steps)]
    empty = lambda p: p[:0]  # noqa: E731

    def timed(make):
        best, out = float("inf"), None
        for _ in range(3):
            g.barrier()
            t0 = time.perf_counter()
            out = make()
            best = min(best, time.perf_counter() - t0)
        return best, out

    bare, _ = timed(lambda: sum(1 for _ in iter(data)))

    def agreed(known):
        stats = end_of_data.Agreement()
        steps = sum(1 for _ in end_of_data.agreed_steps(
            iter(data), g, 1, n_steps if known else None, empty, stats))
        return steps, stats.collectives

    t_unknown, (steps_u, coll_u) = timed(lambda: agreed(False))

    def agreed_data():  # DATA: the same steps on every worker, checked per block
        stats = end_of_data.Agreement()
        steps = sum(1 for _ in end_of_data.agreed_steps(
            iter(data[:base]), g, 1, None, empty, stats, same_steps=True))
        return steps, stats.collectives
    bare_data, _ = timed(lambda: sum(1 for _ in iter(data[:base])))
    t_data, (steps_d, coll_d) = timed(agreed_data)
    assert steps_d == base, (steps_d, base)
    t_known, (steps_k, coll_k) = timed(lambda: agreed(True))

    def per_step_flag():  # TensorFlow's way: one all-reduce of a has-data flag per step
        it, steps = iter(data), 0
        flag = np.zeros(1, np.int64)
        while True:
            flag[0] = 1 if next(it, None) is not None else 0
            if g.allreduce_ints(flag, ReduceOp.MAX)[0] == 0:
                return steps
            steps += 1
    t_flag, steps_f = timed(per_step_flag)
    total = max(g.allgather(n_steps))
    assert steps_u == steps_k == steps_f == total, (steps_u, steps_k, steps_f, total)
    res = {
        "suite": "agreement", "workers": g.size, "steps": total,
        "unknown_us_per_step": (t_unknown - bare) / total * 1e6, "unknown_collectives": coll_u,
        "known_us_per_step": (t_known - bare) / total * 1e6, "known_collectives": coll_k,
        "data_unknown_us_per_step": (t_data - bare_data) / base * 1e6,
        "data_unknown_collectives": coll_d,
        "per_step_allreduce_us_per_step": (t_flag - bare) / total * 1e6,
    }
    worst = g.allgather(res)
    if g.rank == 0:
        r = max(worst, key=lambda x: x["unknown_us_per_step"])
        print(f"{g.size} workers, {total} steps per epoch (slowest rank shown)")
        print(f"{'mode':<28} {'us/step':>8} {'collectives/epoch':>18}")
        print(f"{'counts unknown (blocks)':<28} {r['unknown_us_per_step']:>8.2f} "
              f"{r['unknown_collectives']:>18}")
        print(f"{'counts known (allgather)':<28} {r['known_us_per_step']:>8.2f} "
              f"{r['known_collectives']:>18}")
        print(f"{'DATA, unknown, checked':<28} {r['data_unknown_us_per_step']:>8.2f} "
              f"{r['data_unknown_collectives']:>18}  ({base} steps)")
        print(f"{'one all-reduce per step (TF)':<28} {r['per_step_allreduce_us_per_step']:>8.2f} "
              f"{total + 1:>18}")
        res = dict(r, verdicts=[targets.check(
            "end-of-data agreement per step (counts unknown)", r["unknown_us_per_step"], 5,
            "us", higher_is_better=False)])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=2)
    g.close()
    return res


if __name__ == "__main__":
    main()
