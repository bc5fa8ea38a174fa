"""Distributed input: datasets whose elements are per-replica values, partial batches
and the end of data, distributed iterators.

Words:
- *global batch*: one element of the user's dataset; it is cut over every replica in
  sync (:mod:`gpustrat.distribute.splitting`).
- *step*: what one ``next()`` yields: one piece per local replica, as per-replica values.
- *auto-shard policy*: how workers share the data (DATA, FILE, OFF; AUTO picks FILE for
  file-reading pipelines, else DATA).

The pipeline of one epoch, per worker:
    dataset (sharded by files under FILE) -> prefetch(num_replicas_in_sync)
    -> cut into pieces, this worker's share -> end-of-data agreement between workers
    -> placement on the replicas' devices (background thread for GPUs) -> per-replica values
"""

from __future__ import annotations

import enum
import itertools
import logging
from typing import Any, Callable

from gpustrat import nest
from gpustrat import timeline as _tl
from gpustrat.distribute import context, end_of_data, input_position
from gpustrat.distribute.placement import Placer
from gpustrat.distribute.splitting import Splitter, deal_steps
from gpustrat.errors import OutOfRangeError
from gpustrat.values import PerReplica

log = logging.getLogger("gpustrat")


class InputReplicationMode(enum.Enum):
    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


class InputOptions:
    """Options for distributed input, as ``tf.distribute.InputOptions``.

    Args:
        experimental_fetch_to_device: place each piece on its replica's device before
            ``run`` sees it (default True). False leaves pieces in host memory.
        experimental_per_replica_buffer_size: steps placed ahead on the devices by the
            background prefetcher (GPU devices; default 1).
        experimental_replication_mode: PER_WORKER (one input pipeline per worker, the
            only mode implemented; PER_REPLICA raises).
        experimental_place_dataset_on_device: accepted for compatibility; must be False.
    """

    def __init__(self, experimental_fetch_to_device: bool = True,
                 experimental_replication_mode=InputReplicationMode.PER_WORKER,
                 experimental_place_dataset_on_device: bool = False,
                 experimental_per_replica_buffer_size: int = 1):
        if experimental_per_replica_buffer_size < 1:
            raise ValueError("experimental_per_replica_buffer_size must be at least 1, got "
                             f"{experimental_per_replica_buffer_size}")
        if InputReplicationMode(experimental_replication_mode) is not \
                InputReplicationMode.PER_WORKER:
            raise ValueError("only InputReplicationMode.PER_WORKER is supported: one input "
                             "pipeline per worker")
        if experimental_place_dataset_on_device:
            raise ValueError("experimental_place_dataset_on_device=True is not supported: "
                             "gpustrat pipelines run on the host and place pieces on devices")
        self.experimental_fetch_to_device = bool(experimental_fetch_to_device)
        self.experimental_replication_mode = InputReplicationMode(experimental_replication_mode)
        self.experimental_place_dataset_on_device = False
        self.experimental_per_replica_buffer_size = int(experimental_per_replica_buffer_size)

    def __repr__(self) -> str:
        return (f"InputOptions(experimental_fetch_to_device={self.experimental_fetch_to_device}, "
                f"experimental_per_replica_buffer_size={self.experimental_per_replica_buffer_size})")


class InputContext:
    """What ``distribute_datasets_from_function``'s ``dataset_fn`` is told."""

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``.

        Raises:
            ValueError: the global batch size does not divide evenly.
        """
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size ({global_batch_size}) is not divisible by "
                f"num_replicas_in_sync ({self.num_replicas_in_sync}); choose a multiple of "
                f"{self.num_replicas_in_sync}")
        return global_batch_size // self.num_replicas_in_sync

    def __repr__(self) -> str:
        return (f"InputContext(num_input_pipelines={self.num_input_pipelines}, "
                f"input_pipeline_id={self.input_pipeline_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


class Optional:
    """What ``get_next_as_optional`` returns: a value, or none at the end of data."""

    def __init__(self, value: Any = None, has_value: bool = False):
        self._value, self._has = value, has_value

    def has_value(self) -> bool:
        return self._has

    def get_value(self) -> Any:
        if not self._has:
            raise OutOfRangeError("the optional has no value: the distributed dataset ended")
        return self._value

    def __repr__(self) -> str:
        return f"Optional({self._value!r})" if self._has else "Optional(None)"


_TRANSFORMS = ("map", "batch", "unbatch", "filter", "shuffle", "repeat", "take", "skip",
               "shard", "enumerate", "zip", "concatenate", "interleave", "prefetch",
               "with_options", "cache", "padded_batch", "rebatch", "flat_map", "apply",
               "window", "scan", "unique", "ignore_errors", "group_by_window",
               "bucket_by_sequence_length")


class _DistributedBase:
    """What the two kinds of distributed dataset share: iteration and no transforms."""

    def __getattr__(self, name: str):
        if name in _TRANSFORMS:
            raise AttributeError(
                f"a distributed dataset cannot be transformed further ({name!r}): apply "
                f"{name} to the dataset before distributing it; a distributed dataset can only "
                "be iterated or asked for its element_spec, cardinality() or len()")
        raise AttributeError(f"{type(self).__name__!s} has no attribute {name!r}")

    def __iter__(self) -> "DistributedIterator":
        return DistributedIterator(self._strategy, self, self._options, self.element_spec,
                                   self._stats)

    def _epoch(self, start_state=None, resume=None):
        """``(steps, start, origin)`` of a new epoch: the steps generator, the position
        of this worker's dataset iterator before its first element (the reason, as a
        string, where the pipeline cannot save its position), and the stream position
        the steps start at. ``start_state`` restores that iterator position first;
        ``resume = (layout, origin, steps)`` then continues after ``steps`` steps that
        ``layout`` took from ``origin`` (see :mod:`~gpustrat.distribute.input_position`)."""
        source = iter(self._dataset)
        if start_state is not None:
            source.set_state(start_state)
        try:
            start = source.get_state() if hasattr(source, "get_state") else \
                f"{type(self._dataset).__name__} has no iterator position to save"
        except ValueError as e:
            start = str(e)
        if resume is None:
            return self._epoch_steps(source), start, (0, 0)
        layout, origin, steps = resume
        position, current = input_position.replay(
            source, layout, origin, steps, Splitter(self._strategy.num_replicas_in_sync))
        return self._epoch_steps(source, position, current), start, position


def _spec_or_none(dataset) -> Any:
    """The dataset's element_spec, or None where it cannot be known (an empty dataset
    whose spec comes from looking at an element)."""
    try:
        return getattr(dataset, "element_spec", None)
    except ValueError:
        return None


def _per_replica_spec(dataset, num_pieces: int | None = None) -> Any:
    """The spec of one replica's piece. As tf.distribute: when every global batch has
    a static size ``b`` that ``num_pieces`` divides (``batch(b, drop_remainder=True)``),
    pieces have ``b // num_pieces`` rows; otherwise the batch dimension is None."""
    from gpustrat.data.spec import TensorSpec  # noqa: PLC0415
    spec = _spec_or_none(dataset)
    if spec is None:
        return None

    def piece(s):
        if not len(s.shape):
            return s
        b = s.shape[0]
        rows = b // num_pieces if num_pieces and b is not None and b % num_pieces == 0 \
            else None
        return TensorSpec((rows,) + tuple(s.shape[1:]), s.dtype)
    return nest.map_structure(piece, spec)


class DistributedDataset(_DistributedBase):
    """``strategy.experimental_distribute_dataset(dataset)``: each global batch cut over
    every replica in sync. Iterable once per epoch, any number of times."""

    def __init__(self, strategy, dataset, options: InputOptions | None = None):
        from gpustrat.data import AutoShardPolicy, Dataset, autoshard  # noqa: PLC0415
        if not isinstance(dataset, Dataset):
            raise TypeError(
                f"experimental_distribute_dataset needs a gs.data.Dataset, got "
                f"{type(dataset).__name__}: make one, e.g. "
                "gs.data.Dataset.from_tensor_slices(arrays).batch(global_batch_size)")
        self._strategy = strategy
        self._options = _check_options(options, "experimental_distribute_dataset")
        self._stats = end_of_data.Agreement()
        # One replica in sync: as tf.distribute, elements pass through uncut (unbatched
        # data is fine, and element_spec is the dataset's own).
        self._whole = strategy.num_replicas_in_sync == 1
        _refuse_dataset_elements(dataset)
        if not self._whole:
            _check_batched_spec(dataset)
        workers = strategy.workers
        policy = AutoShardPolicy.OFF if workers.size == 1 else \
            dataset.options().experimental_distribute.auto_shard_policy
        if policy is AutoShardPolicy.AUTO:
            # As tf.data: FILE when the pipeline reads files and has no source that
            # FILE sharding would leave whole on every worker, else DATA.
            policy = AutoShardPolicy.FILE if autoshard.reads_files(dataset) and not \
                autoshard.unshardable_sources(dataset) else AutoShardPolicy.DATA
            if workers.rank == 0:
                log.info("auto-shard policy AUTO chose %s (the dataset %s files)", policy.name,
                         "reads" if policy is AutoShardPolicy.FILE else
                         "reads no or not only")
        if policy is AutoShardPolicy.FILE:
            # Every rank runs the same checks, so their errors are raised on all.
            _refuse_unshardable_sources(dataset, autoshard)
            _refuse_file_cache_under_file_sharding(dataset)
            dataset = autoshard.shard_files(dataset, workers.size, workers.rank)
        elif policy is AutoShardPolicy.DATA:
            # Every worker must read the same order: unseeded shuffles take worker 0's
            # seeds (one allgather here, whether or not there are any), parallel maps
            # keep their order.
            dataset = autoshard.same_order_everywhere(dataset, workers)
        self.auto_shard_policy = policy
        self._stream = policy in (AutoShardPolicy.FILE, AutoShardPolicy.OFF)
        # Under FILE each worker reads other files, so step counts differ between workers.
        self._counts_differ = policy is AutoShardPolicy.FILE
        # The appended prefetch of num_replicas_in_sync batches, in a thread when
        # producing a batch costs more than a thread handoff (see adaptive_prefetch).
        from gpustrat.data.unary import PrefetchDataset  # noqa: PLC0415
        self._dataset = PrefetchDataset(dataset, strategy.num_replicas_in_sync, adaptive=True)
        if self._whole:
            self.element_spec = _spec_or_none(dataset)
        else:
            # Under FILE a worker may run out early and get empty pieces: no static rows.
            self.element_spec = _per_replica_spec(
                dataset, None if self._counts_differ else strategy.num_replicas_in_sync)

    def layout(self) -> input_position.Layout:
        """How this topology cuts the batches into steps (one worker: dealt)."""
        s = self._strategy
        return input_position.Layout(s.num_workers, len(s.local_devices),
                                     not self._stream or s.num_workers == 1,
                                     s.worker_index)

    def stream_kind(self) -> str:
        """``"worker"`` where each worker reads its own files (FILE on several workers),
        else ``"global"``: every worker reads the dataset's stream whole."""
        return "worker" if self._counts_differ and self._strategy.num_workers > 1 \
            else "global"

    def _steps_per_epoch(self, position=(0, 0), current_rows=None) -> int | None:
        card = self._dataset.cardinality()
        if card < 0:
            return None
        layout = self.layout()
        # FILE and OFF: a batch gives as many steps as it has non-empty pieces (local
        # replicas at a time), so the rows of the batches must be known too.
        rows = None if layout.dealt or card == 0 else _batch_rows(self._dataset, card)
        return layout.steps_left(card, rows, position, current_rows)

    def cardinality(self) -> int:
        """Steps per epoch on this worker, or -1 (infinite) / -2 (unknown)."""
        card = self._dataset.cardinality()
        if card < 0 or (self._counts_differ and self._strategy.num_workers > 1):
            return card if card < 0 else -2
        steps = self._steps_per_epoch()
        return -2 if steps is None else steps

    def __len__(self) -> int:
        n = self.cardinality()
        if n < 0:
            raise TypeError("the number of steps of this distributed dataset is "
                            f"{'infinite' if n == -1 else 'unknown'}")
        return n

    def _epoch_steps(self, source, position=(0, 0), current=None):
        s = self._strategy
        local, workers = len(s.local_devices), s.workers
        splitter = Splitter(s.num_replicas_in_sync)
        # A batch consumed in part before a restore: its steps from the position on.
        head = [] if current is None else \
            input_position.clipped_steps(current, position[1], self.layout(), splitter)
        if self._whole:
            steps = ([element] for element in source)
            return itertools.chain(head, steps) if head else steps
        steps = deal_steps(source, splitter, workers.rank, workers.size, local,
                           self._stream)
        if head:
            steps = itertools.chain(head, steps)
        if workers.size == 1:
            return steps
        # Even under DATA and OFF, where every worker should run the same steps, the
        # workers check: a rank-dependent pipeline must not hang the job. With known step
        # counts that is one allgather per epoch. Under DATA a worker with fewer steps
        # would lose the others' pieces of the batches it lacks: an error on every rank.
        from gpustrat.data import AutoShardPolicy  # noqa: PLC0415
        rows = None if current is None else splitter.rows(splitter.flatten(current))
        return end_of_data.agreed_steps(
            steps, workers, local, self._steps_per_epoch(position, rows),
            splitter.empty_like, self._stats,
            same_steps=self.auto_shard_policy is AutoShardPolicy.DATA)


class DistributedDatasetsFromFunction(_DistributedBase):
    """``strategy.distribute_datasets_from_function(dataset_fn)``: one pipeline per
    worker, already batched per replica; local replicas take its batches in turn."""

    def __init__(self, strategy, dataset_fn: Callable, options: InputOptions | None = None):
        from gpustrat.data import Dataset  # noqa: PLC0415
        if not callable(dataset_fn) or isinstance(dataset_fn, Dataset):
            raise TypeError(
                f"distribute_datasets_from_function needs a function "
                f"dataset_fn(input_context) that returns this worker's dataset, got "
                f"{type(dataset_fn).__name__}; to distribute a dataset you have, use "
                "strategy.experimental_distribute_dataset(dataset)")
        _check_takes_one_argument(dataset_fn)
        self._strategy = strategy
        self._options = _check_options(options, "distribute_datasets_from_function")
        self._stats = end_of_data.Agreement()
        workers = strategy.workers
        ctx = InputContext(workers.size, workers.rank, strategy.num_replicas_in_sync)
        self.input_context = ctx
        self._dataset = dataset_fn(ctx)
        if not isinstance(self._dataset, Dataset):
            raise TypeError(f"dataset_fn must return a gs.data.Dataset (batched by the "
                            f"per-replica batch size), got {type(self._dataset).__name__}")
        # One replica in sync takes the batches as they are (no empty batches to make,
        # so unbatched data is fine); several need batches to pad the last step with.
        self._whole = strategy.num_replicas_in_sync == 1
        _refuse_dataset_elements(self._dataset, "distribute_datasets_from_function")
        if self._whole:
            self.element_spec = _spec_or_none(self._dataset)
        else:
            _check_batched_spec(self._dataset, "distribute_datasets_from_function")
            self.element_spec = _per_replica_spec(self._dataset)

    def _steps_per_epoch(self) -> int | None:
        card = self._dataset.cardinality() if hasattr(self._dataset, "cardinality") else -2
        if card < 0:
            return None
        local = len(self._strategy.local_devices)
        return -(-card // local)

    def cardinality(self) -> int:
        n = self._steps_per_epoch()
        if n is None:
            return self._dataset.cardinality() if hasattr(self._dataset, "cardinality") else -2
        return n if self._strategy.num_workers == 1 else -2

    def _epoch_steps(self, source):
        if self._whole:
            return ([element] for element in source)
        s = self._strategy
        local, workers = len(s.local_devices), s.workers
        splitter = Splitter(1, "distribute_datasets_from_function")
        steps = _take_in_turn(source, local, splitter)
        if workers.size == 1:
            return steps
        return end_of_data.agreed_steps(steps, workers, local, self._steps_per_epoch(),
                                        splitter.empty_like, self._stats)


def _take_in_turn(batches, local: int, splitter: Splitter):
    """Replica 0 takes the first batch, replica 1 the second, ...; at the end of the
    data the replicas left over get empty batches."""
    while True:
        step = []
        for _ in range(local):
            b = next(batches, None)
            if b is None:
                break
            splitter.rows(splitter.flatten(b))  # a clear error for unbatched data
            step.append(b)
        if not step:
            return
        while len(step) < local:
            step.append(splitter.empty_like(step[0]))
        yield step


def _batch_rows(dataset, card: int) -> tuple[int, int] | None:
    """(rows of a full batch, rows of the last batch) of a dataset of ``card`` batches,
    or None where the pipeline does not tell: a static batch dimension
    (``batch(b, drop_remainder=True)``), or :meth:`Dataset.batch_rows` (a ``batch``
    whose input's size is known, under any ``prefetch``/``with_options``)."""
    dims = {s.shape[0] for s in nest.flatten(_spec_or_none(dataset) or ())
            if getattr(s, "shape", None) is not None and len(s.shape)}
    if len(dims) == 1 and None not in dims:
        b = dims.pop()
        return b, b
    rows = dataset.batch_rows() if hasattr(dataset, "batch_rows") else None
    if rows is None or rows[0] <= 0:
        return None
    full, last = rows
    # The rows must account for exactly the dataset's batches.
    if card < 1 or not 0 < last <= full:
        return None
    return full, last


def _check_options(options, what: str) -> "InputOptions":
    """``options``, or the defaults for None; anything but InputOptions is a TypeError."""
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"{what}: options must be a gs.distribute.InputOptions, got "
                        f"{type(options).__name__} {options!r}: pass "
                        "gs.distribute.InputOptions(experimental_fetch_to_device=..., ...)")
    return options


def _check_takes_one_argument(fn: Callable) -> None:
    """``fn`` can be called with one positional argument (the InputContext), where its
    signature can be read."""
    import inspect  # noqa: PLC0415
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: called as given
        return
    try:
        sig.bind(None)
    except TypeError:
        raise TypeError(
            f"distribute_datasets_from_function calls dataset_fn(input_context) with one "
            f"argument, but {getattr(fn, '__name__', fn)!r} has the signature {sig}: "
            "take the InputContext (ctx.get_per_replica_batch_size, "
            "ctx.num_input_pipelines, ctx.input_pipeline_id)") from None


def _refuse_dataset_elements(dataset, what: str = "experimental_distribute_dataset") -> None:
    """Elements that are datasets (``window``) cannot be cut over replicas nor placed on
    devices: a clear error instead of one from deep inside the splitting."""
    from gpustrat.data.windowing import contains_datasets  # noqa: PLC0415
    spec = _spec_or_none(dataset)
    if spec is not None and contains_datasets(spec):
        raise ValueError(
            f"{what}: the dataset's elements are datasets (element_spec {spec}), made by "
            "window(); a distributed dataset needs arrays. Turn each window into a batch "
            "before distributing, e.g. ds.window(n).flat_map(lambda w: w.batch(n))")


def _refuse_unshardable_sources(dataset, autoshard) -> None:
    """FILE sharding of a pipeline that also reads data from no file would give that
    data whole to every worker (TensorFlow: "Found an unshardable source dataset")."""
    whole = autoshard.unshardable_sources(dataset)
    if whole and autoshard.reads_files(dataset):
        names = sorted({type(n).__name__ for n in whole})
        raise ValueError(
            f"the FILE auto-shard policy gives each worker some of the files, but the "
            f"dataset also reads data from sources that are not files ({', '.join(names)}),"
            " which every worker would read whole: use AutoShardPolicy.DATA (or AUTO, "
            "which picks DATA here) or OFF, or read every input from files")


def _refuse_file_cache_under_file_sharding(dataset) -> None:
    """A file cache filled from files that FILE sharding splits between workers would
    hold another worker's data under the same name (or, filled before, all the data)."""
    from gpustrat.data.caching import file_cache_names  # noqa: PLC0415
    names = file_cache_names(dataset)
    if names:
        raise ValueError(
            f"the dataset caches files it reads into {names}, but the FILE auto-shard "
            "policy gives each worker other files, so every worker would read or write "
            "the same cache with different data. Cache in memory (cache()), use "
            "AutoShardPolicy.DATA or OFF, or build each worker's pipeline with "
            "distribute_datasets_from_function and a filename per input_pipeline_id")


def _check_batched_spec(dataset, what: str = "experimental_distribute_dataset") -> None:
    spec = _spec_or_none(dataset)
    if spec is None:
        return
    for s in nest.flatten(spec):
        shape = getattr(s, "shape", None)
        if shape is not None and len(shape) == 0:
            raise ValueError(
                f"{what} needs a dataset batched by the "
                f"{'global' if what.startswith('experimental') else 'per-replica'} batch size, "
                f"but its elements have scalar components (element_spec {spec}); call "
                ".batch(batch_size) before distributing it")


class DistributedIterator:
    """Iterator over a distributed dataset: ``next``/``get_next`` raise at the end,
    ``get_next_as_optional`` returns an :class:`Optional`."""

    # A checkpoint saves one position per worker.
    _checkpoint_per_worker = True

    def __init__(self, strategy, dataset, options: InputOptions, element_spec, stats):
        self._strategy = strategy
        self._source = dataset
        self._options = options
        self.element_spec = element_spec
        self._stats = stats
        self._single = len(strategy.local_devices) == 1
        self._workers = strategy.workers  # counts the steps handed out (input_steps)
        self._start_epoch(None)

    def _start_epoch(self, start_state, resume=None) -> None:
        steps, self._start, self._origin = self._source._epoch(start_state, resume)
        self._returned = 0
        self._placer = Placer(self._strategy.local_devices, steps,
                              fetch_to_device=self._options.experimental_fetch_to_device,
                              buffer_size=self._options.experimental_per_replica_buffer_size)

    @property
    def distribute_strategy(self):
        return self._strategy

    def __iter__(self):
        return self

    def __next__(self):
        if context.current()[1] is not None:
            raise RuntimeError(
                "next() of a distributed iterator inside strategy.run: each replica would "
                "take a whole step (every replica's batch), and steps would go "
                f"{self._strategy.num_replicas_in_sync} times as fast. Take the step "
                "outside and pass it in: strategy.run(fn, args=(next(iterator),))")
        # (raises StopIteration at the end)
        step = _tl.timed("get_next", self._placer.next) if _tl.ON else self._placer.next()
        self._returned += 1
        # Every worker hands out the same steps (the end-of-data agreement pads the
        # shorter ones), so collectives between workers compare this count.
        self._workers.input_steps += 1
        if self._single:
            return step[0]
        return _regroup_pieces(step, self._strategy.local_devices)

    def _topology(self) -> list:
        s = self._strategy
        return [s.num_workers, len(s.local_devices)]

    def _policy(self) -> str:
        return str(getattr(self._source, "auto_shard_policy", "FUNCTION"))

    def _stream_kind(self) -> str:
        if isinstance(self._source, DistributedDataset):
            return self._source.stream_kind()
        return "function"

    def get_state(self) -> dict:
        """This worker's position: its dataset iterator's position at the start of the
        epoch, where this iterator's steps started (``origin``, a stream position, see
        :mod:`~gpustrat.distribute.input_position`) and the steps ``next`` has returned
        since (never what the prefetchers read ahead), with the topology that took them.
        Every worker saves its own.

        Raises:
            ValueError: the pipeline cannot save its position (the message names the
                transformation).
        """
        if isinstance(self._start, str):
            raise ValueError(f"cannot save the position of this distributed iterator: "
                             f"{self._start}")
        state = {"steps": self._returned, "start": self._start,
                 "topology": self._topology(), "worker": self._strategy.worker_index,
                 "policy": self._policy(), "stream": self._stream_kind()}
        if isinstance(self._source, DistributedDataset):
            state["origin"] = [int(v) for v in self._origin]
            state["layout"] = "dealt" if self._source.layout().dealt else "stream"
        return state

    def _restore_checkpoint_state_from(self, states: list) -> None:
        """Restore from the positions saved by another number of workers: this worker
        continues from saved worker ``k mod W``'s (see
        :func:`~gpustrat.distribute.input_position.source_state`)."""
        self.set_state(input_position.source_state(states, self._strategy.worker_index))

    def set_state(self, state: dict) -> None:
        """Continue from a position :meth:`get_state` returned: under DATA and OFF (and
        on one worker) saved on any number of workers and replicas (the rest of the
        epoch is what this topology takes from that point of the dataset's stream), under
        FILE on the same number of workers, for ``distribute_datasets_from_function`` on
        the same topology. Reads the epoch's input up to the position again (no model
        code runs); a collective under several workers (the steps' counts are agreed).

        Raises:
            ValueError: the position was saved on a topology it cannot move from, or
                for another dataset.
        """
        state = input_position.upgrade(state)
        input_position.check_compatible(state, self._stream_kind(), self._topology(),
                                        self._policy(), self._strategy.worker_index)
        self._placer.close()
        if "origin" not in state:
            # distribute_datasets_from_function: the same topology, the same steps.
            self._start_epoch(state["start"])
            for _ in range(int(state["steps"])):
                self._placer.next()
            self._returned = int(state["steps"])
            return
        self._start_epoch(state["start"], resume=(input_position.Layout.of(state),
                                                  tuple(state["origin"]),
                                                  int(state["steps"])))

    _checkpoint_state = get_state
    _restore_checkpoint_state = set_state

    def _position_unsaveable(self) -> str | None:
        """Why this iterator cannot save its position (None: it can)."""
        return f"its pipeline cannot save its position: {self._start}" \
            if isinstance(self._start, str) else None

    def get_next(self):
        """The next step; raises :class:`gpustrat.errors.OutOfRangeError` at the end."""
        try:
            return self.__next__()
        except StopIteration:
            raise OutOfRangeError("end of the distributed dataset") from None

    def get_next_as_optional(self) -> Optional:
        try:
            return Optional(self.__next__(), True)
        except StopIteration:
            return Optional()

    @property
    def agreement_collectives(self) -> int:
        """Collectives between workers this dataset's epochs have spent agreeing on the
        end of data (see :mod:`gpustrat.distribute.end_of_data`)."""
        return self._stats.collectives

    def close(self) -> None:
        self._placer.close()

    def __del__(self):
        try:
            self._placer.close_later()
        except Exception:
            pass


def _regroup_pieces(step: list, devices: tuple) -> Any:
    first = step[0]
    if not nest.is_nested(first):
        return PerReplica(step, devices)
    flats = [nest.flatten(p) for p in step]
    return nest.pack_sequence_as(first, [PerReplica(col, devices) for col in zip(*flats)])
