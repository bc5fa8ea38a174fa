"""Host cost of one kernel launch, measured without a GPU.

Each row times the Python of one launcher call, everything up to the driver call, in
the steady state of a training step (the same layout every call: the same tensors at
the same addresses): ``pack`` of a small model's gradients (8 tensors) and of
ResNet-50's (161), ``unpack`` of those 161 into given tensors, and a gather ``split``
of a batch over 4 replicas. The arrays are real CuPy arrays over unowned memory (no
device is touched); every CuPy or Numba call that needs a driver (allocation, the
current device and stream, module loading, the launch itself) is a stand-in that
counts, so the row also checks that each call made exactly one launch and no upload.
Each row gives the calling thread's CPU time per call (the host cost; on a shared
machine wall time under load varies by several times) and the wall time, the best of
5 rounds. Target: at most 20 µs of CPU time per launch for the small layouts (8
tensors, the gather).

CuPy must be importable; without a GPU, ``python tests/conformance/install_cupy.py``
installs the wheels under ``.conformance/`` and ``--cupy 13`` or ``--cupy 14`` picks
one (the default: an installed CuPy, else ``.conformance/cupy14``).

    python benchmarks/bench_launch.py [--quick] [--cupy 13|14] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import types
from pathlib import Path

import numpy as np

try:
    from benchmarks import targets  # imported as benchmarks.bench_NAME
except ImportError:
    import targets  # run as a script: benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
TARGET_US = 20.0


def _import_cupy(version: str | None):
    """Real CuPy: the installed one, or a wheel of ``.conformance/`` (``version``)."""
    if version is None:
        try:
            import cupy  # noqa: PLC0415
            return cupy
        except ImportError:
            version = "14"
    path = REPO / ".conformance" / f"cupy{version}"
    if not path.is_dir():
        return None
    sys.path.insert(0, str(path))
    import cupy  # noqa: PLC0415
    return cupy


class _Kernel:
    """A loaded kernel: the launch (the driver call) only counts."""

    def __init__(self, counts):
        self.counts = counts

    def __call__(self, grid, block, args, shared_mem=0):
        self.counts["launches"] += 1

    # Numba's dispatch, for a launcher that launches through it: kernel[config](...).
    def __getitem__(self, config):
        return self._dispatch

    def _dispatch(self, *args):
        self.counts["launches"] += 1


class _Device:
    compute_capability = "90"

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def use(self):
        return self


class StandInCupy:
    """Real CuPy (its arrays, argument objects and modules' names) with every call that
    needs a driver replaced: allocations hand out unowned address ranges, the current
    device is 0 and its stream the null stream, modules load into a counting kernel."""

    def __init__(self, cp, counts):
        self._cp, self.counts = cp, counts
        self._next = 1 << 40
        self.ndarray = cp.ndarray
        self._null = types.SimpleNamespace(ptr=0, device_id=0, __enter__=None)
        cuda = types.SimpleNamespace(
            function=cp.cuda.function, Device=_Device,
            runtime=types.SimpleNamespace(getDevice=lambda: 0),
            get_current_stream=lambda device_id=-1: self._null,
            Stream=cp.cuda.Stream, ExternalStream=cp.cuda.ExternalStream)
        self.cuda = cuda
        kernel = _Kernel(counts)
        self.RawModule = lambda code=None, **kw: types.SimpleNamespace(
            get_function=lambda entry: kernel)

    def __getattr__(self, name):
        return getattr(self._cp, name)

    def empty(self, shape, dtype=np.float32):
        cp = self._cp
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        nbytes = max(math.prod(shape) * np.dtype(dtype).itemsize, 1)
        ptr, self._next = self._next, self._next + -(-nbytes // 512) * 512
        mem = cp.cuda.memory.UnownedMemory(ptr, nbytes, None, 0)
        self.counts["allocations"] += 1
        return cp.ndarray(shape, dtype, memptr=cp.cuda.memory.MemoryPointer(mem, 0))

    def asarray(self, x, dtype=None):
        if isinstance(x, self._cp.ndarray):
            return x
        host = np.asarray(x, dtype=dtype)
        self.counts["uploads"] += 1
        return self.empty(host.shape, host.dtype)

    def ascontiguousarray(self, x):
        return x


class StandInNumba:
    """``numba.cuda`` where a launch needs it: ``jit`` gives the counting kernel,
    ``compile_ptx`` a one-entry PTX, views and streams stand-ins."""

    is_fake = False

    def __init__(self, counts):
        self.kernel = _Kernel(counts)
        self.gpus = {i: contextlib.nullcontext() for i in range(8)}

    def jit(self, fn=None, **kw):
        if fn is None or kw.get("device"):
            return (lambda f: f) if fn is None else fn
        return self.kernel

    def compile_ptx(self, pyfunc, sig, cc=None, **kw):
        return f".visible .entry {pyfunc.__name__}(\n)\n", None

    def from_cuda_array_interface(self, desc, owner=None, sync=True):
        return types.SimpleNamespace(desc=desc, owner=owner)

    def legacy_default_stream(self):
        return 1

    def default_stream(self):
        return 0

    def external_stream(self, ptr):
        return int(ptr)


def resnet50_shapes():
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            for co, ci, k in ((width, cin, 1), (width, width, 3), (4 * width, width, 1)):
                shapes += [(co, ci, k, k), (co,), (co,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def time_calls(fn, calls: int, counts) -> tuple[float, float, float, float]:
    """Per call of ``fn`` (after warm-up calls), the best of 5 rounds: the calling
    thread's CPU time and the wall time in µs, and the launches and uploads made."""
    for _ in range(3):
        fn()
    cpu = wall = float("inf")
    before = dict(counts)
    for _ in range(5):
        c0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(calls):
            fn()
        t1, c1 = time.perf_counter(), time.thread_time()
        cpu, wall = min(cpu, (c1 - c0) / calls), min(wall, (t1 - t0) / calls)
    n = 5 * calls
    return cpu * 1e6, wall * 1e6, (counts["launches"] - before["launches"]) / n, \
        (counts["uploads"] - before["uploads"]) / n


def measure(cp_real, calls: int) -> list[dict]:
    from gpustrat import devices
    from gpustrat.kernels import _launch
    from gpustrat.kernels.pack import pack, unpack
    from gpustrat.kernels.split import split
    counts = {"launches": 0, "uploads": 0, "allocations": 0}
    cp = StandInCupy(cp_real, counts)
    backend = devices.Backend(cupy=cp, numba_cuda=StandInNumba(counts))
    rows = []
    _launch.clear_table_cache()
    with devices.use_backend(backend):
        mlp = [cp.empty(s, np.float32) for s in
               ((784, 128), (128,), (128, 64), (64,), (64, 32), (32,), (32, 10), (10,))]
        resnet = [cp.empty(s, np.float32) for s in resnet50_shapes()]
        outs = [cp.empty(t.shape, np.float32) for t in resnet]
        buf = cp.empty(sum(t.size for t in resnet), np.float32)
        shapes = [t.shape for t in resnet]
        batch = cp.empty((256, 784), np.float32)
        index = cp.empty((256,), np.int64)
        cases = [
            ("pack, 8 tensors (small MLP)", lambda: pack(mlp), TARGET_US),
            ("pack, 161 tensors (ResNet-50)", lambda: pack(resnet), None),
            ("unpack, 161 tensors into given ones", lambda: unpack(buf, shapes, out=outs),
             None),
            ("split with a gather, 4 replicas", lambda: split(
                batch, 4, index=index, check_index=False), TARGET_US),
        ]
        for name, fn, goal in cases:
            us, wall, launches, uploads = time_calls(fn, calls, counts)
            rows.append({"case": name, "host_us": us, "wall_us": wall,
                         "launches_per_call": launches, "uploads_per_call": uploads,
                         "goal_us": goal})
    _launch.clear_table_cache()
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--cupy", choices=("13", "14"), default=None,
                    help="a CuPy wheel of .conformance/ (default: an installed CuPy)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cp = _import_cupy(args.cupy)
    if cp is None:
        reason = ("CuPy is not installed: run python tests/conformance/install_cupy.py "
                  "(no GPU needed)")
        print(reason)
        return {"suite": "launch", "verdicts": [targets.not_measured(
            "kernel launch host cost (8 tensors)", TARGET_US, reason, "us",
            higher_is_better=False)]}
    load = os.getloadavg()
    print(f"CuPy {cp.__version__}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    rows = measure(cp, 200 if args.quick else 2000)
    print(f"{'case':<40} {'CPU µs':>8} {'wall µs':>8} {'launches':>9} {'uploads':>8}")
    verdicts = []
    for r in rows:
        print(f"{r['case']:<40} {r['host_us']:>8.1f} {r['wall_us']:>8.1f} "
              f"{r['launches_per_call']:>9.2f} {r['uploads_per_call']:>8.2f}")
        assert r["launches_per_call"] == 1 and r["uploads_per_call"] == 0, r
        if r["goal_us"] is not None:
            verdicts.append(targets.check(f"launch host cost: {r['case']}", r["host_us"],
                                          r["goal_us"], "us", higher_is_better=False))
    res = {"suite": "launch", "cupy": cp.__version__, "loadavg": load, "rows": rows,
           "verdicts": verdicts}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
