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
- ``device``: work launched on a stream or communicator of another device.

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


class EventState:
    """What a recorded event stands for: the ops of ``stream`` up to ``seq``."""

    def __init__(self):
        self.stream: Stream | None = None
        self.seq = 0
        self.vc: dict = {}

    def complete(self) -> bool:
        return self.stream is None or self.stream.executed >= self.seq


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
            ev.stream, ev.seq, ev.vc = stream, stream.seq, _join(stream.vc, self.done_vc)

    def wait(self, stream: Stream, ev: EventState) -> None:
        """``stream`` waits for ``ev`` (a no-op op in stream order, as cudaStreamWaitEvent)."""
        with self.lock:
            self.counters["event_waits"] += 1
            if ev.stream is None or ev.stream is stream:
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
            if overlap and (write or a.write) and not ordered:
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
            self._host_sync(what or f"synchronize {stream.name}")
            target = stream.seq
            self._force(lambda: stream.executed >= target, f"synchronize {stream!r}")
            self.done_vc = _join(self.done_vc, stream.vc)

    def synchronize_device(self, device: int) -> None:
        with self.lock:
            self._host_sync(f"synchronize gpu:{device}")
            for s in list(self.streams_list):
                if s.device == device:
                    target = s.seq
                    self._force(lambda s=s, t=target: s.executed >= t, "device synchronize")
                    self.done_vc = _join(self.done_vc, s.vc)

    def synchronize_event(self, ev: EventState) -> None:
        with self.lock:
            self._host_sync("event synchronize")
            self._force(ev.complete, "event synchronize")
            self.done_vc = _join(self.done_vc, ev.vc)

    def query_event(self, ev: EventState) -> bool:
        """An event query: forces the work it stands for where that can run (the
        scheduler's model of a GPU that keeps up), and never counts as a host wait."""
        with self.lock:
            self.counters["event_queries"] += 1
            while not ev.complete():
                heads = self._ready_heads()
                if not heads:
                    return False
                self._execute(self.rng.choice(heads))
            self.done_vc = _join(self.done_vc, ev.vc)
            return True

    # --- memory -----------------------------------------------------------------------------

    def alloc(self, device: int, nbytes: int, stream: Stream) -> Block:
        """A block from ``stream``'s arena of the pool (a freed one when it fits)."""
        with self.lock:
            self.counters["allocations"] += 1
            size = max(-(-int(nbytes) // ROUND) * ROUND, ROUND)
            free = self._free[(stream.id, size)]
            if free:
                blk = free.pop()
                blk.free = False
                self._check_reuse(blk, stream)
                return blk
            addr = self._top[device]
            self._top[device] += size
            self._serial += 1
            blk = Block(addr, size, device, stream, np.full(size, 0xFF, np.uint8),
                        serial=self._serial)
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
            self._free[(blk.arena.id, blk.nbytes)].append(blk)

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
