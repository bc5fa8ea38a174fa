"""Choosing a Communicator for a set of local devices and a worker group.

- CPU devices: :class:`HostCommunicator` (one worker) or :class:`MpiCommunicator`.
- GPU devices: NCCL when ``cupy.cuda.nccl`` is available (in-node, and across workers
  with the unique id broadcast over MPI).
- GPUs without NCCL, or a mix of GPU and CPU devices (as in TensorFlow's
  ``MirroredStrategy(["GPU:0", "CPU:0"])`` example): the host-staged path, which copies to
  host, runs the host or MPI collective and copies each result back to its device.
"""

from __future__ import annotations

from typing import Sequence

from gpustrat.collectives.base import Communicator, WorkerGroup
from gpustrat.devices import Device


def make_communicator(devices: Sequence[Device], workers: WorkerGroup | None = None
                      ) -> Communicator:
    devices = list(devices)
    multi = workers is not None and workers.size > 1
    if all(not d.is_gpu for d in devices):
        return _host_communicator(devices, workers, multi)
    if all(d.is_gpu for d in devices):
        from gpustrat.collectives import nccl  # noqa: PLC0415 - imports CuPy
        if nccl.is_available():
            return nccl.NcclCommunicator(devices, workers)
    from gpustrat.collectives.staged import StagedCommunicator  # noqa: PLC0415
    # The host side sees one host buffer per local replica, whatever its device.
    stand_ins = [Device("cpu", i) for i in range(len(devices))]
    return StagedCommunicator(devices, _host_communicator(stand_ins, workers, multi))


def _host_communicator(devices, workers, multi) -> Communicator:
    if multi:
        from gpustrat.collectives.mpi import MpiCommunicator  # noqa: PLC0415
        return MpiCommunicator(devices, workers)
    from gpustrat.collectives.host import HostCommunicator  # noqa: PLC0415
    return HostCommunicator(devices)
