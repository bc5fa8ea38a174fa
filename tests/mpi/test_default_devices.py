"""MultiWorkerMirroredStrategy's default devices: one GPU per worker, whatever way the
launcher hands GPUs out, and an error on every rank when there is no good default."""

import pytest

from gpustrat.devices import Device
from gpustrat.distribute.multi_worker import default_worker_devices

from tests.mpi_util import assert_mpi_ok


@pytest.mark.parametrize("n_gpus, local_rank, local_size, want", [
    (0, 0, 1, []),
    (0, 3, 4, []),
    (1, 0, 1, [Device("gpu", 0)]),
    (1, 3, 4, [Device("gpu", 0)]),          # CUDA_VISIBLE_DEVICES per rank
    (4, 0, 4, [Device("gpu", 0)]),
    (4, 3, 4, [Device("gpu", 3)]),
    (8, 1, 2, [Device("gpu", 1)]),
])
def test_one_gpu_per_worker(n_gpus, local_rank, local_size, want):
    assert default_worker_devices(n_gpus, local_rank, local_size) == (want, None)


def test_more_workers_than_gpus_on_a_node_is_explained():
    devs, problem = default_worker_devices(2, 2, 3)
    assert devs == []
    assert "node-local rank 2 of 3 workers" in problem and "2 visible GPUs" in problem
    assert "CUDA_VISIBLE_DEVICES" in problem and "devices=" in problem


# Rank 2 of 3 on a node with 2 GPUs has no GPU of its own: every rank raises (before,
# only rank 2 raised and the others waited in the next collective).
NO_GPU_FOR_ONE = r"""
import gpustrat.distribute.multi_worker as mw
from mpi4py import MPI
mw.gpu_count = lambda: 2
try:
    mw.MultiWorkerMirroredStrategy()
except ValueError as e:
    assert "worker 2: node-local rank 2 of 3 workers" in str(e), str(e)
    print(f"raised on rank {MPI.COMM_WORLD.rank}", flush=True)
else:
    raise AssertionError("no error")
"""


@pytest.mark.mpi
def test_a_worker_without_a_gpu_fails_every_rank():
    assert_mpi_ok(3, NO_GPU_FOR_ONE, timeout=60, expect_lines=3, marker="raised on rank")
