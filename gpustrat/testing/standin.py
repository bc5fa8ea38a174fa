"""Counting stand-ins over real CuPy arrays: the host cost of a GPU path, without a GPU.

The stand-in backend swaps CuPy, ``cupyx``, ``cupy.cuda.nccl`` and ``numba.cuda`` for
objects that need no driver and count what a program asks of the GPU:

- *arrays* are real ``cupy.ndarray`` objects (of a subclass) over device addresses
  that no memory backs: shape, strides, views, slicing and reshapes run CuPy's own
  code at CuPy's cost. Values are not computed and never read: an array operation
  (``+``, ``*=``, ``astype``, ``sum``, ``sqrt``, ``where``, ...) counts a launch and
  returns an array of the result's shape and dtype; what the host reads back
  (``get``, ``item``, ``float``) is zeros.
- *memory* comes from a pool per device over a made-up address range: a freed block
  is handed out again for the same rounded size, as CuPy's pool does.
- *the driver's objects*: ``cupy.cuda.Device`` (a context manager; entries counted),
  ``Stream``, ``Event`` (creations, records, waits, queries, and whether the event
  was made with timing), the current stream of each device per thread, pinned host
  memory (NumPy arrays), ``cupy.cuda.nccl`` (communicators whose calls are counted)
  and the ``numba.cuda`` surface gpustrat's kernels launch through (launches counted).

What makes the host wait for the GPU is a *host synchronization*, counted with the
place it was asked for (:attr:`StandIn.sync_sites`): ``get`` (blocking), ``item``,
``float``/``int``/``bool`` of an array, ``cupy.asnumpy``, ``set`` from pageable memory,
``Stream.synchronize``, ``Event.synchronize``, ``Device.synchronize``, Numba's
``to_device`` and a synchronizing Numba import of an array.

Not modelled: the GPU's time, values, ordering (the stream-ordering sanitizer,
:func:`gpustrat.testing.sanitize`, checks that), and the host cost inside Numba's own
dispatcher and inside the CUDA driver (a launch here costs what CuPy's argument
handling and the counting cost, a custom kernel launch next to nothing).

:func:`gpustrat.testing.stand_in` makes the backend current inside a ``with`` block.
This module holds the model (:class:`StandIn`: counters, each thread's current device
and streams, the pool); ``standin_cupy`` the ``cupy`` module, ``standin_arrays`` its
arrays, ``standin_cuda`` its ``cupy.cuda``, ``standin_libs`` NCCL and Numba.
It needs the real CuPy package (for ``cupy.ndarray``); where ``import cupy`` fails,
the CuPy 14 and NCCL folders that ``python tests/conformance/install_cupy.py`` installs
under the checkout's ``.conformance/`` (or ``$GPUSTRAT_CONFORMANCE_DIR``) are put on
``sys.path``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import time
import weakref
from pathlib import Path

import numpy as np

#: What :meth:`StandIn.counts` counts.
COUNTERS = ("host_syncs", "launches", "kernel_launches", "copies", "nccl_calls",
            "nccl_groups", "event_creations", "timing_events", "event_records",
            "event_waits", "event_queries", "stream_creations", "device_enters",
            "allocations", "pinned_allocations")
#: The pool's granularity, as CuPy's (sizes are rounded up to 512 bytes).
ROUND = 512
#: Where each device's made-up addresses begin (device K at (K + 1) << ADDRESS_SHIFT).
ADDRESS_SHIFT = 40
ENV_CONFORMANCE_DIR = "GPUSTRAT_CONFORMANCE_DIR"


# --- the real CuPy --------------------------------------------------------------------

def _conformance_dirs() -> list[Path]:
    root = os.environ.get(ENV_CONFORMANCE_DIR)
    root = Path(root) if root else Path(__file__).resolve().parents[2] / ".conformance"
    return [root / "cupy14", root / "nccl"]


def real_cupy():
    """The real ``cupy`` module: imported, else from the checkout's ``.conformance``.

    Raises:
        RuntimeError: CuPy cannot be imported from either place (how to install it).
    """
    try:
        import cupy  # noqa: PLC0415
        if not hasattr(cupy, "ndarray") or not hasattr(cupy.cuda, "UnownedMemory"):
            raise ImportError(f"the cupy imported from {getattr(cupy, '__file__', '?')} "
                              "is not the CuPy package")
        return cupy
    except ImportError as first:
        dirs = _conformance_dirs()
        if not all(d.is_dir() for d in dirs) or "cupy" in sys.modules:
            raise RuntimeError(
                f"the stand-in backend needs the real CuPy package (for cupy.ndarray), "
                f"but import cupy failed ({first}) and {dirs[0]} or {dirs[1]} is missing: "
                "run python tests/conformance/install_cupy.py (it installs CuPy 14 and "
                "NCCL under .conformance/ without a GPU), or put such folders on the path "
                f"(PYTHONPATH={os.pathsep.join(str(d) for d in dirs)}, or "
                f"{ENV_CONFORMANCE_DIR}=the folder holding cupy14/ and nccl/)") from first
        for d in reversed(dirs):
            if str(d) not in sys.path:
                sys.path.insert(0, str(d))
        importlib.invalidate_caches()
        try:
            import cupy  # noqa: PLC0415
        except ImportError as second:
            raise RuntimeError(f"CuPy under {dirs[0]} does not import ({second}): reinstall "
                               "it with python tests/conformance/install_cupy.py") from second
        return cupy


# --- the model: counters, threads' current device and streams, the pool -----------------

def _site(depth: int = 3) -> str:
    """The innermost ``depth`` callers outside this module and contextlib (where a
    host synchronization was asked for, and who asked), innermost first."""
    f = sys._getframe(1)
    out = []
    while f is not None and len(out) < depth:
        name = f.f_code.co_filename
        if "/gpustrat/testing/standin" not in name and "contextlib" not in name:
            out.append(f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})")
        f = f.f_back
    return " < ".join(out) or "?"


class _Block:
    """An allocation of the pool: back to its free list when the last array is gone."""

    __slots__ = ("pool", "addr", "size", "device", "__weakref__")

    def __init__(self, pool, addr: int, size: int, device: int):
        self.pool, self.addr, self.size, self.device = pool, addr, size, device

    def __del__(self):
        try:
            self.pool.setdefault((self.device, self.size), []).append(self.addr)
        except Exception:  # interpreter shutdown
            pass


class StandIn:
    """The stand-in GPUs: counters, per-thread device and stream state, the pool.

    Args:
        num_devices: GPUs the stand-in shows.
        launch_us: host microseconds each launch (an array operation, a kernel, an NCCL
            call) spends on top of the stand-in's own cost: a model of what CuPy's
            kernel dispatch and the driver add on a GPU machine (0: nothing added).
        numba_launch_us: host microseconds each launch of a Numba kernel spends on top
            of ``launch_us``: a model of Numba's dispatcher, which types every argument
            of every launch (0: nothing added).
    """

    def __init__(self, num_devices: int = 4, launch_us: float = 0.0,
                 numba_launch_us: float = 0.0):
        if num_devices < 1:
            raise ValueError(f"num_devices must be at least 1, got {num_devices}")
        for name, us in (("launch_us", launch_us), ("numba_launch_us", numba_launch_us)):
            if not us >= 0:
                raise ValueError(f"{name} must be a number of microseconds >= 0, got {us!r}")
        self.num_devices = int(num_devices)
        self.launch_s = float(launch_us) * 1e-6
        self.numba_launch_s = float(numba_launch_us) * 1e-6
        self._tls = threading.local()
        self._all_counters: list[dict] = []
        self._lock = threading.Lock()
        #: (thread, what, site) of every host synchronization.
        self.sync_sites: list[tuple[str, str, str]] = []
        self._free: dict = {}
        self._top = {d: (d + 1) << ADDRESS_SHIFT for d in range(self.num_devices)}
        self._next_stream = 0x5000
        self._pinned = weakref.WeakValueDictionary()   # id -> pinned array (not kept alive)
        self.cupy = None          # set by stand_in()

    # --- counting
    def _c(self) -> dict:
        try:
            return self._tls.c
        except AttributeError:
            c = self._tls.c = dict.fromkeys(COUNTERS, 0)
            with self._lock:
                self._all_counters.append(c)
            return c

    def count(self, what: str, n: int = 1) -> None:
        self._c()[what] += n

    def spin(self, seconds: float | None = None) -> None:
        """Spend ``seconds`` (``launch_us``) of the thread's CPU time: a launch's modelled
        cost, in CPU time so that a thread descheduled meanwhile still spends all of it."""
        end = time.thread_time() + (self.launch_s if seconds is None else seconds)
        while time.thread_time() < end:
            pass

    def host_sync(self, what: str) -> None:
        self._c()["host_syncs"] += 1
        self.sync_sites.append((threading.current_thread().name, what, _site()))

    def counts(self) -> dict:
        """Every counter, summed over the threads."""
        out = dict.fromkeys(COUNTERS, 0)
        with self._lock:
            for c in self._all_counters:
                for k, v in c.items():
                    out[k] += v
        return out

    def reset(self) -> None:
        """Set every counter to zero and forget the sync sites."""
        with self._lock:
            for c in self._all_counters:
                for k in c:
                    c[k] = 0
        self.sync_sites.clear()

    @contextlib.contextmanager
    def measure(self):
        """``with standin.measure() as c:`` -- ``c`` holds the counts of the block (and
        ``c["sync_sites"]``, where its host synchronizations were asked for)."""
        before = self.counts()
        sites = len(self.sync_sites)
        out: dict = {}
        yield out
        after = self.counts()
        out.update({k: after[k] - before[k] for k in COUNTERS})
        out["sync_sites"] = self.sync_sites[sites:]

    # --- thread state
    def devs(self) -> list:
        try:
            return self._tls.devs
        except AttributeError:
            d = self._tls.devs = [0]
            return d

    def current_device(self) -> int:
        return self.devs()[-1]

    def stacks(self) -> dict:
        try:
            return self._tls.streams
        except AttributeError:
            s = self._tls.streams = {}
            return s

    def new_stream_ptr(self) -> int:
        with self._lock:
            self._next_stream += 0x10
            return self._next_stream

    # --- memory
    def alloc(self, device: int, nbytes: int) -> _Block:
        """A block of at least ``nbytes`` on ``device``: a freed one of the same rounded
        size when there is one (as CuPy's pool), else fresh addresses."""
        self._c()["allocations"] += 1
        size = -(-int(nbytes) // ROUND) * ROUND or ROUND
        free = self._free.get((device, size))
        if free:
            try:
                return _Block(self._free, free.pop(), size, device)
            except IndexError:   # another thread took the last one
                pass
        with self._lock:
            addr = self._top[device]
            self._top[device] = addr + size
        return _Block(self._free, addr, size, device)

    def pinned(self, shape, dtype) -> np.ndarray:
        self._c()["pinned_allocations"] += 1
        a = np.zeros(shape, dtype)
        self._pinned[id(a)] = a
        return a

    def is_pinned(self, a: np.ndarray) -> bool:
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        return self._pinned.get(id(base)) is base


# --- the backend ------------------------------------------------------------------------

def build(model: StandIn):
    """The stand-in ``cupy``, ``cupyx``, ``cupy.cuda.nccl`` and ``numba.cuda`` of
    ``model``: ``(cupy, cupyx, nccl, numba_cuda)``."""
    from gpustrat.testing.standin_cupy import StandInCupy  # noqa: PLC0415
    from gpustrat.testing.standin_libs import StandInNccl, StandInNumbaCuda  # noqa: PLC0415
    cp = StandInCupy(model, real_cupy())
    model.cupy = cp
    return cp, cp.cupyx, StandInNccl(model, cp), StandInNumbaCuda(model, cp)
