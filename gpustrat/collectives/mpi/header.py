"""The 64-byte header that every collective between workers starts with: one channel
(a duplicated communicator) with deadline waits and the agreement of every rank."""

from __future__ import annotations

import os
import pickle
import struct
import sys
import zlib
from typing import Any

import numpy as np

from gpustrat import timeline as _tl
from gpustrat.collectives.mpi import waits as _waits
from gpustrat.collectives.mpi.waits import (ENV_DEBUG, ENV_INPUT_STEPS, _describe, _name,
                                            _shown, debug_from_env, mpi, timeout_from_env,
                                            wait)
from gpustrat.errors import (CollectiveMismatch, CollectiveTimeout, LayoutMismatch,
                             StateMismatch)

# --- the header every collective starts with ----------------------------------------

# Every collective between workers starts with one Allgather of a fixed 64-byte record
# per rank (a persistent request: starting it is one MPI call), eight int64 slots:
#   0     the kind of collective: a checksum of its name, e.g. "all_reduce(SUM)"
#   1     low 32 bits: a checksum of the layout (shape and dtype; "*" where sizes may
#         differ); high 32 bits: a checksum of an agreement folded into this collective
#         (see _Channel.fold), else 0
#   2     low 32 bits: debug mode: a checksum of the calling line of user code; else 0
#         high 32 bits: the data channel's input step (steps this worker has taken from
#         distributed iterators, modulo 2**31); 0 on control channels
#   3     a size that may differ between ranks (rows of a gather, bytes of a pickle)
#   4..7  the payload itself when it fits in 32 bytes (a few numbers)
# Slots 0-2 must be equal on every rank. Every rank sees every header, so all take the
# same branch: go on with the data collective, which then pairs with its like on every
# rank (or, for a payload that rode in the header, combine the headers' payloads
# locally: one collective in all), or raise the same error on every rank.
_SLOTS = 8
_INLINE = 32
# Reduces and equal-size gathers of at least this many bytes per rank use the blocking
# MPI call once the headers agree: MPICH runs its non-blocking ones up to a third slower.
_BLOCKING_BYTES = 1 << 16
_AGREE = 24  # leading bytes of a header that every rank must share
_PACK = struct.Struct("=4q").pack_into
_PACK_PAYLOAD = struct.Struct(f"=4q{_INLINE}s").pack_into
_STEP_MASK = 0x7FFFFFFF  # the input step travels modulo 2**31 in slot 2's high half
_QUICK = range(64)  # Tests before a header's wait is handed to waits.wait


#: How the header of :meth:`MpiCommunicator.share_error` names itself: a worker that
#: found an error in a collective's arguments tells the workers waiting in it.
ERROR_KIND = "no collective: worker "


#: What a disagreement's description holds for the dtype of an agreement on a key.
_KEY = "key"


def _call(kind: str, shown, dtype) -> str:
    """A collective as a disagreement names it: its kind and layout, or its kind and the
    key it agrees on."""
    return f"{kind} {shown}" if dtype == _KEY else _describe(kind, shown, dtype)


class AgreedKey(tuple):
    """The key of an agreement (``Communicator.agree``) where a header's layout would
    be: a disagreement names each worker's key, not a shape and dtype."""

    __slots__ = ()


def fold_code(key: tuple) -> int:
    """The checksum of an agreement ``key`` as it travels in slot 1's high half."""
    return (zlib.crc32(repr(key).encode()) & _STEP_MASK) << 32

_kind_codes: dict = {}


def kind_code(kind: str) -> int:
    """The checksum of a collective's name that travels in slot 0 (remembered)."""
    code = _kind_codes.get(kind)
    if code is None:
        code = _kind_codes[kind] = zlib.crc32(kind.encode())
    return code


# The public calls a collective can serve, by the qualified name of their function, so
# that an error names what the user called.
_PUBLIC = {
    "Strategy.reduce": "strategy.reduce", "Strategy.gather": "strategy.gather",
    "MultiWorkerMirroredStrategy.reduce": "strategy.reduce",
    "MultiWorkerMirroredStrategy.gather": "strategy.gather",
    "ReplicaContext.all_reduce": "all_reduce in strategy.run",
    "ReplicaContext.all_gather": "all_gather in strategy.run",
    "agreed_steps": "the input pipeline's end-of-data agreement",
    "MpiCommunicator.__init__": "creating a strategy",
    "MultiWorkerMirroredStrategy.__init__": "creating a strategy",
}
_PKG = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep


def _caller() -> tuple:
    """``(public call, "file:line" of the user code that made it)`` for this collective:
    the outermost gpustrat function users call on the stack, and the first frame of
    user code beyond it (either may be None)."""
    f = sys._getframe(1)
    public = None
    while f is not None:
        code = f.f_code
        name = code.co_filename
        if name.startswith(_PKG):
            public = _PUBLIC.get(getattr(code, "co_qualname", code.co_name), public)
        elif not name.startswith(_STDLIB) or "site-packages" in name:
            return public, f"{name}:{f.f_lineno}"
        f = f.f_back
    return public, None


def _site_code() -> int:
    site = _caller()[1]
    return 0 if site is None else zlib.crc32(site.encode())


def _fold_message(folds: list) -> str:
    """What every rank raises when the agreements folded into a header differ:
    ``folds[r]`` is rank r's ``(key, what, hint)``, or None where rank r folded none."""
    what, hint = next((f[1], f[2]) for f in folds if f is not None)
    keys = [None if f is None else f[0] for f in folds]
    longest = max(len(k) for k in keys if k is not None)

    # Where the ranks agree for different callers, each rank's caller is named too.
    whats = {f[1] for f in folds if f is not None}
    callers = [f" ({f[1]})" if len(whats) > 1 and f is not None else "" for f in folds]

    def entry(k, at):
        return "missing" if k is None or at >= len(k) else k[at]
    if longest <= 8:
        held = "; ".join(f"rank {r}{c}: " + ("nothing to agree on (another call)"
                                             if k is None else f"({', '.join(map(str, k))})")
                         for r, (k, c) in enumerate(zip(keys, callers)))
    else:  # long lists: their lengths and the first place they differ
        at = next(i for i in range(longest) if len({entry(k, i) for k in keys}) > 1)
        held = "; ".join(f"rank {r}{c}: {0 if k is None else len(k)} entries, entry {at} "
                         f"{entry(k, at)}" for r, (k, c) in enumerate(zip(keys, callers)))
    return f"{what}: the workers disagree: {held}" + (f". {hint}" if hint else "")


class _Channel:
    """One MPI communicator with deadline waits and the header agreement."""

    __slots__ = ("comm", "rank", "size", "timeout", "debug", "calls", "exits", "pending",
                 "fold", "steps", "broken", "_send", "_recv", "_sendb", "_offsets", "_req",
                 "_views", "_counts")

    def __init__(self, comm, exits: "_ExitWatch | None" = None):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout_from_env()
        self.debug = debug_from_env()
        self.calls = 0
        self.exits = exits
        # (what, hint, shape shown) of the next collective, for its layout error.
        self.pending = None
        # (fold_code(key), key, what, hint[, describe]): an agreement that rides in the
        # next header (slot 1's high half), so that it costs no collective of its own;
        # ``describe()`` gives the (key, what, hint) of a second agreement whose
        # checksum is mixed into the code (MpiCommunicator.agreeing's ``also``).
        self.fold = None
        # The worker group whose input_steps every header carries (data channels), or
        # None (control channels: the end-of-data agreement runs inside next()).
        self.steps = None
        #: Why the channel cannot be used any more (a collective left waiting), or None.
        self.broken: str | None = None
        self._send = np.zeros(_SLOTS, np.int64)
        self._recv = np.zeros((self.size, _SLOTS), np.int64)
        self._sendb = memoryview(self._send).cast("B")
        rec = 8 * _SLOTS
        self._offsets = range(rec, rec * self.size, rec)
        self._req = None
        self._views: dict = {}
        # Slot 3 of every rank's record, read straight from the received headers.
        self._counts = struct.Struct("=" + "24xq32x" * self.size).unpack_from

    def wait(self, request, what) -> None:
        try:
            wait(request, what, self.rank, self.timeout, self.exits)
        except CollectiveTimeout as e:
            self._abandon(e)
            raise

    def _abandon(self, error: CollectiveTimeout) -> None:
        """A collective was left waiting: MPI cannot take it back, so none of this
        channel's collectives can run again (they would pair with it)."""
        if self.broken is None:
            self.broken = str(error).split(". ", 1)[0]

    def _check_usable(self, what) -> None:
        if self.comm is None:
            raise RuntimeError(f"{_name(what)}: this strategy (or worker group) was closed; "
                               "make a new one to run collectives again")
        if self.broken is not None:
            raise CollectiveTimeout(
                f"{_name(what)} cannot run on rank {self.rank}: an earlier collective of "
                f"this strategy did not complete ({self.broken}), and MPI cannot take it "
                "back, so no later one can run on it. End the job on every rank and "
                "restart it (restoring from a checkpoint); a retry inside the job cannot "
                "work")

    def header(self, kind: str, layout: int, count: int, payload, shape, dtype,
               hint: str = "") -> np.ndarray:
        """Allgather this rank's header; return every rank's (a ``(size, 8)`` int64 array
        that the next collective overwrites), or raise the same error on every rank when
        they disagree.

        ``payload``: bytes (at most 32) that ride in the header, or None. ``shape``,
        ``dtype`` and ``hint`` are only used to explain a disagreement.
        """
        pending = self.pending
        if pending is not None:  # the public call's own name, e.g. reduce(SUM, axis=0)
            kind = pending[0]
            shape = pending[2]
        steps = self.steps
        mark = 0 if steps is None else (steps.input_steps & _STEP_MASK) << 32
        if self.debug:
            mark |= _site_code()
        fold = self.fold
        if fold is not None:
            layout |= fold[0]
        code = _kind_codes.get(kind)
        if code is None:
            code = kind_code(kind)
        if payload is None:
            _PACK(self._sendb, 0, code, layout, mark, count)
        else:  # one call writes the payload too (zero-padded to 32 bytes)
            _PACK_PAYLOAD(self._sendb, 0, code, layout, mark, count, payload)
        if not self.swap((kind, shape, dtype)):
            self._disagree(kind, shape, dtype, hint)
        if pending is not None or fold is not None:
            self.pending = self.fold = None
        return self._recv

    def swap(self, what) -> bool:
        """Allgather the header already packed in the send buffer; whether every rank's
        leading slots equal this rank's. ``what`` names the collective if the wait times
        out (see :func:`waits.wait`)."""
        self.calls += 1
        t0 = _tl.now() if _tl.ON else 0  # the wait for every rank's header
        req = self._req
        if req is None or self.broken is not None:
            self._check_usable(what)
            req = self._req = self.comm.Allgather_init([self._send, _waits._MPI.INT64_T],
                                                       [self._recv, _waits._MPI.INT64_T])
        req.Start()
        test = req.Test
        for _ in _QUICK:  # a peer already there is met without a call into wait
            if test():
                break
        else:
            try:
                wait(req, what, self.rank, self.timeout, self.exits)
            except CollectiveTimeout as e:
                self._abandon(e)
                raise
        if t0:
            _tl.peer_wait(t0, what)
        raw = self._recv.tobytes()
        ref = raw[:_AGREE]
        if self.size == 2:
            return raw[64:64 + _AGREE] == ref
        for off in self._offsets:
            if raw[off:off + _AGREE] != ref:
                return False
        return True

    def counts(self) -> tuple:
        """Every rank's slot 3 (the size that may differ) in the last headers."""
        return self._counts(self._recv)

    def _disagree(self, kind: str, shape, dtype, hint: str) -> None:
        """Raise on every rank: every rank saw the same headers, so all come here and
        make the same allgather of their descriptions."""
        hdr = self._recv
        kinds = (hdr[:, 0] != hdr[0, 0]).any()
        layouts = (hdr[:, 1] != hdr[0, 1]).any()
        pending, self.pending = self.pending, None
        fold, self.fold = self.fold, None
        what = kind
        if pending is not None:
            hint = pending[1]
        public, site = _caller()
        mine = (kind, what, None if shape is None else _shown(shape),
                None if dtype is None else _KEY if isinstance(shape, AgreedKey) else
                str(dtype), public, site,
                None if fold is None else
                (fold[1], fold[2]() if callable(fold[2]) else fold[2], fold[3],
                 fold[4]() if len(fold) > 4 else None))
        gathered = self.allgather_raw(mine, "describing collectives that disagree")
        infos = [info[:6] for info in gathered]
        folds = [info[6] for info in gathered]
        n = self.calls
        steps = (hdr[:, 2] >> 32).tolist()
        if len(set(steps)) > 1:
            # Ranks at different input steps: whatever they called, one of them skipped
            # or added a collective inside the input loop (the calls are shown too).
            at = ", ".join(f"rank {r} at input step {s}" for r, s in enumerate(steps))
            parts = []
            for r, (k, w, s, d, pub, site) in enumerate(infos):
                text = f"{pub} [{_call(k, s, d)}]" if pub else _call(k, s, d)
                parts.append(f"rank {r} called {text}" + (f" at {site}" if site else ""))
            raise CollectiveMismatch(
                f"{at}: a rank skipped or added a collective (collective #{n} of this "
                "communicator on this rank; input steps count the steps each worker has "
                "taken from distributed datasets: " + "; ".join(parts) + "). Every rank "
                "must make the same collective calls in the same order on every step; a "
                "program that takes steps in one thread while another makes collectives "
                f"can turn this check off with {ENV_INPUT_STEPS}=0")
        failed = [k[len(ERROR_KIND):] for k, *_ in infos if k.startswith(ERROR_KIND)]
        if failed:
            # A worker found an error before joining (a partial batch reduced with
            # axis=None, its replicas' collectives differing): every worker raises it.
            raise LayoutMismatch(
                "; ".join(f"worker {f}" for f in failed) + f" (collective #{n} of this "
                "communicator, which the other workers had joined); every worker raises "
                "this error")
        if kinds or not layouts:
            parts = []
            for r, (k, w, s, d, pub, at) in enumerate(infos):
                # A collective carrying a folded agreement is named by its caller.
                pub = folds[r][1] if folds[r] is not None else pub
                text = f"{pub} [{_call(k, s, d)}]" if pub else _call(k, s, d)
                parts.append(f"rank {r} called {text}" + (f" at {at}" if at else ""))
            why = ("" if kinds else " (the same collective from different lines of "
                   f"code, which {ENV_DEBUG}=1 reports)")
            raise CollectiveMismatch(
                f"workers called different collectives at collective #{n} of this "
                f"communicator{why}: " + "; ".join(parts) + ". Every rank must make the "
                "same collective calls, with the same shapes and dtypes, in the same "
                "order (a branch on rank-local data, or a rank that skipped a call?)")
        keys = [None if f is None else f[0] for f in folds]
        if any(k != keys[0] for k in keys):
            raise LayoutMismatch(_fold_message(folds))
        alsos = [None if f is None else f[3] for f in folds]
        if any(a != alsos[0] for a in alsos):  # the same values, other state
            raise StateMismatch(_fold_message(alsos))
        layouts = [(s, d) for _, _, s, d, _, _ in infos]
        if isinstance(shape, AgreedKey):  # every rank made this agreement (same kind)
            raise LayoutMismatch(
                f"{what}: the workers disagree: " + "; ".join(
                    f"rank {r}: {s}" for r, (s, _) in enumerate(layouts))
                + (f". {hint}" if hint else ""))
        parts = "; ".join(f"rank {r}: {s} {d}" for r, (s, d) in enumerate(layouts))
        if kind.startswith("all_gather"):
            raise LayoutMismatch(
                f"{what} between workers: shapes may differ only along the gathered axis "
                f"and dtypes must match, but the workers hold {parts}. Cast and reshape "
                "the values the same way on every worker")
        raise LayoutMismatch(f"{what}: every worker must contribute the same shape and "
                             f"dtype, but the workers hold {parts}"
                             + (f". {hint}" if hint else ""))

    def payloads(self, dtype, shape, nbytes: int) -> np.ndarray:
        """Every rank's inline payload, as a ``(size,) + shape`` view of the headers
        (remembered: the headers' buffer lives as long as the channel)."""
        key = (dtype, shape)
        view = self._views.get(key)
        if view is None:
            rows = self._recv.view(np.uint8)[:, 32:32 + nbytes]
            view = rows.view(dtype).reshape((self.size,) + tuple(shape))
            if len(self._views) < 256:
                self._views[key] = view
        return view

    def rank_payloads(self, dtype, shape, nbytes: int) -> tuple:
        """:meth:`payloads` as one view per rank (remembered)."""
        key = (dtype, shape, "ranks")
        views = self._views.get(key)
        if views is None:
            rows = self.payloads(dtype, shape, nbytes)
            views = tuple(rows[r:r + 1].reshape(shape) for r in range(self.size))
            if len(self._views) < 256:
                self._views[key] = views
        return views

    def allgather_raw(self, obj: Any, what) -> list:
        """Every rank's picklable ``obj``: sizes, then the pickles in one Iallgatherv
        (no header: for explaining a disagreement that every rank has seen)."""
        MPI = mpi()
        data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        sizes = np.empty(self.size, np.int64)
        mine = np.array([data.size], np.int64)
        self.wait(self.comm.Iallgather([mine, MPI.INT64_T], [sizes, MPI.INT64_T]), what)
        return self._gatherv(data, sizes, what)

    def _gatherv(self, data: np.ndarray, sizes: np.ndarray, what) -> list:
        MPI = mpi()
        displs = np.zeros(self.size, np.int64)
        np.cumsum(sizes[:-1], out=displs[1:])
        out = np.empty(int(sizes.sum()), np.uint8)
        self.wait(self.comm.Iallgatherv([data, MPI.BYTE],
                                        [out, (sizes, displs), MPI.BYTE]), what)
        return [pickle.loads(out[d:d + s].tobytes()) for d, s in zip(displs, sizes)]

    def allgather_obj(self, obj: Any, kind: str = "allgather") -> list:
        """Every rank's picklable ``obj`` after a header (small pickles ride in it)."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        small = len(data) <= _INLINE
        hdr = self.header(kind, 0, len(data), data if small else None, None, None)
        sizes = hdr[:, 3].copy()
        if sizes.max() <= _INLINE:
            raw = self._recv.view(np.uint8)
            return [pickle.loads(raw[r, 32:32 + s].tobytes()) for r, s in enumerate(sizes)]
        return self._gatherv(np.frombuffer(data, np.uint8), sizes, kind)

    def close(self) -> None:
        if self._req is not None and not self._req.Test():
            # A header allgather left waiting (another rank failed or left): MPI
            # forbids freeing it or its communicator, so both are left as they are.
            self._req = self.comm = None
            return
        if self._req is not None:
            self._req.Free()
            self._req = None
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
