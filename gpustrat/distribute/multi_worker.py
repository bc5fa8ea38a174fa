"""MultiWorkerMirroredStrategy: every MPI rank is a worker with one or more replicas.

Launch with ``mpirun -n W python train.py``. MPI is initialised when the strategy is
created, never at import. Every method spans all workers: ``num_replicas_in_sync``
counts every replica, collectives inside ``run`` reach every replica of every worker,
``reduce`` and ``gather`` go across workers, ``experimental_local_results`` stays local.
Distributed input shards over workers by the dataset's auto-shard policy (see
:mod:`gpustrat.distribute.input_lib`).
"""

from __future__ import annotations

import numpy as np

from gpustrat.collectives.base import Communicator
from gpustrat.collectives.select import make_communicator
from gpustrat.devices import Device, gpu_count, resolve_devices
from gpustrat.distribute import context, reduction
from gpustrat.distribute.strategy import Strategy, no_counterpart
from gpustrat.reduce_util import OPS_BY_KEY, ReduceOp
from gpustrat.values import PerReplica

_NUMERIC = "biufc"  # NumPy dtype kinds that take the short path
# Numbers reduced as 0-d arrays on the short path (booleans and complex numbers take the
# general one, which names them in its errors).
_NUMBERS = frozenset((int, float, np.float16, np.float32, np.float64, np.longdouble,
                      np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                      np.uint32, np.uint64))


def _one_number(value, t):
    """The host array of real numbers that ``value`` is for one CPU replica: a
    Python or NumPy number as a 0-d array, or a one-replica PerReplica's array or
    number; None for anything else (the general path)."""
    if t is PerReplica:
        comps = value.values
        if len(comps) != 1:
            return None
        value = comps[0]
        t = type(value)
        if t is np.ndarray:
            return value if value.dtype.kind in "iuf" else None
    if t in _NUMBERS:
        x = np.asarray(value)
        return x if x.dtype.kind in "iuf" else None  # a huge int is an object array
    return None


def default_worker_devices(n_gpus: int, local_rank: int, local_size: int
                           ) -> tuple[list[Device], str | None]:
    """A worker's default devices and, when there is no good default, why.

    ``n_gpus`` GPUs are visible to this worker, which is rank ``local_rank`` of the
    ``local_size`` workers on its node: none gives no device (the caller takes the
    CPU); one gives ``gpu:0`` (each worker may see its own GPU as device 0, the way
    ``srun --gpus-per-task=1`` or a per-rank ``CUDA_VISIBLE_DEVICES`` arranges it);
    at least one per worker gives ``gpu:<local_rank>``.
    """
    if n_gpus == 0:
        return [], None
    if n_gpus == 1:
        return [Device("gpu", 0)], None
    if local_rank < n_gpus:
        return [Device("gpu", local_rank)], None
    return [], (f"node-local rank {local_rank} of {local_size} workers on a node with "
                f"{n_gpus} visible GPUs: launch at most {n_gpus} ranks per node, give "
                "each rank its own GPU (CUDA_VISIBLE_DEVICES), or pass devices=")


class WorkerClusterResolver:
    """The role of this worker in a :class:`MultiWorkerMirroredStrategy` job, as
    ``strategy.cluster_resolver`` gives it in ``tf.distribute``: ``task_type``
    ``"worker"``, ``task_id`` the worker index, ``cluster_spec()`` (one address per
    rank; MPI connects them), ``num_accelerators()``, ``environment`` ``"mpi"``."""

    task_type = "worker"
    rpc_layer = "mpi"
    environment = "mpi"

    def __init__(self, task_id: int, num_workers: int):
        self.task_id = task_id
        self.num_workers = num_workers

    def cluster_spec(self):
        from gpustrat.distribute.parameter_server.resolver import ClusterSpec  # noqa
        return ClusterSpec({"worker": [f"mpi-rank-{r}" for r in range(self.num_workers)]})

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        return {}

    def __repr__(self) -> str:
        return (f"WorkerClusterResolver(task_type='worker', task_id={self.task_id}, "
                f"num_workers={self.num_workers})")


class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism over MPI workers.

    Args:
        devices: this worker's local devices (e.g. ``["cpu:0", "cpu:1"]`` for two
            replicas per worker). Default: one GPU per worker, the one whose index is
            this worker's node-local rank (ranks of one node found with a
            shared-memory split), or ``gpu:0`` when each worker sees a single GPU (a
            launcher that sets ``CUDA_VISIBLE_DEVICES`` per rank); ``cpu:0`` without a
            GPU. Every worker must hold the same number of devices.
        communicator: an mpi4py communicator whose ranks are the workers (default
            ``COMM_WORLD``); the strategy works on its own duplicate, so several
            strategies coexist in one process.
        collectives: a Communicator to use instead of the default (for tests).

    Raises:
        ValueError: workers hold different numbers of devices (raised on every rank).
    """

    def __init__(self, devices=None, communicator=None,
                 collectives: Communicator | None = None, *, cluster_resolver=None,
                 communication_options=None):
        no_counterpart("MultiWorkerMirroredStrategy", cluster_resolver=cluster_resolver,
                        communication_options=communication_options)
        from gpustrat.collectives.mpi import MpiWorkerGroup  # noqa: PLC0415 - inits MPI
        from gpustrat.distribute.failures import (  # noqa: PLC0415
            install_abort_on_error, uninstall_abort_on_error)
        workers = MpiWorkerGroup(communicator)
        problem = None
        if devices is None:
            devs, problem = default_worker_devices(
                gpu_count(), workers.node_local_rank(), workers.node_local_size())
            devs = devs or [Device("cpu", 0)]
        else:
            devs = resolve_devices(devices)
        problem = problem or workers.thread_problem(len(devs))
        # One collective tells every worker both the device counts and any worker's
        # problem, so that all raise together.
        found = workers.allgather((len(devs), problem))
        problems = [f"worker {r}: {p}" for r, (_, p) in enumerate(found) if p]
        if problems:
            raise ValueError("; ".join(problems))
        counts = [c for c, _ in found]
        if len(set(counts)) != 1:
            raise ValueError(f"workers hold different numbers of devices ({counts}, by rank); "
                             "every worker must hold the same number of local replicas")
        install_abort_on_error(workers)  # until close()
        try:
            comm = collectives or make_communicator(devs, workers)
            super().__init__(devs, comm, workers)
        except BaseException:
            uninstall_abort_on_error(workers)
            raise
        # One CPU replica per worker, several workers: a reduce or gather of one host
        # array goes straight to the communicator (see reduce).
        self._one_host = len(devs) == 1 and not devs[0].is_gpu and workers.size > 1

    @property
    def cluster_resolver(self) -> "WorkerClusterResolver":
        """This worker's role, as ``tf.distribute``'s strategy gives its resolver:
        ``task_type`` ``"worker"``, ``task_id`` the worker index (0 is the one that
        writes summaries, as TensorFlow's chief-less clusters use worker 0),
        ``cluster_spec()``."""
        return WorkerClusterResolver(self.worker_index, self.num_workers)

    def _one_leaf(self, value):
        """The components of a value that is one host array per local replica (a plain
        array with one local replica), or None: the call every training loop makes,
        taken without walking a structure."""
        if context.current()[1] is not None or self._workers.size == 1 or \
                self._devices[0].is_gpu:
            return None  # the general path: errors inside run, one worker's rules
        t = type(value)
        if t is np.ndarray and len(self._devices) == 1 and value.dtype.kind in _NUMERIC:
            return (value,)
        if t is PerReplica:
            comps = value.values
            if len(comps) == len(self._devices) and all(
                    type(c) is np.ndarray and c.dtype.kind in _NUMERIC for c in comps):
                return comps
        return None

    def reduce(self, reduce_op, value, axis=None):
        if axis is not None and type(axis) is not int:
            axis = reduction.check_axis(axis, "strategy.reduce", True)
        t = type(reduce_op)
        op = OPS_BY_KEY.get(id(reduce_op)) if t is ReduceOp else \
            OPS_BY_KEY.get(reduce_op) if t is str else None
        if op is None:
            return super().reduce(reduce_op, value, axis)
        if self._one_host and context.current()[1] is None:
            t = type(value)
            if t is np.ndarray and value.dtype.kind in _NUMERIC:
                # The call every loop makes: one host array of numbers, one replica here.
                if axis is None and value.dtype.kind != "b":
                    return self._communicator.reduce_named(
                        value, op, reduction.NAMES_AXIS_NONE[id(op)],
                        reduction.HINT_AXIS_NONE)
                return reduction.reduce_host_array(self._communicator, op, value, axis)
            if axis is None and t is not np.ndarray:
                # The loss: a NumPy scalar (what run returns for a 0-d result), a
                # Python number, or either (or an array) in a one-replica PerReplica.
                x = _one_number(value, t)
                if x is not None:
                    return self._communicator.reduce_named(
                        x, op, reduction.NAMES_AXIS_NONE[id(op)], reduction.HINT_AXIS_NONE)
        comps = self._one_leaf(value)
        if comps is None:
            return super().reduce(reduce_op, value, axis)
        return reduction.reduce_components(self._communicator, op, comps, axis)

    def gather(self, value, axis):
        if type(axis) is not int:
            axis = reduction.check_axis(axis, "strategy.gather", False)
        if self._one_host and type(value) is np.ndarray and value.dtype.kind in _NUMERIC \
                and context.current()[1] is None:
            return reduction.gather_host_array(self._communicator, value, axis)
        comps = self._one_leaf(value)
        if comps is None:
            return super().gather(value, axis)
        return reduction.gather_components(self._communicator, comps, axis)

    def close(self) -> None:
        from gpustrat.distribute.failures import uninstall_abort_on_error  # noqa: PLC0415
        uninstall_abort_on_error(self.workers)
        super().close()
        self.workers.close()
