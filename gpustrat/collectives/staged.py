"""The host-staged path: GPU collectives when NCCL is not available.

Each collective copies the local replicas' buffers to host memory
(``gpustrat.devices.to_host``), runs the host communicator's collective on them (the
in-process :class:`~gpustrat.collectives.host.HostCommunicator`, or the MPI
communicator between workers) and copies each replica's result back to its device
(``gpustrat.devices.to_device``). Correct everywhere, and as fast as two PCIe copies
allow: NCCL is the fast path.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from gpustrat.collectives.base import Communicator
from gpustrat.devices import Device, to_device, to_host


class StagedCommunicator(Communicator):
    """Collectives over replicas on any devices, through host memory.

    Args:
        devices: this worker's devices, one per local replica.
        host_comm: a communicator over host (NumPy) buffers with one buffer per local
            replica; its worker count and index are this communicator's.
    """

    def __init__(self, devices: Sequence[Device], host_comm: Communicator):
        self.devices = list(devices)
        if host_comm.num_local != len(self.devices):
            raise ValueError(f"the host communicator has {host_comm.num_local} local "
                             f"replicas but {len(self.devices)} devices were given")
        self.host = host_comm
        self.num_workers = host_comm.num_workers
        self.worker_index = host_comm.worker_index

    def _down(self, buffers) -> list:
        if len(buffers) != self.num_local:
            raise ValueError(f"got {len(buffers)} buffers for {self.num_local} local replicas")
        # A buffer is read on its own device's current stream (where it was written).
        out = []
        for b, d in zip(buffers, self.devices):
            with d.activate():
                out.append(to_host(b))
        return out

    def _up(self, results) -> list:
        return [to_device(r, d) for r, d in zip(results, self.devices)]

    def all_reduce(self, buffers, op):
        return self._up(self.host.all_reduce(self._down(buffers), op))

    def all_gather(self, buffers, axis=0):
        return self._up(self.host.all_gather(self._down(buffers), axis))

    def broadcast(self, buffers, root=0):
        return self._up(self.host.broadcast(self._down(buffers), root))

    def reduce_scatter(self, buffers, op):
        return self._up(self.host.reduce_scatter(self._down(buffers), op))

    def agree_layout(self, shape, dtype, what, hint=""):
        self.host.agree_layout(shape, dtype, what, hint)

    def agree(self, key, what, hint=""):
        self.host.agree(key, what, hint)

    def share_error(self, error):
        self.host.share_error(error)

    def agreeing(self, key, what, hint="", also=None):
        # The host collective of the staged call made inside carries it.
        return self.host.agreeing(key, what, hint, also)

    def reduce_numbers(self, numbers, op):
        # The host communicator's own all-reduce, with its checks between workers.
        return self.host.all_reduce([np.asarray(x) for x in numbers], op)[0].item()

    def reduce(self, buffers, op):
        return to_device(self.host.reduce(self._down(buffers), op), self.devices[0])

    def gather(self, buffers, axis=0):
        return to_device(self.host.gather(self._down(buffers), axis), self.devices[0])

    def close(self) -> None:
        self.host.close()
