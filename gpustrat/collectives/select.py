"""Choosing a Communicator for a set of local devices and a worker group.

- CPU devices: :class:`HostCommunicator` (one worker) or :class:`MpiCommunicator`.
- GPU devices: NCCL when ``cupy.cuda.nccl`` is available (in-node, and across workers
  with the unique id broadcast over MPI); otherwise a host-staged path that copies to
  host, runs the host/MPI collective and copies back.
"""

from __future__ import annotations

from typing import Sequence

from gpustrat.collectives.base import Communicator, WorkerGroup
from gpustrat.devices import Device


def make_communicator(devices: Sequence[Device], workers: WorkerGroup | None = None
                      ) -> Communicator:
    devices = list(devices)
    kinds = {d.kind for d in devices}
    if len(kinds) > 1:
        raise ValueError(f"devices {[d.name for d in devices]} mix CPU and GPU devices: "
                         "use all GPUs or all CPUs for one strategy")
    multi = workers is not None and workers.size > 1
    if "gpu" in kinds:
        from gpustrat.collectives import nccl  # noqa: PLC0415 - imports CuPy
        if nccl.is_available():
            return nccl.NcclCommunicator(devices, workers)
        from gpustrat.collectives.staged import StagedCommunicator  # noqa: PLC0415
        return StagedCommunicator(devices, _host_communicator(devices, workers, multi))
    return _host_communicator(devices, workers, multi)


def _host_communicator(devices, workers, multi) -> Communicator:
    if multi:
        from gpustrat.collectives.mpi import MpiCommunicator  # noqa: PLC0415
        return MpiCommunicator(devices, workers)
    from gpustrat.collectives.host import HostCommunicator  # noqa: PLC0415
    return HostCommunicator(devices)
