"""ParameterServerStrategy: variables on server ranks, functions on worker ranks.

One script runs on every rank (``mpiexec -n K python train.py``). The constructor
finds its rank's role from the cluster resolver: on a server or worker rank it serves
until the coordinator finishes and then ends the process with status 0 (like
``server.join()``), so the code after it runs on the coordinator only. When the
coordinator's script ends (normally or with an exception), the workers are stopped,
then the servers, so no rank is left waiting.
"""

from __future__ import annotations

import atexit
import sys
import threading
import traceback

import numpy as np

from gpustrat.distribute.parameter_server import variables as remote
from gpustrat.distribute.parameter_server import doorbell, wire
from gpustrat.distribute.parameter_server.doorbell import job_id
from gpustrat.distribute.parameter_server.channel import (TAG_RESULT, TAG_RESULT_DATA,
                                                           TAG_TASK, TAG_TASK_DATA, Channel,
                                                           Orphaned, ServerLostError, Watch,
                                                           set_channel)
from gpustrat.distribute.strategy import Strategy
from gpustrat.distribute.variables import VariableSynchronization, initial_array


class ParameterServerStrategy(Strategy):
    """Asynchronous training: variables live on the parameter servers, functions
    scheduled with :class:`~gpustrat.distribute.coordinator.ClusterCoordinator` run on
    the workers (``tf.distribute.experimental.ParameterServerStrategy``).

    Args:
        cluster_resolver: an :class:`MpiClusterResolver` (which ranks are servers).
        variable_partitioner: a callable ``(shape, dtype) -> [num_shards, 1, ...]``
            (see ``gs.distribute.experimental.partitioners``): variables it gives more
            than one shard are split along axis 0 over the servers.
        worker_devices: each worker's local devices (default ``["cpu:0"]``);
            ``strategy.run`` inside a scheduled function runs one replica per device.
        server_memory_limit: bytes of variables a server may hold (default: no limit
            but the machine's memory); a variable that does not fit is a
            ``MemoryError`` naming it.

    On server and worker ranks the constructor does not return: the process ends with
    status 0 once the coordinator is done.
    """

    def __init__(self, cluster_resolver, variable_partitioner=None, worker_devices=None,
                 server_memory_limit: int | None = None):
        from gpustrat.distribute.parameter_server.resolver import MpiClusterResolver
        if not isinstance(cluster_resolver, MpiClusterResolver):
            raise TypeError(f"ParameterServerStrategy needs an MpiClusterResolver, got "
                            f"{type(cluster_resolver).__name__}: use "
                            "gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=...)")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError(f"variable_partitioner must be callable (shape, dtype) -> "
                            f"partitions, got {variable_partitioner!r}")
        from gpustrat.collectives.mpi import (mpi, mpi_world,  # noqa: PLC0415
                                              timeout_from_env, wait)
        from gpustrat.devices import resolve_devices  # noqa: PLC0415
        devices = [str(d) for d in (worker_devices or ["cpu:0"])]
        resolve_devices(devices)  # bad names fail on every rank, before any serving
        self.cluster_resolver = cluster_resolver
        self._num_ps = cluster_resolver.num_ps
        self._num_workers = cluster_resolver.num_workers
        self._worker_devices = devices
        self._partitioner = variable_partitioner
        self._memory_limit = server_memory_limit
        role, index = cluster_resolver.task_type, cluster_resolver.task_id
        timeout = timeout_from_env()
        cluster_resolver._start(role == "chief", timeout)
        # Every rank is here (see _start): the job's communicator.
        comm, request = mpi_world().Idup()
        wait(request, "duplicating the job's communicator (MPI Idup)",
             cluster_resolver.rank, timeout)
        ch = Channel(comm, timeout, job_id(*cluster_resolver._coordinator_process))
        ch.server_ranks = [cluster_resolver.rank_of("ps", i) for i in range(self._num_ps)]
        ch.worker_ranks = [cluster_resolver.rank_of("worker", i)
                           for i in range(self._num_workers)]
        ch.open_staging()
        self._channel = ch
        set_channel(ch)
        remote.set_requester(ch.request)
        if role != "chief":
            _serve(ch, role, index, self._num_workers, devices, server_memory_limit, mpi(),
                   Watch(cluster_resolver.coordinator_gone))
        from gpustrat.collectives.select import make_communicator  # noqa: PLC0415
        devs = resolve_devices(["cpu:0"])
        super().__init__(devs, make_communicator(devs), inline=True)
        self._next_vid = 0
        self._next_server = 0
        #: Every variable made in the scope, in order (a sharded one whole): what an
        #: optimizer's slots on the servers belong to.
        self._variables: list = []
        self._send_lock = threading.Lock()
        self._coordinator = None
        self._stopped = False
        atexit.register(self._shutdown)
        global _coordinator_strategy
        _coordinator_strategy = self

    # --- what it is -----------------------------------------------------------------
    @property
    def num_ps(self) -> int:
        return self._num_ps

    @property
    def num_workers(self) -> int:
        return self._num_workers

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of one worker: a scheduled function's ``strategy.run`` runs on them."""
        return len(self._worker_devices)

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy(num_ps={self._num_ps}, "
                f"num_workers={self._num_workers}, worker_devices={self._worker_devices})")

    def __reduce__(self):
        # Inside a scheduled function the strategy is that worker's side of it.
        return (_worker_side, ())

    # --- variables ------------------------------------------------------------------
    def _create_variable(self, replica_ctx, initial_value, trainable, name, dtype, sync,
                         agg):
        if replica_ctx is not None:
            raise RuntimeError(f"variable {name!r}: under ParameterServerStrategy make "
                               "variables in strategy.scope() on the coordinator, not "
                               "inside strategy.run")
        arr = wire.contiguous(initial_array(initial_value, dtype))
        _check_variable_dtype(name, arr.dtype)
        if sync is VariableSynchronization.AUTO:
            sync = VariableSynchronization.ON_WRITE
        shards = self._num_shards(name, arr)
        if shards <= 1:
            (made,) = self._remote([arr], [name], trainable, sync, agg)
        else:
            rows = remote.shard_rows(arr.shape[0], shards)
            bounds = np.cumsum(rows)[:-1]
            parts = [wire.contiguous(p) for p in np.split(arr, bounds, axis=0)]
            made = remote.ShardedVariable._from_shards(
                self._remote(parts, [f"{name}/part_{i}" for i in range(shards)],
                             trainable, sync, agg), name)
        self._variables.append(made)
        return made

    def _num_shards(self, name: str, arr) -> int:
        if self._partitioner is None or arr.ndim == 0:
            return 1
        parts = self._partitioner(tuple(arr.shape), arr.dtype)
        parts = [int(p) for p in parts]
        if len(parts) != arr.ndim or any(p != 1 for p in parts[1:]) or parts[0] < 1:
            raise ValueError(f"variable_partitioner returned {parts} for variable {name!r} "
                             f"of shape {arr.shape}: variables are split along axis 0 only, "
                             f"so it must return [num_shards] + [1] * {arr.ndim - 1}")
        return min(parts[0], arr.shape[0])

    def _remote(self, arrays: list, names: list, trainable, sync, agg) -> list:
        """Remote variables of ``arrays`` (a variable's shards), on the next servers in
        turn: all or none. Every one is made (zeros, where a server's memory limit may
        refuse it) before any value travels; when one is refused, those already made
        are deleted and the next variable goes where this one would have."""
        first = self._next_server
        placed = []
        try:
            for arr, name in zip(arrays, names):
                server = self._next_server % self._num_ps
                self._next_server += 1
                vid = self._next_vid
                self._next_vid += 1
                described = wire.describe_dtype(arr.dtype)
                self._channel.request(server, "create", (vid, name, described, arr.shape))
                placed.append((vid, server))
            for arr, (vid, server) in zip(arrays, placed):
                if arr.any():
                    self._channel.request(server, "assign", (vid,), [arr])
        except Exception as e:
            self._next_server = first
            if not isinstance(e, ServerLostError):  # a lost server answers nothing
                for vid, server in placed:
                    self._channel.request(server, "delete", (vid,))
            raise
        return [remote.RemoteVariable._handle(vid, server, arr.shape, arr.dtype, name,
                                              bool(trainable), sync, agg)
                for arr, name, (vid, server) in zip(arrays, names, placed)]

    # --- running --------------------------------------------------------------------
    def run(self, fn, args=(), kwargs=None, options=None):
        raise RuntimeError(
            "ParameterServerStrategy.run runs inside a function scheduled with "
            "ClusterCoordinator.schedule (on that worker's replicas), not on the "
            "coordinator: schedule a function that calls strategy.run")

    def experimental_distribute_dataset(self, dataset, options=None):
        """A dataset that each worker makes for itself, whole: no sharding across workers
        (give it to ``ClusterCoordinator.create_per_worker_dataset``)."""
        return DeferredDataset("dataset", dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``dataset_fn(input_context)`` called on each worker, with
        ``num_input_pipelines`` = workers and ``input_pipeline_id`` = the worker's index
        (give the result to ``ClusterCoordinator.create_per_worker_dataset``)."""
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {dataset_fn!r}")
        return DeferredDataset("fn", dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    # --- ending ---------------------------------------------------------------------
    def _send_to_worker(self, worker: int, header, arrays=(), wait: bool = True):
        """Send a task; ``wait=False`` returns the pending send (see Channel.send)."""
        ch = self._channel
        with self._send_lock:  # one message's pieces are posted together
            pending = ch.send(ch.worker_ranks[worker], TAG_TASK, header, arrays,
                              data_tag=TAG_TASK_DATA, wait=False)
        if not wait:
            return pending
        ch.wait(pending[0], ch.worker_ranks[worker], f"sending a task to worker {worker}")
        return None

    def _shutdown(self) -> None:
        """Stop the workers, then the servers (at the coordinator's exit)."""
        if self._stopped:
            return
        self._stopped = True
        if self._coordinator is not None:
            self._coordinator._stop_dispatcher()
        ch = self._channel
        for w, rank in enumerate(ch.worker_ranks):
            if rank not in ch.lost:
                self._send_to_worker(w, ("stop",))
        for w, rank in enumerate(ch.worker_ranks):
            if rank in ch.lost:
                continue
            try:
                while True:
                    (header, ms) = ch.wait_message(rank, TAG_RESULT,
                                                   f"stopping worker {w}", doorbell.RESULTS)
                    if ms:
                        ch.recv_arrays(rank, TAG_RESULT_DATA, ms, doorbell.RESULTS)
                    if header[0] == "stopped":
                        break
            except ServerLostError as e:
                print(f"gpustrat: {e}", file=sys.stderr, flush=True)
        for s, rank in enumerate(ch.server_ranks):
            if rank in ch.lost:
                continue
            try:
                ch.request(s, "stop")
            except ServerLostError as e:
                print(f"gpustrat: {e}", file=sys.stderr, flush=True)
        if ch.lost:
            # A rank that does not answer would make MPI_Finalize wait for it forever.
            lost = sorted(ch.lost)
            servers = [i for i, r in enumerate(ch.server_ranks) if r in ch.lost]
            workers = [i for i, r in enumerate(ch.worker_ranks) if r in ch.lost]
            print(f"gpustrat: ranks {lost} did not answer (parameter servers {servers}, "
                  f"workers {workers}); ending every rank of the job, since MPI would wait "
                  "for them at its end." + (" Restart it and restore the variables from a "
                  "checkpoint" if servers else ""), file=sys.stderr, flush=True)
            from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
            mpi().COMM_WORLD.Abort(1)


def _check_variable_dtype(name: str, dtype: np.dtype) -> None:
    """Variables on the servers hold numbers, booleans or strings, as TensorFlow's do:
    the servers add updates into them, which dates and records do not allow."""
    if dtype.kind in "Mm" or (dtype.kind == "V" and dtype.isbuiltin != 2):
        raise TypeError(
            f"variable {name!r}: variables on parameter servers hold numbers, booleans "
            f"or strings (as TensorFlow's do), not {dtype}: keep datetime64 and "
            "timedelta64 values as int64 (value.view(np.int64)) and a structured array "
            "as one variable per field, or pass such values to scheduled functions "
            "as arguments")


def _serve(ch, role, index, num_workers, devices, memory_limit, MPI, watch) -> None:
    """Serve as a server or worker rank until stopped, then end the process (status 0).
    An internal error aborts the whole job with the traceback, never a hang."""
    try:
        if role == "ps":
            from gpustrat.distribute.parameter_server.server import Server  # noqa
            Server(ch, index, memory_limit).serve(watch)
        else:
            from gpustrat.distribute.parameter_server.worker import WorkerRank  # noqa
            WorkerRank(ch, index, num_workers, devices).serve(watch)
    except Orphaned:
        print(f"gpustrat: the coordinator (rank 0) exited without stopping the job "
              f"(os._exit?); {role} {index} (rank {ch.rank}) ends it", file=sys.stderr,
              flush=True)
        MPI.COMM_WORLD.Abort(1)
    except BaseException:  # noqa: BLE001 - the job must end, not hang
        print(f"gpustrat: {role} {index} (rank {ch.rank}) failed; ending the job:\n"
              + traceback.format_exc(), file=sys.stderr, flush=True)
        MPI.COMM_WORLD.Abort(1)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(0)


class DeferredDataset:
    """A distributed dataset each worker makes when given to
    ``create_per_worker_dataset``; it cannot be iterated on the coordinator."""

    def __init__(self, kind: str, source, options):
        self.kind = kind
        self.source = source
        self.options = options

    def make(self):
        strategy = _worker_side()
        if self.kind == "dataset":
            return Strategy.experimental_distribute_dataset(strategy, self.source,
                                                            self.options)
        return strategy.distribute_datasets_from_function(self.source, self.options)

    def __iter__(self):
        raise TypeError("under ParameterServerStrategy a distributed dataset is made on "
                        "each worker: pass it to coordinator.create_per_worker_dataset and "
                        "iterate that")


_coordinator_strategy = None


def coordinator_strategy(what: str) -> ParameterServerStrategy:
    """This process's strategy, when it is the coordinator (``what`` is read or written
    only there)."""
    if _coordinator_strategy is None:
        raise RuntimeError(f"{what} are read and written on the coordinator (e.g. by "
                           "gs.train.Checkpoint after ParameterServerStrategy(...)), not "
                           "inside a scheduled function")
    return _coordinator_strategy


# --- the worker's side, inside its function process ----------------------------------

_worker_strategy = None


class WorkerSideStrategy(ParameterServerStrategy):
    """The strategy inside a scheduled function: ``run`` on this worker's replicas, its
    datasets unsharded (one input pipeline per worker)."""

    def __init__(self, worker: int, num_workers: int, devices):
        from gpustrat.collectives.select import make_communicator  # noqa: PLC0415
        from gpustrat.devices import resolve_devices  # noqa: PLC0415
        devs = resolve_devices(devices)
        Strategy.__init__(self, devs, make_communicator(devs), inline=len(devs) == 1)
        self._worker = worker
        self._num_workers = num_workers
        self._num_ps = None
        self._worker_devices = [str(d) for d in devices]

    @property
    def worker_index(self) -> int:
        return self._worker

    def _create_variable(self, replica_ctx, initial_value, trainable, name, dtype, sync,
                         agg):
        raise RuntimeError(f"variable {name!r}: under ParameterServerStrategy make "
                           "variables in strategy.scope() on the coordinator, before "
                           "scheduling functions that use them")

    def run(self, fn, args=(), kwargs=None, options=None):
        return Strategy.run(self, fn, args, kwargs, options)

    def experimental_distribute_dataset(self, dataset, options=None):
        return Strategy.experimental_distribute_dataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        from gpustrat.distribute.input_lib import InputContext  # noqa: PLC0415
        ctx = InputContext(self._num_workers, self._worker, self.num_replicas_in_sync)
        made = Strategy.distribute_datasets_from_function(
            self, lambda _local: dataset_fn(ctx), options)
        made.input_context = ctx
        return made

    def _shutdown(self) -> None:
        pass

    def __repr__(self) -> str:
        return (f"ParameterServerStrategy(worker {self._worker} of {self._num_workers}, "
                f"devices={self._worker_devices})")


def _worker_side():
    global _worker_strategy
    if _worker_strategy is None:
        from gpustrat.distribute.parameter_server import executor  # noqa: PLC0415
        st = executor.state
        if st["worker"] is None:
            raise RuntimeError("a ParameterServerStrategy can only be sent to its own "
                               "workers (inside functions given to schedule)")
        _worker_strategy = WorkerSideStrategy(st["worker"], st["num_workers"],
                                              st["devices"])
    return _worker_strategy
