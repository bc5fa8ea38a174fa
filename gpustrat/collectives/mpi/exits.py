"""Telling the ranks of a group at once that one of them has exited or died."""

from __future__ import annotations

import os
import time

import numpy as np

from gpustrat.collectives.mpi import waits as _waits
from gpustrat.collectives.mpi.header import _Channel
from gpustrat.collectives.mpi.waits import mpi, wait

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
    if not _watches or _waits._MPI is None or _waits._MPI.Is_finalized():
        return
    MPI = _waits._MPI
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
