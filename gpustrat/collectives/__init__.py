"""Collectives: one Communicator interface, several implementations.

- :class:`~gpustrat.collectives.base.Communicator`: data-plane collectives over all
  replicas in sync (this worker's local replicas times every worker).
- :class:`~gpustrat.collectives.base.WorkerGroup`: control-plane agreement between
  workers (small host values: counts, flags, file lists).
- ``host``: in-process NumPy (one worker); ``mpi``: mpi4py between workers;
  ``nccl``: cupy.cuda.nccl between GPUs; ``hierarchical``: NCCL in node, MPI across.
"""

from gpustrat.collectives.base import Communicator, LocalWorkerGroup, WorkerGroup

__all__ = ["Communicator", "WorkerGroup", "LocalWorkerGroup"]
