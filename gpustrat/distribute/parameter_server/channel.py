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

Waits poll (``improbe``) with a sleep backing off to 1 ms, so an idle rank does not
burn a core, and a request to a server that does not answer within
``GPUSTRAT_TIMEOUT`` seconds raises :class:`ServerLostError`.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from gpustrat.distribute.parameter_server import wire

TAG_REQ = 1
TAG_TASK = 2
TAG_TASK_DATA = 3
TAG_RESULT = 4
TAG_RESULT_DATA = 5
_REPLY_FIRST = 100
_REPLY_SPAN = 30000

_MAX_SLEEP_S = 1e-3


class ServerLostError(RuntimeError):
    """A parameter server did not answer: the job cannot go on (restore from a
    checkpoint in a new job)."""


class Backoff:
    """Waiting in polling loops: spin for ``spin_s`` (an answer expected within
    microseconds must not wait for a time slice), then yield the core for a while,
    then sleep, doubling up to 1 ms, so an idle rank does not burn a core."""

    __slots__ = ("n", "delay", "spin_s", "since")

    def __init__(self, spin_s: float = 2e-3):
        self.spin_s = spin_s
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self.delay = 2e-5
        self.since = None

    def __call__(self) -> None:
        self.n += 1
        if self.n & 15 == 0 or self.since is None:
            now = time.monotonic()
            if self.since is None:
                self.since = now
            elapsed = now - self.since
        else:
            return  # spinning: the clock is read every 16 polls
        if elapsed < self.spin_s:
            return
        if elapsed < self.spin_s + 0.02:
            os.sched_yield()
            return
        time.sleep(self.delay)
        self.delay = min(2 * self.delay, _MAX_SLEEP_S)


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


_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError,
           "KeyError": KeyError, "ServerLostError": ServerLostError}

_channel: Channel | None = None


def set_channel(ch: Channel | None) -> None:
    global _channel
    _channel = ch


def channel() -> Channel | None:
    return _channel
