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
  burn a core.
- *debug mode* (``GPUSTRAT_DEBUG_COLLECTIVES=1``): before each collective, the ranks
  agree on (operation, shape, dtype, call number) with one small extra all-reduce of a
  checksum, and on disagreement allgather the descriptions and raise
  :class:`~gpustrat.errors.CollectiveMismatch` on every rank, naming ranks and calls.

Arrays travel through mpi4py's buffer interface (upper-case calls), never pickled.
``from mpi4py import MPI`` initialises MPI, so it happens in :func:`mpi` the first time a
group is made, never when gpustrat is imported.
"""

from __future__ import annotations

import os
import pickle
import time
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from gpustrat.collectives.base import WorkerGroup, agree_layout_with
from gpustrat.collectives.host import HostCommunicator, divide
from gpustrat.devices import Device
from gpustrat.errors import CollectiveMismatch, CollectiveTimeout
from gpustrat.reduce_util import ReduceOp

ENV_TIMEOUT = "GPUSTRAT_TIMEOUT"
ENV_DEBUG = "GPUSTRAT_DEBUG_COLLECTIVES"
DEFAULT_TIMEOUT = 300.0

# Polling: _SPIN back-to-back Tests (about 10-30 us), then Test after each yield of the
# core for _YIELD_S (MPI progresses only inside MPI calls, so a large transfer must keep
# being tested; the clock is read once per _SPIN tests), then sleeps doubling from 10 us
# up to 1 ms.
_SPIN = 100
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
                f"{name} cannot complete on rank {rank}: rank {gone} has exited (its "
                "script ended, returned from main or called sys.exit) while this rank "
                "waits for it. Every rank must run the same steps and collectives: do not "
                "leave the training loop or the script early on some ranks only, and "
                "raise an exception instead of sys.exit on errors (it ends every rank)")
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
    return f"{op} on shape {shape} {dtype}"


def _mismatch_message(calls: list) -> str:
    """Explain which ranks disagree with rank 0 (every rank builds the same text)."""
    ref = calls[0]
    parts = []
    for rank, c in enumerate(calls):
        if c != ref:
            parts.append(f"rank {rank} called {_describe(*c[:3])} but rank 0 called "
                         f"{_describe(*ref[:3])}")
    # The k-th check of every rank carries k, so a skipped call shows up as the next
    # call differing (or, when nothing differs, as a timeout); the number says where.
    hint = ("every rank must make the same collective calls, with the same shapes and "
            "dtypes, in the same order (a branch on rank-local data, or a rank that "
            "skipped a call?)")
    return (f"collectives disagree between workers at collective #{ref[3]} of this "
            "communicator: " + "; ".join(parts) + ". " + hint)


class _Channel:
    """One MPI communicator with deadline waits and the debug-mode agreement check."""

    __slots__ = ("comm", "rank", "size", "timeout", "debug", "calls", "exits")

    def __init__(self, comm, exits: "_ExitWatch | None" = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout_from_env()
        self.debug = debug_from_env()
        self.calls = 0
        self.exits = exits

    def wait(self, request, what) -> None:
        wait(request, what, self.rank, self.timeout, self.exits)

    def check(self, op: str, shape=None, dtype=None) -> None:
        """Debug mode: agree with every rank on (op, shape, dtype, call number) first.

        One small Iallreduce(MAX) of (crc, -crc, n, -n) tells whether every rank has
        the same description crc and call number n; only when they differ are the full
        descriptions gathered, to raise CollectiveMismatch on every rank (all see the
        same reduced values, so all take the same branch).
        """
        self.calls += 1
        if shape is not None and not isinstance(shape, str):
            shape = tuple(int(n) for n in shape)
        mine = (op, shape, None if dtype is None else str(dtype), self.calls)
        crc = zlib.crc32(repr(mine[:3]).encode())
        MPI = mpi()
        agree = np.array([crc, -crc, self.calls, -self.calls], np.int64)
        what = lambda: "debug check before " + _describe(*mine[:3])  # noqa: E731
        self.wait(self.comm.Iallreduce(MPI.IN_PLACE, [agree, MPI.INT64_T], MPI.MAX), what)
        if agree[0] == -agree[1] and agree[2] == -agree[3]:
            return
        calls = self.allgather_obj(mine, what)
        raise CollectiveMismatch(_mismatch_message(calls))

    def allgather_obj(self, obj: Any, what) -> list:
        """Every rank's picklable ``obj``: sizes, then the pickles in one Iallgatherv."""
        MPI = mpi()
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.size, np.int64)
        mine = np.array([data.size], np.int64)
        self.wait(self.comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]), what)
        displs = np.zeros(self.size, np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        out = np.empty(int(sizes.sum()), np.uint8)
        self.wait(self.comm.Iallgatherv([data, MPI.BYTE],
                                        [out, (sizes, displs), MPI.BYTE]), what)
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs, sizes)]


# --- ranks that exit early ---------------------------------------------------------

_watches: dict = {}  # id -> _ExitWatch of every open group, told at interpreter exit
_atexit_registered = False


class _ExitWatch:
    """Tells the ranks of a group, at once, that one of them has exited.

    A rank whose script ends (or calls ``sys.exit``) while the others are still inside
    a collective would otherwise leave them waiting the whole ``GPUSTRAT_TIMEOUT``.
    Every rank keeps one receive posted on its own duplicate communicator; at
    interpreter exit a rank sends its number to every other rank, so that a rank waiting
    in a collective of this group raises within ``_EXIT_GRACE_S``, naming the rank that
    left. Then the exiting rank waits on a non-blocking barrier for the others to exit
    too (MPI_Finalize would wait for them anyway) and receives their notices, so no
    message is left unmatched. A normal end costs each rank ``size - 1`` sends and
    receives of one integer; nothing is spent while the job runs.
    """

    def __init__(self, comm, timeout: float):
        global _atexit_registered
        MPI = mpi()
        dup, req = comm.Idup()
        wait(req, "creating a worker group (MPI Idup)", comm.Get_rank(), timeout)
        self.comm = dup
        self.size = dup.Get_size()
        self._buf = np.zeros(1, np.int64)
        self._status = MPI.Status()
        self._req = dup.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=0)
        self.gone: int | None = None
        _watches[id(self)] = self
        if not _atexit_registered:
            import atexit  # noqa: PLC0415
            atexit.register(_tell_exit)
            _atexit_registered = True

    def poll(self) -> int | None:
        """The rank that has exited, once one has; else None."""
        if self.gone is None and self._req.Test(self._status):
            self.gone = self._status.Get_source()
        return self.gone

    def close(self) -> None:
        """Withdraw the posted receive (collective with the group's close)."""
        _watches.pop(id(self), None)
        if self.gone is None:
            self._req.Cancel()
            self._req.Wait()
        self.comm.Free()


def _tell_exit() -> None:
    """atexit: tell every open group's other ranks that this rank is leaving."""
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
        if self._ch.debug:
            self._ch.check("allgather")
        return self._ch.allgather_obj(obj, "allgather")

    def allreduce_ints(self, values, op):
        op = ReduceOp.from_value(op)
        if op is ReduceOp.MEAN:
            raise ValueError("allreduce_ints supports SUM, MAX and MIN, not MEAN "
                             "(an integer mean would round): SUM and divide instead")
        MPI = mpi()
        buf = np.array(values, dtype=np.int64, order="C")
        ch = self._ch
        if ch.debug:
            ch.check(f"allreduce_ints({op.name})", buf.shape, buf.dtype)
        ch.wait(ch.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], getattr(MPI, _OPS[op])),
                lambda: _describe(f"allreduce_ints({op.name})", buf.shape, buf.dtype))
        return buf

    def bcast(self, obj, root=0):
        if not 0 <= root < self.size:
            raise ValueError(f"bcast root {root} is not a rank (0 .. {self.size - 1})")
        MPI = mpi()
        ch = self._ch
        if ch.debug:
            ch.check(f"bcast(root={root})")
        what = f"bcast(root={root})"
        mine = self.rank == root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
        n = np.array([len(data)], np.int64)
        ch.wait(ch.comm.Ibcast([n, MPI.INT64_T], root=root), what)
        buf = np.frombuffer(data, np.uint8).copy() if mine else np.empty(int(n[0]), np.uint8)
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root), what)
        return obj if mine else pickle.loads(buf.tobytes())

    def barrier(self):
        ch = self._ch
        if ch.debug:
            ch.check("barrier")
        ch.wait(ch.comm.Ibarrier(), "barrier")

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

class MpiCommunicator(HostCommunicator):
    """Collectives over CPU replicas of several workers: local NumPy reduction first
    (HostCommunicator), then one MPI collective between workers on its result.

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
        sizes = workers.allgather(self.num_local)
        if len(set(sizes)) > 1:
            raise ValueError(f"every worker must hold the same number of local replicas, "
                             f"but the workers hold {sizes} (worker i at position i)")

    @staticmethod
    def _check_dtype(x: np.ndarray, what: str) -> None:
        if x.dtype.hasobject:
            raise TypeError(f"{what}: arrays of Python objects (dtype {x.dtype}) cannot "
                            "travel between workers; use a numeric dtype")

    def reduce(self, buffers, op):
        # The common case, one NumPy buffer per worker and debug mode off, is written
        # out here: a one-float reduce must cost little more than a bare Allreduce, and
        # each Python call or attribute lookup on this path is a tenth of a microsecond.
        if len(buffers) == 1 and type(op) is ReduceOp:
            x = buffers[0]
            if type(x) is np.ndarray:
                hit = _reduce_args_cache.get((x.dtype, op))
                ch = self._ch
                if hit is not None and hit[2] is None and not ch.debug:
                    buf = x.copy()  # C-contiguous, and the input stays untouched
                    req = ch.comm.Iallreduce(_MPI.IN_PLACE, [buf, hit[0]], hit[1])
                    if not req.Test():
                        ch.wait(req, lambda: _describe(f"all_reduce({op.name})",
                                                       x.shape, x.dtype))
                    return divide(buf, self.num_replicas) if op is _MEAN else buf
        return super().reduce(buffers, op)

    def agree_layout(self, shape, dtype, what, hint=""):
        if self.num_workers == 1:
            return
        MPI = mpi()
        ch = self._ch

        def max_ints(agree):
            ch.wait(ch.comm.Iallreduce(MPI.IN_PLACE, [agree, MPI.INT64_T], MPI.MAX),
                    lambda: "checking the layouts between workers before "
                    + (what() if callable(what) else what))
            return agree
        # On the data channel, ordered with the data collectives of this communicator.
        agree_layout_with(max_ints, lambda obj: ch.allgather_obj(obj, "checking layouts"),
                          shape, dtype, what, hint)

    def _across_workers_reduce(self, x, op):
        MPI = _MPI
        mtype, mop, up = reduce_args(x.dtype, op)
        ch = self._ch
        if ch.debug:
            ch.check(f"all_reduce({op.name})", x.shape, x.dtype)
        buf = x if up is None else x.astype(up)
        if not buf.flags.c_contiguous:
            buf = np.ascontiguousarray(buf)
        req = ch.comm.Iallreduce(MPI.IN_PLACE, [buf, mtype], mop)
        ch.wait(req, lambda: _describe(f"all_reduce({op.name})", x.shape, x.dtype))
        return buf if up is None else buf.astype(x.dtype)

    def _across_workers_gather(self, x, axis):
        MPI = _MPI
        self._check_dtype(x, "all_gather")
        if x.ndim == 0:
            raise ValueError("all_gather concatenates along an axis, but the values are "
                             "scalars: gather x[None] (or reshape to at least 1-D)")
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"all_gather axis {axis} is out of range for shape {x.shape}")
        ax = axis % x.ndim
        front = np.ascontiguousarray(np.moveaxis(x, ax, 0) if ax else x)
        rest = front.shape[1:]
        ch = self._ch
        if ch.debug:
            # Sizes along the gathered axis may differ: shown and compared as "*".
            dims = ["*" if i == ax else str(n) for i, n in enumerate(x.shape)]
            shown = "(" + ", ".join(dims) + (",)" if len(dims) == 1 else ")")
            ch.check(f"all_gather(axis={ax})", shown, x.dtype)
        row_bytes = front.itemsize * int(np.prod(rest, dtype=np.int64))
        # The counts travel with a checksum of (ndim, other axes, dtype): every rank sees
        # every checksum, so a mismatch (which would gather reinterpreted bytes) is
        # raised on all of them, at no extra collective.
        sig = zlib.crc32(repr((x.ndim, rest, str(x.dtype))).encode())
        info = np.empty(3 * ch.size, np.int64)
        mine = np.array([front.shape[0], row_bytes, sig], np.int64)
        what = f"all_gather(axis={ax}) of shape {x.shape} {x.dtype}"
        ch.wait(ch.comm.Iallgather([mine, MPI.INT64_T], [info, MPI.INT64_T]), what)
        rows, sigs = info[0::3], info[2::3]
        if (sigs != sigs[0]).any():
            shapes = ch.allgather_obj((x.shape, str(x.dtype)), what)
            parts = [f"rank {r}: {s} {d}" for r, (s, d) in enumerate(shapes)]
            raise ValueError(
                f"all_gather(axis={ax}) between workers: shapes may differ only along the "
                f"gathered axis and dtypes must match, but the workers hold "
                f"{'; '.join(parts)}. Cast and reshape the values the same way on every "
                "worker")
        counts = rows * row_bytes
        displs = np.zeros(ch.size, np.int64)
        np.cumsum(counts[:-1], out=displs[1:])
        out = np.empty((int(rows.sum()),) + rest, x.dtype)
        ch.wait(ch.comm.Iallgatherv([front, MPI.BYTE], [out, (counts, displs), MPI.BYTE]),
                what)
        return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out

    def _across_workers_bcast(self, x, root_worker):
        MPI = _MPI
        self._check_dtype(x, "broadcast")
        ch = self._ch
        if ch.debug:
            ch.check(f"broadcast(root worker {root_worker})", x.shape, x.dtype)
        buf = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root_worker),
                lambda: _describe(f"broadcast(root worker {root_worker})", x.shape, x.dtype))
        return buf

    def close(self) -> None:
        if self._ch.comm is not None:
            self._ch.comm.Free()
            self._ch.comm = None
