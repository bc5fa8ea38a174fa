"""The worker group: every rank of an MPI communicator is a worker."""

from __future__ import annotations

import pickle

import numpy as np

from gpustrat.collectives.base import WorkerGroup, layout_code
from gpustrat.collectives.mpi import stall
from gpustrat.collectives.mpi.exits import _ExitWatch, exits_of
from gpustrat.collectives.mpi.header import _INLINE, _Channel
from gpustrat.collectives.mpi.waits import (_NP_OPS, _OPS, _describe, mpi,
                                            timeout_from_env, wait)
from gpustrat.reduce_util import ReduceOp

# --- workers ------------------------------------------------------------------------

class MpiWorkerGroup(WorkerGroup):
    """Every rank of an MPI communicator is a worker.

    Args:
        comm: an mpi4py intra-communicator (default ``COMM_WORLD``). The group works
            on a duplicate of it, so several groups (strategies) coexist.
    """

    def __init__(self, comm=None):
        MPI = mpi()
        base = MPI.COMM_WORLD if comm is None else comm
        timeout = timeout_from_env()
        dup, req = base.Idup()
        wait(req, "creating a worker group (MPI Idup)", base.Get_rank(), timeout,
             exits_of(base))
        self.comm = dup
        self.exits = _ExitWatch(dup, timeout) if dup.Get_size() > 1 else None
        if self.exits is not None:  # waits of this group survey every rank when stalled
            self.exits.inspector = stall.start(dup, timeout, self.exits)
        self._ch = _Channel(dup, self.exits)
        self.size = self._ch.size
        self.rank = self._ch.rank
        # Ranks sharing memory are one node: the node-local rank picks this worker's GPU.
        self.node_comm = dup.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self._node_rank = self.node_comm.Get_rank()
        self._node_size = self.node_comm.Get_size()

    @property
    def timeout(self) -> float:
        """Seconds any blocking wait of this group may take (``GPUSTRAT_TIMEOUT``)."""
        return self._ch.timeout

    @property
    def debug(self) -> bool:
        return self._ch.debug

    def node_local_rank(self) -> int:
        """This worker's index among the workers of its node (shared-memory domain)."""
        return self._node_rank

    def node_local_size(self) -> int:
        """Number of workers on this worker's node."""
        return self._node_size

    def dup_comm(self):
        """A new duplicate of this group's communicator (collective; deadline-bounded)."""
        dup, req = self.comm.Idup()
        self._ch.wait(req, "duplicating the worker communicator (MPI Idup)")
        return dup

    def allgather(self, obj):
        return self._ch.allgather_obj(obj)

    def allreduce_ints(self, values, op):
        op = ReduceOp.from_value(op)
        if op is ReduceOp.MEAN:
            raise ValueError("allreduce_ints supports SUM, MAX and MIN, not MEAN "
                             "(an integer mean would round): SUM and divide instead")
        buf = np.array(values, dtype=np.int64, order="C")
        ch = self._ch
        kind = f"allreduce_ints({op.name})"
        small = buf.nbytes <= _INLINE
        ch.header(kind, layout_code(buf.shape, buf.dtype), buf.nbytes,
                  buf.tobytes() if small else None, buf.shape, buf.dtype)
        if small:
            return _NP_OPS[op].reduce(ch.payloads(buf.dtype, buf.shape, buf.nbytes), axis=0)
        MPI = mpi()
        ch.wait(ch.comm.Iallreduce(MPI.IN_PLACE, [buf, MPI.INT64_T], getattr(MPI, _OPS[op])),
                lambda: _describe(kind, buf.shape, buf.dtype))
        return buf

    def bcast(self, obj, root=0):
        if not 0 <= root < self.size:
            raise ValueError(f"bcast root {root} is not a rank (0 .. {self.size - 1})")
        MPI = mpi()
        ch = self._ch
        what = f"bcast(root={root})"
        mine = self.rank == root
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if mine else b""
        small = len(data) <= _INLINE
        hdr = ch.header(what, 0, len(data), data if mine and small else None, None, None)
        size = int(hdr[root, 3])
        if size <= _INLINE:
            return obj if mine else pickle.loads(
                ch._recv.view(np.uint8)[root, 32:32 + size].tobytes())
        buf = np.frombuffer(data, np.uint8).copy() if mine else np.empty(size, np.uint8)
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root), what)
        return obj if mine else pickle.loads(buf.tobytes())

    def barrier(self):
        # Every rank's header must arrive before any rank's Allgather completes.
        self._ch.header("barrier", 0, 0, None, None, None)

    def abort(self, code: int = 1) -> None:
        """``MPI_Abort``: the MPI launcher ends every rank of the job."""
        self.comm.Abort(code)

    def concurrent_collectives(self) -> bool:
        MPI = mpi()
        return MPI.Query_thread() >= MPI.THREAD_MULTIPLE

    def duplicate(self) -> "MpiWorkerGroup":
        """A new group on a duplicate of this group's communicator (collective)."""
        return MpiWorkerGroup(self.comm)

    def close(self) -> None:
        """Free the duplicated communicators (collective over the group)."""
        if self.exits is not None:
            if self.exits.inspector is not None:
                self.exits.inspector.close()
            self.exits.close()
            self.exits = None
        for c in (self.node_comm, self.comm):
            if c is not None and c != mpi().COMM_NULL:
                c.Free()
        self.node_comm = self.comm = None
