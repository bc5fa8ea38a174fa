"""Doorbells: how a rank waiting for an MPI message sleeps without missing it.

MPI offers no wait that sleeps in the kernel (MPICH's blocking calls spin), so a rank
that waits polls: spinning gives the fastest answer but burns a core that the ranks
and function processes doing the work need, sleeping frees the core but answers late.
A *doorbell* is a datagram socket (Linux's abstract namespace, no file) per waiting
thread of a rank: the waiter sleeps in ``select()`` on it, and a rank on the same
machine that has just sent it a message *rings* it (one byte), which wakes it at
once. A ring that finds nobody sleeping stays in the socket and makes the next sleep
return at once, so none is lost; a ring to a rank on another machine finds no socket
and is dropped, and that rank's sleep ends at its timeout (the backoff's delay, at
most 1 ms), as without doorbells.

Slots: every rank's slot :data:`REPLIES` is rung for the messages its requests and
its main loop wait for (answers of servers, requests to a server, tasks to a worker);
the coordinator's slot :data:`RESULTS` is rung by the workers for its dispatcher
thread.
"""

from __future__ import annotations

import select
import socket
import zlib

REPLIES = 0
RESULTS = 1


def address(job: str, rank: int, slot: int) -> bytes:
    """The abstract socket address of ``rank``'s doorbell ``slot`` in job ``job``."""
    return b"\0gpustrat-ps-" + f"{job}-{rank}-{slot}".encode()


def job_id(host: str, pid: int) -> str:
    """A job's name from its coordinator's machine and process (unique while it runs)."""
    return f"{zlib.crc32(host.encode()):08x}-{pid}"


class Doorbell:
    """A doorbell to sleep on (one per waiting thread)."""

    def __init__(self, addr: bytes):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(addr)
        except OSError:
            # No abstract namespace (not Linux) or the name is taken: never rung,
            # every sleep lasts its timeout.
            self.sock.close()
            self.sock = None
            return
        self.sock.setblocking(False)

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    def drain(self) -> bool:
        """Take the rings waiting in the socket; whether there were any."""
        rung = False
        while self.sock is not None:
            try:
                self.sock.recv(64)
                rung = True
            except (BlockingIOError, InterruptedError):
                return rung
            except OSError:
                return rung
        return rung

    def sleep(self, seconds: float, also=None) -> bool:
        """Sleep until rung, ``also`` (a file descriptor) is readable, or ``seconds``
        pass; whether it was rung or ``also`` became readable."""
        fds = [self.sock] if self.sock is not None else []
        if also is not None:
            fds.append(also)
        if not fds:
            select.select([], [], [], seconds)
            return False
        try:
            ready, _, _ = select.select(fds, [], [], seconds)
        except (OSError, ValueError):
            return False
        if not ready:
            return False
        self.drain()
        return True

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class Ringer:
    """Rings other ranks' doorbells (thread-safe: one ``sendto`` per ring)."""

    def __init__(self, job: str):
        self.job = job
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setblocking(False)
        self._addresses: dict = {}

    def ring(self, rank: int, slot: int = REPLIES) -> None:
        addr = self._addresses.get((rank, slot))
        if addr is None:
            addr = self._addresses[(rank, slot)] = address(self.job, rank, slot)
        try:
            self.sock.sendto(b"\1", addr)
        except OSError:
            # Not on this machine, not listening yet, or rings already pending (a full
            # socket): the waiter wakes at its timeout, or at the pending rings.
            pass

    def close(self) -> None:
        self.sock.close()
