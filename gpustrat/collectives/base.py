"""The collective interfaces every backend implements.

Words:
- *local replicas*: the replicas of this worker, one per local device, in order.
- *replicas in sync*: every replica of every worker; global replica id =
  ``worker_index * num_local + local_index`` (every worker holds the same number).
- *buffer*: one array per local replica, living on that replica's device (NumPy for
  CPU devices, CuPy for GPUs).

A :class:`Communicator` call is made once per collective, by one thread, with the
buffers of *all* local replicas (the replica threads of ``strategy.run`` meet first and
one of them issues the call). This is the shape NCCL wants (one grouped call over the
local devices) and lets the host and MPI paths reduce locally before going between
workers.
"""

from __future__ import annotations

import abc
import contextlib
import zlib
from typing import Any, Callable, Sequence

import numpy as np

from gpustrat.devices import Device
from gpustrat.reduce_util import ReduceOp


class Communicator(abc.ABC):
    """Data-plane collectives over all replicas in sync."""

    #: Devices of the local replicas, in local replica order.
    devices: list[Device]
    num_workers: int = 1
    worker_index: int = 0

    @property
    def num_local(self) -> int:
        return len(self.devices)

    @property
    def num_replicas(self) -> int:
        return self.num_local * self.num_workers

    def global_replica_id(self, local_index: int) -> int:
        return self.worker_index * self.num_local + local_index

    @abc.abstractmethod
    def all_reduce(self, buffers: Sequence[Any], op: ReduceOp) -> list:
        """Element-wise reduction over every replica in sync.

        Args:
            buffers: one array per local replica, on its device; the same shape and
                dtype on every replica of every worker.
            op: SUM, MEAN (SUM divided by ``num_replicas``), MAX or MIN.
        Returns:
            One new array per local replica, on its device, all equal. Inputs are not
            modified.
        Raises:
            ValueError: local buffers differ in shape or dtype (naming them).
        """

    def all_reduce_inplace(self, buffers: Sequence[Any], op: ReduceOp) -> list:
        """:meth:`all_reduce` that may overwrite ``buffers`` and return them as results.

        For buffers the caller owns and will not read again (fusion buffers): the
        backend can skip allocating and copying a result. The default does neither
        and returns new arrays, which is also correct.
        """
        return self.all_reduce(buffers, op)

    def all_reduce_shared(self, buffers: Sequence[Any], op: ReduceOp) -> list:
        """:meth:`all_reduce_inplace` for a caller that only reads the results: local
        replicas on one host may get one read-only array, the same object for all
        (no copy of the reduction per replica). The default is
        :meth:`all_reduce_inplace`."""
        return self.all_reduce_inplace(buffers, op)

    @abc.abstractmethod
    def all_gather(self, buffers: Sequence[Any], axis: int = 0) -> list:
        """Concatenate every replica's buffer along ``axis``, in global replica order.

        Shapes may differ only along ``axis``. Returns one array per local replica.
        """

    @abc.abstractmethod
    def broadcast(self, buffers: Sequence[Any], root: int = 0) -> list:
        """Every replica receives the buffer of global replica ``root``.

        Non-root buffers give the shape and dtype only. Returns one array per local replica.
        """

    @abc.abstractmethod
    def reduce_scatter(self, buffers: Sequence[Any], op: ReduceOp) -> list:
        """Reduce, then give global replica ``r`` the ``r``-th of ``num_replicas`` equal
        chunks along axis 0 (whose length must divide evenly)."""

    def agree_layout(self, shape, dtype, what: str, hint: str = "") -> None:
        """Check, between workers, that the next collective's buffers have the same shape
        and dtype everywhere; raise ValueError on every worker when they do not.

        Where shapes come from the data (a partial batch gives workers different row
        counts), a reduction over mismatched buffers would combine unrelated bytes or
        break the MPI library. Over MPI the check rides in the header of the next
        collective (this call only names it, at no cost); over NCCL it is one small
        collective between workers; in one process it is nothing, the local buffers
        being compared directly. ``what`` names the operation (a string, or a callable
        returning it) and ``hint`` says what to do, in the message.
        """

    def reduce_named(self, x: Any, op: ReduceOp, name: str, hint: str = "",
                     shown=None) -> Any:
        """:meth:`agree_layout` of ``x`` (named ``name``, with ``hint``; an error shows
        the shape ``shown``, default ``x.shape``) then :meth:`reduce` of ``[x]``: one
        worker-local replica's array. Backends may do both in one step (over MPI a small
        payload rides in the agreement's own header)."""
        self.agree_layout(x.shape if shown is None else shown, x.dtype, name, hint)
        return self.reduce([x], op)

    def share_error(self, error: Exception) -> None:
        """This worker found ``error`` in the arguments of a collective before issuing
        it, where the other workers may already wait in it: make them raise too instead
        of waiting (over MPI: a header of its own, which no data collective's can match,
        so that every worker raises a CollectiveMismatch naming it). The caller then
        raises ``error`` itself. Nothing in one process."""

    def agree(self, key: tuple, what, hint: str = "") -> None:
        """Check, between workers, that every worker passes the same ``key`` (a tuple of
        ints and strings: a layout, a state, a checksum); raise ValueError on every
        worker when they do not.

        Unlike :meth:`agree_layout` this is a collective of its own, for checks that no
        data collective follows (a value every worker must write alike, an error one
        worker found before a reduction). Nothing in one process.
        """
        self.agree_layout(key, np.uint8, what, hint)

    def agreeing(self, key: tuple, what, hint: str = "", also=None):
        """:meth:`agree` on ``key``, as a context manager around the collectives it guards:
        ``with comm.agreeing(key, what): comm.all_reduce_inplace(...)``.

        Where the backend can, the check rides with the first collective issued inside
        the ``with`` (over MPI, in that collective's header) and costs no collective of
        its own; a disagreement still raises on every worker before any data moves.
        Elsewhere it is :meth:`agree`, on entry. Every worker must issue the same first
        collective inside the ``with``.

        ``also``: a second agreement that rides with the first, on state that changes
        from call to call (an optimizer's step count): ``(code, describe)``, where
        ``code`` is a 32-bit checksum the caller keeps (so that nothing is hashed anew
        each call) and ``describe()`` gives its ``(key, what, hint)``, called only to
        explain a disagreement (over MPI) or for a backend's own collective. Workers
        whose keys agree but whose ``also`` do not raise
        :class:`~gpustrat.errors.StateMismatch` with ``describe()``'s words.
        """
        if also is not None:
            extra, extra_what, extra_hint = also[1]()
            key = tuple(key) + tuple(f"{extra_what}: {k}" for k in extra)
            hint = f"{hint}; {extra_hint}" if hint else extra_hint
        self.agree(key, what, hint)
        return _NOTHING

    def reduce_numbers(self, numbers: Sequence[Any], op: ReduceOp):
        """Python numbers (ints, or floats), one per local replica, reduced over every
        replica in sync on the host, with no device involved: the number the all-reduce
        of their 0-d NumPy arrays would hold (int64 or float64 arithmetic; MEAN is a
        true division). Combined here first, then over the workers
        (:meth:`number_group`), in rank order, so every worker gets the same number."""
        a = np.asarray(numbers)
        mean = op is ReduceOp.MEAN
        local = a.max() if op is ReduceOp.MAX else a.min() if op is ReduceOp.MIN else a.sum()
        if self.num_workers > 1:
            parts = np.asarray(self.number_group().allgather(local))
            local = parts.max() if op is ReduceOp.MAX else \
                parts.min() if op is ReduceOp.MIN else parts.sum()
        return (np.true_divide(local, self.num_replicas) if mean else local).item()

    def number_group(self):
        """The :class:`WorkerGroup` :meth:`reduce_numbers` gathers over (backends
        between workers name theirs)."""
        raise NotImplementedError(f"{type(self).__name__} has no worker group for host "
                                  "numbers")

    def reduce(self, buffers: Sequence[Any], op: ReduceOp):
        """The all-reduce result on local replica 0's device only (what
        ``strategy.reduce`` returns). Backends may override to do less work."""
        return self.all_reduce(buffers, op)[0]

    def reduce_checked(self, buffers: Sequence[Any], op: ReduceOp):
        """:meth:`reduce` of buffers the caller has checked: one per local replica, each
        on its replica's device, of one shape and one dtype, and ``op`` a
        :class:`ReduceOp`. Backends may skip their own checks of those."""
        return self.reduce(buffers, op)

    def gather(self, buffers: Sequence[Any], axis: int = 0):
        """The all-gather result on local replica 0's device only (what
        ``strategy.gather`` returns). Backends may override to do less work."""
        return self.all_gather(buffers, axis)[0]

    def close(self) -> None:
        """Release backend resources (NCCL communicators, duplicated MPI comms)."""


_NOTHING = contextlib.nullcontext()


def layout(shape, dtype) -> tuple:
    """``(shape, dtype name)`` with plain ints (a dimension may also be a string such
    as ``"*"``, for "any size")."""
    return (tuple(n if isinstance(n, str) else int(n) for n in shape), str(np.dtype(dtype)))


_layout_codes: dict = {}


def layout_code(shape, dtype) -> int:
    """A 32-bit checksum of ``(shape, dtype)``, equal on every worker for equal layouts
    (remembered: a training loop checks the same few layouts every step)."""
    key = (tuple(shape), dtype)
    code = _layout_codes.get(key)
    if code is None:
        code = zlib.crc32(repr(layout(shape, dtype)).encode())
        if len(_layout_codes) >= 4096:  # keys that change every step (a step count)
            _layout_codes.clear()       # must not keep the loop's own layouts out
        _layout_codes[key] = code
    return code


def _shown(shape) -> str:
    dims = [str(n) for n in shape]
    return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def layout_mismatch_message(what: str, layouts: Sequence[tuple], hint: str) -> str:
    """The text every worker raises: each worker's (shape, dtype), in rank order."""
    parts = "; ".join(f"rank {r}: {_shown(s)} {d}" for r, (s, d) in enumerate(layouts))
    what = what() if callable(what) else what
    return (f"{what}: every worker must contribute the same shape and dtype, but the "
            f"workers hold {parts}" + (f". {hint}" if hint else ""))


def agree_layout_with(max_ints: Callable[[np.ndarray], np.ndarray],
                      gather: Callable[[Any], list], shape, dtype, what, hint: str = "") -> None:
    """:meth:`Communicator.agree_layout` over two collectives between workers: one small
    all-reduce (``max_ints``, element-wise MAX of an int64 vector) when the layouts
    agree, an allgather of them (``gather``) when they do not."""
    code = layout_code(shape, dtype)
    agreed = max_ints(np.array([code, -code], np.int64))
    if agreed[0] == -agreed[1]:  # max == min: one layout everywhere
        return
    raise ValueError(layout_mismatch_message(what, gather(layout(shape, dtype)), hint))


def agree_layout_over(group: "WorkerGroup", shape, dtype, what, hint: str = "") -> None:
    """:func:`agree_layout_with` over a worker group's control collectives."""
    if group.size > 1:
        agree_layout_with(lambda v: group.allreduce_ints(v, ReduceOp.MAX), group.allgather,
                          shape, dtype, what, hint)


class WorkerGroup(abc.ABC):
    """Control-plane collectives between workers (processes), on small host values.

    Every worker must make the same calls in the same order. Implementations put a
    deadline on every blocking wait so that a dead peer gives an error, not a hang.
    """

    size: int = 1
    rank: int = 0
    # Steps this worker has taken from the distributed iterators of strategies on this
    # group (counted where a step is handed to the caller). Data collectives between
    # workers compare it, so that a rank that skipped or added a collective inside an
    # input loop is found at the next collective (see docs/mpi.md).
    input_steps: int = 0

    @abc.abstractmethod
    def allgather(self, obj: Any) -> list:
        """Each worker's ``obj`` (small, picklable), in rank order."""

    @abc.abstractmethod
    def allreduce_ints(self, values: np.ndarray, op: ReduceOp) -> np.ndarray:
        """Element-wise SUM/MAX/MIN of an int64 vector over workers (no pickling)."""

    @abc.abstractmethod
    def bcast(self, obj: Any, root: int = 0) -> Any:
        """``root``'s ``obj`` on every worker."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every worker has arrived."""

    def abort(self, code: int = 1) -> None:
        """Stop every worker of the job (after an unrecoverable error on this one)."""
        raise SystemExit(code)

    def concurrent_collectives(self) -> bool:
        """Whether collectives on two duplicates of this group may run at the same time
        from two threads of a worker (MPI: the library gave ``MPI_THREAD_MULTIPLE``).
        Without it, only one thread at a time may make collectives."""
        return False

    def duplicate(self) -> "WorkerGroup":
        """A group of the same workers whose collectives never interleave with this
        group's (collective: every worker calls it). For control messages sent from
        another thread than this group's users, e.g. a communicator's, called from
        replica threads while the input pipeline agrees on the end of data."""
        return self

    def close(self) -> None:
        """Release the group's resources (collective for groups between processes)."""


class LocalWorkerGroup(WorkerGroup):
    """The single-worker group: every agreement is trivially with oneself."""

    size = 1
    rank = 0

    def allgather(self, obj):
        return [obj]

    def allreduce_ints(self, values, op):
        return np.asarray(values, dtype=np.int64).copy()

    def bcast(self, obj, root=0):
        if root != 0:
            raise ValueError(f"broadcast root {root} out of range for a single worker")
        return obj

    def barrier(self):
        pass
