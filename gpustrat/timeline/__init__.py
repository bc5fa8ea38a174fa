"""A per-rank timeline of steps, input waits and collectives, as a Chrome trace.

Turn it on for a whole job with ``GPUSTRAT_TIMELINE=PATH`` (read when the first
strategy is made), or around part of a program::

    with gs.timeline.record("trace.json"):
        for batch in dist:
            strategy.run(step, args=(batch,))

Every rank streams its events to ``PATH.rank<N>.events`` as it goes (a dead rank's
events up to its last fraction of a second survive); when recording ends normally,
rank 0 merges every rank's file into ``PATH``. ``python -m gpustrat timeline merge
PATH`` does it after a job died, and ``python -m gpustrat timeline summary PATH``
reports where the time went (see docs/timeline.md).

Words:
- *track*: one row of the trace. ``pid`` is the worker's rank; ``tid`` is the local
  replica (0 is also the thread that called ``strategy.run``); other threads (input
  placement, background checkpoint writes, the parameter-server coordinator) get
  tracks from 100 on, GPUs' device times from 1000 on.
- *span*: one complete event (``"ph": "X"``): a start and a duration, in microseconds.
- *waiting for peers*: the part of a collective spent until every worker has arrived
  (over MPI, the header exchange that opens every collective); the rest of the
  collective moves and combines the data.

Cost: off, each hook is one test of the module flag :data:`ON`. On, each event is one
tuple appended to a queue; a background thread writes them (see :mod:`.trace`), and
merging turns them into JSON.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import threading
import time
import weakref

from gpustrat.timeline import trace as _trace

#: Whether events are recorded: every hook tests it first (``if _tl.ON:``).
ON = False
ENV = "GPUSTRAT_TIMELINE"

now = time.perf_counter_ns
_rec: "_trace.Writer | None" = None
_lock = threading.Lock()
_env_read = False
_attached: "weakref.WeakSet" = weakref.WeakSet()
_COLLECTIVES = ("all_reduce", "all_reduce_inplace", "all_reduce_shared", "all_gather",
                "broadcast", "reduce_scatter", "reduce", "gather", "reduce_named", "agree",
                "reduce_numbers")


class _Thread(threading.local):
    """This thread's part in the timeline: ``tid``, its track (None until it records
    an event, see :func:`_tid`), and ``coll``, the ns waited for peers so far in the
    collective it is in (None outside one). Class attributes are the defaults, so the
    hooks read them without a ``getattr`` default."""

    tid = None
    coll = None


_local = _Thread()


# --- turning it on and off -------------------------------------------------------------

def start(path) -> None:
    """Record this process's events from now on; see :func:`record`.

    Raises:
        RuntimeError: recording is already on (to another path).
        ValueError: ``path``'s folder does not exist.
    """
    global ON, _rec, _exit_hook
    path = os.fspath(path)
    with _lock:
        if _rec is not None:
            raise RuntimeError(f"a timeline is already being recorded to {_rec.path!r}; "
                               "stop it first (gs.timeline.stop())")
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise ValueError(f"timeline path {path!r}: folder {folder!r} does not exist; "
                             "create it or choose another path")
        wait = _wait_from_env()
        _rec = _trace.Writer(path)
        _rec.wait = wait
        if not _exit_hook:
            atexit.register(_at_exit)
            _exit_hook = True
        for comm in list(_attached):
            _wrap(comm)
        ON = True


def _wait_from_env() -> float:
    text = os.environ.get("GPUSTRAT_TIMELINE_WAIT", "10")
    try:
        wait = float(text)
    except ValueError:
        wait = -1.0
    if not wait >= 0:
        raise ValueError(f"GPUSTRAT_TIMELINE_WAIT={text!r}: give the seconds rank 0 waits "
                         "for the other ranks' timeline files (a number >= 0, default 10)")
    return wait


def stop(merge: bool = True):
    """Stop recording; write this rank's last events, and on rank 0 (``merge``) the
    merged trace, once every rank's file is complete (waiting at most
    ``GPUSTRAT_TIMELINE_WAIT`` seconds, default 10, for ranks still writing).

    Returns:
        The merged trace's path on rank 0 (None elsewhere, or when nothing was on).
    """
    global ON, _rec
    with _lock:
        rec = _rec
        if rec is None:
            return None
        ON = False
        _rec = None
        for comm in list(_attached):
            _unwrap(comm)
    _resolve_device_times(rec, wait=True)
    rec.close()
    if merge and rec.rank == 0:
        _trace.merge(rec.path, size=rec.size, wait=rec.wait)
        return rec.path
    return None


@contextlib.contextmanager
def record(path):
    """Record a timeline of the block to ``path`` (a Chrome trace JSON file, opened by
    Perfetto and chrome://tracing; on GPUs Nsight Systems shows the same names as NVTX
    ranges).

    Every rank must enter and leave the block (rank 0 merges every rank's events at
    its end). Inside, each ``strategy.run`` (per replica), collective, input
    ``get_next``, placement copy, ``apply_gradients`` (its fused reduction: the
    collectives inside it, one per fusion bucket),
    checkpoint save and parameter-server ``schedule``/``fetch`` is recorded.
    """
    start(path)
    try:
        yield path
    finally:
        stop()


def from_env() -> None:
    """Start recording to ``$GPUSTRAT_TIMELINE`` if it is set (read once per process;
    called when a strategy is made); the merged trace is written at exit."""
    global _env_read
    if _env_read:
        return
    _env_read = True
    path = os.environ.get(ENV)
    if path and _rec is None:
        start(path)  # stopped (and merged) at exit


def _at_exit() -> None:
    # A rank whose program ends (or fails) with recording on still completes its file.
    if _rec is not None:
        stop()


_exit_hook = False


# --- tracks ----------------------------------------------------------------------------

_other_tids = itertools.count(100)


def _tid() -> int:
    """This thread's track: 0 for the main thread, 100 on for the others (named after
    the thread the first time)."""
    tid = _local.tid
    if tid is None:
        t = threading.current_thread()
        tid = 0 if t is threading.main_thread() else next(_other_tids)
        _local.tid = tid
        rec = _rec
        if rec is not None and tid:
            rec.thread_name(tid, t.name)
    return tid


# --- recording -------------------------------------------------------------------------
# Each hook appends one tuple ``(name, category, track, start ns, end ns, args)`` to
# the recording's queue and nothing else: ``args`` is the rawest form that says it all
# (a run's step number, a wait's collective kind, a collective's tuple; see
# trace._chrome), turned into the trace's dictionaries when the trace is merged.

def emit(name: str, cat: str, t0: int, t1: int, args=None, tid=None) -> None:
    """One span from ``t0`` to ``t1`` (``now()`` values) on this thread's track.

    ``args``: None, or ``((key, value), ...)`` with strings and numbers (tuples of
    those are left alone by the garbage collector; dicts would be scanned as long as
    they wait in the queue); a collective's are its own tuple (see :mod:`.trace`)."""
    rec = _rec
    if rec is not None:
        if tid is None:
            tid = _local.tid
            if tid is None:
                tid = _tid()
        rec.events.append((name, cat, tid, t0, t1, args))


def span(name: str, t0: int, args=None, cat: str = "gpustrat") -> None:
    """A span from ``t0`` to now, on this thread's track (``args`` as :func:`emit`'s)."""
    emit(name, cat, t0, now(), args)


def _nvtx_push(name: str) -> bool:
    from gpustrat import devices  # noqa: PLC0415
    return devices.nvtx_push(name)


def _nvtx_pop() -> None:
    from gpustrat import devices  # noqa: PLC0415
    devices.nvtx_pop()


def timed(name: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, recorded as a span named ``name`` (and an NVTX range
    on GPUs)."""
    rec = _rec
    if rec is None:
        return fn(*args, **kwargs)
    pushed = rec.nvtx and _nvtx_push(name)
    t0 = now()
    try:
        return fn(*args, **kwargs)
    finally:
        t1 = now()
        tid = _local.tid
        rec.events.append((name, "gpustrat", _tid() if tid is None else tid, t0, t1, None))
        if pushed:
            _nvtx_pop()


def traced(name: str):
    """Decorator for functions off the hot paths (checkpoint saves, the parameter
    server's scheduling): recorded as ``name`` while the timeline is on."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if not ON:
                return fn(*args, **kwargs)
            return timed(name, fn, *args, **kwargs)
        return call
    return wrap


_context = None


def replica_fn(fn):
    """``fn`` of one ``strategy.run``, recording each replica's run on its track."""
    global _context
    if _context is None:
        from gpustrat.distribute import context as _context  # noqa: PLC0415
    rec = _rec
    if rec is None:
        return fn
    rec.steps += 1
    step = rec.steps
    current = _context.current
    append = rec.events.append
    local = _local
    nvtx = rec.nvtx

    def run(*args, **kwargs):
        ctx = current()[1]
        index = ctx.local_index if ctx is not None else 0
        previous = local.tid
        local.tid = index
        pushed = nvtx and _nvtx_push("run")
        t0 = now()
        try:
            return fn(*args, **kwargs)
        finally:
            append(("run", "step", index, t0, now(), step))  # args: the step
            if pushed:
                _nvtx_pop()
            local.tid = previous
    return run


def replica_wait(t0: int, signature) -> None:
    """A replica waited from ``t0`` for the worker's other replicas in a collective."""
    t1 = now()
    rec = _rec
    if rec is None:
        return
    kind = signature[0] if type(signature) is tuple and signature else "collective"
    if type(kind) is not str:
        kind = str(kind)
    tid = _local.tid
    rec.events.append(("wait for replicas", "wait", _tid() if tid is None else tid,
                       t0, t1, kind))  # args: the collective's kind


def peer_wait(t0: int, what) -> None:
    """This thread waited from ``t0`` until every worker had arrived at a collective
    (the MPI header exchange)."""
    t1 = now()
    rec = _rec
    if rec is None:
        return
    local = _local
    waited = local.coll
    if waited is not None:  # inside a timed collective: its wait (its kind is the span's)
        local.coll = waited + (t1 - t0)
        kind = None
    else:
        kind = what[0] if type(what) is tuple else what if type(what) is str else \
            "agreement"
        if type(kind) is not str:
            kind = str(kind)
    tid = local.tid
    rec.events.append(("wait for peers", "wait", _tid() if tid is None else tid, t0, t1,
                       kind))


# --- collectives: a strategy's communicator, timed while recording ------------------------

def attach(comm) -> None:
    """Time ``comm``'s collectives whenever the timeline is on (called once per
    communicator, when its strategy is made); reads ``GPUSTRAT_TIMELINE`` the first
    time."""
    from_env()
    with _lock:
        _attached.add(comm)
        if ON:
            _wrap(comm)


def _wrap(comm) -> None:
    d = getattr(comm, "__dict__", None)
    if d is None or "_timeline_wrapped" in d:
        return
    gpu = any(getattr(dev, "is_gpu", False) for dev in getattr(comm, "devices", ()))
    if gpu:
        _rec.nvtx = True
    ref = weakref.ref(comm)
    for name in _COLLECTIVES:
        fn = getattr(type(comm), name, None)
        if fn is not None:
            d[name] = _timed_collective(_rec, ref, name, fn, gpu)
    d["_timeline_wrapped"] = True


def _unwrap(comm) -> None:
    d = getattr(comm, "__dict__", None)
    if d is not None and d.pop("_timeline_wrapped", False):
        for name in _COLLECTIVES:
            d.pop(name, None)


def _timed_collective(rec, ref, name, fn, gpu: bool):
    """Communicator method ``fn``, recorded into ``rec`` as one collective while the
    timeline is on (a collective it calls on the same thread is part of it)."""
    describe = _describer(name)
    append = rec.events.append
    local = _local
    known = None  # (replicas, workers): fixed for a communicator

    def collective(*args, **kwargs):
        nonlocal known
        comm = ref()
        if not ON or local.coll is not None:
            return fn(comm, *args, **kwargs)  # off, or inside another collective
        local.coll = 0  # ns waited for peers so far (peer_wait adds to it)
        pushed = rec.nvtx and _nvtx_push(name)
        if known is None:
            known = (comm.num_replicas, comm.num_workers)
        starts = _device_events(comm) if gpu else None
        t0 = now()
        try:
            return fn(comm, *args, **kwargs)
        finally:
            t1 = now()
            waited = local.coll
            local.coll = None
            kind, dtype, nbytes = describe(args)
            rec.collectives += 1
            tid = local.tid
            # Turned into the trace's arguments when merged (trace._chrome).
            append((kind, "collective", _tid() if tid is None else tid, t0, t1,
                    (kind, dtype, nbytes, known[0], known[1], rec.collectives, waited)))
            if starts is not None:
                _pend_device_times(rec, comm, kind, t0, starts)
            if pushed:
                _nvtx_pop()
    return collective


def _device_events(comm):
    from gpustrat import devices  # noqa: PLC0415
    return devices.timing_events(comm.devices)


#: The communicator methods that take a ReduceOp second, and the kind they record.
_REDUCING = {"all_reduce": "all_reduce", "all_reduce_inplace": "all_reduce",
             "all_reduce_shared": "all_reduce", "reduce": "reduce",
             "reduce_scatter": "reduce_scatter", "reduce_numbers": "reduce_numbers"}
_dtypes: dict = {}


def _describer(name: str):
    """The function that gives ``(kind, dtype, bytes)`` of the arguments of a call of
    communicator method ``name`` (the names of ops and dtypes are remembered, so that
    a loop's collectives cost a few dictionary reads)."""
    if name == "agree":
        return lambda args: ("agree", "", 0)
    base = _REDUCING.get(name)
    kinds: dict = {}  # op (a string, or another op's id) -> kind
    gather = name in ("all_gather", "gather")
    numbers = name == "reduce_numbers"  # Python numbers, one per local replica

    def describe(args) -> tuple:
        first = args[0] if args else None
        if name == "reduce_named":
            kind, arrays = args[2] if len(args) > 2 else name, (first,)
        else:
            t = type(first)
            arrays = first if t is list or t is tuple else ()
            kind = name
            if base is not None and len(args) > 1:
                op = args[1]
                key = op if type(op) is str else id(op)
                kind = kinds.get(key)
                if kind is None:
                    kind = kinds[key] = f"{base}({getattr(op, 'name', op)})"
        if not arrays:
            return kind, "", 0
        a = arrays[0]
        if numbers:
            return kind, type(a).__name__, 8 * len(arrays)
        dt = getattr(a, "dtype", None)
        dtype = _dtypes.get(dt)
        if dtype is None:
            dtype = _dtypes[dt] = "" if dt is None else str(dt)
        if not gather:
            # The local buffers of a reduction or broadcast share one layout.
            return kind, dtype, getattr(a, "nbytes", 0) * len(arrays)
        return kind, dtype, int(sum(getattr(x, "nbytes", 0) for x in arrays))
    return describe


def _pend_device_times(rec, comm, kind, t0, starts) -> None:
    """Queue the CUDA events around a collective for its device times (GPU tracks)."""
    from gpustrat import devices  # noqa: PLC0415
    ends = devices.timing_events(comm.devices)
    rec.pending_device.append((kind, t0, comm.devices, starts, ends))
    _resolve_device_times(rec, wait=False)


def _resolve_device_times(rec, wait: bool) -> None:
    """Turn the CUDA events of finished collectives into device spans (GPU tracks),
    oldest first; without ``wait`` only those already complete (a query, never a host
    wait), with ``wait`` all (when the trace is written)."""
    pending = rec.pending_device
    if not pending:
        return
    from gpustrat import devices  # noqa: PLC0415
    while pending:
        kind, t0, devs, starts, ends = pending[0]
        times = [devices.elapsed_ms(s, e, wait) for s, e in zip(starts, ends)]
        if any(t is None for t, s in zip(times, starts) if s is not None):
            return
        pending.popleft()
        for dev, ms in zip(devs, times):
            if ms is None:
                continue
            tid = 1000 + dev.index
            if tid not in rec.named:
                rec.thread_name(tid, f"{dev.name} (device time)")
            begin = max(t0, rec.device_end.get(tid, 0))
            end = begin + int(ms * 1e6)
            rec.device_end[tid] = end
            rec.events.append((kind, "device", tid, begin, end, (("device_ms", ms),)))


# --- the parameter server's functions, as the coordinator sees them -------------------------

_ps_sent: dict = {}


def ps_sent(worker: int, closure) -> None:
    """The coordinator sent a scheduled function to ``worker``."""
    _ps_sent[id(closure)] = now()


def ps_answered(worker: int, closure) -> None:
    """``worker`` answered ``closure``: its run there, on the worker's track (a worker
    runs its functions one after the other, so a run starts when it was sent or when
    the one before it was answered, whichever is later)."""
    t0 = _ps_sent.pop(id(closure), None)
    rec = _rec
    if t0 is None or rec is None:
        return
    tid = 200 + worker
    if tid not in rec.named:
        rec.thread_name(tid, f"parameter-server worker {worker} (runs)")
    t0 = max(t0, rec.device_end.get(tid, 0))
    t1 = now()
    rec.device_end[tid] = t1
    emit("ps run", "ps", t0, t1, (("function", getattr(closure, "name", "")),), tid)
