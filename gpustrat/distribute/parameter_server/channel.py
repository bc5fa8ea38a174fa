"""The job's MPI channel: one duplicate of ``COMM_WORLD`` shared by every role.

Tags:
- ``TAG_REQ``: a request to a server, ``(op, reply_tag, args)``; its arrays follow on
  ``reply_tag`` and the server answers ``(status, payload)`` plus arrays on
  ``reply_tag``. Every request of a process takes a fresh reply tag, so several threads
  of one process (the coordinator's main thread and its dispatcher) can have requests
  in flight to the same server.
- ``TAG_TASK`` / ``TAG_TASK_DATA``: the coordinator to a worker (functions to run,
  datasets to make, stop).
- ``TAG_RESULT`` / ``TAG_RESULT_DATA``: a worker to the coordinator.
- ``TAG_FAST``: variable reads and updates in one message each way (see
  ``FAST_CODES``), the transfers that decide training speed.

Transfers are nonblocking. Waits poll (``improbe``, ``Test``) and spin only briefly
(an answer expected within microseconds must not wait for a time slice), then sleep
on the thread's doorbell, which the sender of what is waited for rings (see
:mod:`.doorbell` and :class:`Backoff`), so an idle or waiting rank leaves its core to
the ranks and function processes that compute. A request to a server that does not
answer within ``GPUSTRAT_TIMEOUT`` seconds raises :class:`ServerLostError`; so does,
at once, every later request to it (see :attr:`Channel.lost`).
"""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time

import numpy as np

from gpustrat.distribute.parameter_server import doorbell, staging, wire

TAG_REQ = 1
TAG_TASK = 2
TAG_TASK_DATA = 3
TAG_RESULT = 4
TAG_RESULT_DATA = 5
TAG_FAST = 6
_REPLY_FIRST = 100
_REPLY_SPAN = 16000
#: Errors of fast requests come on their reply tag plus this.
ERR_OFFSET = 16000
#: Fast requests: a 32-byte header (code, reply tag, variable id, bytes that follow)
#: and, for updates, the value's bytes on the reply tag; the answer is the value (read)
#: or an 8-byte acknowledgement (update), with nothing else, into a receive posted
#: beforehand.
FAST_CODES = {"read": 0, "assign": 1, "assign_add": 2, "assign_sub": 3}
FAST_OPS = {v: k for k, v in FAST_CODES.items()}

_MAX_SLEEP_S = 1e-3
_RUNG_SLEEP_S = 0.05
_FIRST_SLEEP_S = 1e-5
#: Linux rounds a sleeping thread's wake-up up by its timer slack (50 us by default):
#: 1 us lets the first, short sleeps of a wait be as short as asked.
_TIMER_SLACK_NS = 1000
_slack = threading.local()


def _fine_timers() -> None:
    """Give the calling thread a timer slack of 1 us (once per thread; Linux only)."""
    _slack.done = True
    try:
        import ctypes  # noqa: PLC0415
        ctypes.CDLL(None, use_errno=True).prctl(29, _TIMER_SLACK_NS, 0, 0, 0)  # SET_TIMERSLACK
    except (OSError, AttributeError):
        pass


class ServerLostError(RuntimeError):
    """A parameter server did not answer: the job cannot go on (restore from a
    checkpoint in a new job)."""


class Backoff:
    """Waiting in polling loops: spin for ``spin_s`` (an answer expected within
    microseconds must not wait for a time slice), yielding the core at each poll to any
    process that is ready to run on it (``sched_yield``: on an idle core the spin goes
    on at once, on a busy one the computing process goes first), then sleep, from 10 us
    doubling up to 1 ms, so that a waiting process gives its core to those that compute
    (MPI's own blocking waits spin; Python's sleep releases the core). ``__call__(wait)`` sleeps
    in ``wait(seconds)`` instead: a doorbell's ``sleep`` (see :mod:`.doorbell`), which
    returns True as soon as it is rung, and the wait spins again. ``cap`` is the
    longest sleep; ``rung``: every sender of what is waited for rings the doorbell
    (all on this machine), so the wait sleeps ``cap`` at once (see
    :meth:`Channel.backoff`)."""

    __slots__ = ("delay", "spin_s", "since", "cap", "first")

    def __init__(self, spin_s: float = 50e-6, cap: float = _MAX_SLEEP_S,
                 rung: bool = False):
        self.spin_s = spin_s
        self.cap = cap
        # A wait that every sender rings needs no short sleeps: the ring ends it.
        self.first = cap if rung else _FIRST_SLEEP_S
        self.reset()

    def reset(self) -> None:
        self.delay = self.first
        self.since = None

    def __call__(self, wait=None) -> None:
        now = time.perf_counter()
        if self.since is None:
            self.since = now
            return
        if now - self.since < self.spin_s:
            _yield()
            return
        if not getattr(_slack, "done", False):
            _fine_timers()
        if wait is None:
            time.sleep(self.delay)
        elif wait(self.delay):
            # Woken (a doorbell): what was waited for is arriving, spin again.
            self.reset()
            return
        self.delay = min(2 * self.delay, self.cap)


_yield = getattr(os, "sched_yield", lambda: None)


def transfer_spin(nbytes: int) -> float:
    """How long a wait for ``nbytes`` on their way polls before it sleeps: about as
    long as they take to move within a machine."""
    return 50e-6 + nbytes / 4e9


class Orphaned(Exception):
    """The coordinator's process ended without stopping this rank."""


class Watch:
    """Checks, at most once a second while a rank is idle, whether the coordinator's
    process is gone (``gone`` is the resolver's ``coordinator_gone``)."""

    def __init__(self, gone):
        self.gone = gone
        self.next = time.monotonic() + 1.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self.next:
            return
        self.next = now + 1.0
        if self.gone():
            raise Orphaned


class Channel:
    """The job's communicator plus request/answer helpers (thread-safe), and the
    doorbells of this rank (see :mod:`.doorbell`; ``job`` names them, None for none)."""

    def __init__(self, comm, timeout: float, job: str | None = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self._tags = itertools.count()
        self._lock = threading.Lock()
        #: server index -> MPI rank, worker index -> MPI rank (set by the strategy)
        self.server_ranks: list = []
        self.worker_ranks: list = []
        #: ranks that did not answer in time (a request to a server among them fails at
        #: once); the coordinator tells the workers of each lost server
        self.lost: set = set()
        #: this rank's update slots (see :meth:`open_staging`), None for none
        self.staging = None
        slots = (doorbell.REPLIES, doorbell.RESULTS) if self.rank == 0 else \
            (doorbell.REPLIES,)
        self.bells = {s: doorbell.Doorbell(doorbell.address(job, self.rank, s))
                      for s in slots} if job is not None else {}
        self._ringer = doorbell.Ringer(job) if job is not None else None
        #: The longest sleep of a wait for a message that its sender rings: long when
        #: every rank has a doorbell on this machine (a ring ends the sleep at once),
        #: else 1 ms (a rank on another machine cannot ring).
        self.cap = _MAX_SLEEP_S
        if job is not None:
            # A collective: every rank makes its channel in the strategy's constructor.
            mine = (socket.gethostname(), all(b.sock is not None
                                              for b in self.bells.values()))
            every = comm.allgather(mine)
            if len({host for host, _ in every}) == 1 and all(ok for _, ok in every):
                self.cap = _RUNG_SLEEP_S

    def open_staging(self) -> None:
        """Make the update slots between the servers and the ranks on their machines
        (see :mod:`.staging`), once ``server_ranks`` is set: a collective."""
        from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
        self.staging = staging.open_staging(self.comm, self.server_ranks, mpi())

    def backoff(self, spin_s: float = 50e-6) -> Backoff:
        """A Backoff for a wait that the sender of what is waited for rings."""
        return Backoff(spin_s, self.cap, rung=self.cap > _MAX_SLEEP_S)

    def ring(self, rank: int, slot: int = doorbell.REPLIES) -> None:
        """Wake ``rank``'s thread waiting on doorbell ``slot`` (a message was sent)."""
        if self._ringer is not None:
            self._ringer.ring(rank, slot)

    def ring_waiter(self, rank: int) -> None:
        """Ring ``rank`` (doorbell REPLIES) after a message of a counted wait (a read or
        an update, its acknowledgement), unless it is known to be awake, polling for it
        (see :mod:`.staging`)."""
        if self.staging is None or self.staging.may_sleep(rank):
            self.ring(rank)

    def sleeper(self, slot: int = doorbell.REPLIES):
        """What a Backoff of a thread waiting on doorbell ``slot`` sleeps in."""
        bell = self.bells.get(slot)
        return bell.sleep if bell is not None else None

    def send(self, dest: int, tag: int, header, arrays=(), data_tag: int | None = None,
             slot: int = doorbell.REPLIES, sleep_slot: int = doorbell.REPLIES,
             wait: bool = True):
        """Send a small picklable ``header`` with the arrays' layouts on ``tag``, then
        each array's bytes on ``data_tag`` (default ``tag``), ring ``dest``'s doorbell
        ``slot`` and wait (on this thread's doorbell ``sleep_slot``) until ``dest``
        has taken them. Nonblocking sends and a sleeping wait: MPI's blocking send
        spins until the receiver takes a large message.

        With ``wait=False``, returns ``(requests, arrays)`` instead: the caller keeps
        both until :meth:`done` says the requests completed (a loop that also
        receives must not wait for a peer that may be sending to it)."""
        comm = self.comm
        requests = [comm.isend((header, wire.metas(arrays)), dest=dest, tag=tag)]
        dt = tag if data_tag is None else data_tag
        requests += [comm.Isend(wire.raw(a), dest=dest, tag=dt) for a in arrays]
        self.ring(dest, slot)
        if not wait:
            return requests, arrays
        self.wait(requests, dest, "sending to it", sleep_slot)
        return None

    @staticmethod
    def done(pending: list) -> list:
        """``pending`` (tuples that start with the requests of :meth:`send`) less what
        completed."""
        test = _test_all()
        return [p for p in pending if not test(p[0])]

    def recv_arrays(self, source: int, data_tag: int, ms: list,
                    sleep_slot: int = doorbell.REPLIES) -> list:
        """The arrays that follow a header of :meth:`send` (``ms``: their layouts)."""
        out = wire.empty_like_metas(ms)
        self.recv_into(source, data_tag, out, sleep_slot)
        return out

    def recv_into(self, source: int, data_tag: int, arrays: list,
                  sleep_slot: int = doorbell.REPLIES) -> None:
        """Receive the arrays that follow a header into ``arrays`` (C-contiguous): they
        are on their way, so the wait polls about as long as the bytes take to move."""
        comm = self.comm
        self.wait([comm.Irecv(wire.raw(a), source=source, tag=data_tag) for a in arrays],
                  source, "receiving from it", sleep_slot,
                  spin_s=transfer_spin(sum(a.nbytes for a in arrays)))

    def wait(self, requests: list, peer: int, what: str,
             sleep_slot: int = doorbell.REPLIES, spin_s: float = 50e-6) -> None:
        """Wait for MPI ``requests`` with ``peer``: spin briefly, then sleep on this
        thread's doorbell (see :class:`Backoff`); a peer that takes no part within
        ``GPUSTRAT_TIMEOUT`` is lost (:class:`ServerLostError`)."""
        test = _test_all()
        if test(requests):
            return
        backoff = Backoff(spin_s)
        sleep = self.sleeper(sleep_slot)
        deadline = time.monotonic() + self.timeout
        while not test(requests):
            if time.monotonic() > deadline:
                self.lost.add(peer)
                raise ServerLostError(
                    f"{what}: rank {peer} did not take part within {self.timeout:g} s "
                    "(GPUSTRAT_TIMEOUT): it has probably been lost. The job cannot "
                    "continue: restart it and restore the variables from a checkpoint")
            backoff(sleep)

    def close(self) -> None:
        for bell in self.bells.values():
            bell.close()
        if self._ringer is not None:
            self._ringer.close()

    def reply_tag(self) -> int:
        with self._lock:
            return _REPLY_FIRST + next(self._tags) % _REPLY_SPAN

    def wait_message(self, source: int, tag: int, what, slot: int = doorbell.REPLIES):
        """The next message from ``source`` on ``tag`` (polling with a deadline; the
        sender rings doorbell ``slot``)."""
        comm = self.comm
        backoff = self.backoff()
        sleep = self.sleeper(slot)
        deadline = time.monotonic() + self.timeout
        while True:
            msg = comm.improbe(source=source, tag=tag)
            if msg is not None:
                return msg.recv()
            if time.monotonic() > deadline:
                self.lost.add(source)
                raise ServerLostError(
                    f"{what() if callable(what) else what}: rank {source} did not answer "
                    f"within {self.timeout:g} s (GPUSTRAT_TIMEOUT): it has probably been "
                    "lost. The job cannot continue: restart it and restore the variables "
                    "from a checkpoint")
            backoff(sleep)

    def request(self, server: int, op: str, args: tuple = (), arrays=(), into=None):
        """Ask server ``server`` (its index) to do ``op``; returns (payload, arrays).
        A read (``args``: variable id, shape, dtype) lands in ``into`` when given."""
        if self.server_ranks[server] in self.lost:
            raise self.known_lost(server, op)
        code = FAST_CODES.get(op)
        if code == 0 and len(args) == 3 and not arrays:
            vid, shape, dtype = args
            out = np.empty(shape, np.dtype(dtype)) if into is None else into
            self._fast(server, code, vid, None, out, op)
            return None, [out]
        if code and len(args) == 1 and len(arrays) == 1:
            self._fast(server, code, args[0], arrays[0], None, op)
            return None, []
        dest = self.server_ranks[server]
        tag = self.reply_tag()
        self.send(dest, TAG_REQ, (op, tag, args), arrays, data_tag=tag)
        (status, payload), ms = self.wait_message(
            dest, tag, lambda: f"{op} on parameter server {server} (rank {dest})")
        out = self.recv_arrays(dest, tag, ms) if ms else []
        if status != "ok":
            kind, text = payload
            raise _ERRORS.get(kind, RuntimeError)(text)
        return payload, out


    def known_lost(self, server: int, op: str) -> ServerLostError:
        """The error of a request ``op`` to server ``server``, already known to be lost:
        raised at once, not after another GPUSTRAT_TIMEOUT."""
        return ServerLostError(
            f"{op} on parameter server {server} (rank {self.server_ranks[server]}): the "
            f"server was lost earlier (it did not answer within {self.timeout:g} s, "
            "GPUSTRAT_TIMEOUT). The job cannot continue: restart it and restore the "
            "variables from a checkpoint")

    def _fast(self, server: int, code: int, vid: int, value, answer, op: str) -> None:
        """One fast request; ``answer``: where a read lands (None: an update, whose
        8-byte acknowledgement lands in this thread's buffer). An update's value
        goes through this rank's slot at the server when it can (see :mod:`.staging`),
        else through MPI."""
        dest = self.server_ranks[server]
        staged = None
        if code >= 2 and self.staging is not None:
            try:
                staged = self.staging.put(dest, code, value, self.timeout)
            except TimeoutError:
                self.lost.add(dest)
                raise ServerLostError(
                    f"{op} on parameter server {server} (rank {dest}): it did not take "
                    f"this rank's previous update within {self.timeout:g} s "
                    "(GPUSTRAT_TIMEOUT): it has probably been lost. The job cannot "
                    "continue: restart it and restore the variables from a checkpoint"
                    ) from None
        if staged is None:
            self._request_fast(server, dest, code, vid, value, answer, op)
            return
        try:
            self._request_fast(server, dest, staged, vid, value, answer, op, staged=True)
        finally:
            self.staging.done(dest)

    def _request_fast(self, server: int, dest: int, code: int, vid: int, value, answer,
                      op: str, staged: bool = False) -> None:
        """Send the request (and ``value`` through MPI, unless ``staged``) and wait for
        the answer."""
        comm = self.comm
        tag = self.reply_tag()
        nbytes = 0 if value is None else value.nbytes
        # This thread's header and acknowledgement buffers: the header is sent before
        # this returns, and the acknowledgement is never read.
        bufs = _fast_buffers.__dict__
        header = bufs.get("header")
        if header is None:
            header = bufs["header"] = np.empty(4, np.int64)
            bufs["ack"] = np.empty(1, np.int64)
        if answer is None:
            answer = bufs["ack"]
        header[0] = code
        header[1] = tag
        header[2] = vid
        header[3] = nbytes
        pending = [comm.Irecv(wire.raw(answer), source=dest, tag=tag)]
        comm.Send(header, dest=dest, tag=TAG_FAST)  # 32 bytes: sent at once
        if nbytes and not staged:
            # A second, contiguous message: MPI moves it as fast as a bare Send (one
            # message of header and value through a struct datatype is packed, slower).
            pending.append(comm.Isend(wire.raw(value), dest=dest, tag=tag))
        self.ring_waiter(dest)
        test = _test_all()
        if test(pending):
            return
        # Spin about as long as the bytes take to move (staged: as the server may take
        # to add the caller's update before, of about this size), then sleep (see
        # Backoff).
        backoff = self.backoff(transfer_spin(nbytes + answer.nbytes))
        sleep = self.sleeper()
        if sleep is not None and self.staging is not None and value is not None:
            # Counted while asleep: the server rings only a caller that may sleep.
            sleep = self.staging.counted(sleep, lambda: test(pending))
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not test(pending):
            polls += 1
            if polls & 15 == 0:
                msg = comm.improbe(source=dest, tag=tag + ERR_OFFSET)
                if msg is not None:
                    pending[0].Cancel()
                    pending[0].Wait()
                    if nbytes:  # the server takes the value before it answers
                        self.wait(pending[1:], dest, f"{op} on parameter server {server}")
                    _, (kind, text) = msg.recv()[0]
                    raise _ERRORS.get(kind, RuntimeError)(text)
                if time.monotonic() > deadline:
                    self.lost.add(dest)
                    raise ServerLostError(
                        f"{op} on parameter server {server} (rank {dest}): it did not "
                        f"answer within {self.timeout:g} s (GPUSTRAT_TIMEOUT): it has "
                        "probably been lost. The job cannot continue: restart it and "
                        "restore the variables from a checkpoint")
            backoff(sleep)


def _test_all():
    global _testall
    if _testall is None:
        from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
        _testall = mpi().Request.Testall
    return _testall


_testall = None
_fast_buffers = threading.local()


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError,
           "KeyError": KeyError, "ServerLostError": ServerLostError}

_channel: Channel | None = None


def set_channel(ch: Channel | None) -> None:
    global _channel
    _channel = ch


def channel() -> Channel | None:
    return _channel
