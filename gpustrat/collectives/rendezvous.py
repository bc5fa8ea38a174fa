"""Rendezvous: how the workers of a job agree on an NCCL unique id.

One worker (rank 0) creates the id, a 128-byte token naming the NCCL clique, and the
:class:`~gpustrat.collectives.base.WorkerGroup` broadcasts it over MPI; every worker
then creates its NCCL communicators with it. If creating the id fails on rank 0, the
failure itself is broadcast, so every worker raises the same error instead of the
others waiting for an id that never comes.
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


def nccl_unique_id(workers: WorkerGroup) -> tuple:
    """A fresh NCCL unique id from rank 0, the same tuple on every worker."""
    def make():
        from gpustrat.collectives.nccl import nccl_module  # noqa: PLC0415
        return tuple(nccl_module().get_unique_id())
    uid = broadcast_unique_id(workers, make)
    return tuple(uid)
