"""Collectives: one Communicator interface, several implementations.

- :class:`~gpustrat.collectives.base.Communicator`: data-plane collectives over all
  replicas in sync (this worker's local replicas times every worker).
- :class:`~gpustrat.collectives.base.WorkerGroup`: control-plane agreement between
  workers (small host values: counts, flags, file lists).
- ``host``: in-process NumPy (one worker); ``mpi``: mpi4py between workers;
  ``nccl``: cupy.cuda.nccl between GPUs, in a node and across workers (the unique id
  goes over MPI, ``rendezvous``); ``staged``: GPU or mixed devices through host memory;
  ``select``: which one a strategy gets; ``fusion``: many tensors per collective.
"""

from gpustrat.collectives.base import Communicator, LocalWorkerGroup, WorkerGroup

__all__ = ["Communicator", "WorkerGroup", "LocalWorkerGroup"]
