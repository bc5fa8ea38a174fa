"""``cupy.cuda.nccl`` of the sanitizer: communicators whose calls are ops on streams.

Each rank's call of a collective is an op on the stream it was given, reading its send
range and writing its receive range; the calls of one collective run together once
every rank's call is first in its stream's queue (NCCL kernels wait for their peers),
and a synchronization that waits for a call whose peers never came is a ``hang``.
``abort()`` ends the clique's pending calls, as ``ncclCommAbort`` does.
"""

from __future__ import annotations

import numpy as np

from gpustrat.testing.fake_numba import flat_view
from gpustrat.testing.sanitizer import Sanitizer


class FakeNccl:
    """``cupy.cuda.nccl``: communicators whose calls are ops on the given streams; the
    calls of one collective run together once every rank's call is first in its queue."""

    available = True
    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = range(6)
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = range(5)
    _DTYPES = {0: "int8", 1: "uint8", 2: "int32", 3: "uint32", 4: "int64", 5: "uint64",
               6: "float16", 7: "float32", 8: "float64"}

    class NcclError(RuntimeError):
        pass

    def __init__(self, san: Sanitizer, fake_cupy):
        self.san, self.cupy = san, fake_cupy
        self._cliques: dict = {}
        self._group = 0
        nccl = self

        class NcclCommunicator:
            def __init__(self, ndev, commId, rank):
                self.n, self.rank = int(ndev), int(rank)
                self.dev = nccl.cupy.current_device()
                self.clique = nccl._cliques.setdefault(bytes(commId), {"calls": {}})
                self.calls = 0
                self.aborted = False

            @staticmethod
            def initAll(devices):
                uid = nccl.get_unique_id()
                comms = []
                for r, d in enumerate(devices):
                    with nccl.cupy.cuda.Device(d):
                        comms.append(NcclCommunicator(len(devices), uid, r))
                return comms

            def _call(self, kind, send, sbytes, recv, rbytes, stream, **params):
                if self.aborted:
                    raise nccl.NcclError("ncclInvalidUsage: the communicator was aborted")
                san = nccl.san
                s = san.stream_of_handle(int(stream), self.dev)
                if s.device != self.dev:
                    san.report("device", f"NCCL {kind} of the gpu:{self.dev} communicator "
                               f"issued on {s!r}")
                call = self.clique["calls"].setdefault(self.calls,
                                                       _Collective(self.n, kind, self.clique))
                self.calls += 1
                reads = [san.block_at(send, sbytes)] if sbytes else []
                writes = [san.block_at(recv, rbytes)] if rbytes else []
                reads = [(b, o, o + sbytes) for b, o in reads]
                writes = [(b, o, o + rbytes) for b, o in writes]
                op = san.enqueue(s, f"NCCL {kind}", None, reads, writes, group=call,
                                 count="nccl_calls")
                call.add(self.rank, op, reads, writes, params)

            def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
                nb = count * np.dtype(nccl._DTYPES[datatype]).itemsize
                self._call("allReduce", sendbuf, nb, recvbuf, nb, stream, dtype=datatype, op=op)

            def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
                # Only the root's receive buffer is written (NCCL ignores the others').
                nb = count * np.dtype(nccl._DTYPES[datatype]).itemsize
                self._call("reduce", sendbuf, nb, recvbuf, nb if self.rank == root else 0,
                           stream, dtype=datatype, op=op, root=root)

            def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
                nb = recvcount * np.dtype(nccl._DTYPES[datatype]).itemsize
                self._call("reduceScatter", sendbuf, nb * self.n, recvbuf, nb, stream,
                           dtype=datatype, op=op)

            def broadcast(self, sendbuf, recvbuf, count, datatype, root, stream):
                nb = count * np.dtype(nccl._DTYPES[datatype]).itemsize
                self._call("broadcast", sendbuf, nb if self.rank == root else 0, recvbuf,
                           nb, stream, dtype=datatype, root=root)

            def allGather(self, sendbuf, recvbuf, count, datatype, stream):
                nb = count * np.dtype(nccl._DTYPES[datatype]).itemsize
                self._call("allGather", sendbuf, nb, recvbuf, nb * self.n, stream,
                           dtype=datatype)

            def check_async_error(self):
                pass

            def abort(self):
                # ncclCommAbort ends the clique's pending kernels (their results are
                # garbage): queued calls whose peers never came may run now.
                self.aborted = True
                self.clique["aborted"] = True

            def destroy(self):
                self.aborted = True

            def rank_id(self):
                return self.rank

            def size(self):
                return self.n

            def device_id(self):
                return self.dev

        self.NcclCommunicator = NcclCommunicator

    def get_version(self):
        return 22304

    def get_unique_id(self):
        return bytes(np.random.default_rng(len(self._cliques)).integers(0, 255, 128,
                                                                         dtype=np.uint8))

    def groupStart(self):
        self._group += 1

    def groupEnd(self):
        self._group -= 1


class _Collective:
    """One collective call of a clique: one op per rank, run together."""

    def __init__(self, n: int, kind: str, clique: dict):
        self.n, self.kind, self.clique = n, kind, clique
        self.parts: dict = {}

    def add(self, rank, op, reads, writes, params):
        self.parts[rank] = (op, reads, writes, params)

    def ready(self) -> bool:
        return ((len(self.parts) == self.n or self.clique.get("aborted")) and
                all(op.stream.queue and op.stream.queue[0] is op
                    for op, _, _, _ in self.parts.values()))

    def take(self) -> list:
        return [self.parts[r][0] for r in sorted(self.parts)]

    def run(self) -> None:
        if self.clique.get("aborted"):
            self.parts.clear()
            return
        ranks = sorted(self.parts)
        p0 = self.parts[ranks[0]][3]
        dtype = np.dtype(FakeNccl._DTYPES[p0["dtype"]])
        send = {r: flat_view(*self.parts[r][1][0], dtype) for r in ranks if self.parts[r][1]}
        recv = {r: flat_view(*self.parts[r][2][0], dtype) for r in ranks if self.parts[r][2]}
        if self.kind in ("allReduce", "reduceScatter", "reduce"):
            stack = np.stack([send[r] for r in ranks])
            op = p0["op"]
            if op in (FakeNccl.NCCL_SUM, FakeNccl.NCCL_AVG):
                total = stack[0].copy()
                for row in stack[1:]:
                    total = (total + row).astype(dtype)
                if op == FakeNccl.NCCL_AVG:
                    total = (total / self.n).astype(dtype)
            elif op == FakeNccl.NCCL_PROD:
                total = np.prod(stack, axis=0).astype(dtype)
            else:
                total = (stack.max(axis=0) if op == FakeNccl.NCCL_MAX else stack.min(axis=0))
            for r in ranks:
                if self.kind == "reduce":
                    if r == p0["root"]:
                        recv[r][...] = total
                elif self.kind == "allReduce":
                    recv[r][...] = total
                else:
                    m = recv[r].size
                    recv[r][...] = total[r * m:(r + 1) * m]
        elif self.kind == "broadcast":
            root = p0["root"]
            for r in ranks:
                recv[r][...] = send[root]
        else:
            gathered = np.concatenate([send[r] for r in ranks])
            for r in ranks:
                recv[r][...] = gathered
        self.parts.clear()
