"""Tensor fusion: 1,000 all-reduces of 1,000 float32 each, fused against separate calls.

Target: fused at least 5x faster than 1,000 separate ``comm.all_reduce``
calls, on every communicator. Measured here on the host communicator (1 and 2 local
CPU replicas) and on the MPI communicator (``mpiexec -n 2``, one replica per worker).
Both ways are checked to give the same values before they are timed; each time is
the best of several repeats, the ways interleaved so that a busy machine slows all.

A third time, the *floor*, is the work no fused call can skip: copying every tensor
into the fusion buffers, reducing them, giving every replica its copy (host) or the
one collective between workers (MPI), with no Python-level handling of the tensors
or results. ``separate / floor`` (the "bound" column) is the speed-up fusion could
reach if everything else were free: where it is below the target, the machine's
memory bandwidth or the collective's own time, not the fusion code, decides.

    python benchmarks/bench_fusion.py [--quick] [--replicas 1 2] [--mpi 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
TARGET = 5.0


def make_tensors(n_tensors: int, size: int, replicas: int, seed: int = 0) -> list[list]:
    rng = np.random.default_rng(seed)
    # Small integers: sums are exact in float32, whatever order a backend adds in.
    return [[rng.integers(-8, 8, size).astype(np.float32) for _ in range(replicas)]
            for _ in range(n_tensors)]


def check_same(comm, tensors, op, bucket_bytes=None) -> None:
    from gpustrat.collectives.fusion import fused_all_reduce
    fused = fused_all_reduce(comm, tensors, op, bucket_bytes)
    for j, row in enumerate(tensors):
        for i, (a, b) in enumerate(zip(comm.all_reduce(row, op), fused[j])):
            if a.shape != b.shape or a.dtype != b.dtype or not np.array_equal(a, b):
                raise AssertionError(f"fused result of tensor {j} on replica {i} differs "
                                     "from the separate all_reduce")


def time_all(comm, tensors, op, repeats: int, sync=lambda: None, bucket_bytes=None,
             floor=None) -> tuple[float, float, float]:
    """Best-of-``repeats`` seconds for separate calls, one fused call and ``floor()``
    (inf when None)."""
    from gpustrat.collectives.fusion import fused_all_reduce
    separate = fused = low = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = [comm.all_reduce(row, op) for row in tensors]
        separate = min(separate, time.perf_counter() - t0)
        del out
        sync()
        t0 = time.perf_counter()
        out = fused_all_reduce(comm, tensors, op, bucket_bytes)
        fused = min(fused, time.perf_counter() - t0)
        del out
        if floor is not None:
            sync()
            t0 = time.perf_counter()
            floor()
            low = min(low, time.perf_counter() - t0)
    return separate, fused, low


def host_floor(tensors, op_ufunc=np.add):
    """The copies and adds a fused host all-reduce cannot skip, in preallocated
    buffers: pack each replica, reduce into replica 0's buffer, copy it back."""
    replicas = len(tensors[0])
    columns = [[row[i] for row in tensors] for i in range(replicas)]
    total = sum(t.size for t in columns[0])
    bufs = [np.empty(total, columns[0][0].dtype) for _ in range(replicas)]

    def floor():
        for col, buf in zip(columns, bufs):
            np.concatenate(col, axis=None, out=buf)
        for buf in bufs[1:]:
            op_ufunc(bufs[0], buf, out=bufs[0])
        for buf in bufs[1:]:
            np.copyto(buf, bufs[0])
    return floor


def measure_host(replicas: int, n_tensors: int, size: int, repeats: int,
                 op: str = "sum") -> dict:
    from gpustrat.collectives.host import HostCommunicator
    from gpustrat.devices import Device
    comm = HostCommunicator([Device("cpu", i) for i in range(replicas)])
    tensors = make_tensors(n_tensors, size, replicas)
    check_same(comm, tensors, op)
    separate, fused, floor = time_all(comm, tensors, op, repeats,
                                      floor=host_floor(tensors))
    return _row(f"host, {replicas} replica(s)", n_tensors, size, separate, fused, floor)


def _row(name, n_tensors, size, separate, fused, floor) -> dict:
    return {"communicator": name, "tensors": n_tensors, "elements": size,
            "separate_ms": separate * 1e3, "fused_ms": fused * 1e3,
            "floor_ms": floor * 1e3, "speedup": separate / fused,
            "bound": separate / floor, "met": separate / fused >= TARGET}


def _mpi_child(n_tensors: int, size: int, repeats: int) -> None:
    """Runs on every rank of ``mpiexec``; rank 0 prints one ``RESULT {json}`` line."""
    from gpustrat.collectives.mpi import MpiCommunicator, MpiWorkerGroup
    from gpustrat.devices import Device
    from gpustrat.reduce_util import ReduceOp
    group = MpiWorkerGroup()
    comm = MpiCommunicator([Device("cpu", 0)], group)
    tensors = make_tensors(n_tensors, size, 1, seed=group.rank)
    check_same(comm, tensors, "sum")
    pack = host_floor(tensors)
    bucket = np.empty(sum(t[0].size for t in tensors), np.float32)

    def floor():  # pack, then the one collective between workers
        pack()
        comm._across_workers_reduce(bucket, ReduceOp.SUM)
    separate, fused, low = time_all(comm, tensors, "sum", repeats, sync=group.barrier,
                                    floor=floor)
    # The job is as slow as its slowest rank.
    times = group.allgather((separate, fused, low))
    separate, fused, low = (max(t[k] for t in times) for k in range(3))
    if group.rank == 0:
        row = _row(f"mpi, {group.size} workers x 1 replica", n_tensors, size,
                   separate, fused, low)
        print("RESULT " + json.dumps(row), flush=True)
    comm.close()
    group.close()


def measure_mpi(nprocs: int, n_tensors: int, size: int, repeats: int,
                timeout: float = 300) -> dict | None:
    """Launch this script under ``mpiexec -n nprocs``; None (with a message) when MPI
    is not installed."""
    from gpustrat.launch import mpiexec_command  # noqa: PLC0415
    try:
        launcher = mpiexec_command(nprocs)
    except FileNotFoundError as e:
        print(f"MPI: {e}; without it the MPI communicator is not measured")
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get(
                   "PYTHONPATH", "")) if p))
    cmd = launcher + [sys.executable, str(Path(__file__).resolve()),
           "--mpi-child", "--tensors", str(n_tensors), "--elements", str(size),
           "--repeats", str(repeats)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"mpiexec exited with {proc.returncode}:\n{proc.stdout}\n"
                           f"{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"no RESULT line from the MPI job:\n{proc.stdout}\n{proc.stderr}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, for CI")
    ap.add_argument("--replicas", type=int, nargs="*", default=[1, 2],
                    help="local CPU replicas of the host communicator (default: 1 2)")
    ap.add_argument("--mpi", type=int, default=2,
                    help="MPI workers (0 skips the MPI communicator; default 2)")
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--elements", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--json", help="write results here")
    ap.add_argument("--mpi-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    repeats = args.repeats or (5 if args.quick else 30)
    if args.mpi_child:
        _mpi_child(args.tensors, args.elements, repeats)
        return {}
    rows = [measure_host(r, args.tensors, args.elements, repeats) for r in args.replicas]
    if args.mpi:
        row = measure_mpi(args.mpi, args.tensors, args.elements, repeats)
        if row is not None:
            rows.append(row)
    print(f"{args.tensors} all-reduces of {args.elements} float32 "
          f"(best of {repeats}; target: fused >= {TARGET:g}x faster)")
    print(f"{'communicator':<28} {'separate (ms)':>14} {'fused (ms)':>11} {'speedup':>8} "
          f"{'floor (ms)':>11} {'bound':>7}")
    for r in rows:
        print(f"{r['communicator']:<28} {r['separate_ms']:>14.2f} {r['fused_ms']:>11.2f} "
              f"{r['speedup']:>7.1f}x {r['floor_ms']:>11.2f} {r['bound']:>6.1f}x")
    print("floor: the copies (and, over MPI, the one collective) no fused call can skip; "
          "bound = separate / floor")
    verdicts = [targets.check(f"fused vs separate, {r['communicator']}", r["speedup"], TARGET,
                              "x") for r in rows]
    result = {"suite": "fusion", "target": TARGET, "rows": rows, "verdicts": verdicts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
