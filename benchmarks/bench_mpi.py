"""Cross-worker reduce through MpiCommunicator against a bare mpi4py ``Allreduce``.

Run: ``mpiexec -n 2 python benchmarks/bench_mpi.py [--quick]``; rank 0 prints the table.

Measured, interleaved in rounds so that both sides see the same machine load:
- 4 MiB float32 ``MpiCommunicator.reduce`` (one local replica) vs ``comm.Allreduce`` of
  the same buffer into a preallocated output: bandwidth and ratio (target >= 0.8);
- one-float reduce latency vs bare ``Allreduce`` (target: at most 3 us slower);
- the one-float reduce again with ``GPUSTRAT_DEBUG_COLLECTIVES=1`` (its agreement
  allgather), to document what the debug mode costs.
Each figure is the median over rounds of the mean time per call in a round.
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


def _time_per_call(fn, calls: int, barrier) -> float:
    barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def main(argv=None) -> dict:
    """Run the benchmark on every rank; return the results (rank 0 also prints them)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    p.add_argument("--mib", type=float, default=4.0, help="size of the large reduce")
    args = p.parse_args(argv)

    import numpy as np  # noqa: PLC0415

    from gpustrat.collectives import mpi as gmpi  # noqa: PLC0415
    from gpustrat.devices import resolve_devices  # noqa: PLC0415
    from gpustrat.distribute.reduction import reduce_components  # noqa: PLC0415
    from gpustrat.reduce_util import ReduceOp  # noqa: PLC0415

    MPI = gmpi.mpi()
    group = gmpi.MpiWorkerGroup()
    comm = gmpi.MpiCommunicator(resolve_devices(["cpu:0"]), group)
    old = os.environ.get(gmpi.ENV_DEBUG)
    os.environ[gmpi.ENV_DEBUG] = "1"
    try:
        debug_comm = gmpi.MpiCommunicator(resolve_devices(["cpu:0"]), group)
    finally:
        if old is None:
            del os.environ[gmpi.ENV_DEBUG]
        else:
            os.environ[gmpi.ENV_DEBUG] = old
    bare = group.dup_comm()
    barrier = bare.Barrier

    rounds = 5 if args.quick else 25
    n_big = int(args.mib * 2**20) // 4
    big = np.random.default_rng(group.rank).random(n_big, dtype=np.float32)
    big_out = np.empty_like(big)
    one = np.ones(1, np.float32)
    one_out = np.empty_like(one)
    SUM = ReduceOp.SUM
    big_calls = 3 if args.quick else 10
    small_calls = 500 if args.quick else 3000

    cases = {
        "big_bare": (lambda: bare.Allreduce(big, big_out, MPI.SUM), big_calls),
        "big_gpustrat": (lambda: comm.reduce([big], SUM), big_calls),
        "one_bare": (lambda: bare.Allreduce(one, one_out, MPI.SUM), small_calls),
        "one_gpustrat": (lambda: comm.reduce([one], SUM), small_calls),
        "one_debug": (lambda: debug_comm.reduce([one], SUM), small_calls // 10),
        # strategy.reduce's path: the layout check between workers, then the reduce.
        "one_strategy": (lambda: reduce_components(comm, SUM, [one], None),
                         small_calls // 10),
    }
    # Same answer on both paths, and warm caches.
    bare.Allreduce(big, big_out, MPI.SUM)
    np.testing.assert_allclose(comm.reduce([big], SUM), big_out, rtol=1e-6)
    for fn, calls in cases.values():
        _time_per_call(fn, max(1, calls // 5), barrier)
    samples: dict[str, list] = {k: [] for k in cases}
    for _ in range(rounds):
        for name, (fn, calls) in cases.items():
            samples[name].append(_time_per_call(fn, calls, barrier))
    med = {k: statistics.median(v) for k, v in samples.items()}

    nbytes = big.nbytes
    res = {
        "workers": group.size,
        "big_mib": nbytes / 2**20,
        "big_bare_gbps": nbytes / med["big_bare"] / 1e9,
        "big_gpustrat_gbps": nbytes / med["big_gpustrat"] / 1e9,
        "big_ratio": med["big_bare"] / med["big_gpustrat"],
        "one_bare_us": med["one_bare"] * 1e6,
        "one_gpustrat_us": med["one_gpustrat"] * 1e6,
        "one_overhead_us": (med["one_gpustrat"] - med["one_bare"]) * 1e6,
        "one_debug_us": med["one_debug"] * 1e6,
        "debug_overhead_us": (med["one_debug"] - med["one_gpustrat"]) * 1e6,
        "one_strategy_us": med["one_strategy"] * 1e6,
        "strategy_overhead_us": (med["one_strategy"] - med["one_gpustrat"]) * 1e6,
    }
    # Rank 0 reports; the verdict uses its medians (all ranks wait for each other).
    res["big_ok"] = res["big_ratio"] >= 0.8
    res["one_ok"] = res["one_overhead_us"] <= 3.0
    res["verdicts"] = [
        targets.check(f"{res['big_mib']:g} MiB reduce vs bare Allreduce bandwidth",
                      res["big_ratio"], 0.8, "x", echo=group.rank == 0),
        targets.check("one-float reduce over bare Allreduce", res["one_overhead_us"], 3.0,
                      "us", higher_is_better=False, echo=group.rank == 0)]
    if group.rank == 0:
        print(f"MpiCommunicator.reduce vs bare mpi4py Allreduce, {group.size} workers, "
              f"median of {rounds} rounds")
        r = res
        verdict = {True: "ok", False: "MISSED"}
        rows = [
            (f"{r['big_mib']:g} MiB float32 reduce (GB/s)", f"{r['big_bare_gbps']:.2f}",
             f"{r['big_gpustrat_gbps']:.2f}", f"ratio {r['big_ratio']:.2f}",
             f"target >= 0.8 {verdict[r['big_ok']]}"),
            ("one-float reduce (us)", f"{r['one_bare_us']:.2f}",
             f"{r['one_gpustrat_us']:.2f}", f"{r['one_overhead_us']:+.2f} us",
             f"target <= +3 us {verdict[r['one_ok']]}"),
            ("one-float reduce, debug mode (us)", "", f"{r['one_debug_us']:.2f}",
             f"{r['debug_overhead_us']:+.2f} us", "GPUSTRAT_DEBUG_COLLECTIVES=1"),
            ("one-float strategy.reduce (us)", "", f"{r['one_strategy_us']:.2f}",
             f"{r['strategy_overhead_us']:+.2f} us", "layout check between workers"),
        ]
        print(f"{'case':34} {'bare':>10} {'gpustrat':>10} {'result':>14}")
        for case, b, g, result, note in rows:
            print(f"{case:34} {b:>10} {g:>10} {result:>14}  {note}")
        sys.stdout.flush()
    for c in (comm, debug_comm):
        c.close()
    bare.Free()
    group.close()
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
