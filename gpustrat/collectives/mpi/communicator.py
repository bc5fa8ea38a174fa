"""The data plane: collectives over the CPU replicas of several workers."""

from __future__ import annotations

import math
import sys
from typing import Sequence

import numpy as np

from gpustrat.collectives.base import layout_code
from gpustrat.collectives.host import HostCommunicator, divide
from gpustrat.collectives.mpi import waits as _waits
from gpustrat.collectives.mpi.group import MpiWorkerGroup
from gpustrat.collectives.mpi.header import (_BLOCKING_BYTES, _INLINE, _PACK_PAYLOAD,
                                             _STEP_MASK, ERROR_KIND, AgreedKey, _Channel,
                                             fold_code, kind_code)
from gpustrat.collectives.mpi.waits import (_BOOL_NP_OPS, _MEAN, _NP_OPS, _describe,
                                            input_steps_from_env, reduce_args)
from gpustrat.devices import Device, to_host
from gpustrat.errors import CollectiveMismatch
from gpustrat.reduce_util import ReduceOp

class _Results:
    """Result arrays of large collectives, reused once the caller has let go of them.

    A fresh multi-megabyte array per call costs page faults that take longer than the
    transfer itself. An array handed out is reused only when nothing but this cache
    refers to it (a view, a memoryview or any other holder keeps it out), so a result
    never changes under a caller.
    """

    __slots__ = ("_arrays",)
    _KEEP = 2  # per layout: the result a loop still holds while it asks for the next

    def __init__(self):
        self._arrays: dict = {}

    def get(self, shape: tuple, dtype) -> np.ndarray:
        key = (shape, dtype)
        kept = self._arrays.get(key)
        if kept is None:
            if len(self._arrays) >= 32:
                self._arrays.clear()
            kept = self._arrays[key] = []
        for a in kept:
            if sys.getrefcount(a) == 3:  # `kept`, `a` and getrefcount's argument
                return a
        a = np.empty(shape, dtype)
        if len(kept) < self._KEEP:
            kept.append(a)
        else:
            kept[0] = a
        return a


class _Folded:
    """``with``: an agreement that rides in the header of the first collective issued
    inside (see :meth:`MpiCommunicator.agreeing`); dropped on the way out if none was."""

    __slots__ = ("_ch", "_fold")

    def __init__(self, ch: _Channel, fold: tuple):
        self._ch = ch
        self._fold = fold

    def __enter__(self):
        self._ch.fold = self._fold

    def __exit__(self, *exc):
        self._ch.fold = None


# --- data plane -------------------------------------------------------------------

_REDUCE_KINDS = {op: f"all_reduce({op.name})" for op in ReduceOp}


class MpiCommunicator(HostCommunicator):
    """Collectives over CPU replicas of several workers: local NumPy reduction first
    (HostCommunicator), then the header and one MPI collective between workers.

    Args:
        devices: this worker's CPU devices (every worker must hold the same number).
        workers: the :class:`MpiWorkerGroup` of the job.
    """

    def __init__(self, devices: Sequence[Device], workers: MpiWorkerGroup):
        if not isinstance(workers, MpiWorkerGroup):
            raise TypeError(f"MpiCommunicator needs an MpiWorkerGroup, got "
                            f"{type(workers).__name__}")
        super().__init__(devices)
        gpus = [d.name for d in self.devices if d.is_gpu]
        if gpus:
            raise ValueError(f"MpiCommunicator moves host (NumPy) arrays; devices {gpus} "
                             "are GPUs: use select.make_communicator, which stages GPU "
                             "buffers or uses NCCL")
        self.workers = workers
        self.num_workers = workers.size
        self.worker_index = workers.rank
        # Data collectives get their own communicator: replica threads and input
        # pipeline threads may each be inside a collective at the same moment.
        self._ch = _Channel(workers.dup_comm(), workers.exits)
        if input_steps_from_env():
            self._ch.steps = workers
        self._results = _Results()
        self._plans: dict = {}
        self._last_plan: tuple = (None, None, None, None)
        self._gather_plans: dict = {}
        self._last_gather: tuple = (None, None, None, None)
        self._folds: dict = {}
        self._named: dict = {}
        self._last_named: tuple = (None, None, None, None)
        sizes = workers.allgather(self.num_local)
        if len(set(sizes)) > 1:
            raise ValueError(f"every worker must hold the same number of local replicas, "
                             f"but the workers hold {sizes} (worker i at position i)")

    @staticmethod
    def _check_dtype(x: np.ndarray, what: str) -> None:
        if x.dtype.hasobject:
            raise TypeError(f"{what}: arrays of Python objects (dtype {x.dtype}) cannot "
                            "travel between workers; use a numeric dtype")

    def agree_layout(self, shape, dtype, what, hint=""):
        # Rides with the next collective: its header carries the layout, and this only
        # says how to explain a disagreement (no communication here).
        self._ch.pending = (what() if callable(what) else what, hint, shape)

    def share_error(self, error):
        # Its own kind of collective: it matches another worker's only when that worker
        # found the same error (then each raises its own).
        error._gpustrat_told = True
        ch = self._ch
        ch.pending = ch.fold = None
        try:
            ch.header(f"{ERROR_KIND}{self.workers.rank} failed before this collective: "
                      f"{type(error).__name__}: {error}", 0, 0, None, None, None)
        except CollectiveMismatch:
            pass  # every worker raises; this one its own error

    def agree(self, key, what, hint=""):
        # A header of its own: the layout checksum is the key's. A layout named for the
        # next data collective stays pending for it.
        ch = self._ch
        saved, ch.pending = ch.pending, None
        what = what() if callable(what) else what
        try:
            ch.header(what, layout_code(key, np.uint8), 0, None, AgreedKey(key),
                      np.dtype(np.uint8), hint)
        finally:
            ch.pending = saved

    def agreeing(self, key, what, hint="", also=None):
        # Rides in the header of the first collective inside: no collective of its own.
        # A step's agreement is one code in the header, worked out once per key; its
        # words (key, what, hint) are only read to explain a disagreement. The key a
        # plan keeps (the same tuple every step) is found by identity, without hashing
        # or comparing its strings.
        fold = self._folds.get(id(key))
        if fold is None or fold[1] is not key or fold[2] is not what or \
                fold[3] is not hint:
            fold = self._folds.get(key)
            # (Compared by value: callers often build the same text anew for each call.)
            if fold is None or fold[2] != what or fold[3] != hint:
                if len(self._folds) >= 512:
                    self._folds.clear()
                fold = self._folds[key] = (fold_code(key), key, what, hint)
            # The entry holds the key, so its id is not reused while the entry lives.
            self._folds[id(key)] = fold
        if also is not None:  # its checksum mixed in; described only on a disagreement
            fold = (fold[0] ^ ((also[0] & _STEP_MASK) << 32), key, what, hint, also[1])
        return _Folded(self._ch, fold)

    def reduce(self, buffers, op):
        if type(op) is not ReduceOp:
            op = ReduceOp.from_value(op)
        if len(buffers) == 1:
            x = buffers[0]
            if type(x) is not np.ndarray:
                x = np.asarray(to_host(x))
            # The caller's array is sent as it is (never modified): no copy.
            out = self._allreduce(x, op, owned=False)
            return divide(out, self.num_replicas) if op is _MEAN else out
        return super().reduce(buffers, op)  # local reduction into a new array first

    def reduce_named(self, x: np.ndarray, op: ReduceOp, name: str, hint: str = "",
                     shown=None):
        """``agree_layout(x.shape, x.dtype, name, hint)`` then ``reduce([x], op)`` for one
        host array of numbers, in one call: a payload that rides in the header (a few
        numbers, the loss a loop reduces every step) is packed, exchanged and combined
        here with no other call in between. ``name`` must be the same object for every
        call of a kind (a module constant): the layout's plan is remembered by it.
        ``shown``: the shape an error shows (default ``x.shape``)."""
        ch = self._ch
        shape, dtype = x.shape, x.dtype
        last = self._last_named
        if last[0] is name and last[1] == shape and last[2] is dtype:
            plan = last[3]
        else:
            plan = self._named_plan(x, op, name)
        if plan is None or ch.fold is not None or ch.debug:
            ch.pending = (name, hint, shape if shown is None else shown)
            out = self._allreduce(x, op, owned=False)
            return divide(out, self.num_replicas) if op is _MEAN else out
        code, lcode, nbytes, views, ufunc = plan
        steps = ch.steps
        _PACK_PAYLOAD(ch._sendb, 0, code, lcode,
                      0 if steps is None else (steps.input_steps & _STEP_MASK) << 32,
                      nbytes, x.tobytes())
        if not ch.swap((name, shape, dtype)):
            ch.pending = (name, hint, shape if shown is None else shown)
            ch._disagree(name, shape, dtype, hint)
        # Rank by rank, in rank order, so every rank computes the same bits.
        out = ufunc(views[0], views[1]) if len(views) > 1 else views[0].copy()
        for v in views[2:]:
            out = ufunc(out, v)
        if type(out) is not np.ndarray:  # 0-d operands give a NumPy scalar
            out = np.asarray(out)
        return divide(out, self.num_replicas) if op is _MEAN else out

    def _named_plan(self, x: np.ndarray, op: ReduceOp, name: str):
        """:meth:`reduce_named`'s ``(kind code, layout checksum, bytes, per-rank payload
        views, ufunc)`` for ``x``'s layout, or None when the payload does not ride in
        the header as numbers combined one rank at a time (larger arrays, booleans,
        float16); remembered as the last plan."""
        key = (name, x.shape, x.dtype)
        if key in self._named:
            plan = self._named[key]
        else:
            self._check_dtype(x, name)
            hit, lcode, nbytes, views, _, ufunc = self._plan(x.shape, x.dtype, op)
            plan = None if not views else (kind_code(name), lcode, nbytes, views, ufunc)
            if len(self._named) < 1024:
                self._named[key] = plan
        self._last_named = (name, x.shape, x.dtype, plan)
        return plan

    def all_reduce(self, buffers, op):
        if len(buffers) == 1 and self.num_local == 1:
            return [self.reduce(buffers, op)]  # no other local replica to copy for
        return super().all_reduce(buffers, op)

    def _across_workers_reduce(self, x, op):
        return self._allreduce(x, op, owned=True)

    def _allreduce(self, x: np.ndarray, op: ReduceOp, owned: bool) -> np.ndarray:
        """All-reduce ``x`` between workers (MEAN sums; the caller divides). ``owned``:
        ``x`` may be overwritten and returned."""
        ch = self._ch
        shape, dtype = x.shape, x.dtype
        last = self._last_plan
        # The last layout again (a loop's): compared, not hashed. Plans are keyed by
        # id(op): hashing an Enum member runs Python code, an id does not.
        if last[0] == shape and last[1] is dtype and last[2] is op:
            plan = last[3]
        else:
            plan = self._plans.get((shape, dtype, id(op)))
            if plan is None:
                plan = self._plan(shape, dtype, op)
            self._last_plan = (shape, dtype, op, plan)
        hit, lcode, nbytes, views, kind, ufunc = plan
        small = views is not None
        ch.header(kind, lcode, nbytes, x.tobytes() if small else None, shape, dtype)
        if small:
            if views:
                # Rank by rank, in rank order, so every rank computes the same bits.
                if len(views) == 2:
                    out = ufunc(views[0], views[1])
                else:
                    out = ufunc(views[0], views[1]) if len(views) > 1 else views[0].copy()
                    for v in views[2:]:
                        out = ufunc(out, v)
            else:
                rows = ch.payloads(dtype, shape, nbytes)
                if dtype.kind == "b":
                    out = _BOOL_NP_OPS[op].reduce(rows, axis=0)
                else:  # float16: summed in float32, rounded once
                    out = _NP_OPS[op].reduce(rows, axis=0, dtype=hit[2]).astype(dtype)
            if type(out) is not np.ndarray:  # 0-d operands give a NumPy scalar
                out = np.asarray(out)
        else:
            mtype, mop, up = hit
            if up is not None:
                out = x.astype(up)
                src = _waits._MPI.IN_PLACE
            elif owned and x.flags.c_contiguous and x.flags.writeable:
                out, src = x, _waits._MPI.IN_PLACE
            else:
                out = self._results.get(x.shape, x.dtype)
                src = [x if x.flags.c_contiguous else np.ascontiguousarray(x), mtype]
            if nbytes >= _BLOCKING_BYTES:
                # Every rank's header has arrived, so every rank is in this reduce: the
                # blocking call (as fast as a bare Allreduce) cannot wait on an absent
                # rank, only on one killed during the transfer, which the launcher ends.
                ch.comm.Allreduce(src, [out, mtype], mop)
            else:
                req = ch.comm.Iallreduce(src, [out, mtype], mop)
                if not req.Test():
                    ch.wait(req, (kind, x.shape, x.dtype))
            if up is not None:
                out = out.astype(x.dtype)
        return out

    def _plan(self, shape: tuple, dtype, op: ReduceOp) -> tuple:
        """What a reduce of this layout needs, worked out once: ``(reduce_args, layout
        checksum, bytes, per-rank payload views, kind, NumPy ufunc)``; the views are None
        when the payload does not ride in the header, () when it does but is combined
        as a whole (booleans, float16)."""
        hit = reduce_args(dtype, op)
        nbytes = dtype.itemsize * math.prod(shape)
        views = None
        if nbytes <= _INLINE:
            views = () if hit[2] is not None or dtype.kind == "b" else \
                self._ch.rank_payloads(dtype, shape, nbytes)
        plan = (hit, layout_code(shape, dtype), nbytes, views, _REDUCE_KINDS[op],
                _NP_OPS[op])
        if len(self._plans) < 1024:
            self._plans[(shape, dtype, id(op))] = plan
        return plan

    def gather(self, buffers, axis=0):
        if len(buffers) == 1 and type(buffers[0]) is np.ndarray:
            return self._gather(buffers[0], axis)
        return self.all_gather(buffers, axis)[0]

    def all_gather(self, buffers, axis=0):
        if len(buffers) == 1 and type(buffers[0]) is np.ndarray:
            return [self._gather(buffers[0], axis)]
        bufs = [np.asarray(to_host(b)) for b in buffers]
        local = np.concatenate(bufs, axis=axis) if len(bufs) > 1 else bufs[0]
        out = self._gather(local, axis)
        return [out] + [out.copy() for _ in range(self.num_local - 1)]

    def _across_workers_gather(self, x, axis):
        return self._gather(x, axis)

    def _gather_plan(self, x: np.ndarray, axis: int) -> tuple:
        """``(axis, kind, layout checksum, other axes, bytes per row, the headers' view
        of every rank's rows when they ride there, the result's shape when every rank
        has ``x``'s rows)`` for gathering arrays of ``x``'s layout along ``axis``, checked
        and worked out once."""
        self._check_dtype(x, "all_gather")
        if x.ndim == 0:
            raise ValueError("all_gather concatenates along an axis, but the values are "
                             "scalars: gather x[None] (or reshape to at least 1-D)")
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(f"all_gather axis {axis} is out of range for shape {x.shape}")
        ax = axis % x.ndim
        rest = x.shape[:ax] + x.shape[ax + 1:]
        # Sizes along the gathered axis may differ; the other axes and dtype may not.
        shown = x.shape[:ax] + ("*",) + x.shape[ax + 1:]
        row_bytes = x.dtype.itemsize * math.prod(rest)
        # The same rows on every rank, in the headers: their view and the result's shape.
        front = (x.shape[ax],) + rest
        nbytes = row_bytes * x.shape[ax]
        inline = self._ch.payloads(x.dtype, front, nbytes) if nbytes <= _INLINE else None
        plan = (ax, f"all_gather(axis={ax})", layout_code(shown, x.dtype), rest, row_bytes,
                inline, (self.num_workers * x.shape[ax],) + rest)
        if len(self._gather_plans) < 1024:
            self._gather_plans[(x.shape, x.dtype, axis)] = plan
        return plan

    def _gather(self, x: np.ndarray, axis: int) -> np.ndarray:
        MPI = _waits._MPI
        shape, dtype = x.shape, x.dtype
        last = self._last_gather
        if last[0] == shape and last[1] is dtype and last[2] == axis:
            plan = last[3]
        else:
            plan = self._gather_plans.get((shape, dtype, axis))
            if plan is None:
                plan = self._gather_plan(x, axis)
            self._last_gather = (shape, dtype, axis, plan)
        ax, kind, lcode, rest, row_bytes, inline, same_shape = plan
        front = np.moveaxis(x, ax, 0) if ax else x
        ch = self._ch
        if inline is not None and ch.pending is None and ch.fold is None and not ch.debug:
            # A few numbers: they ride in the header, which is the whole collective.
            steps = ch.steps
            # tobytes writes any layout in C order: no contiguous copy needed.
            _PACK_PAYLOAD(ch._sendb, 0, kind_code(kind), lcode,
                          0 if steps is None else (steps.input_steps & _STEP_MASK) << 32,
                          shape[ax], front.tobytes())
            if not ch.swap((kind, shape, dtype)):
                ch._disagree(kind, shape, dtype, "")
            rows = ch.counts()
            if rows.count(rows[0]) == len(rows):  # every rank has this rank's rows
                out = inline.copy().reshape(same_shape)
                return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out
        else:
            # tobytes writes any layout in C order: a small payload needs no contiguous
            # copy.
            ch.header(kind, lcode, front.shape[0],
                      front.tobytes() if x.nbytes <= _INLINE else None, shape, dtype)
            rows = ch.counts()
        nbytes = x.nbytes
        total, most = sum(rows), max(rows)
        same = most * len(rows) == total  # the same rows everywhere
        if most * row_bytes <= _INLINE:
            if same:  # every rank has this rank's rows: one copy
                out = inline.copy().reshape(same_shape)
            else:
                raw = ch._recv.view(np.uint8)
                out = np.empty((total,) + rest, x.dtype)
                flat = out.reshape(-1).view(np.uint8)
                at = 0
                for r, n in enumerate(rows):
                    nb = n * row_bytes
                    flat[at:at + nb] = raw[r, 32:32 + nb]
                    at += nb
        else:
            out = self._results.get((total,) + rest, x.dtype)
            if not front.flags.c_contiguous:  # also a small one, when others' are not
                front = np.ascontiguousarray(front)
            if same:
                if nbytes >= _BLOCKING_BYTES:
                    # As in _allreduce: every rank is in this gather, so the blocking
                    # call cannot wait on an absent rank.
                    ch.comm.Allgather([front, MPI.BYTE], [out, MPI.BYTE])
                    return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out
                req = ch.comm.Iallgather([front, MPI.BYTE], [out, MPI.BYTE])
            else:
                counts = np.array(rows, np.int64) * row_bytes
                displs = np.zeros(ch.size, np.int64)
                np.cumsum(counts[:-1], out=displs[1:])
                req = ch.comm.Iallgatherv([front, MPI.BYTE],
                                          [out, (counts, displs), MPI.BYTE])
            ch.wait(req, (kind, x.shape, x.dtype))
        return np.ascontiguousarray(np.moveaxis(out, 0, ax)) if ax else out

    def _across_workers_bcast(self, x, root_worker):
        MPI = _waits._MPI
        self._check_dtype(x, "broadcast")
        ch = self._ch
        kind = f"broadcast(root worker {root_worker})"
        buf = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        small = buf.nbytes <= _INLINE
        ch.header(kind, layout_code(x.shape, x.dtype), 0,
                  buf.tobytes() if small and self.worker_index == root_worker else None,
                  x.shape, x.dtype)
        if small:
            # [r, ...]: an array also for 0-d buffers ([r] would give a NumPy scalar).
            return ch.payloads(x.dtype, x.shape, buf.nbytes)[root_worker, ...].copy()
        ch.wait(ch.comm.Ibcast([buf, MPI.BYTE], root=root_worker),
                lambda: _describe(kind, x.shape, x.dtype))
        return buf

    def close(self) -> None:
        self._ch.close()
