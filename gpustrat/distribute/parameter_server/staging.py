"""Update slots: shared memory through which a rank hands its updates to a server on
the same machine.

Words:
- *slot*: a region of ``SLOT_BYTES`` in a shared-memory window that a server
  allocates (``MPI_Win_allocate_shared`` over the ranks of its machine). Each other
  rank of that machine has two slots at each such server, used in turn.
- *staged update*: an ``assign_add`` or ``assign_sub`` whose value fits a slot. The
  caller copies the value into its next slot and sends only the request's 32-byte
  header (its code carries :data:`STAGED`, the slot's number and the slot's use
  count); the server acknowledges it, adds straight from the slot into the variable
  and then *releases* the slot (writes the use count beside it). Through MPI the
  value would be copied into a buffer of the server (by the server) and then added
  from there: staged, the server reads it once, and the caller's copy of the next
  update overlaps the server's addition of this one (the other slot). A caller
  writes a slot again only after the server released it.

A value larger than a slot, a server on another machine, a second thread of the
caller while the first holds the slots, or an MPI library without shared windows:
the update goes through MPI as before (see :meth:`.channel.Channel._fast`).

The same window holds, for every rank of the machine, the number of its threads
asleep in a counted wait (:meth:`Staging.counted`): a caller waiting for the
acknowledgement of an update, a server waiting for requests. A server rings a
caller's doorbell after acknowledging an update, and a caller rings a server's after
sending a read or an update, only when that number is not 0: both spin a while before
they sleep, and a ring costs a system call on each side. A waiter counts itself, then
looks for what it waits for once more before it sleeps, and the sender reads the count
after its message went out (each behind a memory barrier), so no wait sleeps through
what it waits for.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np

#: Marks a staged update in a fast request's code: bits 0-2 the operation, bit 4 the
#: slot's number, bits 5 on the slot's use count (this use included).
STAGED = 8
#: Bytes of a slot (at most; see _slot_bytes): updates up to this size are staged.
SLOT_BYTES = 4 << 20
#: Before the slots of a region: the use count that last released each slot.
_HEAD = 64
#: At the start of every rank's part of the window: its count of sleeping waiters.
_BELL = 64


class Staging:
    """This rank's slots at the servers of its machine (as a caller) and, on a server,
    everybody's slots here. Made by every rank of ``comm`` at once (a collective)."""

    def __init__(self, comm, server_ranks: list, MPI):
        me = comm.Get_rank()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        ranks = node.allgather(me)  # the channel rank of each rank of this machine
        size = 0
        if me in server_ranks:
            slot = _slot_bytes(len(ranks), sum(r in server_ranks for r in ranks))
            size = (_HEAD + 2 * slot) * len(ranks) if slot else 0
        self.win = MPI.Win.Allocate_shared(_BELL + size, 1, comm=node)
        self.win.Lock_all(MPI.MODE_NOCHECK)  # Sync (a memory barrier) needs an epoch
        mine = ranks.index(me)
        self._me = me
        #: server rank -> [its region for this rank, the use counts that released each
        #: slot, the slot to use next, the use count of each slot, the slots' size]
        self._out: dict = {}
        self._locks: dict = {}
        #: on a server: caller rank -> its region here; the slots' size
        self._in: dict = {}
        self._slot = 0
        #: rank of this machine -> its count of sleeping waiters (see counted)
        self._sleepers: dict = {}
        self._sleep_lock = threading.Lock()
        for i, rank in enumerate(ranks):
            mem, _ = self.win.Shared_query(i)
            whole = np.frombuffer(mem, np.uint8)
            self._sleepers[rank] = whole[:4].view(np.int32)
            if rank == me:
                self._sleepers[rank][0] = 0  # shared memory starts undefined
            if rank not in server_ranks:
                continue
            whole = whole[_BELL:]
            region = len(whole) // len(ranks)
            if region == 0:  # no slots at this server
                continue
            slot = (region - _HEAD) // 2
            if rank == me:
                self._slot = slot
                self._in = {r: whole[j * region:(j + 1) * region]
                            for j, r in enumerate(ranks) if r != me}
            else:
                mem = whole[mine * region:(mine + 1) * region]
                self._out[rank] = [mem, mem[:16].view(np.int64), 0, [0, 0], slot]
                self._locks[rank] = threading.Lock()
        self.win.Sync()
        node.Barrier()  # every count is 0 before anybody reads one

    # --- the caller ---------------------------------------------------------------
    def put(self, dest: int, code: int, value: np.ndarray, timeout: float):
        """Copy ``value`` (C-contiguous) of request ``code`` (assign_add or _sub) into
        this rank's next slot at server ``dest`` and return the staged request's code,
        holding the slots until :meth:`done`; None when it is not staged (see the
        module docstring). A server that has not released the slot within ``timeout``
        seconds: TimeoutError."""
        lock = self._locks.get(dest)
        if lock is None or not 0 < value.nbytes <= self._out[dest][4] or \
                not lock.acquire(blocking=False):
            return None
        try:
            out = self._out[dest]
            region, released, n, uses, slot = out
            if uses[n]:
                self._wait_released(released, n, uses[n], timeout)
            start = _HEAD + n * slot
            np.copyto(region[start:start + value.nbytes], value.reshape(-1).view(np.uint8))
            uses[n] += 1
            out[2] = 1 - n
            self.win.Sync()  # the bytes before the header that announces them
            return code | STAGED | n << 4 | uses[n] << 5
        except BaseException:
            lock.release()
            raise

    def done(self, dest: int) -> None:
        """The staged request to ``dest`` was answered (or failed)."""
        self._locks[dest].release()

    def _wait_released(self, released, n: int, count: int, timeout: float) -> None:
        sync = self.win.Sync
        deadline = None
        while True:
            sync()
            if released[n] == count:
                return
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now > deadline:
                raise TimeoutError
            time.sleep(0)

    def counted(self, sleep, answered):
        """``sleep`` (a doorbell's ``sleep(seconds)``) for a thread in a counted wait:
        the thread is counted while it sleeps, and ``answered()`` (whether what it waits
        for came) is checked once more after counting; True at once if it says so."""
        count = self._sleepers[self._me]

        def counted_sleep(seconds: float) -> bool:
            with self._sleep_lock:
                count[0] += 1
            try:
                self.win.Sync()  # counted before looking again (see the module docstring)
                if answered():
                    return True
                return sleep(seconds)
            finally:
                with self._sleep_lock:
                    count[0] -= 1
        return counted_sleep

    def may_sleep(self, rank: int) -> bool:
        """Whether a thread of ``rank`` may be asleep in a counted wait (True for a rank
        of another machine: its doorbell cannot be rung anyway)."""
        count = self._sleepers.get(rank)
        if count is None:
            return True
        self.win.Sync()  # the answer went out before the count is read
        return count[0] > 0

    # --- the server ---------------------------------------------------------------
    def incoming(self, source: int, code: int, nbytes: int) -> np.ndarray:
        """The bytes of ``source``'s staged update ``code``."""
        self.win.Sync()  # the header came: its bytes are there
        start = _HEAD + (code >> 4 & 1) * self._slot
        return self._in[source][start:start + nbytes]

    def release(self, source: int, code: int) -> None:
        """Done with the slot of ``source``'s staged update ``code``."""
        self._in[source][:16].view(np.int64)[code >> 4 & 1] = code >> 5
        self.win.Sync()


def _slot_bytes(ranks: int, servers: int) -> int:
    """The slots' size at a server of a machine with ``ranks`` ranks, ``servers`` of
    them servers: ``SLOT_BYTES``, less where every rank filling both its slots at
    every server would take more than half the free shared memory (``/dev/shm``, a
    few tens of MiB in some containers: a page that finds none there kills the
    process). Pages of a slot are taken only when an update first fills them."""
    slot = SLOT_BYTES
    try:
        st = os.statvfs("/dev/shm")
        slot = min(slot, st.f_bavail * st.f_frsize // (4 * ranks * servers))
    except OSError:  # no /dev/shm: the MPI library keeps shared memory elsewhere
        pass
    return max(slot, 0) // _HEAD * _HEAD


def open_staging(comm, server_ranks: list, MPI) -> Staging | None:
    """The update slots of this rank (a collective over ``comm``); None where the MPI
    library has no shared-memory windows."""
    try:
        return Staging(comm, server_ranks, MPI)
    except (MPI.Exception, NotImplementedError):
        return None
