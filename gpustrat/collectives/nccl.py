"""NCCL between GPUs, through ``cupy.cuda.nccl``.

Words:
- *NCCL rank*: one per replica in sync: global replica id
  ``worker_index * num_local + local_index``. Each local GPU has its own NCCL
  communicator, and one thread issues the calls of all local GPUs between
  ``groupStart()`` and ``groupEnd()`` (NCCL requires the grouping when one thread
  drives several GPUs).
- *clique*: all NCCL ranks of the job. In one process it is made by
  ``NcclCommunicator.initAll``; with several workers, the unique id is created on rank
  0 and broadcast over MPI (``rendezvous.py``), and the cross-worker traffic goes
  through NCCL as well (NCCL picks rings and trees over NVLink, PCIe and the network
  itself), so there is no separate hierarchical NCCL-then-MPI path.
- *ordering*: a collective runs on each device's current stream (inside ``run``, the
  replica's stream), as a hand-written NCCL call does: the work queued before it is
  ordered before it and the caller's later work after it, with no event between
  streams and no host wait. A result is ordered on its own device's current stream;
  read it with that device current (``gpustrat.devices.to_host`` does), since CuPy's
  ``get()`` copies on the current device's stream.
- *deadline*: a watchdog thread (one per communicator, started with its first
  collective, as PyTorch's NCCL watchdog) polls an event recorded on each stream after
  the collective, and ``ncclCommGetAsyncError``, until the work is done or
  ``GPUSTRAT_TIMEOUT`` seconds (default 300) pass; then every local NCCL communicator
  is aborted, which ends the stuck NCCL kernels, and the next call on the communicator
  raises :class:`~gpustrat.errors.CollectiveTimeout` instead of hanging on a dead
  peer. A collective only appends to the watchdog's queue: the watchdog looks at it
  every millisecond while it has work (never spinning, so it does not contend with the
  caller for the interpreter), and sleeps until the next collective after a tenth of a
  second without one. It holds the collective's buffers until its events complete, so
  their memory is not reused while NCCL may still read or write it. An aborted
  communicator refuses further calls.

Reductions use the dtype and op table below. MEAN is ``ncclAvg`` on floating dtypes
when the NCCL library has it (2.10 and later), else SUM followed by a division on the
device; integer MEAN is SUM then a true division (float64), as on the host. Dtypes
NCCL has no type for are reduced through one it has, with the host's results: bool
as uint8 (MAX is any, MIN all, SUM any as NumPy adds booleans), int16 and uint16 cast
to int32 and uint32 and back (the low 16 bits of the wider sum are the 16-bit sum,
wraparound included), complex as floats of twice the length (SUM and MEAN; MAX and MIN
of complex values are refused). Gathers and broadcasts move bytes, so they accept any
dtype.

Importing this module imports nothing from CuPy; :func:`is_available` does, and never
raises.
"""

from __future__ import annotations

import collections
import operator
import threading
import time
import weakref
from typing import Callable, Sequence

import numpy as np

from gpustrat import devices
from gpustrat.collectives.base import (Communicator, LocalWorkerGroup, WorkerGroup,
                                       agree_layout_over)
from gpustrat.collectives.host import check_same_layout
from gpustrat.devices import (PER_THREAD_STREAM, Device, cupy, gpu_count, is_gpu_array,
                              kept_events, nccl_library, release_events, to_device)
from gpustrat.errors import CollectiveTimeout
from gpustrat.reduce_util import ReduceOp

_DEVICE_ID = operator.attrgetter("data.device_id")   # (no Device object made)
_CONTIGUOUS = operator.attrgetter("flags.c_contiguous")
_PTR = operator.attrgetter("ptr")
_DATA = operator.attrgetter("data")


#: Each collective's name with each op, ``_NAMED[id(op)]["reduce"]``: reading an Enum
#: member's ``name`` runs Python code.
_NAMED = {id(op): {kind: f"{kind}({op.name})" for kind in ("all_reduce", "reduce",
                                                             "reduce_scatter")}
          for op in ReduceOp}


def _described(*parts) -> Callable[[], str]:
    """A collective's description for the watchdog, made only if it is needed, from
    plain values (shapes, dtypes, names): the watchdog keeps it, and a closure over the
    buffers would keep them referenced."""
    return lambda: "".join(map(str, parts))


def _memory_of(keep) -> list:
    """The memory pointers of the arrays in ``keep`` (arrays and lists of them): what
    the watchdog holds, so that the memory stays allocated while NCCL may use it but
    the arrays' own reference counts, by which plans tell whether a caller still holds
    a buffer, are untouched."""
    out = []
    for k in keep:
        if type(k) is list or type(k) is tuple:
            out += map(_DATA, k)
        else:
            out.append(k.data)
    return out

ENV_TIMEOUT = "GPUSTRAT_TIMEOUT"

# --- the dtype and op table ----------------------------------------------------------------
# NumPy dtype name -> cupy.cuda.nccl datatype constant. bfloat16 is the ml_dtypes dtype.
NCCL_DTYPES = {
    "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
    "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64",
    "bfloat16": "NCCL_BFLOAT16",
}
# ReduceOp -> NCCL op constant. MEAN's entry is used only where ncclAvg exists and the
# dtype is floating; otherwise MEAN is SUM plus a division (see _reduce_args).
NCCL_OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.MEAN: "NCCL_AVG",
            ReduceOp.MAX: "NCCL_MAX", ReduceOp.MIN: "NCCL_MIN"}
# Dtypes without an NCCL type -> the dtype NCCL reduces them as ("view": the same
# bytes read as that dtype; "cast": a copy in that dtype, cast back after).
NCCL_WIRE = {
    "bool": ("view", "uint8"), "complex64": ("view", "float32"),
    "complex128": ("view", "float64"), "int16": ("cast", "int32"),
    "uint16": ("cast", "uint32"),
}
#: ncclAvg appeared in NCCL 2.10.0 (version code 21000).
AVG_MIN_VERSION = 21000
# Gathers and broadcasts move raw bytes.
_BYTES = "NCCL_INT8"


def nccl_dtype_name(dtype) -> str:
    """The NCCL datatype name of ``dtype``; TypeError if NCCL has none (the
    communicator reduces the dtypes of ``NCCL_WIRE`` through another one)."""
    dtype = np.dtype(dtype)
    name = NCCL_DTYPES.get(dtype.name)
    if name is None:
        supported = ", ".join(k for k in NCCL_DTYPES)
        also = ", ".join(k for k in NCCL_WIRE)
        raise TypeError(f"NCCL cannot reduce dtype {dtype}: supported dtypes are "
                        f"{supported} (and {also} through them); cast first (for example "
                        "to float32 or float64)")
    return name


def _wire_itemsize(wire, dtype) -> int:
    """The size of one element as NCCL counts it (the wire dtype's)."""
    return np.dtype(dtype).itemsize if wire is None else np.dtype(wire[1]).itemsize


def nccl_module():
    """``cupy.cuda.nccl``, imported on first use (RuntimeError if unavailable)."""
    cupy()  # a clear error when CuPy itself is missing
    try:
        mod = nccl_library()
    except Exception as e:
        raise RuntimeError(f"cupy.cuda.nccl cannot be imported ({e}): install NCCL "
                           "(pip install nvidia-nccl-cu12 or the CUDA 13 wheel)") from e
    if not getattr(mod, "available", True):
        raise RuntimeError("CuPy was built without NCCL support (cupy.cuda.nccl.available "
                           "is False): use a CuPy wheel with NCCL")
    return mod


def is_available() -> bool:
    """True when ``cupy.cuda.nccl`` imports and at least one GPU is visible. Never raises."""
    try:
        if gpu_count() == 0:
            return False
        nccl_module()
        return True
    except Exception:
        return False


def timeout_from_env() -> float:
    """``GPUSTRAT_TIMEOUT`` in seconds (default 300; ``inf`` waits forever)."""
    from gpustrat.collectives.mpi import timeout_from_env as parse  # noqa: PLC0415
    return parse()


# ncclResult_t values (nccl.h). Some CuPy versions name only 0..5, and their NcclError
# then fails with a KeyError on the number itself: name it here.
_NCCL_RESULTS = {1: "ncclUnhandledCudaError", 2: "ncclSystemError",
                 3: "ncclInternalError", 4: "ncclInvalidArgument",
                 5: "ncclInvalidUsage", 6: "ncclRemoteError: a peer failed or its "
                 "connection broke", 7: "ncclInProgress"}


def async_error_text(e: BaseException) -> str:
    """What ``check_async_error`` raised, as text naming the NCCL result."""
    if isinstance(e, KeyError) and len(e.args) == 1 and isinstance(e.args[0], int):
        code = e.args[0]
        return f"{_NCCL_RESULTS.get(code, 'NCCL result')} ({code})"
    return str(e)


def wait_for(done: Callable[[], bool], timeout: float, describe: Callable[[], str],
             on_timeout: Callable[[], None], check: Callable[[], None] | None = None,
             clock=time.monotonic, sleep=time.sleep, started: float | None = None,
             spin: int = 100, delay: float = 1e-5) -> None:
    """Poll ``done()`` until it is true, or abort and raise after ``timeout`` seconds.

    ``check()`` (if given) runs between polls and raises on an asynchronous error; then
    ``on_timeout()`` (the abort) runs too and the error is re-raised as RuntimeError.
    The poll spins for the first ``spin`` checks, then sleeps from ``delay`` seconds,
    doubling up to 1 ms (or ``delay``, if longer). ``started`` (a ``clock()`` value) is
    when the work was issued; default: now.
    """
    deadline = (clock() if started is None else started) + timeout
    polls = 0
    longest = max(delay, 1e-3)
    while not done():
        polls += 1
        if check is not None:
            try:
                check()
            except Exception as e:
                on_timeout()
                raise RuntimeError(f"{describe()} failed on the device "
                                   f"({async_error_text(e)}); this worker's NCCL "
                                   "communicators were aborted") from e
        if clock() > deadline:
            on_timeout()
            raise CollectiveTimeout(
                f"{describe()} did not complete within {timeout:g} s ({ENV_TIMEOUT}); "
                "this worker's NCCL communicators were aborted. Another worker may have "
                "died, be stuck, or have skipped this collective; create a new strategy "
                "to continue")
        if polls > spin:
            sleep(delay)
            delay = min(delay * 2, longest)


class NcclCommunicator(Communicator):
    """Collectives over GPU replicas with NCCL: in one process and across workers.

    Args:
        devices: this worker's GPU devices, one per local replica (every worker must
            hold the same number).
        workers: the job's :class:`WorkerGroup` (None or size 1: one process).
        timeout: deadline in seconds for each collective (default: ``GPUSTRAT_TIMEOUT``).
    """

    def __init__(self, devices: Sequence[Device], workers: WorkerGroup | None = None,
                 timeout: float | None = None):
        self.devices = list(devices)
        cpus = [d.name for d in self.devices if not d.is_gpu]
        if cpus:
            raise ValueError(f"NcclCommunicator reduces between GPUs; {cpus} are CPU devices "
                             "(use the host or MPI communicator for CPU replicas)")
        self.workers = workers if workers is not None else LocalWorkerGroup()
        self.num_workers = self.workers.size
        self.worker_index = self.workers.rank
        # Control messages (gather sizes, layout checks) are sent from replica threads:
        # on their own duplicate, never interleaved with the input pipeline's agreement
        # on the end of data over ``workers``.
        self._control = self.workers.duplicate()
        self.timeout = timeout_from_env() if timeout is None else float(timeout)
        self._aborted: str | None = None
        nccl = nccl_module()
        self._nccl = nccl
        version = int(nccl.get_version())
        self._avg = version >= AVG_MIN_VERSION and hasattr(nccl, "NCCL_AVG")
        cp = cupy()
        if self.num_workers == 1:
            self._comms = nccl.NcclCommunicator.initAll([d.index for d in self.devices])
        else:
            from gpustrat.collectives.rendezvous import (  # noqa: PLC0415
                new_communicator, nccl_unique_id)
            counts = self.workers.allgather(self.num_local)
            if len(set(counts)) > 1:
                raise ValueError(f"every worker must hold the same number of GPUs, but the "
                                 f"workers hold {counts} (worker i at position i)")
            uid = nccl_unique_id(self.workers)
            comms = []
            nccl.groupStart()
            try:
                for i, d in enumerate(self.devices):
                    with cp.cuda.Device(d.index):
                        comms.append(new_communicator(
                            nccl, self.num_replicas, uid, self.global_replica_id(i)))
            finally:
                nccl.groupEnd()
            self._comms = comms
        self._device_ids = [d.index for d in self.devices]
        self._args: dict = {}    # (dtype, op) -> _reduce_args
        self._watchdog: _Watchdog | None = None

    # --- plumbing ---------------------------------------------------------------------

    def _const(self, name: str) -> int:
        return int(getattr(self._nccl, name))

    def _reduce_args(self, dtype, op: ReduceOp):
        """``(wire, nccl datatype, nccl op, post)`` for reducing ``dtype`` with ``op``.

        ``wire`` is None where NCCL has ``dtype``, else ``(how, dtype)`` from
        ``NCCL_WIRE``. post is None, "divide" (in place, inexact) or "true_divide"
        (integer or bool MEAN to float64). Worked out once per dtype and op."""
        args = self._args.get((dtype, id(op)))   # (an Enum member hashes in Python)
        if args is None:
            args = self._args[(dtype, id(op))] = self._work_out_reduce_args(dtype, op)
        return args

    def _work_out_reduce_args(self, dtype, op: ReduceOp):
        dtype = np.dtype(dtype)
        wire = NCCL_WIRE.get(dtype.name)
        if wire is not None:
            if dtype.kind == "c" and op in (ReduceOp.MAX, ReduceOp.MIN):
                raise TypeError(f"NCCL cannot reduce dtype {dtype} with {op.name}: NCCL has "
                                "no order of complex numbers; reduce the real and "
                                "imaginary parts (or abs(x)) separately")
            if dtype.kind == "b" and op in (ReduceOp.SUM, ReduceOp.MEAN):
                # NumPy adds booleans as a logical or: the MAX of their bytes.
                dt = self._const(nccl_dtype_name(wire[1]))
                post = "true_divide" if op is ReduceOp.MEAN else None
                return wire, dt, self._const(NCCL_OPS[ReduceOp.MAX]), post
            dt = self._const(nccl_dtype_name(wire[1]))
            kind = np.dtype(wire[1]).kind
        else:
            dt = self._const(nccl_dtype_name(dtype))
            kind = "f" if dtype.name == "bfloat16" else dtype.kind
        if op is not ReduceOp.MEAN:
            return wire, dt, self._const(NCCL_OPS[op]), None
        if kind != "f" or (wire is not None and wire[0] == "cast"):
            return wire, dt, self._const(NCCL_OPS[ReduceOp.SUM]), "true_divide"
        if self._avg:
            return wire, dt, self._const(NCCL_OPS[ReduceOp.MEAN]), None
        return wire, dt, self._const(NCCL_OPS[ReduceOp.SUM]), "divide"

    def _to_wire(self, bufs: list, wire) -> list:
        """The buffers NCCL reduces: ``bufs`` themselves, or (a "cast" wire) copies in
        the wider dtype, made on each buffer's device and current stream."""
        if wire is None or wire[0] == "view":
            return bufs
        cp = cupy()
        out = []
        for b, d in zip(bufs, self.devices):
            with cp.cuda.Device(d.index):
                out.append(b.astype(wire[1]))
        return out

    def _from_wire(self, outs: list, dtype) -> list:
        """The reduced buffers back in ``dtype`` (a "cast" wire), on their devices."""
        if outs[0].dtype == dtype:
            return outs
        cp = cupy()
        res = []
        for o, d in zip(outs, self.devices):
            with cp.cuda.Device(d.index):
                res.append(o.astype(dtype))
        return res

    def _check_usable(self) -> None:
        failure = self._watchdog.failure if self._watchdog is not None else None
        if failure is not None:
            raise type(failure)(f"{failure} [found by the watchdog after an earlier "
                                "collective]") from failure
        if self._aborted:
            raise RuntimeError(f"this NCCL communicator was aborted ({self._aborted}); "
                               "create a new strategy to continue")

    def _prepare(self, buffers, what: str) -> list:
        self._check_usable()
        if len(buffers) != self.num_local:
            raise ValueError(f"{what}: got {len(buffers)} buffers for {self.num_local} local "
                             "replicas")
        if set(map(type, buffers)) == {cupy().ndarray} and \
                list(map(_DEVICE_ID, buffers)) == self._device_ids and \
                all(map(_CONTIGUOUS, buffers)):
            return buffers     # contiguous arrays on their devices: the common case
        cp = cupy()
        out = []
        for b, d in zip(buffers, self.devices):
            x = b if is_gpu_array(b) and b.device.id == d.index else to_device(b, d)
            if not x.flags.c_contiguous:
                with cp.cuda.Device(d.index):
                    x = cp.ascontiguousarray(x)
            out.append(x)
        return out

    def _empty(self, i: int, shape, dtype):
        cp = cupy()
        with cp.cuda.Device(self.devices[i].index):
            return cp.empty(shape, dtype)

    def _run(self, what: Callable[[], str], issue: Callable[[int, object, int], None],
             keep=()) -> None:
        """Issue every local call in one NCCL group, each on its device's current stream,
        and hand the deadline (and ``keep``, the buffers) to the watchdog. No event
        between streams, no host wait."""
        current_stream = cupy().cuda.get_current_stream
        nccl = self._nccl
        streams = []
        nccl.groupStart()
        try:
            # No device switch: within a group NCCL sets each communicator's device.
            for i, (comm, index) in enumerate(zip(self._comms, self._device_ids)):
                stream = current_stream(index)
                streams.append(stream)
                issue(i, comm, stream.ptr)
        finally:
            nccl.groupEnd()
        capture = devices.capture_state
        if capture is not None:
            # Captured: the calls are the graph's, whose events CUDA forbids querying;
            # the graph holds the buffers, and each replay is watched (watch_replay).
            capture.hold(keep)
            return
        self._watch(streams, what, _memory_of(keep))

    def _watch(self, streams: list, what: Callable[[], str], keep) -> None:
        """Hand the work queued so far on ``streams`` (one per local device, in this
        communicator's device order) to the watchdog. It records the events it polls
        itself, except on a per-thread default stream, whose events only the calling
        thread can record."""
        if self._watchdog is None:
            self._watchdog = _Watchdog(self)
        if PER_THREAD_STREAM in map(_PTR, streams):
            self._watchdog.watch(None, kept_events(streams, self._device_ids), what, keep)
        else:
            self._watchdog.watch(streams, None, what, keep)

    def watch_replay(self, streams: list, what: Callable[[], str]) -> None:
        """Watch a replayed graph: an event recorded on each local device's stream
        after its launch (one per device, in ``streams``, this communicator's device
        order) is handed to the watchdog, so the replay's collectives get the same
        deadline as eager ones. No host wait."""
        self._watch(streams, what, ())

    def _post(self, outs: list, post: str | None) -> list:
        if post is None:
            return outs
        cp = cupy()
        n = self.num_replicas
        res = []
        for o, d in zip(outs, self.devices):
            with cp.cuda.Device(d.index):
                if post == "divide":
                    o /= n
                    res.append(o)
                else:
                    res.append(o / n)
        return res

    # --- collectives ------------------------------------------------------------------

    def all_reduce(self, buffers, op):
        return self._all_reduce(buffers, op, inplace=False)

    def all_reduce_inplace(self, buffers, op):
        """In place where the buffers are contiguous arrays on their devices (fusion
        buffers): no result allocation."""
        return self._all_reduce(buffers, op, inplace=True)

    def _all_reduce(self, buffers, op, inplace: bool):
        op = ReduceOp.from_value(op)
        what = _NAMED[id(op)]["all_reduce"]
        bufs = self._prepare(buffers, what)
        check_same_layout(bufs, what)
        dtype = bufs[0].dtype
        wire, dt, nop, post = self._reduce_args(dtype, op)
        sends = self._to_wire(bufs, wire)
        outs = sends if inplace or sends is not bufs else [
            self._empty(i, b.shape, b.dtype) for i, b in enumerate(bufs)]
        count = int(sends[0].nbytes) // _wire_itemsize(wire, dtype)
        if count:
            self._run(_described("NCCL ", what, " of ", bufs[0].shape, " ", dtype),
                      lambda i, c, s: c.allReduce(sends[i].data.ptr, outs[i].data.ptr,
                                                  count, dt, nop, s), (sends, outs))
        outs = self._from_wire(outs, dtype)
        if inplace and outs[0] is not bufs[0]:
            cp = cupy()
            for b, o, d in zip(bufs, outs, self.devices):
                with cp.cuda.Device(d.index):
                    b[...] = o
            outs = bufs
        return self._post(outs, post)

    def reduce(self, buffers, op):
        """The reduction on local replica 0's device only, with one ``ncclReduce`` to
        that replica (the other devices receive nothing, and nothing is allocated
        there). Dtypes NCCL reduces through another dtype take the all-reduce path."""
        op = ReduceOp.from_value(op)
        what = _NAMED[id(op)]["reduce"]
        bufs = self._prepare(buffers, what)
        check_same_layout(bufs, what)
        return self._reduce(bufs, op, what)

    def reduce_checked(self, buffers, op):
        """:meth:`reduce` of buffers the caller checked (see the base class): only their
        contiguity is left to look at."""
        if not all(map(_CONTIGUOUS, buffers)):
            return self.reduce(buffers, op)
        self._check_usable()
        return self._reduce(buffers, op, _NAMED[id(op)]["reduce"])

    def _reduce(self, bufs: list, op: ReduceOp, what: str):
        dtype = bufs[0].dtype
        wire, dt, nop, post = self._reduce_args(dtype, op)
        if wire is not None and wire[0] != "view":
            return self._all_reduce(bufs, op, inplace=False)[0]
        root = self.global_replica_id(0) if self.worker_index == 0 else 0
        out = self._empty(0, bufs[0].shape, dtype)
        count = int(bufs[0].nbytes) // _wire_itemsize(wire, dtype)
        if count:
            root_ptrs = [out.data.ptr] + [b.data.ptr for b in bufs[1:]]
            self._run(_described("NCCL ", what, " of ", bufs[0].shape, " ", dtype),
                      lambda i, c, s: c.reduce(bufs[i].data.ptr, root_ptrs[i], count, dt,
                                               nop, root, s), (bufs, out))
        return self._post([out], post)[0]

    def reduce_scatter(self, buffers, op):
        op = ReduceOp.from_value(op)
        what = _NAMED[id(op)]["reduce_scatter"]
        bufs = self._prepare(buffers, what)
        check_same_layout(bufs, what)
        n = self.num_replicas
        shape = bufs[0].shape
        if len(shape) == 0 or shape[0] % n:
            raise ValueError(f"reduce_scatter needs axis 0 divisible by {n} replicas, "
                             f"got shape {shape}")
        dtype = bufs[0].dtype
        wire, dt, nop, post = self._reduce_args(dtype, op)
        sends = self._to_wire(bufs, wire)
        out_shape = (shape[0] // n,) + tuple(shape[1:])
        outs = [self._empty(i, out_shape, b.dtype) for i, b in enumerate(sends)]
        recvcount = int(sends[0].nbytes) // n // _wire_itemsize(wire, dtype)
        if recvcount:
            self._run(_described("NCCL ", what, " of ", shape, " ", dtype),
                      lambda i, c, s: c.reduceScatter(sends[i].data.ptr, outs[i].data.ptr,
                                                      recvcount, dt, nop, s), (sends, outs))
        return self._post(self._from_wire(outs, dtype), post)

    def broadcast(self, buffers, root=0):
        if not 0 <= root < self.num_replicas:
            raise ValueError(f"broadcast root {root} is not a replica id "
                             f"(0 .. {self.num_replicas - 1})")
        bufs = self._prepare(buffers, "broadcast")
        check_same_layout(bufs, "broadcast")
        outs = [self._empty(i, b.shape, b.dtype) for i, b in enumerate(bufs)]
        nbytes = int(bufs[0].nbytes)
        dt = self._const(_BYTES)
        if nbytes:
            self._run(_described("NCCL broadcast from replica ", root, " of ", bufs[0].shape,
                                 " ", bufs[0].dtype),
                      lambda i, c, s: c.broadcast(bufs[i].data.ptr, outs[i].data.ptr,
                                                  nbytes, dt, root, s), (bufs, outs))
        return outs

    def all_gather(self, buffers, axis=0):
        """Concatenation along ``axis`` in global replica order. Sizes along ``axis``
        may differ: they are exchanged first (over the worker group), every piece is
        padded to the largest, gathered with one ``ncclAllGather``, and trimmed."""
        cp = cupy()
        bufs = self._prepare(buffers, "all_gather")
        x0 = bufs[0]
        if x0.ndim == 0:
            raise ValueError("all_gather concatenates along an axis, but the values are "
                             "scalars: gather x[None] (or reshape to at least 1-D)")
        if not -x0.ndim <= axis < x0.ndim:
            raise ValueError(f"all_gather axis {axis} is out of range for shape {x0.shape}")
        ax = axis % x0.ndim
        fronts = []
        for b, d in zip(bufs, self.devices):
            with cp.cuda.Device(d.index):
                fronts.append(cp.ascontiguousarray(cp.moveaxis(b, ax, 0)) if ax else b)
        mine = [(int(f.shape[0]), tuple(int(s) for s in f.shape[1:]), f.dtype.str)
                for f in fronts]
        every = ([m for w in self._control.allgather(mine) for m in w]
                 if self.num_workers > 1 else mine)
        rest, dstr = every[0][1], every[0][2]
        for r, (_, rr, dd) in enumerate(every):
            if rr != rest or dd != dstr:
                raise ValueError(
                    f"all_gather(axis={ax}): shapes may differ only along the gathered "
                    f"axis, but replica {r} has slices {rr} {np.dtype(dd)} where replica 0 "
                    f"has {rest} {np.dtype(dstr)}")
        rows = [e[0] for e in every]
        width = int(np.prod(rest, dtype=np.int64)) * np.dtype(dstr).itemsize
        most = max(rows)
        sends = []
        for f, d in zip(fronts, self.devices):
            if f.shape[0] == most:
                sends.append(f)
            else:
                with cp.cuda.Device(d.index):
                    padded = cp.zeros((most,) + rest, f.dtype)
                    padded[:f.shape[0]] = f
                    sends.append(padded)
        n = self.num_replicas
        recvs = [self._empty(i, (n * most,) + rest, np.dtype(dstr)) for i in range(self.num_local)]
        nbytes = most * width
        dt = self._const(_BYTES)
        if nbytes:
            self._run(_described("NCCL all_gather(axis=", ax, ") of ", x0.shape, " ", x0.dtype),
                      lambda i, c, s: c.allGather(sends[i].data.ptr, recvs[i].data.ptr,
                                                  nbytes, dt, s), (sends, recvs))
        outs = []
        for recv, d in zip(recvs, self.devices):
            with cp.cuda.Device(d.index):
                if any(r != most for r in rows):
                    recv = cp.concatenate([recv[k * most:k * most + rows[k]]
                                           for k in range(n)])
                outs.append(cp.ascontiguousarray(cp.moveaxis(recv, 0, ax)) if ax else recv)
        return outs

    # --- failure and teardown ---------------------------------------------------------

    def abort(self, reason: str = "aborted by the caller") -> None:
        """``ncclCommAbort`` every local communicator; later calls raise."""
        self._aborted = reason
        for c in self._comms:
            try:
                c.abort()
            except Exception:  # an abort must reach every communicator
                pass

    def number_group(self):
        return self._control

    def agree_layout(self, shape, dtype, what, hint=""):
        agree_layout_over(self._control, shape, dtype, what, hint)

    def close(self) -> None:
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.stop()
            self._watchdog = None
        for c in getattr(self, "_comms", []):
            try:
                c.destroy()
            except Exception:
                pass
        self._comms = []
        control = getattr(self, "_control", None)
        if control is not None and control is not self.workers:
            control.close()
        self._control = None


#: How often the watchdog looks at its pending collectives, and how long it goes on
#: looking without any before it sleeps until the next one (seconds). Each look takes
#: the interpreter from the threads issuing work (about 60 us of host time per
#: 4-replica step of small kernels, measured on a 2-core machine), but the watchdog
#: also holds each collective's buffers until it sees the collective complete: looking
#: every 10 ms kept them up to 10 ms longer, several steps' worth of memory out of the
#: pool when steps are short.
WATCHDOG_POLL_S = 1e-3
WATCHDOG_IDLE_S = 0.1


class _Watchdog:
    """Waits, in its own thread, for the collectives of one communicator to complete
    (see *deadline* in the module docstring); ``failure`` is what went wrong, if
    anything did. Holds no reference to the communicator between collectives.

    A collective costs its caller one append to a deque: its streams (or, on a
    per-thread default stream, the events the caller recorded there), a description and
    the buffers to hold. Every ``WATCHDOG_POLL_S`` the thread takes what came, records
    one event on each stream for all of it (the work of every collective taken is
    before that event on its stream) and polls those events until they complete or the
    deadline passes; then it lets go of the buffers. It is woken (an Event) only for
    the first collective after it went to sleep."""

    def __init__(self, comm: NcclCommunicator):
        self.failure: BaseException | None = None
        self._pending: collections.deque = collections.deque()
        self._asleep = False
        self._wake = threading.Event()
        self._timeout = comm.timeout
        self._comms = list(comm._comms)
        self._device_ids = [d.index for d in comm.devices]
        self._backend = devices.current_backend()
        self._abort_method = weakref.WeakMethod(comm.abort)
        self._thread = threading.Thread(target=self._loop, name="gpustrat-nccl-watchdog",
                                        daemon=True)
        self._thread.start()
        # A communicator dropped without close() stops its watchdog too.
        weakref.finalize(comm, self._put, None)

    def watch(self, streams: list | None, events: list | None, what: Callable[[], str],
              keep) -> None:
        self._put((streams, events, what, keep))

    def _put(self, item) -> None:
        self._pending.append(item)
        if self._asleep:
            self._asleep = False
            self._wake.set()

    def stop(self) -> None:
        self._put(None)
        self._thread.join(timeout=5)

    def _abort(self, reason: str) -> None:
        abort = self._abort_method()
        if abort is not None:
            abort(reason)
        else:
            for c in self._comms:
                try:
                    c.abort()
                except Exception:  # an abort must reach every communicator
                    pass

    def _check(self) -> None:
        for c in self._comms:
            c.check_async_error()

    def _sleep_until_work(self) -> None:
        """Poll for new collectives for ``WATCHDOG_IDLE_S``, then sleep until one comes."""
        pending = self._pending
        quiet = time.monotonic() + WATCHDOG_IDLE_S
        while not pending and time.monotonic() < quiet:
            time.sleep(WATCHDOG_POLL_S)
        if pending:
            return
        self._asleep = True
        if not pending:          # (one put between the two looks sets the Event)
            self._wake.wait()
        self._wake.clear()
        self._asleep = False

    def _events(self, batch: list) -> tuple | None:
        """``(events, their devices)``: one event on each stream the collectives of
        ``batch`` were issued on, with the events callers recorded themselves; None
        while a capture is on."""
        with devices.capture_lock:
            if devices.capture_state is not None:
                return None
            if devices.current_backend() is not self._backend:
                return [], []       # the libraries that ran the work are gone
            streams: dict = {}
            events, devs = [], []
            for item_streams, item_events, _, _ in batch:
                if item_events is not None:
                    events += item_events
                    devs += self._device_ids
                else:
                    for s, dev in zip(item_streams, self._device_ids):
                        streams[(dev, s.ptr)] = s
            if streams:
                ids = [dev for dev, _ in streams]
                events += kept_events(list(streams.values()), ids)
                devs += ids
        return events, devs

    def _loop(self) -> None:
        pending = self._pending
        batch: list = []
        while True:
            if not pending and not batch:
                self._sleep_until_work()
                continue
            stop = False
            while pending:
                item = pending.popleft()
                if item is None:
                    stop = True
                    break
                batch.append(item)
            if batch and self.failure is None:
                recorded = self._events(batch)
                if recorded is None:      # a capture is on: look again later
                    if not stop:
                        time.sleep(WATCHDOG_POLL_S)
                        continue
                else:
                    self._wait(batch, *recorded)
            batch = []                    # the buffers may be reused from here on
            if stop:
                return

    def _wait(self, batch: list, events: list, devs: list) -> None:
        first = batch[0][2]
        more = len(batch) - 1

        def what() -> str:
            return first() + (f" (or one of the {more} collectives issued after it)"
                              if more else "")
        try:
            wait_for(lambda: all(e.done for e in events), self._timeout, what,
                     on_timeout=lambda: self._abort(f"{what()} failed or timed out"),
                     check=self._check, spin=0, delay=WATCHDOG_POLL_S)
        except BaseException as e:  # raised by the communicator's next call
            self.failure = e
        else:
            with devices.capture_lock:
                if devices.current_backend() is self._backend:
                    release_events(events, devs)
