"""Rendezvous: how the workers of a job agree on an NCCL unique id.

One worker (rank 0) creates the id, a 128-byte token naming the NCCL clique, and the
:class:`~gpustrat.collectives.base.WorkerGroup` broadcasts it over MPI; every worker
then creates its NCCL communicators with it. If creating the id fails on rank 0, the
failure itself is broadcast, so every worker raises the same error instead of the
others waiting for an id that never comes.

The id's Python form depends on the CuPy version: ``cupy.cuda.nccl.get_unique_id()``
returns a tuple of 128 signed chars (-128..127) up to CuPy 13 and ``bytes`` since CuPy
14, and ``NcclCommunicator(ndev, commId, rank)`` accepts only that same form (a
``tuple``-typed, then a ``bytes``-typed Cython argument). The id therefore travels as
``bytes`` (:func:`unique_id_bytes`), and :func:`new_communicator` hands each worker's
own CuPy the form it takes, so workers may even run different CuPy versions.
"""

from __future__ import annotations

from typing import Any, Callable

from gpustrat.collectives.base import WorkerGroup

_FAILED = "gpustrat-rendezvous-failed"


def broadcast_unique_id(workers: WorkerGroup, make_id: Callable[[], Any], root: int = 0):
    """``make_id()`` called on worker ``root`` only, its value returned on every worker.

    Raises:
        RuntimeError: ``make_id`` failed on the root (on every worker, with the root's
            error message).
    """
    payload = None
    if workers.rank == root:
        try:
            payload = ("ok", make_id())
        except Exception as e:  # sent to every worker, then raised everywhere
            payload = (_FAILED, f"{type(e).__name__}: {e}")
    status, value = workers.bcast(payload, root=root)
    if status == _FAILED:
        raise RuntimeError(f"creating the NCCL unique id on worker {root} failed ({value}); "
                           "check that NCCL is installed and a GPU is visible on every "
                           "worker")
    return value


def nccl_unique_id(workers: WorkerGroup) -> bytes:
    """A fresh NCCL unique id from rank 0, the same 128 bytes on every worker."""
    def make():
        from gpustrat.collectives.nccl import nccl_module  # noqa: PLC0415
        return unique_id_bytes(nccl_module().get_unique_id())
    return unique_id_bytes(broadcast_unique_id(workers, make))


#: ``NCCL_UNIQUE_ID_BYTES`` (nccl.h).
UNIQUE_ID_BYTES = 128


def unique_id_bytes(uid) -> bytes:
    """An NCCL unique id as ``bytes``, from CuPy 14's ``bytes`` or CuPy 13's tuple of
    signed chars.

    Raises:
        ValueError: ``uid`` is not 128 bytes, or holds a number outside -128..255.
    """
    if isinstance(uid, (bytes, bytearray)):
        out = bytes(uid)
    else:
        values = [int(v) for v in uid]
        bad = [v for v in values if not -128 <= v <= 255]
        if bad:
            raise ValueError(f"an NCCL unique id holds chars (-128..255), but this one "
                             f"holds {bad[:4]}: pass what cupy.cuda.nccl.get_unique_id() "
                             "returned")
        out = bytes(v & 0xFF for v in values)
    if len(out) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(out)}: "
                         "pass what cupy.cuda.nccl.get_unique_id() returned")
    return out


def unique_id_signed_chars(uid: bytes) -> tuple:
    """The id in CuPy 13's form: a tuple of 128 ints in -128..127 (C ``char``)."""
    return tuple(b - 256 if b > 127 else b for b in unique_id_bytes(uid))


# The form the installed CuPy's NcclCommunicator took last: "bytes" (CuPy 14) or
# "chars" (CuPy 13); tried first next time.
_accepted_form: list = ["bytes"]


def new_communicator(nccl, ndev: int, uid, rank: int):
    """``nccl.NcclCommunicator(ndev, commId, rank)`` with ``commId`` in the form this
    CuPy takes.

    The form is found by asking the constructor: a wrong one is a TypeError of its
    argument check, raised before NCCL is called (so nothing is left half made and no
    peer is kept waiting), and the other form is then passed. Which form worked is
    remembered, so later communicators of the process are made in one call.

    Args:
        nccl: ``cupy.cuda.nccl``.
        ndev: the number of NCCL ranks in the clique.
        uid: the unique id (``bytes`` or CuPy 13's tuple).
        rank: this communicator's NCCL rank.
    Raises:
        TypeError: the constructor took neither form (its two messages are included).
    """
    raw = unique_id_bytes(uid)
    forms = {"bytes": lambda: raw, "chars": lambda: unique_id_signed_chars(raw)}
    first = _accepted_form[0]  # read once: another thread may change it meanwhile
    order = [first] + [f for f in forms if f != first]
    errors = []
    for form in order:
        try:
            comm = nccl.NcclCommunicator(int(ndev), forms[form](), int(rank))
        except TypeError as e:
            errors.append(f"{form}: {e}")
            continue
        _accepted_form[0] = form
        return comm
    raise TypeError("cupy.cuda.nccl.NcclCommunicator took the unique id neither as "
                    f"bytes (CuPy 14) nor as a tuple of signed chars (CuPy 13): "
                    f"{'; '.join(errors)}")
