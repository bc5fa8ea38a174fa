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
# Closed groups whose notices went out but whose other ranks have not all closed or
# exited yet: finished when they have (at a later close, a new group, or exit).
_closing: list = []
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
    """Tells the ranks of a group, at once, that one of them has left: exited, died or
    closed its strategy.

    A rank whose script ends (or calls ``sys.exit`` or ``MPI.Finalize``), or that
    closes its strategy, while the others are still inside a collective would
    otherwise leave them waiting the whole ``GPUSTRAT_TIMEOUT``. Every rank keeps one
    receive posted on its own duplicate communicator; when it leaves (at
    :meth:`close`, at interpreter exit, and at ``MPI_Finalize``: an attribute delete
    callback on ``COMM_SELF``, which MPI runs first thing there) it sends a notice to
    every other rank, so that a rank waiting in a collective of this group raises
    within ``_EXIT_GRACE_S``, naming the rank that left and how. Then the leaving rank
    enters a non-blocking barrier; once every rank has left, each receives the others'
    notices and frees the communicator, so no message is left unmatched. A rank that
    closes does not wait for that: its group is finished at a later close, when it
    makes a new group, or at its exit (where MPI_Finalize would wait for the others
    anyway).

    A rank that ends without running any exit code (killed, ``os._exit``) sends nothing:
    a rank waiting in a collective checks every ``_LIVENESS_S`` whether the processes
    of its peers on the same node still run (``/proc``), and raises naming the one that
    is gone. Leaving costs each rank ``size - 1`` sends and receives of one integer;
    nothing is spent while collectives complete without waiting.
    """

    def __init__(self, comm, timeout: float):
        MPI = mpi()
        _finish_closed(block=False)
        dup, req = comm.Idup()
        wait(req, "creating a worker group (MPI Idup)", comm.Get_rank(), timeout,
             exits_of(comm))
        self.comm = dup
        self.size = dup.Get_size()
        rank = dup.Get_rank()
        ids = _Channel(dup).allgather_raw(_process_id(), "creating a worker group")
        host, ns = ids[rank][:2]
        self._local_peers = [(r, pid, start) for r, (h, n, pid, start) in enumerate(ids)
                             if r != rank and h == host and n == ns and n is not None
                             and start is not None]
        self._next_check = 0.0
        self._buf = np.zeros(1, np.int64)  # the first notice: _CLOSED or _EXITED
        self._status = MPI.Status()
        self._req = dup.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=0)
        self._sends: list = []
        self._barrier = None
        self.gone: int | None = None
        self.died = False
        _watches[id(self)] = self
        _install_exit_hooks()

    def poll(self) -> int | None:
        """The rank that has left (exited, died or closed), once one has; else None."""
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
        if self._buf[0] == _CLOSED:
            return f"rank {self.gone} has closed its strategy (strategy.close())"
        return (f"rank {self.gone} has exited (its script ended, returned from main, or "
                "called sys.exit or MPI.Finalize)")

    def close(self) -> None:
        """Tell the other ranks that this rank has closed the group; the communicator is
        freed once they all have closed or exited (see the class docstring)."""
        if _watches.pop(id(self), None) is None:
            return
        if _waits._MPI is None or _waits._MPI.Is_finalized():
            return  # MPI has ended: nothing is left to free
        if self.died:
            # A peer is gone without its notices: nobody would finish the barrier.
            self._req.Cancel()
            self._req.Wait()
            self.comm.Free()
            return
        self._notify(_CLOSED)
        self._barrier = self.comm.Ibarrier()
        _closing.append(self)
        _finish_closed(block=False)

    def _notify(self, kind: int) -> None:
        MPI = _waits._MPI
        me = self.comm.Get_rank()
        self._note = np.array([kind], np.int64)
        self._sends = [self.comm.Isend([self._note, MPI.INT64_T], dest=r, tag=0)
                       for r in range(self.size) if r != me]

    def _finish(self) -> None:
        """After the barrier: receive the other ranks' notices and free the group."""
        MPI = _waits._MPI
        self._req.Wait()
        for _ in range(self.size - 2):
            self.comm.Recv([np.empty(1, np.int64), MPI.INT64_T], source=MPI.ANY_SOURCE,
                           tag=0)
        MPI.Request.Waitall(self._sends)
        self.comm.Free()


_EXITED, _CLOSED = 0, 1


class _Watches:
    """The watches of open groups over the same ranks as a communicator, polled as one
    (for a wait on that communicator before its own group has a watch): a rank that
    exited or died is reported; one that only closed an older strategy is not."""

    def __init__(self, watches: list):
        self._watches = watches
        self._gone = None

    def poll(self) -> int | None:
        if self._gone is None:
            for w in self._watches:
                if w.poll() is not None and (w.died or w._buf[0] != _CLOSED):
                    self._gone = w
                    break
        return None if self._gone is None else self._gone.gone

    def reason(self) -> str:
        return self._gone.reason()


def exits_of(comm) -> "_Watches | None":
    """What tells of a rank of ``comm`` that left, before a group on it has its own
    watch: the open groups' watches whose ranks are ``comm``'s (None if there are none)."""
    MPI = mpi()
    same = [w for w in _watches.values()
            if MPI.Comm.Compare(w.comm, comm) in (MPI.IDENT, MPI.CONGRUENT)]
    return _Watches(same) if same else None


def _finish_closed(block: bool) -> None:
    """Finish the closed groups whose ranks have all left (every one with ``block``)."""
    if not _closing or _waits._MPI is None or _waits._MPI.Is_finalized():
        return
    for w in list(_closing):
        if block:
            wait(w._barrier, "waiting at exit for the other ranks to exit or close their "
                 "strategies", w.comm.Get_rank(), float("inf"))
        elif not w._barrier.Test():
            continue
        _closing.remove(w)
        w._finish()


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
    """Tell every open group's other ranks that this rank is leaving, and finish every
    group once all its ranks have left."""
    if _waits._MPI is None or _waits._MPI.Is_finalized():
        return
    watches = list(_watches.values())
    _watches.clear()
    for w in watches:
        w._notify(_EXITED)
    # Every notice is sent before any barrier, so the barriers (on different
    # communicators, in any order) cannot wait on each other.
    for w in watches:
        w._barrier = w.comm.Ibarrier()
    _closing.extend(watches)
    _finish_closed(block=True)
