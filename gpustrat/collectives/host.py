"""Host collectives: NumPy arrays of logical CPU devices, in one process.

The reduction over local replicas happens here; the step between workers is a hook
(:meth:`HostCommunicator._across_workers_reduce` and friends) that the MPI
communicator fills in, so both share one local path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gpustrat.collectives.base import Communicator
from gpustrat.devices import Device, to_host
from gpustrat.reduce_util import ReduceOp

_NP_OPS = {ReduceOp.SUM: np.add, ReduceOp.MEAN: np.add,
           ReduceOp.MAX: np.maximum, ReduceOp.MIN: np.minimum}


def check_same_layout(buffers: Sequence[np.ndarray], what: str) -> None:
    """Raise ValueError naming the replicas whose shape or dtype differs from replica 0's."""
    s0, d0 = buffers[0].shape, buffers[0].dtype
    for i, b in enumerate(buffers[1:], 1):
        if b.shape != s0 or b.dtype != d0:
            raise ValueError(
                f"{what}: replica 0 has shape {s0} dtype {d0} but replica {i} has shape "
                f"{b.shape} dtype {b.dtype}; every replica must contribute the same shape "
                "and dtype (reduce over an axis, or pad, for partial batches)")


def reduce_arrays(arrays: Sequence[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Element-wise SUM/MAX/MIN (MEAN sums) of same-shaped arrays into a new array."""
    ufunc = _NP_OPS[op]
    out = np.array(arrays[0], copy=True)
    for a in arrays[1:]:
        ufunc(out, a, out=out)
    return out


def divide(x: np.ndarray, n: int) -> np.ndarray:
    """MEAN's final step; integers become floats, as TensorFlow's ``/`` does."""
    if np.issubdtype(x.dtype, np.inexact):
        x /= n
        return x
    return x / n


class HostCommunicator(Communicator):
    """Collectives over local CPU replicas of one worker (NumPy, no copies to share)."""

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)

    # Between-worker hooks: identity for one worker; MpiCommunicator overrides them.
    def _across_workers_reduce(self, x: np.ndarray, op: ReduceOp) -> np.ndarray:
        return x

    def _across_workers_gather(self, x: np.ndarray, axis: int) -> np.ndarray:
        return x

    def _across_workers_bcast(self, x: np.ndarray, root_worker: int) -> np.ndarray:
        return x

    def _replicate(self, x: np.ndarray) -> list:
        # Every replica gets its own array, so an in-place update in one replica's
        # function cannot change another replica's value.
        return [x] + [x.copy() for _ in range(self.num_local - 1)]

    def reduce(self, buffers, op):
        op = ReduceOp.from_value(op)
        bufs = [np.asarray(to_host(b)) for b in buffers]
        check_same_layout(bufs, f"all_reduce({op.name})")
        out = self._across_workers_reduce(reduce_arrays(bufs, op), op)
        return divide(out, self.num_replicas) if op is ReduceOp.MEAN else out

    def all_reduce(self, buffers, op):
        return self._replicate(self.reduce(buffers, op))

    def all_reduce_inplace(self, buffers, op):
        return self._reduce_into_first(buffers, op, shared=False)

    def all_reduce_shared(self, buffers, op):
        return self._reduce_into_first(buffers, op, shared=True)

    def _reduce_into_first(self, buffers, op, shared: bool) -> list:
        """Reduce into replica 0's buffer; the others get a copy of it in their own
        buffer, or (``shared``) that buffer itself, made read-only."""
        if type(op) is not ReduceOp:
            op = ReduceOp.from_value(op)
        bufs = [to_host(b) for b in buffers]
        out = bufs[0]
        flags = out.flags if isinstance(out, np.ndarray) else None
        if flags is None or not (flags.c_contiguous and flags.writeable):
            return self.all_reduce(buffers, op)
        if len(bufs) == 1:  # one replica here (a fusion buffer between workers)
            out = self._across_workers_reduce(out, op)
            return [divide(out, self.num_replicas) if op is ReduceOp.MEAN else out]
        check_same_layout(bufs, f"all_reduce({op.name})")
        ufunc = _NP_OPS[op]
        for b in bufs[1:]:
            ufunc(out, b, out=out)
        out = self._across_workers_reduce(out, op)
        if op is ReduceOp.MEAN:
            out = divide(out, self.num_replicas)
        if shared:
            out = out.view()   # read-only for its readers; the buffer stays writeable
            out.flags.writeable = False
            return [out] * len(bufs)
        results = [out]
        for b in bufs[1:]:
            if b.dtype == out.dtype and b.flags.writeable:
                np.copyto(b, out)
                results.append(b)
            else:  # an integer MEAN became floats
                results.append(out.copy())
        return results

    def all_gather(self, buffers, axis=0):
        bufs = [np.asarray(to_host(b)) for b in buffers]
        local = np.concatenate(bufs, axis=axis) if len(bufs) > 1 else bufs[0].copy()
        return self._replicate(self._across_workers_gather(local, axis))

    def broadcast(self, buffers, root=0):
        if not 0 <= root < self.num_replicas:
            raise ValueError(f"broadcast root {root} is not a replica id "
                             f"(0 .. {self.num_replicas - 1})")
        root_worker, root_local = divmod(root, self.num_local)
        src = np.array(to_host(buffers[root_local]), copy=True)
        return self._replicate(self._across_workers_bcast(src, root_worker))

    def reduce_scatter(self, buffers, op):
        full = self.reduce(buffers, op)
        n = self.num_replicas
        if full.ndim == 0 or full.shape[0] % n:
            raise ValueError(f"reduce_scatter needs axis 0 divisible by {n} replicas, "
                             f"got shape {full.shape}")
        chunks = np.split(full, n, axis=0)
        first = self.worker_index * self.num_local
        return [chunks[first + i].copy() for i in range(self.num_local)]
