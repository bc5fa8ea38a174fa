"""MirroredStrategy and OneDeviceStrategy: one worker, one or more local devices."""

from __future__ import annotations

from gpustrat.collectives.base import Communicator
from gpustrat.collectives.select import make_communicator
from gpustrat.devices import parse_device, resolve_devices
from gpustrat.distribute.strategy import Strategy, no_counterpart


class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the devices of one process.

    Args:
        devices: device names (``"gpu:0"``, ``"cpu:1"``, ...). Default: every visible
            GPU, else ``cpu:0``. Any number of logical CPU devices may be named.
        communicator: collectives to use instead of the default (NCCL for GPUs, host
            collectives for CPUs).
    """

    def __init__(self, devices=None, communicator: Communicator | None = None, *,
                 cross_device_ops=None):
        no_counterpart("MirroredStrategy", cross_device_ops=cross_device_ops)
        if communicator is not None and not isinstance(communicator, Communicator):
            raise TypeError(
                f"MirroredStrategy: communicator must be a gpustrat Communicator, got "
                f"{type(communicator).__name__}; TensorFlow's cross_device_ops (its "
                "second argument) has no counterpart: the collectives are chosen for you")
        devs = resolve_devices(devices)
        super().__init__(devs, communicator or make_communicator(devs))

    @property
    def cluster_resolver(self):
        """None, as ``tf.distribute.MirroredStrategy``'s (one worker)."""
        return None


class OneDeviceStrategy(Strategy):
    """Everything on one device; ``run`` calls the function in the calling thread."""

    def __init__(self, device):
        if device is None:
            raise ValueError("OneDeviceStrategy needs a device, such as 'gpu:0' or 'cpu:0'")
        devs = resolve_devices([parse_device(device)])
        super().__init__(devs, make_communicator(devs), inline=True)
