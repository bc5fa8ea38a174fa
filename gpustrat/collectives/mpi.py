"""MPI between workers: the only module that imports mpi4py.

Words:
- *worker*: one MPI rank. A job launched as ``mpiexec -n 4 python train.py`` has four.
- *channel*: one duplicated MPI communicator plus the rule for waiting on it. Each
  :class:`MpiWorkerGroup` and each :class:`MpiCommunicator` owns its own duplicate, so
  several strategies coexist, and control collectives (input pipeline threads) never
  interleave with data collectives (replica threads) on one communicator.
- *deadline*: every blocking wait is a non-blocking MPI call (``Iallreduce``,
  ``Ibcast``, ...) polled with ``Test`` until it completes or ``GPUSTRAT_TIMEOUT``
  seconds (default 300) pass; then :class:`~gpustrat.errors.CollectiveTimeout` is
  raised. Polling is a tight ``Test`` spin first (small collectives finish in a few
  microseconds, as fast as the blocking call), then ``Test`` between yields of the core,
  then sleeps backing off to 1 ms, so a rank waiting minutes for a slow peer does not
  burn a core. The one exception: the data transfer of a reduce or gather of 64 KiB or
  more, which starts only after every rank's header has arrived (so no rank can be
  absent from it), is the blocking MPI call, as fast as a bare one.
- *header*: every collective between workers starts with one Allgather of a fixed
  64-byte record per rank: the kind of collective, a checksum of the layout, a size that
  may differ between ranks, and (up to 32 bytes) the payload itself. Every rank sees
  every header, so a disagreement raises :class:`~gpustrat.errors.CollectiveMismatch`
  (or :class:`~gpustrat.errors.LayoutMismatch`) on every rank, naming each rank's call,
  before any data moves; a small reduce, gather or broadcast is that one collective.
- *debug mode* (``GPUSTRAT_DEBUG_COLLECTIVES=1``): the header also carries a checksum of
  the line of user code that made the call, so the same collective reached from two
  different lines (a skipped call followed by an alike one) is a mismatch too.

Arrays travel through mpi4py's buffer interface (upper-case calls), never pickled.
``from mpi4py import MPI`` initialises MPI, so it happens in :func:`mpi` the first time a
group is made, never when gpustrat is imported.
"""

from __future__ import annotations

import math
import os
import pickle
import struct
import sys
import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from gpustrat.collectives.base import WorkerGroup, layout_code
from gpustrat.collectives.host import HostCommunicator, divide
from gpustrat.devices import Device, to_host
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout, LayoutMismatch
from gpustrat.reduce_util import ReduceOp

ENV_TIMEOUT = "GPUSTRAT_TIMEOUT"
ENV_DEBUG = "GPUSTRAT_DEBUG_COLLECTIVES"
DEFAULT_TIMEOUT = 300.0

# Polling: back-to-back Tests for _SPIN_S (the clock read every _SPIN tests), then Test
# after each yield of the core for _YIELD_S (MPI progresses only inside MPI calls, so a
# large transfer must keep being tested), then sleeps doubling from 10 us up to 1 ms.
_SPIN = 100
_SPIN_S = 300e-6
_YIELD_S = 0.05
_MAX_SLEEP_S = 1e-3
# How long a wait goes on after another rank of the group has exited (see _ExitWatch).
_EXIT_GRACE_S = 1.0

_MPI = None


def mpi():
    """The ``mpi4py.MPI`` module, imported (and MPI initialised) on first use."""
    global _MPI
    if _MPI is None:
        from mpi4py import MPI  # noqa: PLC0415 - importing initialises MPI
        _MPI = MPI
    return _MPI


def mpi_world():
    """``MPI.COMM_WORLD``, initialising MPI if needed."""
    return mpi().COMM_WORLD


def timeout_from_env() -> float:
    """``GPUSTRAT_TIMEOUT`` in seconds (default 300; ``inf`` waits forever)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        t = float(raw)
    except ValueError:
        t = float("nan")
    if not t > 0:  # also rejects nan
        raise ValueError(f"{ENV_TIMEOUT}={raw!r} is not a positive number of seconds: "
                         f"unset it for the default {DEFAULT_TIMEOUT:g} s, or set 'inf' "
                         "to wait forever")
    return t


def debug_from_env() -> bool:
    """Whether ``GPUSTRAT_DEBUG_COLLECTIVES`` turns the agreement checks on."""
    return os.environ.get(ENV_DEBUG, "").strip().lower() in ("1", "true", "yes", "on")


# --- dtype and op table -------------------------------------------------------------

# numpy dtype -> name of the MPI datatype used to reduce it.
_REDUCE_TYPES = {
    np.dtype(np.float32): "FLOAT", np.dtype(np.float64): "DOUBLE",
    np.dtype(np.longdouble): "LONG_DOUBLE",
    np.dtype(np.int8): "INT8_T", np.dtype(np.int16): "INT16_T",
    np.dtype(np.int32): "INT32_T", np.dtype(np.int64): "INT64_T",
    np.dtype(np.uint8): "UINT8_T", np.dtype(np.uint16): "UINT16_T",
    np.dtype(np.uint32): "UINT32_T", np.dtype(np.uint64): "UINT64_T",
    np.dtype(np.complex64): "C_FLOAT_COMPLEX", np.dtype(np.complex128): "C_DOUBLE_COMPLEX",
    np.dtype(np.bool_): "C_BOOL",
}
# float16 has no portable MPI datatype (Open MPI has none; MPICH's MPIX_C_FLOAT16 is an
# extension), so it is reduced in float32 and rounded back once, which is also more
# accurate than summing in float16.
_UPCAST = {np.dtype(np.float16): np.dtype(np.float32)}
_OPS = {ReduceOp.SUM: "SUM", ReduceOp.MEAN: "SUM", ReduceOp.MAX: "MAX", ReduceOp.MIN: "MIN"}
# The host path combines booleans with np.add/maximum/minimum: or, or, and.
_BOOL_OPS = {ReduceOp.SUM: "LOR", ReduceOp.MEAN: "LOR", ReduceOp.MAX: "LOR",
             ReduceOp.MIN: "LAND"}

_reduce_args_cache: dict = {}
_MEAN = ReduceOp.MEAN  # a module global is faster to reach than an enum member


def reduce_args(dtype: np.dtype, op: ReduceOp):
    """``(MPI datatype, MPI op, dtype to reduce in or None)`` for reducing ``dtype``."""
    key = (dtype, op)
    hit = _reduce_args_cache.get(key)
    if hit is not None:
        return hit
    MPI = mpi()
    up = _UPCAST.get(dtype)
    name = _REDUCE_TYPES.get(up or dtype)
    if name is None:
        raise TypeError(
            f"cannot reduce arrays of dtype {dtype} between workers: supported are "
            f"{sorted({str(d) for d in _REDUCE_TYPES} | {str(d) for d in _UPCAST})}; "
            "cast to one of them first")
    if dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
        raise TypeError(f"{op.name} of complex values ({dtype}) is not defined between "
                        "workers: reduce the real and imaginary parts, or the absolute value")
    mop = (_BOOL_OPS if dtype.kind == "b" else _OPS)[op]
    hit = (getattr(MPI, name), getattr(MPI, mop), up)
    _reduce_args_cache[key] = hit
    return hit


# --- waiting with a deadline --------------------------------------------------------

def wait(request, what: str | Callable[[], str], rank: int, timeout: float,
         exits: "_ExitWatch | None" = None) -> None:
    """Wait for ``request``, raising CollectiveTimeout after ``timeout`` seconds, or
    ``_EXIT_GRACE_S`` after ``exits`` reports that another rank of the group has exited.

    ``what`` names the operation (a callable is only called to build the error).
    """
    test = request.Test
    for _ in range(_SPIN):
        if test():
            return
    # Keep spinning up to _SPIN_S: a peer a few tens of microseconds behind (Python
    # work between its collectives) is met without giving the core away, which on a
    # loaded node can cost a whole time slice.
    start = time.monotonic()
    spin_until = start + _SPIN_S
    while True:
        for _ in range(_SPIN):
            if test():
                return
        if time.monotonic() >= spin_until:
            break
    start = time.monotonic()
    deadline = start + timeout
    yield_until = start + _YIELD_S
    delay = 1e-5
    gone = None
    while True:
        now = time.monotonic()
        if exits is not None and gone is None:
            gone = exits.poll()
            if gone is not None:
                # A peer that left may still have completed its side: give MPI a moment.
                deadline = min(deadline, now + _EXIT_GRACE_S)
        if now >= deadline and gone is not None:
            name = what() if callable(what) else what
            raise CollectiveTimeout(
                f"{name} cannot complete on rank {rank}: {exits.reason()} while this "
                "rank waits for it. Every rank must run the same steps and collectives: "
                "do not leave the training loop or the script early on some ranks only, "
                "and raise an exception instead of sys.exit on errors (it ends every "
                "rank)")
        if now >= deadline:
            name = what() if callable(what) else what
            raise CollectiveTimeout(
                f"{name} did not complete within {timeout:g} s on rank {rank}: another "
                "rank probably died, is stuck, or skipped this collective (every rank "
                "must make the same collective calls in the same order). Check the other "
                f"ranks' output; raise {ENV_TIMEOUT} (seconds) if the work between "
                f"collectives legitimately takes longer; {ENV_DEBUG}=1 names ranks "
                "that call different collectives")
        if now < yield_until:
            # sched_yield, not sleep(0): a zero sleep still costs the kernel's timer
            # slack (about 50 us), which a peer spinning on us would wait out.
            for _ in range(_SPIN):
                os.sched_yield()
                if test():
                    return
        else:
            time.sleep(delay)
            delay = min(2 * delay, _MAX_SLEEP_S)
            if test():
                return


def _describe(op: str, shape, dtype) -> str:
    if shape is None:
        return op
    return f"{op} on shape {shape if isinstance(shape, str) else _shown(shape)} {dtype}"


# --- the header every collective starts with ----------------------------------------

# Every collective between workers starts with one Allgather of a fixed 64-byte record
# per rank (a persistent request: starting it is one MPI call), eight int64 slots:
#   0     the kind of collective: a checksum of its name, e.g. "all_reduce(SUM)"
#   1     a checksum of the layout (shape and dtype; "*" where sizes may differ)
#   2     debug mode: a checksum of the calling line of user code; else 0
#   3     a size that may differ between ranks (rows of a gather, bytes of a pickle)
#   4..7  the payload itself when it fits in 32 bytes (a few numbers)
# Slots 0-2 must be equal on every rank. Every rank sees every header, so all take the
# same branch: go on with the data collective, which then pairs with its like on every
# rank (or, for a payload that rode in the header, combine the headers' payloads
# locally: one collective in all), or raise the same error on every rank.
_SLOTS = 8
_INLINE = 32
# Reduces and equal-size gathers of at least this many bytes per rank use the blocking
# MPI call once the headers agree: MPICH runs its non-blocking ones up to a third slower.
_BLOCKING_BYTES = 1 << 16
_AGREE = 24  # leading bytes of a header that every rank must share
_PACK = struct.Struct("=4q").pack_into

_kind_codes: dict = {}


def kind_code(kind: str) -> int:
    """The checksum of a collective's name that travels in slot 0 (remembered)."""
    code = _kind_codes.get(kind)
    if code is None:
        code = _kind_codes[kind] = zlib.crc32(kind.encode())
    return code


def _shown(shape) -> str:
    dims = [str(n) for n in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


# The public calls a collective can serve, by the qualified name of their function, so
# that an error names what the user called.
_PUBLIC = {
    "Strategy.reduce": "strategy.reduce", "Strategy.gather": "strategy.gather",
    "MultiWorkerMirroredStrategy.reduce": "strategy.reduce",
    "MultiWorkerMirroredStrategy.gather": "strategy.gather",
    "ReplicaContext.all_reduce": "all_reduce in strategy.run",
    "ReplicaContext.all_gather": "all_gather in strategy.run",
    "agreed_steps": "the input pipeline's end-of-data agreement",
    "MpiCommunicator.__init__": "creating a strategy",
    "MultiWorkerMirroredStrategy.__init__": "creating a strategy",
}
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _caller() -> tuple:
    """``(public call, "file:line" of the user code that made it)`` for this collective:
    the outermost gpustrat function users call on the stack, and the first frame of
    user code beyond it (either may be None)."""
    f = sys._getframe(1)
    public = None
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name.startswith(_PKG):
            public = _PUBLIC.get(getattr(code, "co_qualname", code.co_name), public)
        elif not name.startswith(_STDLIB) or "site-packages" in name:
            return public, f"{name}:{f.f_lineno}"
        f = f.f_back
    return public, None


def _site_code() -> int:
    site = _caller()[1]
    return 0 if site is None else zlib.crc32(site.encode())


class _Channel:
    """One MPI communicator with deadline waits and the header agreement."""

    __slots__ = ("comm", "rank", "size", "timeout", "debug", "calls", "exits", "pending",
                 "_send", "_recv", "_sendb", "_offsets", "_req", "_views")

    def __init__(self, comm, exits: "_ExitWatch | None" = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout_from_env()
        self.debug = debug_from_env()
        self.calls = 0
        self.exits = exits
        # (what, hint, shape shown) of the next collective, for its layout error.
        self.pending = None
        self._send = np.zeros(_SLOTS, np.int64)
        self._recv = np.zeros((self.size, _SLOTS), np.int64)
        self._sendb = memoryview(self._send).cast("B")
        rec = 8 * _SLOTS
        self._offsets = range(rec, rec * self.size, rec)
        self._req = None
        self._views: dict = {}

    def wait(self, request, what) -> None:
        wait(request, what, self.rank, self.timeout, self.exits)

    def header(self, kind: str, layout: int, count: int, payload, shape, dtype,
               hint: str = "") -> np.ndarray:
        """Allgather this rank's header; return every rank's (a ``(size, 8)`` int64 array
        that the next collective overwrites), or raise the same error on every rank when
        they disagree.

        ``payload``: bytes (at most 32) that ride in the header, or None. ``shape``,
        ``dtype`` and ``hint`` are only used to explain a disagreement.
        """
        self.calls += 1
        pending = self.pending
        if pending is not None:  # the public call's own name, e.g. reduce(SUM, axis=0)
            kind = pending[0]
            shape = pending[2]
        sendb = self._sendb
        _PACK(sendb, 0, kind_code(kind), layout, _site_code() if self.debug else 0, count)
        if payload is not None:
            sendb[32:32 + len(payload)] = payload
        req = self._req
        if req is None:
            req = self._req = self.comm.Allgather_init([self._send, _MPI.INT64_T],
                                                       [self._recv, _MPI.INT64_T])
        req.Start()
        if not req.Test():
            self.wait(req, lambda: _describe(kind, shape, dtype))
        raw = self._recv.tobytes()
        ref = raw[:_AGREE]
        for off in self._offsets:
            if raw[off:off + _AGREE] != ref:
                self._disagree(kind, shape, dtype, hint)
        self.pending = None
        return self._recv

    def _disagree(self, kind: str, shape, dtype, hint: str) -> None:
        """Raise on every rank: every rank saw the same headers, so all come here and
        make the same allgather of their descriptions."""
        hdr = self._recv
        kinds = (hdr[:, 0] != hdr[0, 0]).any()
        layouts = (hdr[:, 1] != hdr[0, 1]).any()
        pending, self.pending = self.pending, None
        what = kind
        if pending is not None:
            hint = pending[1]
        public, site = _caller()
        mine = (kind, what, None if shape is None else _shown(shape),
                None if dtype is None else str(dtype), public, site)
        infos = self.allgather_raw(mine, "describing collectives that disagree")
        n = self.calls
        if kinds or not layouts:
            parts = []
            for r, (k, w, s, d, pub, at) in enumerate(infos):
                text = f"{pub} [{_describe(k, s, d)}]" if pub else _describe(k, s, d)
                parts.append(f"rank {r} called {text}" + (f" at {at}" if at else ""))
            why = ("" if kinds else " (the same collective from different lines of "
                   f"code, which {ENV_DEBUG}=1 reports)")
            raise CollectiveMismatch(
                f"workers called different collectives at collective #{n} of this "
                f"communicator{why}: " + "; ".join(parts) + ". Every rank must make the "
                "same collective calls, with the same shapes and dtypes, in the same "
                "order (a branch on rank-local data, or a rank that skipped a call?)")
        layouts = [(s, d) for _, _, s, d, _, _ in infos]
        parts = "; ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(layouts))
        if kind.startswith("all_gather"):
            raise LayoutMismatch(
                f"{what} between workers: shapes may differ only along the gathered axis "
                f"and dtypes must match, but the workers hold {parts}. Cast and reshape "
                "the values the same way on every worker")
        raise LayoutMismatch(f"{what}: every worker must contribute the same shape and "
                             f"dtype, but the workers hold {parts}"
                             + (f". {hint}" if hint else ""))

    def payloads(self, dtype, shape, nbytes: int) -> np.ndarray:
        """Every rank's inline payload, as a ``(size,) + shape`` view of the headers
        (remembered: the headers' buffer lives as long as the channel)."""
        key = (dtype, shape)
        view = self._views.get(key)
        if view is None:
            rows = self._recv.view(np.uint8)[:, 32:32 + nbytes]
            view = rows.view(dtype).reshape((self.size,) + tuple(shape))
            if len(self._views) < 256:
                self._views[key] = view
        return view

    def rank_payloads(self, dtype, shape, nbytes: int) -> tuple:
        """:meth:`payloads` as one view per rank (remembered)."""
        key = (dtype, shape, "ranks")
        views = self._views.get(key)
        if views is None:
            rows = self.payloads(dtype, shape, nbytes)
            views = tuple(rows[r:r + 1].reshape(shape) for r in range(self.size))
            if len(self._views) < 256:
                self._views[key] = views
        return views

    def allgather_raw(self, obj: Any, what) -> list:
        """Every rank's picklable ``obj``: sizes, then the pickles in one Iallgatherv
        (no header: for explaining a disagreement that every rank has seen)."""
        MPI = mpi()
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.size, np.int64)
        mine = np.array([data.size], np.int64)
        self.wait(self.comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]), what)
        return self._gatherv(data, sizes, what)

    def _gatherv(self, data: np.ndarray, sizes: np.ndarray, what) -> list:
        MPI = mpi()
        displs = np.zeros(self.size, np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        out = np.empty(int(sizes.sum()), np.uint8)
        self.wait(self.comm.Iallgatherv([data, MPI.BYTE],
                                        [out, (sizes, displs), MPI.BYTE]), what)
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs, sizes)]

    def allgather_obj(self, obj: Any, kind: str = "allgather") -> list:
        """Every rank's picklable ``obj`` after a header (small pickles ride in it)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        small = len(data) <= _INLINE
        hdr = self.header(kind, 0, len(data), data if small else None, None, None)
        sizes = hdr[:, 3].copy()
        if sizes.max() <= _INLINE:
            raw = self._recv.view(np.uint8)
            return [pickle.loads(raw[r, 32:32 + s].tobytes()) for r, s in enumerate(sizes)]
        return self._gatherv(np.frombuffer(data, np.uint8), sizes, kind)

    def close(self) -> None:
        if self._req is not None:
            self._req.Free()
            self._req = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


class _Results:
    """Result arrays of large collectives, reused once the caller has let go of them.

    A fresh multi-megabyte array per call costs page faults that take longer than the
    transfer itself. An array handed out is reused only when nothing but this cache
    refers to it (a view, a memoryview or any other holder keeps it out), so a result
    never changes under a caller.
    """

    __slots__ = ("_arrays",)
    _KEEP = 2  # per layout: the result a loop still holds while it asks for the next

    def __init__(self):
        self._arrays: dict = {}

    def get(self, shape: tuple, dtype) -> np.ndarray:
        key = (shape, dtype)
        kept = self._arrays.get(key)
        if kept is None:
            if len(self._arrays) >= 32:
                self._arrays.clear()
            kept = self._arrays[key] = []
        for a in kept:
            if sys.getrefcount(a) == 3:  # `kept`, `a` and getrefcount's argument
                return a
        a = np.empty(shape, dtype)
        if len(kept) < self._KEEP:
            kept.append(a)
        else:
            kept[0] = a
        return a


# --- ranks that exit early ---------------------------------------------------------

_watches: dict = {}  # id -> _ExitWatch of every open group, told at interpreter exit
_hooks_installed = False
# How often a waiting rank checks that the processes of its peers on this node still run.
_LIVENESS_S = 0.2


def _process_id() -> tuple:
    """``(host, pid namespace, pid, start time)``: who this process is, so that a peer
    on the same node can tell whether it still runs."""
    import socket  # noqa: PLC0415
    try:
        st = os.stat("/proc/self/ns/pid")
        ns = (st.st_dev, st.st_ino)
    except OSError:
        ns = None
    pid = os.getpid()
    return socket.gethostname(), ns, pid, _start_time(pid)


def _start_time(pid: int):
    """The start time of process ``pid`` (field 22 of /proc/pid/stat), or None when it is
    gone, a zombie, or /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


class _ExitWatch:
    """Tells the ranks of a group, at once, that one of them has exited or died.

    A rank whose script ends (or calls ``sys.exit`` or ``MPI.Finalize``) while the others
    are still inside a collective would otherwise leave them waiting the whole
    ``GPUSTRAT_TIMEOUT``. Every rank keeps one receive posted on its own duplicate
    communicator; at interpreter exit, and at ``MPI_Finalize`` (an attribute delete
    callback on ``COMM_SELF``, which MPI runs first thing there), a rank sends its
    number to every other rank, so that a rank waiting in a collective of this group
    raises within ``_EXIT_GRACE_S``, naming the rank that left. Then the exiting rank
    waits on a non-blocking barrier for the others to exit too (MPI_Finalize would wait
    for them anyway) and receives their notices, so no message is left unmatched.

    A rank that ends without running any exit code (killed, ``os._exit``) sends nothing:
    a rank waiting in a collective checks every ``_LIVENESS_S`` whether the processes
    of its peers on the same node still run (``/proc``), and raises naming the one that
    is gone. A normal end costs each rank ``size - 1`` sends and receives of one
    integer; nothing is spent while collectives complete without waiting.
    """

    def __init__(self, comm, timeout: float):
        MPI = mpi()
        dup, req = comm.Idup()
        wait(req, "creating a worker group (MPI Idup)", comm.Get_rank(), timeout)
        self.comm = dup
        self.size = dup.Get_size()
        rank = dup.Get_rank()
        ids = _Channel(dup).allgather_raw(_process_id(), "creating a worker group")
        host, ns = ids[rank][:2]
        self._local_peers = [(r, pid, start) for r, (h, n, pid, start) in enumerate(ids)
                             if r != rank and h == host and n == ns and n is not None
                             and start is not None]
        self._next_check = 0.0
        self._buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._req = dup.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=0)
        self.gone: int | None = None
        self.died = False
        _watches[id(self)] = self
        _install_exit_hooks()

    def poll(self) -> int | None:
        """The rank that has exited or died, once one has; else None."""
        if self.gone is None and self._req.Test(self._status):
            self.gone = self._status.Get_source()
        if self.gone is None and self._local_peers:
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + _LIVENESS_S
                for r, pid, start in self._local_peers:
                    if _start_time(pid) != start:
                        self.gone, self.died = r, True
                        self.pid = pid
                        break
        return self.gone

    def reason(self) -> str:
        """Why the rank that :meth:`poll` named is gone, for an error message."""
        if self.died:
            return (f"rank {self.gone} (process {self.pid} on this node) has ended without "
                    "telling the others (killed by a signal, or os._exit)")
        return (f"rank {self.gone} has exited (its script ended, returned from main, or "
                "called sys.exit or MPI.Finalize)")

    def close(self) -> None:
        """Withdraw the posted receive (collective with the group's close)."""
        _watches.pop(id(self), None)
        if self.gone is None or self.died:
            self._req.Cancel()
            self._req.Wait()
        self.comm.Free()


def _install_exit_hooks() -> None:
    """Tell the other ranks at interpreter exit, and at MPI_Finalize if it comes first."""
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    import atexit  # noqa: PLC0415
    atexit.register(_tell_exit)
    MPI = mpi()
    # MPI_Finalize deletes COMM_SELF's attributes before anything else, so a delete
    # callback runs while MPI still works, also when the script calls MPI.Finalize().
    keyval = MPI.Comm.Create_keyval(delete_fn=lambda *_: _tell_exit())
    MPI.COMM_SELF.Set_attr(keyval, True)


def _tell_exit() -> None:
    """Tell every open group's other ranks that this rank is leaving."""
    if not _watches or _MPI is None or _MPI.Is_finalized():
        return
    MPI = _MPI
    watches = list(_watches.values())
    _watches.clear()
    sends, barriers = [], []
    for w in watches:
        me = np.array([w.comm.Get_rank()], np.int64)
        sends += [w.comm.Isend([me, MPI.INT64_T], dest=r, tag=0)
                  for r in range(w.size) if r != me[0]]
    # Every notice is sent before any barrier, so the barriers (on different
    # communicators, in any order) cannot wait on each other.
    for w in watches:
        barriers.append(w.comm.Ibarrier())
    for w, b in zip(watches, barriers):
        wait(b, "waiting at exit for the other ranks to exit", w.comm.Get_rank(),
             float("inf"))
        w._req.Wait()
        for _ in range(w.size - 2):
            w.comm.Recv([w._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=0)
    MPI.Request.Waitall(sends)


# --- workers ------------------------------------------------------------------------

class MpiWorkerGroup(WorkerGroup):
    """Every rank of an MPI communicator is a worker.

    Args:
        comm: an mpi4py intra-communicator (default ``COMM_WORLD``). The group works
            on a duplicate of it, so several groups (strategies) coexist.
    """

    def __init__(self, comm=None):
        MPI = mpi()
        base = MPI.COMM_WORLD if comm is None else comm
        timeout = timeout_from_env()
        dup, req = base.Idup()
        wait(req, "creating a worker group (MPI Idup)", base.Get_rank(), timeout)
        self.comm = dup
        self.exits = _ExitWatch(dup, timeout) if dup.Get_size() > 1 else None
        self._ch = _Channel(dup, self.exits)
        self.size = self._ch.size
        self.rank = self._ch.rank
        # Ranks sharing memory are one node: the node-local rank picks this worker's GPU.
        self.node_comm = dup.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self._node_rank = self.node_comm.Get_rank()
        self._node_size = self.node_comm.Get_size()

    @property
    def timeout(self) -> float:
        """Seconds any blocking wait of this group may take (``GPUSTRAT_TIMEOUT``)."""
        return self._ch.timeout

    @property
    def debug(self) -> bool:
        return self._ch.debug

    def node_local_rank(self) -> int:
        """This worker's index among the workers of its node (shared-memory domain)."""
        return self._node_rank

    def node_local_size(self) -> int:
        """Number of workers on this worker's node."""
        return self._node_size

    def dup_comm(self):
        """A new duplicate of this group's communicator (collective; deadline-bounded)."""
        dup, req = self.comm.Idup()
        self._ch.wait(req, "duplicating the worker communicator (MPI Idup)")
        return dup

    def allgather(self, obj):
        return self._ch.allgather_obj(obj)

    def allreduce_ints(self, values, op):
        op = ReduceOp.from_value(op)
        if op is ReduceOp.MEAN:
            raise ValueError("allreduce_ints supports SUM, MAX and MIN, not MEAN "
                             "(an integer mean would round): SUM and divide instead")
        buf = np.array(values, dtype=np.int64, order="C")
        ch = self._ch
        kind = f"allreduce_ints({op.name})"
        small = buf.nbytes <= _INLINE
        ch.header(kind, layout_code(buf.shape, buf.dtype), buf.nbytes,
                  buf.tobytes() if small else None, buf.shape, buf.dtype)
        if small:
            return _NP_OPS[op].reduce(ch.payloads(buf.dtype, buf.shape, buf.nbytes), axis=0)
        MPI = mpi()
        ch.wait(ch.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], getattr(MPI, _OPS[op])),
                lambda: _describe(kind, buf.shape, buf.dtype))
        return buf

    def bcast(self, obj, root=0):
        if not 0 <= root < self.size:
            raise ValueError(f"bcast root {root} is not a rank (0 .. {self.size - 1})")
        MPI = mpi()
        ch = self._ch
        what = f"bcast(root={root})"
        mine = self.rank == root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
        small = len(data) <= _INLINE
        hdr = ch.header(what, 0, len(data), data if mine and small else None, None, None)
        size = int(hdr[root, 3])
        if size <= _INLINE:
            return obj if mine else pickle.loads(
                ch._recv.view(np.uint8)[root, 32:32 + size].tobytes())
        buf = np.frombuffer(data, np.uint8).copy() if mine else np.empty(size, np.uint8)
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root), what)
        return obj if mine else pickle.loads(buf.tobytes())

    def barrier(self):
        # Every rank's header must arrive before any rank's Allgather completes.
        self._ch.header("barrier", 0, 0, None, None, None)

    def abort(self, code: int = 1) -> None:
        """``MPI_Abort``: the MPI launcher ends every rank of the job."""
        self.comm.Abort(code)

    def duplicate(self) -> "MpiWorkerGroup":
        """A new group on a duplicate of this group's communicator (collective)."""
        return MpiWorkerGroup(self.comm)

    def close(self) -> None:
        """Free the duplicated communicators (collective over the group)."""
        if self.exits is not None:
            self.exits.close()
            self.exits = None
        for c in (self.node_comm, self.comm):
            if c is not None and c != mpi().COMM_NULL:
                c.Free()
        self.node_comm = self.comm = None


# --- data plane -------------------------------------------------------------------

# What the replicas' host arrays combine with, per op (booleans: or, or, and).
_NP_OPS = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add, ReduceOp.MAX: np.maximum,
           ReduceOp.MIN: np.minimum}
_BOOL_NP_OPS = {ReduceOp.SUM: np.logical_or, ReduceOp.MEAN: np.logical_or,
                ReduceOp.MAX: np.logical_or, ReduceOp.MIN: np.logical_and}
_REDUCE_KINDS = {op: f"all_reduce({op.name})" for op in ReduceOp}


class MpiCommunicator(HostCommunicator):
    """Collectives over CPU replicas of several workers: local NumPy reduction first
    (HostCommunicator), then the header and one MPI collective between workers.

    Args:
        devices: this worker's CPU devices (every worker must hold the same number).
        workers: the :class:`MpiWorkerGroup` of the job.
    """

    def __init__(self, devices: Sequence[Device], workers: MpiWorkerGroup):
        if not isinstance(workers, MpiWorkerGroup):
            raise TypeError(f"MpiCommunicator needs an MpiWorkerGroup, got "
                            f"{type(workers).__name__}")
        super().__init__(devices)
        gpus = [d.name for d in self.devices if d.is_gpu]
        if gpus:
            raise ValueError(f"MpiCommunicator moves host (NumPy) arrays; devices {gpus} "
                             "are GPUs: use select.make_communicator, which stages GPU "
                             "buffers or uses NCCL")
        self.workers = workers
        self.num_workers = workers.size
        self.worker_index = workers.rank
        # Data collectives get their own communicator: replica threads and input
        # pipeline threads may each be inside a collective at the same moment.
        self._ch = _Channel(workers.dup_comm(), workers.exits)
        self._results = _Results()
        self._plans: dict = {}
        self._gather_plans: dict = {}
        sizes = workers.allgather(self.num_local)
        if len(set(sizes)) > 1:
            raise ValueError(f"every worker must hold the same number of local replicas, "
                             f"but the workers hold {sizes} (worker i at position i)")

    @staticmethod
    def _check_dtype(x: np.ndarray, what: str) -> None:
        if x.dtype.hasobject:
            raise TypeError(f"{what}: arrays of Python objects (dtype {x.dtype}) cannot "
                            "travel between workers; use a numeric dtype")

    def agree_layout(self, shape, dtype, what, hint=""):
        # Rides with the next collective: its header carries the layout, and this only
        # says how to explain a disagreement (no communication here).
        self._ch.pending = (what() if callable(what) else what, hint, shape)

    def agree(self, key, what, hint=""):
        # A header of its own: the layout checksum is the key's. A layout named for the
        # next data collective stays pending for it.
        ch = self._ch
        saved, ch.pending = ch.pending, None
        what = what() if callable(what) else what
        try:
            ch.header(what, layout_code(key, np.uint8), 0, None, key, np.dtype(np.uint8), hint)
        finally:
            ch.pending = saved

    def reduce(self, buffers, op):
        if type(op) is not ReduceOp:
            op = ReduceOp.from_value(op)
        if len(buffers) == 1:
            x = buffers[0]
            if type(x) is not np.ndarray:
                x = np.asarray(to_host(x))
            # The caller's array is sent as it is (never modified): no copy.
            out = self._allreduce(x, op, owned=False)
            return divide(out, self.num_replicas) if op is _MEAN else out
        return super().reduce(buffers, op)  # local reduction into a new array first

    def _across_workers_reduce(self, x, op):
        return self._allreduce(x, op, owned=True)

    def _allreduce(self, x: np.ndarray, op: ReduceOp, owned: bool) -> np.ndarray:
        """All-reduce ``x`` between workers (MEAN sums; the caller divides). ``owned``:
        ``x`` may be overwritten and returned."""
        ch = self._ch
        shape, dtype = x.shape, x.dtype
        # Keyed by id(op): hashing an Enum member runs Python code, an id does not.
        plan = self._plans.get((shape, dtype, id(op)))
        if plan is None:
            plan = self._plan(shape, dtype, op)
        hit, lcode, nbytes, views, kind, ufunc = plan
        small = views is not None
        ch.header(kind, lcode, nbytes, x.tobytes() if small else None, shape, dtype)
        if small:
            if views:
                # Rank by rank, in rank order, so every rank computes the same bits.
                out = ufunc(views[0], views[1]) if len(views) > 1 else views[0].copy()
                for v in views[2:]:
                    out = ufunc(out, v)
            else:
                rows = ch.payloads(dtype, shape, nbytes)
                if dtype.kind == "b":
                    out = _BOOL_NP_OPS[op].reduce(rows, axis=0)
                else:  # float16: summed in float32, rounded once
                    out = _NP_OPS[op].reduce(rows, axis=0, dtype=hit[2]).astype(dtype)
            if type(out) is not np.ndarray:  # 0-d operands give a NumPy scalar
                out = np.asarray(out)
        else:
            mtype, mop, up = hit
            if up is not None:
                out = x.astype(up)
                src = _MPI.IN_PLACE
            elif owned and x.flags.c_contiguous and x.flags.writeable:
                out, src = x, _MPI.IN_PLACE
            else:
                out = self._results.get(x.shape, x.dtype)
                src = [x if x.flags.c_contiguous else np.ascontiguousarray(x), mtype]
            if nbytes >= _BLOCKING_BYTES:
                # Every rank's header has arrived, so every rank is in this reduce: the
                # blocking call (as fast as a bare Allreduce) cannot wait on an absent
                # rank, only on one killed during the transfer, which the launcher ends.
                ch.comm.Allreduce(src, [out, mtype], mop)
            else:
                req = ch.comm.Iallreduce(src, [out, mtype], mop)
                if not req.Test():
                    ch.wait(req, lambda: _describe(kind, x.shape, x.dtype))
            if up is not None:
                out = out.astype(x.dtype)
        return out

    def _plan(self, shape: tuple, dtype, op: ReduceOp) -> tuple:
        """What a reduce of this layout needs, worked out once: ``(reduce_args, layout
        checksum, bytes, per-rank payload views, kind, NumPy ufunc)``; the views are None
        when the payload does not ride in the header, () when it does but is combined
        as a whole (booleans, float16)."""
        hit = reduce_args(dtype, op)
        nbytes = dtype.itemsize * math.prod(shape)
        views = None
        if nbytes <= _INLINE:
            views = () if hit[2] is not None or dtype.kind == "b" else \
                self._ch.rank_payloads(dtype, shape, nbytes)
        plan = (hit, layout_code(shape, dtype), nbytes, views, _REDUCE_KINDS[op],
                _NP_OPS[op])
        if len(self._plans) < 1024:
            self._plans[(shape, dtype, id(op))] = plan
        return plan

    def all_gather(self, buffers, axis=0):
        if len(buffers) == 1 and type(buffers[0]) is np.ndarray:
            return [self._gather(buffers[0], axis)]
        bufs = [np.asarray(to_host(b)) for b in buffers]
        local = np.concatenate(bufs, axis=axis) if len(bufs) > 1 else bufs[0]
        out = self._gather(local, axis)
        return [out] + [out.copy() for _ in range(self.num_local - 1)]

    def _across_workers_gather(self, x, axis):
        return self._gather(x, axis)

    def _gather_plan(self, x: np.ndarray, axis: int) -> tuple:
        """``(axis, kind, layout checksum, other axes, bytes per row)`` for gathering
        arrays of ``x``'s layout along ``axis``, checked and worked out once."""
        self._check_dtype(x, "all_gather")
        if x.ndim == 0:
            raise ValueError("all_gather concatenates along an axis, but the values are "
                             "scalars: gather x[None] (or reshape to at least 1-D)")
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"all_gather axis {axis} is out of range for shape {x.shape}")
        ax = axis % x.ndim
        rest = x.shape[:ax] + x.shape[ax + 1:]
        # Sizes along the gathered axis may differ; the other axes and dtype may not.
        shown = x.shape[:ax] + ("*",) + x.shape[ax + 1:]
        plan = (ax, f"all_gather(axis={ax})", layout_code(shown, x.dtype), rest,
                x.dtype.itemsize * math.prod(rest))
        if len(self._gather_plans) < 1024:
            self._gather_plans[(x.shape, x.dtype, axis)] = plan
        return plan

    def _gather(self, x: np.ndarray, axis: int) -> np.ndarray:
        MPI = _MPI
        plan = self._gather_plans.get((x.shape, x.dtype, axis))
        if plan is None:
            plan = self._gather_plan(x, axis)
        ax, kind, lcode, rest, row_bytes = plan
        front = np.moveaxis(x, ax, 0) if ax else x
        if not front.flags.c_contiguous:
            front = np.ascontiguousarray(front)
        ch = self._ch
        nbytes = front.nbytes
        small = nbytes <= _INLINE
        hdr = ch.header(kind, lcode, front.shape[0], front.tobytes() if small else None,
                        x.shape, x.dtype)
        rows = hdr[:, 3].tolist()
        total = sum(rows)
        if max(rows) * row_bytes <= _INLINE:
            if min(rows) == max(rows):  # the same rows everywhere: one copy
                out = ch.payloads(x.dtype, front.shape, nbytes).copy().reshape(
                    (total,) + rest)
            else:
                raw = ch._recv.view(np.uint8)
                out = np.empty((total,) + rest, x.dtype)
                flat = out.reshape(-1).view(np.uint8)
                at = 0
                for r, n in enumerate(rows):
                    nb = n * row_bytes
                    flat[at:at + nb] = raw[r, 32:32 + nb]
                    at += nb
        else:
            out = self._results.get((total,) + rest, x.dtype)
            if min(rows) == max(rows):
                if nbytes >= _BLOCKING_BYTES:
                    # As in _allreduce: every rank is in this gather, so the blocking
                    # call cannot wait on an absent rank.
                    ch.comm.Allgather([front, MPI.BYTE], [out, MPI.BYTE])
                    return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out
                req = ch.comm.Iallgather([front, MPI.BYTE], [out, MPI.BYTE])
            else:
                counts = np.array(rows, np.int64) * row_bytes
                displs = np.zeros(ch.size, np.int64)
                np.cumsum(counts[:-1], out=displs[1:])
                req = ch.comm.Iallgatherv([front, MPI.BYTE],
                                          [out, (counts, displs), MPI.BYTE])
            ch.wait(req, lambda: _describe(kind, x.shape, x.dtype))
        return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out

    def _across_workers_bcast(self, x, root_worker):
        MPI = _MPI
        self._check_dtype(x, "broadcast")
        ch = self._ch
        kind = f"broadcast(root worker {root_worker})"
        buf = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        small = buf.nbytes <= _INLINE
        ch.header(kind, layout_code(x.shape, x.dtype), 0,
                  buf.tobytes() if small and self.worker_index == root_worker else None,
                  x.shape, x.dtype)
        if small:
            return ch.payloads(x.dtype, x.shape, buf.nbytes)[root_worker].copy()
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root_worker),
                lambda: _describe(kind, x.shape, x.dtype))
        return buf

    def close(self) -> None:
        self._ch.close()
