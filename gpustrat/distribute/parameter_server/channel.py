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

Waits poll (``improbe``) with a sleep backing off to 1 ms, so an idle rank does not
burn a core, and a request to a server that does not answer within
``GPUSTRAT_TIMEOUT`` seconds raises :class:`ServerLostError`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

import numpy as np

from gpustrat.distribute.parameter_server import wire

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


class ServerLostError(RuntimeError):
    """A parameter server did not answer: the job cannot go on (restore from a
    checkpoint in a new job)."""


class Backoff:
    """Waiting in polling loops: spin for ``spin_s`` (an answer expected within
    microseconds must not wait for a time slice), then yield the core for a while,
    then sleep, doubling up to 1 ms, so an idle rank does not burn a core."""

    __slots__ = ("delay", "spin_s", "since")

    def __init__(self, spin_s: float = 2e-3):
        self.spin_s = spin_s
        self.reset()

    def reset(self) -> None:
        self.delay = 2e-5
        self.since = None

    def __call__(self) -> None:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        elapsed = now - self.since
        if elapsed < self.spin_s:
            return
        if elapsed < self.spin_s + 0.005:
            os.sched_yield()
            return
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, _MAX_SLEEP_S)


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
    """The job's communicator plus request/answer helpers (thread-safe)."""

    def __init__(self, comm, timeout: float):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout
        self._tags = itertools.count()
        self._lock = threading.Lock()
        #: server index -> MPI rank, worker index -> MPI rank (set by the strategy)
        self.server_ranks: list = []
        self.worker_ranks: list = []
        #: ranks that did not answer in time
        self.lost: set = set()

    def reply_tag(self) -> int:
        with self._lock:
            return _REPLY_FIRST + next(self._tags) % _REPLY_SPAN

    def wait_message(self, source: int, tag: int, what):
        """The next message from ``source`` on ``tag`` (polling with a deadline)."""
        comm = self.comm
        backoff = Backoff()
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
            backoff()

    def request(self, server: int, op: str, args: tuple = (), arrays=()):
        """Ask server ``server`` (its index) to do ``op``; returns (payload, arrays)."""
        code = FAST_CODES.get(op)
        if code == 0 and len(args) == 3 and not arrays:
            vid, shape, dtype = args
            out = np.empty(shape, np.dtype(dtype))
            self._fast(server, code, vid, None, out, op)
            return None, [out]
        if code and len(args) == 1 and len(arrays) == 1:
            self._fast(server, code, args[0], arrays[0], np.empty(1, np.int64), op)
            return None, []
        dest = self.server_ranks[server]
        tag = self.reply_tag()
        wire.mpi_send(self.comm, dest, TAG_REQ, (op, tag, args), arrays, data_tag=tag)
        (status, payload), ms = self.wait_message(
            dest, tag, lambda: f"{op} on parameter server {server} (rank {dest})")
        out = wire.mpi_recv_arrays(self.comm, dest, tag, ms) if ms else []
        if status != "ok":
            kind, text = payload
            raise _ERRORS.get(kind, RuntimeError)(text)
        return payload, out


    def _fast(self, server: int, code: int, vid: int, value, answer, op: str) -> None:
        comm = self.comm
        dest = self.server_ranks[server]
        tag = self.reply_tag()
        nbytes = 0 if value is None else value.nbytes
        header = np.array([code, tag, vid, nbytes], np.int64)
        pending = comm.Irecv(wire.raw(answer), source=dest, tag=tag)
        comm.Send(header, dest=dest, tag=TAG_FAST)
        if nbytes:
            # A second, contiguous message: MPI moves it as fast as a bare Send (one
            # message of header and value through a struct datatype is packed, slower).
            comm.Send(wire.raw(value), dest=dest, tag=tag)
        backoff = Backoff()
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not pending.Test():
            polls += 1
            if polls & 15 == 0:
                msg = comm.improbe(source=dest, tag=tag + ERR_OFFSET)
                if msg is not None:
                    pending.Cancel()
                    pending.Wait()
                    _, (kind, text) = msg.recv()[0]
                    raise _ERRORS.get(kind, RuntimeError)(text)
                if time.monotonic() > deadline:
                    self.lost.add(dest)
                    raise ServerLostError(
                        f"{op} on parameter server {server} (rank {dest}): it did not "
                        f"answer within {self.timeout:g} s (GPUSTRAT_TIMEOUT): it has "
                        "probably been lost. The job cannot continue: restart it and "
                        "restore the variables from a checkpoint")
            backoff()


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError,
           "KeyError": KeyError, "ServerLostError": ServerLostError}

_channel: Channel | None = None


def set_channel(ch: Channel | None) -> None:
    global _channel
    _channel = ch


def channel() -> Channel | None:
    return _channel
