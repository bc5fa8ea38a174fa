"""The Strategy base: what every strategy offers.

A strategy owns this worker's local devices, a :class:`ReplicaRunner` (one persistent
thread per local replica), a :class:`Communicator` for collectives over every replica
in sync, and a :class:`WorkerGroup` for agreement between workers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Sequence

from gpustrat import nest
from gpustrat import timeline as _tl
from gpustrat.collectives.base import Communicator, LocalWorkerGroup, WorkerGroup
from gpustrat.devices import Device, gpu_array_type, is_gpu_array, to_device
from gpustrat.distribute import collective_ops, context, reduction
from gpustrat.distribute.distributed_variables import DistributedVariable, as_components
from gpustrat.distribute.replica_context import ReplicaContext, ValueContext, in_merge_call
from gpustrat.distribute.runner import Rendezvous, ReplicaRunner
from gpustrat.reduce_util import ReduceOp
from gpustrat.values import DistributedValues, local_components, regroup


class Strategy:
    """Distributes computation over replicas: this worker's devices times every worker.

    Args:
        devices: this worker's local devices, in replica order.
        communicator: collectives over every replica in sync.
        workers: agreement between workers (a single worker by default).
        inline: run a single replica's function in the calling thread.
    """

    def __init__(self, devices: Sequence[Device], communicator: Communicator,
                 workers: WorkerGroup | None = None, inline: bool = False):
        self._devices = tuple(devices)
        self._communicator = communicator
        self._workers = workers or LocalWorkerGroup()
        self._inline = inline and len(self._devices) == 1
        self._runner = None if self._inline else ReplicaRunner(self._devices)
        self._rendezvous = self._runner.rendezvous if self._runner else Rendezvous(1)
        if communicator.num_workers > 1:
            self._rendezvous.share_error = communicator.share_error
        first = self._workers.rank * len(self._devices)
        self._replica_contexts = [ReplicaContext(self, i, first + i)
                                  for i in range(len(self._devices))]
        self._enter = self._enter_replica  # bound once: run() is a hot path
        _tl.attach(communicator)  # its collectives are timed while a timeline records

    # --- what the strategy is --------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        return self._communicator.num_replicas

    @property
    def local_devices(self) -> tuple:
        """This worker's devices, one per local replica."""
        return self._devices

    @property
    def communicator(self) -> Communicator:
        return self._communicator

    @property
    def extended(self):
        """Extension points for optimizers and metrics: ``update``, ``reduce_to``,
        ``batch_reduce_to`` (see :mod:`gpustrat.distribute.extended`)."""
        ext = getattr(self, "_extended", None)
        if ext is None:
            from gpustrat.distribute.extended import StrategyExtended  # noqa: PLC0415
            ext = self._extended = StrategyExtended(self)
        return ext

    @property
    def workers(self) -> WorkerGroup:
        return self._workers

    @property
    def num_workers(self) -> int:
        return self._workers.size

    @property
    def worker_index(self) -> int:
        return self._workers.rank

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(devices={[d.name for d in self._devices]}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")

    # --- contexts --------------------------------------------------------------------
    @contextlib.contextmanager
    def scope(self):
        """Make this strategy current; inside, code is in cross-replica context."""
        current, ctx = context.current()
        if ctx is not None:
            raise RuntimeError("strategy.scope() cannot be entered inside strategy.run "
                               "(replica context); enter it outside run")
        if current is not None and current is not self:
            raise RuntimeError(f"cannot enter the scope of {self!r} inside the scope of "
                               f"another strategy, {current!r}: use one strategy at a time")
        context.push(self, None)
        try:
            yield self
        finally:
            context.pop()

    def _default_replica_context(self) -> ReplicaContext:
        return self._replica_contexts[0]

    def _enter_replica(self, index: int) -> None:
        context.push(self, self._replica_contexts[index])

    # --- running ---------------------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None, options=None):
        """Call ``fn`` once per local replica, in replica context.

        Per-replica values among ``args``/``kwargs`` (at any depth of nesting) are
        unpacked to each replica's component; a plain GPU (CuPy) array goes to each
        replica's device (a copy on another device, the array itself on its own);
        everything else goes to every replica as is. Returns the results regrouped:
        the structure of ``fn``'s result with a per-replica value at every leaf
        (whatever it is, a Python int or string too), except a leaf that is None on
        every replica (None) or one distributed value on every replica (that value); a
        single replica's result as is.

        Raises:
            ValueError: a distributed argument made on other devices, or with another
                number of components.
            The first replica's exception, with a note naming the replica.
        """
        kwargs = kwargs or {}
        if in_merge_call():
            raise RuntimeError("strategy.run was called inside a merge_call function "
                               "(cross-replica context within run); return from the "
                               "merge function, then call run from outside")
        if context.current()[1] is not None:
            raise RuntimeError("strategy.run was called inside a function already running in "
                               "a replica context; call it from cross-replica context")
        n = len(self._devices)
        if not isinstance(args, (tuple, list)):
            args = (args,)
        per_args, per_kwargs = _split_arguments(args, kwargs, self._devices)
        if _tl.ON:
            fn = _tl.replica_fn(fn)
        if self._runner is None:
            with self._devices[0].activate():
                self._enter(0)
                try:
                    results = [fn(*per_args[0], **per_kwargs[0])]
                finally:
                    context.pop()
        else:
            results = self._runner.call(fn, per_args, per_kwargs, self._enter, context.pop)
        return regroup(results, self._devices)

    experimental_run_v2 = run  # TensorFlow r1.15's name

    # --- cross-replica operations ----------------------------------------------------
    def _check_cross_replica(self, what: str) -> None:
        if context.current()[1] is not None:
            raise RuntimeError(f"strategy.{what} must be called in cross-replica context, "
                               "not inside strategy.run; inside run use "
                               "get_replica_context().all_reduce / all_gather")

    def _components(self, value: Any, what: str) -> tuple:
        if isinstance(value, DistributedValues):
            return local_components(value, self._devices, what)
        return (value,) * len(self._devices)

    def reduce(self, reduce_op, value: Any, axis: int | None = None) -> Any:
        """Reduce per-replica ``value`` (any nested structure) over every replica in sync.

        ``axis=None`` reduces element-wise across replicas (shapes must match);
        ``axis=k`` also reduces along dimension ``k`` of each component, MEAN dividing by
        the total number of examples. The result lives on the first local device.
        """
        op = ReduceOp.from_value(reduce_op)
        self._check_cross_replica("reduce")
        if axis is not None and type(axis) is not int:
            axis = reduction.check_axis(axis, "strategy.reduce", True)

        def leaf(v):
            v = as_components(v)
            if not isinstance(v, DistributedValues) and axis is None:
                self._check_plain(op, v)
                if self.num_workers == 1:
                    return v
                # Across workers a plain value is this worker's own (with one local
                # replica, run returns plain values), so it is reduced over the workers.
            return reduction.reduce_components(self._communicator, op,
                                               self._components(v, "strategy.reduce"), axis)
        if not nest.is_nested(value):
            return leaf(value)
        with collective_ops.same_structure_everywhere(
                self._communicator, f"strategy.reduce({op.name})", value):
            return nest.map_structure(leaf, value)

    def _check_plain(self, op: ReduceOp, value: Any) -> None:
        # As tf.distribute: a plain value counts as the same on every local replica; its
        # MEAN, MAX and MIN over them are itself, and its SUM would silently multiply.
        if op is ReduceOp.SUM and len(self._devices) > 1:
            raise ValueError(
                f"cannot SUM-reduce a plain value ({type(value).__name__}) over "
                f"{len(self._devices)} local replicas: pass a per-replica value (the result "
                "of strategy.run or of a distributed dataset), or use MEAN")

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's component along ``axis`` onto the first local
        device; shapes may differ only along ``axis``. On one worker a plain
        (non-distributed) leaf is returned as is, as tf.distribute's MirroredStrategy
        does; across workers it is each worker's own value, and they are gathered."""
        self._check_cross_replica("gather")
        if type(axis) is not int:
            axis = reduction.check_axis(axis, "strategy.gather", False)

        def leaf(v):
            v = as_components(v)
            if not isinstance(v, DistributedValues) and self.num_workers == 1:
                return v
            return reduction.gather_components(
                self._communicator, self._components(v, "strategy.gather"), axis)
        if not nest.is_nested(value):
            return leaf(value)
        with collective_ops.same_structure_everywhere(self._communicator,
                                                      "strategy.gather", value):
            return nest.map_structure(leaf, value)

    def experimental_local_results(self, value: Any) -> tuple:
        """This worker's components in replica order; a plain value gives ``(value,)``;
        a distributed variable gives its component variables."""
        what = "strategy.experimental_local_results"
        if isinstance(value, DistributedVariable):
            local_components(as_components(value), self._devices, what)   # same devices
            return value.values
        if isinstance(value, DistributedValues):
            return local_components(value, self._devices, what)
        if nest.is_nested(value):
            flat = nest.flatten(value)
            if any(isinstance(v, DistributedValues) for v in flat):
                return tuple(nest.pack_sequence_as(value, column) for column
                             in zip(*[self._components(v, what) for v in flat]))
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """``value_fn(ctx)`` once per local replica, its arrays placed on the replica's
        device; returns per-replica values (OneDeviceStrategy and the default strategy
        return ``value_fn``'s result unwrapped, as tf.distribute does)."""
        n = self.num_replicas_in_sync
        results = []
        for i, dev in enumerate(self._devices):
            ctx = ValueContext(self._replica_contexts[i].replica_id_in_sync_group, n)
            out = value_fn(ctx)
            results.append(nest.map_structure(
                lambda v, d=dev: to_device(v, d) if _is_arraylike(v) else v, out))
        return regroup(results, self._devices, always_wrap=not self._inline)

    # --- distributed input -----------------------------------------------------------
    def experimental_distribute_dataset(self, dataset, options=None):
        """Split each global batch of ``dataset`` over the replicas in sync; returns an iterable DistributedDataset."""
        from gpustrat.distribute.input_lib import DistributedDataset  # noqa: PLC0415
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable, options=None):
        """``dataset_fn(input_context)`` makes this worker's per-replica-batched dataset;
        local replicas take its batches in turn."""
        from gpustrat.distribute.input_lib import DistributedDatasetsFromFunction  # noqa
        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def experimental_make_numpy_dataset(self, numpy_input):
        """A dataset of the rows of NumPy array(s), as TensorFlow r1.15's API had."""
        from gpustrat.data import Dataset  # noqa: PLC0415
        return Dataset.from_tensor_slices(numpy_input)

    def close(self) -> None:
        """Stop the replica threads and release the communicator."""
        if self._runner is not None:
            self._runner.close()
        self._communicator.close()


_WHY_NOT = {
    "cross_device_ops": "the collectives are chosen for you: NCCL between the GPUs of a "
                        "process, host collectives between CPU devices, MPI between workers",
    "communication_options": "the collectives are chosen for you (NCCL within a node, MPI "
                             "between workers), and a step's collectives are fused",
    "cluster_resolver": "the workers are the ranks of the MPI launch (mpiexec -n W, or "
                        "srun): TF_CONFIG and cluster resolvers are not read",
}


def no_counterpart(where: str, **given) -> None:
    """A TensorFlow constructor argument that gpustrat has no use for: None is
    accepted, anything else is a TypeError saying why."""
    for name, value in given.items():
        if value is not None:
            raise TypeError(f"{where}: {name}={value!r} has no counterpart: "
                            f"{_WHY_NOT[name]}. Leave it out (see docs/porting.md)")


def _is_arraylike(v) -> bool:
    return hasattr(v, "__array__") or hasattr(v, "__cuda_array_interface__")


def _split_arguments(args: Sequence, kwargs: dict, devices: tuple):
    """One (args, kwargs) per replica of ``devices``; shared as is when no argument is
    distributed or on a GPU.

    A plain GPU array (one CuPy array, not a per-replica value) goes to each replica's
    device, as TensorFlow copies a tensor argument: a replica on another device gets a
    copy, ordered after the work queued on the array's device's current stream; a
    replica on the array's own device gets the array itself, which its stream reads
    after that same work (``ReplicaRunner.call`` orders it).
    """
    n = len(devices)
    gpu = gpu_array_type()
    placed = DistributedValues if gpu is None else (DistributedValues, gpu)
    if not kwargs and not any(nest.is_nested(a) for a in args):
        # The common step `run(fn, args=(x,))`: no structure to walk.
        if not any(isinstance(a, placed) for a in args):
            args = tuple(args)
            return [args] * n, [kwargs] * n
        return list(zip(*[_argument_components(a, devices) for a in args])), [kwargs] * n
    flat = nest.flatten((tuple(args), kwargs))
    if not any(isinstance(v, placed) for v in flat):
        args = tuple(args)
        return [args] * n, [kwargs] * n
    per_args, per_kwargs = [], []
    for column in zip(*[_argument_components(v, devices) for v in flat]):
        a, k = nest.pack_sequence_as((tuple(args), kwargs), column)
        per_args.append(a)
        per_kwargs.append(k)
    return per_args, per_kwargs


def _argument_components(v: Any, devices: tuple) -> tuple:
    if isinstance(v, DistributedValues):
        return local_components(v, devices, "strategy.run")
    if is_gpu_array(v):
        return tuple(to_device(v, d) for d in devices)
    return (v,) * len(devices)
