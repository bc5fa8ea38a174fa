"""A stream-ordering sanitizer: the asynchronous CUDA semantics gpustrat relies on, on
the host, with the mistakes that break them reported.

Words:
- *op*: device work queued on a stream (a kernel, a copy, an NCCL call, a wait for an
  event). An op runs only when something forces it: a host synchronization, an event
  query, or the randomized scheduler, which runs ready ops at random moments and in
  any order CUDA allows. A program whose results depend on an order CUDA does not
  promise therefore gets wrong values here too, not only a report.
- *happens-before*: vector clocks, as in PyTorch's CUDA sanitizer. Every stream counts
  its ops; a stream's clock holds, for every stream, how many of that stream's ops are
  ordered before its next op: by stream order, by event waits, and by completion the
  issuing thread has observed (a synchronize, an event that was queried done).
- *access*: a read or a write of a byte range of a memory block by an op.
- *block*: an allocation of the memory pool. As CuPy's pool, the pool keeps one arena
  per stream: a freed block is handed out again only to work on the stream it was
  allocated on (stream order makes that safe for that stream alone). A block is freed
  when the last array referring to it is dropped, in the thread that dropped it.

Reports:
- ``race``: an access not ordered after the last write of the range on another stream,
  or a write not ordered after the reads since;
- ``reuse``: a pool block handed out again while work on another stream may still use
  it (the previous owner was used on a stream the allocating stream never waited for);
- ``hang``: a synchronization that can never complete (an NCCL call whose peers never
  issued theirs, for example);
- ``device``: work launched on a stream or communicator of another device;
- ``replay``: an access not ordered after a graph replay's access of the same bytes
  (the host, or another stream, rewrote a graph's input while a replay may still
  read it);
- ``capture``: work captured in a graph that a replay cannot repeat safely (a
  host-to-device copy staged through CuPy's pinned buffers, which CuPy hands to later
  copies while the graph still reads them).

Stream capture (CUDA graphs):
- *capture*: from ``begin_capture`` to ``end_capture`` on a stream (the *origin*), the
  ops issued on it are recorded, not run. A stream that waits for an event recorded
  in the capture joins it (its later ops are recorded too), and must be joined back
  (the origin waits for an event recorded on it after its last op) before the
  capture ends, as CUDA requires. The recorded ops run in the order they were issued
  (stricter than a graph's edges: races inside one graph are not looked for).
- *graph*: what ``end_capture`` returns; ``launch(stream)`` queues its ops again, in
  order, on that stream, on the same addresses, with their accesses checked.
- What CUDA forbids during a capture raises :class:`CUDARuntimeError` with CUDA's
  error name, and invalidates the capture (``end_capture`` then raises
  ``cudaErrorStreamCaptureInvalidated``): synchronizing a capturing stream, or its
  device; querying or synchronizing an event recorded in a capture; waiting, in a
  capture, for an event recorded outside it (or in another capture); an op on a
  device's legacy default stream while a blocking stream of that device captures
  (``cudaErrorStreamCaptureImplicit``); in ``global`` mode any synchronization or
  event query from any thread, in ``thread_local`` mode from the capturing thread.
  Stricter than CUDA: an allocation on a capturing stream from the default pool
  raises (CUDA's relaxed mode allows the cudaMalloc, but the memory would go back to
  the pool, to other work, while the graph still uses it): allocate from a private
  pool (``cupy.cuda.MemoryPool``) during a capture.

Counters (:meth:`Sanitizer.counts`): host synchronizations, launches (kernels and
array operations), copies, NCCL calls, events recorded and waited for, allocations.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

#: What :meth:`Sanitizer.counts` counts.
COUNTERS = ("host_syncs", "launches", "copies", "nccl_calls", "event_records",
            "event_waits", "event_queries", "allocations")
#: Pool granularity, as CuPy's (allocations are rounded up to 512 bytes).
ROUND = 512


class SanitizerError(AssertionError):
    """Raised for reports when the sanitizer is strict, and for a hang."""


class CUDARuntimeError(RuntimeError):
    """A CUDA runtime error (CuPy's ``cupy.cuda.runtime.CUDARuntimeError``): ``status``
    is CUDA's error name, which starts the message, as in CuPy."""

    def __init__(self, status: str, message: str):
        super().__init__(f"{status}: {message}")
        self.status = status


#: ``cupy.cuda.runtime``'s capture modes.
CAPTURE_GLOBAL, CAPTURE_THREAD_LOCAL, CAPTURE_RELAXED = 0, 1, 2
_MODE_NAMES = {0: "global", 1: "thread_local", 2: "relaxed"}


@dataclass
class Report:
    kind: str
    message: str

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


def _site() -> str:
    """The innermost caller outside the sanitizer and the fakes (where the op was issued)."""
    f = sys._getframe(1)
    while f is not None:
        name = f.f_code.co_filename
        if "/gpustrat/testing/" not in name and "contextlib" not in name:
            return f"{name.rsplit('/', 1)[-1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "?"


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


class Stream:
    """A queue of ops on one device. ``ptr`` is its handle (0: the device's null stream)."""

    def __init__(self, san: "Sanitizer", device: int, ptr: int, name: str):
        self.san, self.device, self.ptr, self.name = san, device, ptr, name
        self.queue: collections.deque = collections.deque()
        self.seq = 0            # ops issued
        self.executed = 0       # ops run
        self.vc: dict = {}      # what the next op is ordered after
        self.blocking = False   # synchronizes with the legacy default stream
        self.capture: "Capture | None" = None
        self.id = len(san.streams_list)
        san.streams_list.append(self)

    def __repr__(self) -> str:
        return f"{self.name} (gpu:{self.device})"


@dataclass
class Op:
    stream: Stream
    seq: int
    vc: dict
    what: str
    site: str
    run: Callable[[], None] | None = None
    ready: Callable[[], bool] | None = None
    group: object = None    # an NCCL call: runs together with its peers
    graph: object = None    # the graph whose replay queued this op


@dataclass
class Access:
    lo: int
    hi: int
    write: bool
    op: Op


@dataclass
class Block:
    addr: int
    nbytes: int
    device: int
    arena: Stream
    buf: np.ndarray
    accesses: list = field(default_factory=list)
    free: bool = False
    serial: int = 0
    freed_vc: dict = field(default_factory=dict)   # what the freeing thread had seen done
    freed_by: str = ""                             # that thread (for reports)
    pool: int = 0                                  # 0: the default pool


class EventState:
    """What a recorded event stands for: the ops of ``stream`` up to ``seq``; or, when
    recorded in a capture, the ``node``-th recorded op of ``stream`` in ``capture``."""

    def __init__(self):
        self.stream: Stream | None = None
        self.seq = 0
        self.vc: dict = {}
        self.capture: "Capture | None" = None
        self.node = 0

    def complete(self) -> bool:
        return self.stream is None or self.stream.executed >= self.seq


@dataclass
class Node:
    """An op recorded in a capture: what a replay queues again."""

    what: str
    site: str
    run: Callable[[], None] | None
    reads: list
    writes: list
    count: str | None
    group: object = None    # the captured NCCL call (its ``replayed(rank)`` pairs peers)
    rank: int = 0


class Capture:
    """One capture sequence: its streams, its recorded ops, and why it failed, if it did."""

    def __init__(self, origin: Stream, mode: int, serial: int):
        self.origin, self.mode, self.serial = origin, mode, serial
        self.thread = threading.get_ident()
        self.members: list[Stream] = [origin]
        self.nodes: list[Node] = []
        self.per_stream: collections.Counter = collections.Counter()
        self.rejoined: dict = {}
        self.error: str | None = None

    def __repr__(self) -> str:
        return f"capture #{self.serial} of {self.origin!r}"


class Graph:
    """What ``end_capture`` returns: the recorded ops, replayed in order by
    :meth:`Sanitizer.launch`."""

    def __init__(self, nodes: list, serial: int, device: int, site: str):
        self.nodes, self.serial, self.device, self.site = nodes, serial, device, site
        self.launches = 0

    def __repr__(self) -> str:
        return f"graph #{self.serial} (gpu:{self.device}, {len(self.nodes)} ops)"


class Sanitizer:
    """The model: streams, events, the pool, the checks, the scheduler, the counters.

    Args:
        seed: seeds the randomized scheduler.
        run_probability: chance that an enqueue lets the scheduler run ready ops.
        strict: raise :class:`SanitizerError` at the first report (else collect them).
        num_devices: GPUs the fake shows.
    """

    def __init__(self, seed: int = 0, run_probability: float = 0.5, strict: bool = False,
                 num_devices: int = 4):
        self.lock = threading.RLock()
        self.rng = random.Random(seed)
        self.p = run_probability
        self.strict = strict
        self.num_devices = num_devices
        self.streams_list: list[Stream] = []
        self.by_ptr: dict = {}
        self._null = {d: Stream(self, d, 0, f"null{d}") for d in range(num_devices)}
        #: The host, as a stream whose "ops" are its own accesses of pinned memory: they
        #: are ordered after the device work it has seen complete, and everything
        #: queued later is ordered after them.
        self.host = Stream(self, -1, -1, "host")
        self._next_ptr = 0x1000
        self._observed = threading.local()
        self._collecting = threading.local()   # .on: this thread runs a garbage collection
        self.blocks: list[Block] = []
        self._addrs: list[int] = []
        self._top = {d: (d + 1) << 40 for d in range(num_devices)}
        self._free: dict = collections.defaultdict(list)   # (arena id, size) -> blocks
        self.reports: list[Report] = []
        self.counters = collections.Counter({k: 0 for k in COUNTERS})
        self.sync_sites: list[tuple[str, str, str]] = []   # (thread, what, site)
        self._serial = 0
        self.captures: list[Capture] = []    # the open ones
        self._capture_serial = 0

    @property
    def done_vc(self) -> dict:
        """The device work the calling thread has seen complete (a synchronize, an event
        that was queried done). Per thread: what another thread saw orders nothing here,
        since how threads hand work to each other is not modelled (so code must not rely
        on another thread's host wait)."""
        vc = getattr(self._observed, "vc", None)
        if vc is None:
            vc = self._observed.vc = {}
        return vc

    @done_vc.setter
    def done_vc(self, vc: dict) -> None:
        self._observed.vc = vc

    # --- streams and events --------------------------------------------------------------

    def null_stream(self, device: int) -> Stream:
        return self._null[device]

    def new_stream(self, device: int, name: str | None = None) -> Stream:
        with self.lock:
            ptr = self._next_ptr
            self._next_ptr += 0x10
            s = Stream(self, device, ptr, name or f"stream{len(self.streams_list)}")
            self.by_ptr[ptr] = s
            return s

    def stream_of_handle(self, handle: int, device: int) -> Stream:
        """The stream a raw ``cudaStream_t`` names (0, 1: the device's legacy default)."""
        if handle in (0, 1):
            return self._null[device]
        s = self.by_ptr.get(int(handle))
        if s is None:
            raise SanitizerError(f"stream handle {handle:#x} names no stream")
        return s

    def record(self, stream: Stream, ev: EventState) -> None:
        with self.lock:
            self.counters["event_records"] += 1
            c = stream.capture
            if c is not None:
                ev.stream, ev.capture, ev.node = stream, c, c.per_stream[stream]
                return
            ev.capture = None
            ev.stream, ev.seq, ev.vc = stream, stream.seq, _join(stream.vc, self.done_vc)

    def wait(self, stream: Stream, ev: EventState) -> None:
        """``stream`` waits for ``ev`` (a no-op op in stream order, as cudaStreamWaitEvent)."""
        with self.lock:
            self.counters["event_waits"] += 1
            if ev.stream is None or ev.stream is stream:
                return
            if ev.capture is not None or stream.capture is not None:
                self._capture_wait(stream, ev)
                return
            src, seq = ev.stream, ev.seq
            self.enqueue(stream, f"wait for {src.name}@{seq}", ready=lambda: src.executed >= seq,
                         order_after=ev.vc, count=None)

    # --- issuing work ---------------------------------------------------------------------

    def enqueue(self, stream: Stream, what: str, run: Callable[[], None] | None = None,
                reads=(), writes=(), ready=None, group=None, order_after: dict | None = None,
                count: str | None = "launches") -> Op:
        """Queue an op on ``stream`` after checking its accesses.

        ``reads``/``writes`` are ``(block, lo, hi)`` byte ranges. ``order_after``: a
        clock the op (and everything after it on the stream) is ordered after.
        """
        with self.lock:
            if count:
                self.counters[count] += 1
            if stream.capture is not None:
                return self._record_node(stream, what, run, reads, writes, group, count)
            if stream.ptr == 0 and self.captures:
                self._check_legacy(stream, what)
            stream.vc = _join(stream.vc, self.done_vc)
            stream.vc[self.host.id] = self.host.seq
            if order_after:
                stream.vc = _join(stream.vc, order_after)
            stream.seq += 1
            stream.vc[stream.id] = stream.seq
            op = Op(stream, stream.seq, dict(stream.vc), what, _site(), run, ready, group)
            for blk, lo, hi in reads:
                self._access(blk, lo, hi, False, op)
            for blk, lo, hi in writes:
                self._access(blk, lo, hi, True, op)
            stream.queue.append(op)
            self._tick()
            return op

    def host_access(self, what: str, reads=(), writes=()) -> None:
        """The host reads or writes (pinned) memory now."""
        with self.lock:
            h = self.host
            h.vc = _join(h.vc, self.done_vc)
            h.seq += 1
            h.vc[h.id] = h.seq
            h.executed = h.seq
            op = Op(h, h.seq, dict(h.vc), what, _site())
            for blk, lo, hi in reads:
                self._access(blk, lo, hi, False, op)
            for blk, lo, hi in writes:
                self._access(blk, lo, hi, True, op)

    def _ordered(self, earlier: Op, later_vc: dict, later_stream: Stream) -> bool:
        return earlier.stream is later_stream or later_vc.get(earlier.stream.id, 0) >= earlier.seq

    def _access(self, blk: Block, lo: int, hi: int, write: bool, op: Op) -> None:
        if hi <= lo:
            return
        keep = []
        for a in blk.accesses:
            overlap = a.lo < hi and lo < a.hi
            ordered = self._ordered(a.op, op.vc, op.stream)
            if overlap and (write or a.write) and not ordered and a.op.graph is not None:
                self.report("replay", f"{op.what} at {op.site} "
                            f"{'rewrote' if write else 'read'} bytes [{max(lo, a.lo)}, "
                            f"{min(hi, a.hi)}) of block #{blk.serial} (gpu:{blk.device}) "
                            f"that a replay of {a.op.graph!r} ({a.op.what} on "
                            f"{a.op.stream!r}) may still {'write' if a.write else 'read'}: "
                            "order it after the replay (an event recorded after the "
                            "launch), or write the graph's inputs on the launch stream")
            elif overlap and (write or a.write) and not ordered:
                kind = ("write" if write else "read") + " after " + ("write" if a.write else "read")
                self.report("race", f"{kind} on block #{blk.serial} (gpu:{blk.device}) bytes "
                            f"[{max(lo, a.lo)}, {min(hi, a.hi)}): {op.what} on "
                            f"{op.stream!r} at {op.site} is not ordered after {a.op.what} on "
                            f"{a.op.stream!r} at {a.op.site}")
            # A write ordered after an earlier access that it covers supersedes it.
            if not (write and ordered and lo <= a.lo and a.hi <= hi):
                keep.append(a)
        keep.append(Access(lo, hi, write, op))
        if len(keep) > 64:   # bounded: the oldest ordered accesses matter least
            keep = keep[-64:]
        blk.accesses = keep

    def report(self, kind: str, message: str) -> None:
        r = Report(kind, message)
        self.reports.append(r)
        if self.strict:
            raise SanitizerError(str(r))

    # --- running ----------------------------------------------------------------------------

    def _ready_heads(self) -> list[Op]:
        heads = []
        for s in self.streams_list:
            if not s.queue:
                continue
            op = s.queue[0]
            if op.ready is not None and not op.ready():
                continue
            if op.group is not None and not op.group.ready():
                continue
            heads.append(op)
        return heads

    def _execute(self, op: Op) -> None:
        ops = op.group.take() if op.group is not None else [op]
        for o in ops:
            assert o.stream.queue[0] is o
            o.stream.queue.popleft()
        if op.group is not None:
            op.group.run()
        elif op.run is not None:
            op.run()
        for o in ops:
            o.stream.executed = o.seq

    def _tick(self) -> None:
        if self.rng.random() >= self.p:
            return
        for _ in range(self.rng.randint(1, 3)):
            heads = self._ready_heads()
            if not heads:
                return
            self._execute(self.rng.choice(heads))

    def _force(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            heads = self._ready_heads()
            if not heads:
                stuck = "; ".join(f"{s!r}: {s.queue[0].what} at {s.queue[0].site}"
                                  for s in self.streams_list if s.queue)
                r = Report("hang", f"{what} can never complete: no queued op can run "
                           f"({stuck})")
                self.reports.append(r)
                raise SanitizerError(str(r))
            self._execute(self.rng.choice(heads))

    def drain(self) -> None:
        """Run every queued op (no host synchronization is counted)."""
        with self.lock:
            self._force(lambda: not any(s.queue for s in self.streams_list), "draining")

    def _host_sync(self, what: str) -> None:
        self.counters["host_syncs"] += 1
        self.sync_sites.append((threading.current_thread().name, what, _site()))

    def synchronize_stream(self, stream: Stream, what: str | None = None) -> None:
        with self.lock:
            if self.captures:
                self._forbid_in_capture(what or f"synchronize {stream.name}", stream)
            self._host_sync(what or f"synchronize {stream.name}")
            target = stream.seq
            self._force(lambda: stream.executed >= target, f"synchronize {stream!r}")
            self.done_vc = _join(self.done_vc, stream.vc)

    def synchronize_device(self, device: int) -> None:
        with self.lock:
            if self.captures:
                self._forbid_in_capture(f"synchronize gpu:{device}", device=device)
            self._host_sync(f"synchronize gpu:{device}")
            for s in list(self.streams_list):
                if s.device == device:
                    target = s.seq
                    self._force(lambda s=s, t=target: s.executed >= t, "device synchronize")
                    self.done_vc = _join(self.done_vc, s.vc)

    def synchronize_event(self, ev: EventState) -> None:
        with self.lock:
            if self.captures or ev.capture is not None:
                self._forbid_in_capture("event synchronize", event=ev)
            self._host_sync("event synchronize")
            self._force(ev.complete, "event synchronize")
            self.done_vc = _join(self.done_vc, ev.vc)

    def query_event(self, ev: EventState) -> bool:
        """An event query: forces the work it stands for where that can run (the
        scheduler's model of a GPU that keeps up), and never counts as a host wait."""
        with self.lock:
            self.counters["event_queries"] += 1
            if self.captures or ev.capture is not None:
                self._forbid_in_capture("event query", event=ev)
            while not ev.complete():
                heads = self._ready_heads()
                if not heads:
                    return False
                self._execute(self.rng.choice(heads))
            self.done_vc = _join(self.done_vc, ev.vc)
            return True

    # --- stream capture ------------------------------------------------------------------

    def begin_capture(self, stream: Stream, mode: int = CAPTURE_RELAXED) -> None:
        with self.lock:
            if stream.ptr == 0:
                raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                       f"the legacy default stream ({stream!r}) cannot be "
                                       "captured: capture on a stream of your own")
            if stream.capture is not None:
                raise CUDARuntimeError("cudaErrorIllegalState",
                                       f"{stream!r} is already capturing ({stream.capture!r})")
            if mode not in _MODE_NAMES:
                raise CUDARuntimeError("cudaErrorInvalidValue", f"capture mode {mode!r}")
            self._capture_serial += 1
            c = Capture(stream, mode, self._capture_serial)
            stream.capture = c
            self.captures.append(c)

    def end_capture(self, stream: Stream) -> Graph:
        with self.lock:
            c = stream.capture
            if c is None or c.origin is not stream:
                raise CUDARuntimeError("cudaErrorIllegalState",
                                       f"{stream!r} did not begin a capture")
            if c.mode != CAPTURE_RELAXED and c.thread != threading.get_ident():
                self._invalidate(c, "ended from another thread")
                self._close(c)
                raise CUDARuntimeError("cudaErrorStreamCaptureWrongThread",
                                       f"{c!r} was begun in another thread")
            unjoined = [m for m in c.members if m is not stream and
                        c.per_stream[m] > c.rejoined.get(m, -1)]
            self._close(c)
            if c.error is not None:
                raise CUDARuntimeError("cudaErrorStreamCaptureInvalidated",
                                       f"{c!r} was invalidated: {c.error}")
            if unjoined:
                raise CUDARuntimeError(
                    "cudaErrorStreamCaptureUnjoined",
                    f"{c!r} ended while {', '.join(map(repr, unjoined))} joined it and "
                    "was not joined back (the origin must wait for an event recorded on "
                    "each stream after its last captured op)")
            return Graph(c.nodes, c.serial, stream.device, _site())

    def capture_status(self, stream: Stream) -> bool:
        return stream.capture is not None

    def launch(self, graph: Graph, stream: Stream) -> None:
        """Queue ``graph``'s recorded ops on ``stream``, in order (``cudaGraphLaunch``)."""
        with self.lock:
            if stream.capture is not None:
                raise CUDARuntimeError("cudaErrorNotSupported",
                                       "launching a graph into a capture is not modelled")
            if stream.device != graph.device:
                self.report("device", f"{graph!r} launched on {stream!r}")
            graph.launches += 1
            for n in graph.nodes:
                group = n.group.replayed(n.rank) if n.group is not None else None
                op = self.enqueue(stream, f"{n.what} (replay)", n.run, n.reads, n.writes,
                                  group=group, count=n.count)
                op.graph = graph
                if group is not None:
                    group.add_replayed(n.rank, op, n.group)

    def _record_node(self, stream, what, run, reads, writes, group, count) -> Op:
        c = stream.capture
        c.nodes.append(Node(what, _site(), run, list(reads), list(writes), count, group))
        c.per_stream[stream] += 1
        # Not queued: a placeholder for the caller (NCCL's fake notes it in its call).
        return Op(stream, 0, {}, what, c.nodes[-1].site)

    def note_group_rank(self, stream: Stream, rank: int) -> None:
        """The fake NCCL names the rank of the call it just recorded in a capture."""
        c = stream.capture
        if c is not None and c.nodes and c.nodes[-1].group is not None:
            c.nodes[-1].rank = rank

    def _capture_wait(self, stream: Stream, ev: EventState) -> None:
        c, e = stream.capture, ev.capture
        if e is not None and e.origin.capture is not e:
            e = None     # recorded in a capture that has ended: an ordinary past event
        if e is None and c is not None:
            self._invalidate(c, f"a wait for an event of {ev.stream!r} recorded outside it")
            raise CUDARuntimeError(
                "cudaErrorStreamCaptureIsolation",
                f"{stream!r} (capturing in {c!r}) waited at {_site()} for an event "
                f"recorded on {ev.stream!r} outside the capture: order the work before "
                "the capture begins")
        if e is not None and c is None:
            stream.capture = e     # joins the capture (a fork)
            e.members.append(stream)
            return
        if e is not c:
            self._invalidate(c, f"a wait for an event of {e!r}")
            self._invalidate(e, f"a wait from {c!r}")
            raise CUDARuntimeError("cudaErrorStreamCaptureIsolation",
                                   f"{stream!r} in {c!r} waited for an event recorded in {e!r}")
        c.rejoined[ev.stream] = max(c.rejoined.get(ev.stream, -1), ev.node)

    def _check_legacy(self, stream: Stream, what: str) -> None:
        for c in self.captures:
            blocking = [m for m in c.members if m.device == stream.device and m.blocking]
            if blocking:
                self._invalidate(c, f"{what} on the legacy default stream")
                raise CUDARuntimeError(
                    "cudaErrorStreamCaptureImplicit",
                    f"{what} on the legacy default stream of gpu:{stream.device} at "
                    f"{_site()} while the blocking {blocking[0]!r} captures ({c!r}): the "
                    "legacy stream would synchronize with it; capture on non-blocking "
                    "streams")

    def _forbid_in_capture(self, what: str, stream: Stream | None = None,
                           device: int | None = None, event: EventState | None = None) -> None:
        me = threading.get_ident()
        why = None
        hit = []
        if stream is not None and stream.capture is not None:
            why, hit = f"{stream!r} is capturing", [stream.capture]
        elif event is not None and event.capture is not None and \
                event.capture.origin.capture is event.capture:
            why, hit = f"the event was recorded in {event.capture!r}", [event.capture]
        elif device is not None and any(m.device == device for c in self.captures
                                        for m in c.members):
            hit = [c for c in self.captures if any(m.device == device for m in c.members)]
            why = f"a stream of gpu:{device} is capturing"
        else:
            for c in self.captures:
                if c.mode == CAPTURE_GLOBAL or (c.mode == CAPTURE_THREAD_LOCAL
                                                and c.thread == me):
                    why, hit = f"{c!r} is in {_MODE_NAMES[c.mode]} mode", [c]
                    break
        if why is None:
            return
        for c in hit:
            self._invalidate(c, f"{what} at {_site()}")
        raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                               f"operation not permitted when stream is capturing: {what} "
                               f"at {_site()} while {why}")

    def _invalidate(self, c: Capture | None, why: str) -> None:
        if c is not None and c.error is None:
            c.error = why

    def _close(self, c: Capture) -> None:
        for m in c.members:
            m.capture = None
        if c in self.captures:
            self.captures.remove(c)

    # --- memory -----------------------------------------------------------------------------

    def alloc(self, device: int, nbytes: int, stream: Stream, pool: int = 0) -> Block:
        """A block from ``stream``'s arena of a pool (a freed one when it fits):
        ``pool`` 0 is CuPy's default pool, another number a private pool's."""
        with self.lock:
            if stream.capture is not None and not pool:
                self._invalidate(stream.capture, "an allocation from the default pool")
                raise CUDARuntimeError(
                    "cudaErrorStreamCaptureUnsupported",
                    f"allocation of {int(nbytes)} bytes from the default memory pool at "
                    f"{_site()} while {stream!r} is capturing (in {stream.capture!r}): "
                    "the block would go back to the pool, to other work, while the "
                    "graph still uses it; allocate from a private pool "
                    "(cupy.cuda.MemoryPool) during a capture")
            self.counters["allocations"] += 1
            size = max(-(-int(nbytes) // ROUND) * ROUND, ROUND)
            free = self._free[(stream.id, size, pool)]
            if free:
                blk = free.pop()
                blk.free = False
                self._check_reuse(blk, stream)
                return blk
            addr = self._top[device]
            self._top[device] += size
            self._serial += 1
            blk = Block(addr, size, device, stream, np.full(size, 0xFF, np.uint8),
                        serial=self._serial, pool=pool)
            k = bisect.bisect(self._addrs, addr)
            self._addrs.insert(k, addr)
            self.blocks.insert(k, blk)
            return blk

    def _check_reuse(self, blk: Block, stream: Stream) -> None:
        # Work the freeing thread had seen complete before it freed the block is over.
        vc = _join(_join(stream.vc, self.done_vc), blk.freed_vc)
        for a in blk.accesses:
            if not self._ordered(a.op, vc, stream):
                self.report("reuse", f"block #{blk.serial} (gpu:{blk.device}, {stream.name}'s "
                            f"pool) handed out again at {_site()} while {a.op.what} on "
                            f"{a.op.stream!r} at {a.op.site} may still "
                            f"{'write' if a.write else 'read'} it: that stream's work was "
                            f"never ordered before {stream.name}'s, nor seen complete by "
                            f"the thread that freed the block ({blk.freed_by})")
                break
        blk.accesses = []

    def free(self, blk: Block) -> None:
        """``blk`` goes back to its arena: when the last array referring to it is gone, in
        the thread that dropped that reference (as CuPy's pool). What that thread had seen
        complete is over before any later use of the block."""
        with self.lock:
            blk.free = True
            blk.freed_vc = dict(self.done_vc)
            blk.freed_by = threading.current_thread().name
            if getattr(self._collecting, "on", False):
                # Its arrays were in a reference cycle: the collector runs in whichever
                # thread allocates at the time, which may have seen nothing complete.
                blk.freed_by += ", by the garbage collector"
            self._free[(blk.arena.id, blk.nbytes, blk.pool)].append(blk)

    def gc_callback(self, phase: str, info: dict) -> None:
        """For ``gc.callbacks``: marks the frees a garbage collection makes (in reports)."""
        self._collecting.on = phase == "start"

    def block_at(self, addr: int, nbytes: int = 1) -> tuple[Block, int]:
        """The block holding ``[addr, addr + nbytes)`` and the offset in it."""
        with self.lock:   # another thread's allocation inserts into both lists
            k = bisect.bisect(self._addrs, addr) - 1
            if k >= 0:
                blk = self.blocks[k]
                if addr + max(nbytes, 1) <= blk.addr + blk.nbytes:
                    return blk, addr - blk.addr
        raise SanitizerError(f"device address range [{addr:#x}, {addr + nbytes:#x}) is outside "
                             "every allocation (out of bounds, or freed memory)")

    # --- counts -----------------------------------------------------------------------------

    def counts(self) -> dict:
        with self.lock:
            return dict(self.counters)

    @contextlib.contextmanager
    def measure(self):
        """``with san.measure() as c:`` -- ``c`` is filled with the counts of the block."""
        before = self.counts()
        sites = len(self.sync_sites)
        out: dict = {}
        yield out
        after = self.counts()
        out.update({k: after.get(k, 0) - before.get(k, 0)
                    for k in set(after) | set(before)})
        out["sync_sites"] = self.sync_sites[sites:]

    def check(self) -> None:
        """Raise :class:`SanitizerError` listing the reports, if any."""
        if self.reports:
            raise SanitizerError(f"{len(self.reports)} report(s):\n" +
                                 "\n".join(str(r) for r in self.reports[:10]))
