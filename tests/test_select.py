"""Which communicator a strategy gets (runs without a GPU: no NCCL here)."""

import numpy as np
import pytest

from gpustrat.collectives import nccl
from gpustrat.collectives.host import HostCommunicator
from gpustrat.collectives.select import make_communicator
from gpustrat.collectives.staged import StagedCommunicator
from gpustrat.devices import Device


def test_cpu_devices_get_the_host_communicator():
    c = make_communicator([Device("cpu", 0), Device("cpu", 1)])
    assert type(c) is HostCommunicator and c.num_replicas == 2


@pytest.mark.skipif(nccl.is_available(), reason="checks the path taken without NCCL")
def test_mixed_or_nccl_less_devices_are_staged_through_host():
    for devs in ([Device("gpu", 0), Device("cpu", 0)], [Device("gpu", 0), Device("gpu", 1)]):
        c = make_communicator(devs)
        assert isinstance(c, StagedCommunicator) and c.devices == devs
        assert all(not d.is_gpu for d in c.host.devices) and c.host.num_local == 2


def test_staged_over_cpu_devices_matches_host():
    # The staged logic on devices whose placement is the host (a stand-in for GPUs).
    devs = [Device("cpu", 0), Device("cpu", 1)]
    staged = StagedCommunicator(devs, HostCommunicator(devs))
    out = staged.all_reduce([np.ones(3), np.full(3, 2.0)], "mean")
    assert len(out) == 2 and all(o.shape == (3,) and (o == 1.5).all() for o in out)
    np.testing.assert_array_equal(staged.reduce([np.ones(2), np.ones(2)], "sum"), [2, 2])
