"""The :class:`Dataset` class: a lazy, restartable input pipeline, as ``tf.data.Dataset``.

Words:
    node: one Dataset object. A pipeline is a graph of nodes: sources (no inputs, such as
        ``range`` or ``TextLineDataset``) and transformations (``map``, ``batch``, ...)
        that know their input nodes (:meth:`Dataset._inputs`) and can be rebuilt over
        other inputs (:meth:`Dataset._with_inputs`). Auto-sharding uses that to rebuild
        a pipeline with each file source reading only some of its files.
    file source: a node with a static list of files (``_files``); it can be rebuilt over
        another list with ``_with_files``.
    iteration: ``iter(dataset)`` builds a fresh chain of Python generators, one per node
        (:meth:`Dataset._iter`), and wraps the last one in a :class:`DatasetIterator`.
        Every ``iter`` is a new epoch: sources restart, shuffles reshuffle. Nothing runs
        (no file is opened, no thread started) before the first ``next``.
    cardinality: the number of elements, or :data:`INFINITE_CARDINALITY` (-1) or
        :data:`UNKNOWN_CARDINALITY` (-2), as in ``tf.data``.
    peek: to compute an ``element_spec`` that cannot be derived statically (``map``
        runs user code), a node iterates its input for its first two elements with a
        peek context: shuffles use their first-epoch order without counting an epoch,
        parallel stages run serially. The function is called on those elements and on
        copies of the first with its unknown dimensions resized (up to four calls, see
        :func:`gpustrat.data.spec.probes`) before the data is iterated.
"""

from __future__ import annotations

import abc
import os
from typing import Any, Callable, Iterator

import numpy as np

from gpustrat.data.iterator_state import (drawn_seed_nodes, epoch_counts, fingerprint,
                                          set_drawn_seed, set_epoch_counts,
                                          unsupported_nodes)
from gpustrat.data.options import Options
from gpustrat.data.spec import spec_of, unknown_dims

INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
# tf.data.AUTOTUNE: "pick a value for me".
AUTOTUNE = -1


def autotune_parallelism() -> int:
    """Threads used for ``num_parallel_calls=AUTOTUNE``.

    Mapped functions are Python code that mostly waits (I/O, sleeps, NumPy releasing the
    GIL), so more threads than cores pay off: four per core, at least 8, at most 32.
    """
    return max(8, min(32, 4 * (os.cpu_count() or 1)))


class _IterContext:
    """What a node's ``_iter`` needs to know about the iteration it is part of."""

    __slots__ = ("peek", "root", "_options")

    def __init__(self, peek: bool = False, root: "Dataset | None" = None):
        self.peek = peek
        self.root = root
        self._options = None

    def options(self, node: "Dataset") -> Options:
        """The options of the whole pipeline iterated (those set downstream of ``node``
        too, as tf.data applies options to the whole pipeline), else ``node``'s."""
        if self._options is None:
            self._options = (self.root if self.root is not None else node).options()
        return self._options


# What an ended or failed iterator's ``next`` reads: raises StopIteration.
_ENDED = iter(())


class DatasetIterator:
    """An iterator over one epoch of a dataset.

    ``next(it)`` (or ``it.get_next()``) returns the next element and raises
    ``StopIteration`` at the end. ``close()`` stops the pipeline: every background thread
    of the epoch is stopped and joined before ``close`` returns. Dropping the last
    reference to the iterator does the same.
    """

    __slots__ = ("_gen", "_dataset", "_state", "_failed")

    # A checkpoint saves one position per worker (each worker reads its own input).
    _checkpoint_per_worker = True

    def __init__(self, dataset: "Dataset", gen: Iterator, state=None):
        # ``state``: the root StateIterator of the epoch (None: the pipeline cannot save
        # its position), and ``gen`` what ``next`` is called on: its fast_iter(), often
        # a C-level iterator, so that tracking the position costs nothing per element.
        self._gen = gen
        self._dataset = dataset
        self._state = state
        self._failed: str | None = None

    def get_state(self) -> dict:
        """The position of this iterator: what ``next`` has returned so far (never
        what a prefetch read ahead), as a state tree that :meth:`set_state` takes back.

        Raises:
            ValueError: a node of the pipeline cannot save its position (the message
                names it), or the pipeline raised an error (a position after an error
                is not saved: restore the last saved one).
        """
        if self._state is None:
            why = unsupported_nodes(self._dataset) or ["this iterator was not made by iter()"]
            raise ValueError("cannot save the position of this dataset iterator: "
                             + "; ".join(why))
        if self._failed is not None:
            raise ValueError(f"cannot save the position of a dataset iterator whose "
                             f"pipeline raised {self._failed}: restore the last saved "
                             "position instead")
        state = {"dataset": fingerprint(self._dataset), "position": self._state.save()}
        drawn = drawn_seed_nodes(self._dataset)
        if drawn:
            state["seeds"] = np.array([n._seed for n in drawn], np.uint64)
        epochs = epoch_counts(self._dataset)
        if epochs:
            state["epochs"] = np.array(epochs, np.int64)
        return state

    def set_state(self, state: dict) -> None:
        """Continue from a position that :meth:`get_state` returned, for the same
        dataset (the same transformations over the same sizes).

        Raises:
            ValueError: the state is of another dataset, or this one cannot restore.
        """
        if self._state is None:
            self.get_state()  # raises the error naming the node
        mine = fingerprint(self._dataset)
        if list(state["dataset"]) != mine:
            raise ValueError(f"cannot restore an iterator position saved for another "
                             f"dataset: saved for {list(state['dataset'])}, this dataset is "
                             f"{mine} (node:cardinality); restore into the pipeline that "
                             "was saved")
        if "seeds" in state:  # before any node's iterator reads its seed
            for node, seed in zip(drawn_seed_nodes(self._dataset), state["seeds"]):
                set_drawn_seed(node, seed)
        fresh = self._dataset._state_iter(_IterContext(root=self._dataset))
        fresh.restore(state["position"])
        if "epochs" in state:  # the counters as at the save (making fresh moved them)
            set_epoch_counts(self._dataset, state["epochs"])
        self._close()
        self._state, self._gen, self._failed = fresh, fresh.fast_iter(), None

    _checkpoint_state = get_state
    _restore_checkpoint_state = set_state

    def _position_unsaveable(self) -> str | None:
        """Why this iterator cannot save its position (None: it can)."""
        if self._state is not None:
            return None
        return "; ".join(unsupported_nodes(self._dataset)
                         or ["this iterator was not made by iter()"])

    def __iter__(self) -> "DatasetIterator":
        return self

    def __next__(self):
        try:
            return next(self._gen)
        except StopIteration:
            self._close()
            raise
        except BaseException as e:
            # As a generator that raised: the chain is closed (its threads joined), later
            # ``next`` calls raise StopIteration, and the position is no longer saved.
            if self._state is not None:
                self._failed = f"{type(e).__name__}: {e}"
            self._close()
            raise

    def get_next(self):
        """The next element; raises ``StopIteration`` at the end (as ``next``)."""
        return self.__next__()

    def _close(self) -> None:
        if self._state is not None:
            if self._gen is _ENDED:
                return
            self._gen = _ENDED
            self._state.close()
        else:
            self._gen.close()

    @property
    def element_spec(self):
        return self._dataset.element_spec

    def close(self) -> None:
        """Stop the pipeline and join its threads; later ``next`` calls raise StopIteration."""
        self._close()

    def __enter__(self) -> "DatasetIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._close()
        except Exception:  # interpreter shutdown: nothing left to stop
            pass


def _check_int(name: str, value, what: str) -> int:
    """``value`` as an int; TypeError naming it when it is not an integer (a float, a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_positive(name: str, value, what: str) -> int:
    value = _check_int(name, value, what)
    if value <= 0:
        raise ValueError(f"{what}: {name} must be positive, got {value}")
    return int(value)


def rows_of_batches(total: int, batch_size: int, drop_remainder: bool
                    ) -> tuple[int, int] | None:
    """:meth:`Dataset.batch_rows` of ``total`` elements (negative: unknown) batched by
    ``batch_size``; None when there is no batch at all."""
    if total < 0:
        return None
    if drop_remainder:
        return (batch_size, batch_size) if total >= batch_size else None
    if total == 0:
        return None
    count = -(-total // batch_size)
    return batch_size, total - (count - 1) * batch_size


class Dataset(abc.ABC):
    """A ``tf.data``-compatible pipeline of elements (nested structures of arrays).

    Build one with the static constructors (:meth:`range`, :meth:`from_tensor_slices`,
    :meth:`from_generator`, :meth:`list_files`, ...) or the file sources
    (``TextLineDataset``, ``TFRecordDataset``, ``NpyDataset``), chain transformations,
    and iterate: every ``for x in dataset`` is one epoch.
    """

    # Static file list of a file source; None for every other node.
    _files: list[str] | None = None

    # --- graph protocol --------------------------------------------------------------

    def _inputs(self) -> tuple["Dataset", ...]:
        """The datasets this node reads from (none for a source)."""
        return ()

    def _with_inputs(self, inputs: tuple["Dataset", ...]) -> "Dataset":
        """The same transformation over other inputs (sources return themselves)."""
        return self

    @abc.abstractmethod
    def _iter(self, ctx: _IterContext) -> Iterator:
        """A fresh generator over one epoch of this node's elements."""

    def _cardinality(self) -> int:
        return UNKNOWN_CARDINALITY

    # --- position saving (see gpustrat.data.iterator_state) ---------------------------

    def _state_iter(self, ctx: _IterContext):
        """A fresh :class:`~gpustrat.data.iterator_state.StateIterator` over one epoch;
        only called when :meth:`_state_unsupported` of every node is None."""
        raise NotImplementedError

    def _state_unsupported(self) -> str | None:
        """Why this node cannot save its position (None: it can)."""
        if type(self)._state_iter is Dataset._state_iter:
            return (f"{type(self).__name__} cannot save its position yet (saving the "
                    "position of this transformation is not supported)")
        return None

    def _compute_spec(self) -> Any:
        """The element spec; by default the first element's ranks and dtypes (a peek),
        every dimension None: nothing says that later elements have its shape."""
        gen = self._iter(_IterContext(peek=True))
        try:
            first = next(gen)
        except StopIteration:
            raise ValueError(
                f"cannot infer the element_spec of an empty {type(self).__name__}: "
                "it has no element to look at") from None
        finally:
            gen.close()
        return unknown_dims(spec_of(first))

    def _batch_fused(self, batch_size: int, drop_remainder: bool) -> "Dataset | None":
        """A source that yields whole batches by slicing, or None if this node has none."""
        return None

    # --- inspection ------------------------------------------------------------------

    def __iter__(self) -> DatasetIterator:
        # Whether every node can save its position, walked once per node: datasets are
        # immutable, and a copy (another id) walks again.
        saveable = self.__dict__.get("_saveable")
        if saveable is None or saveable[0] != id(self):
            saveable = self.__dict__["_saveable"] = (id(self), not unsupported_nodes(self))
        if saveable[1]:
            state = self._state_iter(_IterContext(root=self))
            return DatasetIterator(self, state.fast_iter(), state)
        return DatasetIterator(self, self._iter(_IterContext(root=self)))

    @property
    def element_spec(self) -> Any:
        """Nested structure of :class:`TensorSpec` describing each element."""
        spec = self.__dict__.get("_spec_cache")
        if spec is None:
            spec = self._compute_spec()
            self.__dict__["_spec_cache"] = spec
        return spec

    def cardinality(self) -> int:
        """Number of elements, or INFINITE_CARDINALITY (-1) / UNKNOWN_CARDINALITY (-2)."""
        return int(self._cardinality())

    def batch_rows(self) -> tuple[int, int] | None:
        """``(rows of a full batch, rows of the last batch)`` when this dataset is a
        ``batch`` (under any ``prefetch``/``with_options``) whose input size is known;
        None otherwise. Not in ``tf.data``: the distributed input uses it to count an
        epoch's steps on every worker without iterating."""
        return None

    def __len__(self) -> int:
        n = self.cardinality()
        if n == INFINITE_CARDINALITY:
            raise TypeError("the dataset is infinite (cardinality -1): it has no length")
        if n == UNKNOWN_CARDINALITY:
            raise TypeError("the dataset's length is unknown (cardinality -2); count it "
                            "by iterating if you must")
        return n

    def options(self) -> Options:
        """The pipeline's options: its inputs' options merged, then this node's own."""
        merged = Options()
        for ds in self._inputs():
            merged = merged.merge(ds.options())
        own = self.__dict__.get("_own_options")
        return merged.merge(own) if own is not None else merged

    def as_numpy_iterator(self) -> DatasetIterator:
        """An iterator over the elements (they already are NumPy values)."""
        return iter(self)

    def apply(self, transformation: Callable[["Dataset"], "Dataset"]) -> "Dataset":
        """``transformation(self)``, for chaining."""
        return transformation(self)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} cardinality={self.cardinality()}>"

    # --- sources ---------------------------------------------------------------------

    @staticmethod
    def range(*args, output_type=None, dtype=np.int64) -> "Dataset":
        """Integers like Python's ``range(start, stop, step)``, as int64 scalars.

        ``output_type`` (``tf.data``'s name) or ``dtype`` picks another integer dtype.
        """
        from gpustrat.data.sources import RangeDataset
        return RangeDataset(*args, dtype=dtype if output_type is None else output_type)

    @staticmethod
    def from_tensors(tensors: Any) -> "Dataset":
        """A dataset of exactly one element, ``tensors``."""
        from gpustrat.data.sources import TensorsDataset
        return TensorsDataset(tensors)

    @staticmethod
    def from_tensor_slices(tensors: Any) -> "Dataset":
        """One element per row (first-axis index) of every component of ``tensors``."""
        from gpustrat.data.sources import TensorSliceDataset
        return TensorSliceDataset(tensors)

    @staticmethod
    def from_generator(generator: Callable, output_types=None, output_shapes=None,
                       args: tuple | None = None, output_signature: Any = None) -> "Dataset":
        """Elements produced by calling ``generator(*args)`` anew each epoch.

        ``output_signature`` (a structure of TensorSpec) is checked for every element;
        ``output_types``/``output_shapes`` are the older spelling of the same thing.

        The position of an iterator over a Python generator cannot be saved. When
        ``generator`` is a class whose objects are iterators with ``get_state()``
        (returning a state tree: numbers, strings, bytes, NumPy arrays, and lists,
        tuples and dicts of them) and ``set_state(state)`` methods, it can: saving calls
        ``get_state()`` on the epoch's object, restoring calls ``set_state`` on a new
        ``generator(*args)`` before its first element (see docs/checkpoint.md).
        """
        from gpustrat.data.sources import GeneratorDataset
        return GeneratorDataset(generator, output_types, output_shapes, args, output_signature)

    @staticmethod
    def list_files(file_pattern, shuffle: bool | None = None, seed: int | None = None) -> "Dataset":
        """File names matching a glob pattern (or list of patterns), as bytes scalars."""
        from gpustrat.data.files import ListFilesDataset
        return ListFilesDataset(file_pattern, shuffle, seed)

    @staticmethod
    def from_npy(path, mmap: bool = True) -> "Dataset":
        """Rows of one or more ``.npy`` files, read through memory maps (see NpyDataset)."""
        from gpustrat.data.npy import NpyDataset
        return NpyDataset(path, mmap=mmap)

    @staticmethod
    def zip(*args, datasets=None, name: str | None = None) -> "Dataset":
        """Elements made of one element of each dataset: ``zip(a, b)``, ``zip((a, b))``
        or ``zip(datasets={"x": a, "y": b})``; any nesting of datasets in tuples, dicts
        and namedtuples is allowed (not lists, as in tf.data)."""
        from gpustrat.data.combining import ZipDataset
        if datasets is not None:
            if args:
                raise TypeError("zip: pass datasets positionally or as datasets=, not both")
            structure = datasets
        elif not args:
            raise TypeError("zip needs at least one dataset: Dataset.zip(a, b), "
                            "Dataset.zip((a, b)) or Dataset.zip({\"x\": a, \"y\": b})")
        elif len(args) == 1:
            structure = args[0]
        else:
            structure = tuple(args)
        return ZipDataset(structure)

    @staticmethod
    def sample_from_datasets(datasets, weights=None, seed: int | None = None,
                             stop_on_empty_dataset: bool = False,
                             rerandomize_each_iteration: bool | None = None) -> "Dataset":
        """Elements drawn at random from ``datasets`` with probabilities proportional
        to ``weights`` (a list, or a dataset of weight vectors; default uniform)."""
        from gpustrat.data.sampling import sample_from_datasets
        return sample_from_datasets(datasets, weights, seed, stop_on_empty_dataset,
                                    rerandomize_each_iteration)

    @staticmethod
    def choose_from_datasets(datasets, choice_dataset: "Dataset",
                             stop_on_empty_dataset: bool = True) -> "Dataset":
        """Element ``j`` taken from ``datasets[c_j]``, ``c_j`` the ``j``-th element of
        ``choice_dataset`` (int64 scalars)."""
        from gpustrat.data.sampling import choose_from_datasets
        return choose_from_datasets(datasets, choice_dataset, stop_on_empty_dataset)

    # --- transformations -------------------------------------------------------------

    def batch(self, batch_size: int, drop_remainder: bool = False,
              num_parallel_calls: int | None = None, deterministic: bool | None = None) -> "Dataset":
        """Stack ``batch_size`` consecutive elements into one (the last may be smaller)."""
        batch_size = _check_positive("batch_size", batch_size, "batch")
        fused = self._batch_fused(batch_size, bool(drop_remainder))
        if fused is not None:
            return fused
        from gpustrat.data.batching import BatchDataset
        return BatchDataset(self, batch_size, bool(drop_remainder))

    def unbatch(self) -> "Dataset":
        """Split every element along its first axis into that many elements."""
        from gpustrat.data.batching import UnbatchDataset
        return UnbatchDataset(self)

    def map(self, map_func: Callable, num_parallel_calls: int | None = None,
            deterministic: bool | None = None, name: str | None = None,
            use_processes: bool | None = None) -> "Dataset":
        """Apply ``map_func`` to every element (tuples are unpacked into arguments).

        With ``num_parallel_calls`` (an int or AUTOTUNE) the calls run in a thread pool;
        results keep the input order unless ``deterministic`` is False. With
        ``use_processes=True`` (or the options' ``experimental_processing.use_processes``)
        they run in that many worker processes instead (AUTOTUNE: one per core this
        process may use): Python code that holds the GIL then scales with the cores.
        """
        from gpustrat.data.mapping import MapDataset
        return MapDataset(self, map_func, num_parallel_calls, deterministic, use_processes)

    def filter(self, predicate: Callable) -> "Dataset":
        """Keep the elements for which ``predicate`` returns a true scalar."""
        from gpustrat.data.mapping import FilterDataset
        return FilterDataset(self, predicate)

    def shuffle(self, buffer_size: int, seed: int | None = None,
                reshuffle_each_iteration: bool = True) -> "Dataset":
        """Randomly shuffle with a buffer of ``buffer_size`` elements (tf.data semantics)."""
        from gpustrat.data.shuffling import ShuffleDataset
        return ShuffleDataset(self, buffer_size, seed, reshuffle_each_iteration)

    def repeat(self, count: int | None = None) -> "Dataset":
        """Repeat the dataset ``count`` times (None or -1: forever)."""
        from gpustrat.data.positional import RepeatDataset
        return RepeatDataset(self, count)

    def take(self, count: int) -> "Dataset":
        """At most the first ``count`` elements (-1: all)."""
        from gpustrat.data.positional import TakeDataset
        return TakeDataset(self, count)

    def skip(self, count: int) -> "Dataset":
        """All but the first ``count`` elements (-1: skip everything)."""
        from gpustrat.data.positional import SkipDataset
        return SkipDataset(self, count)

    def shard(self, num_shards: int, index: int) -> "Dataset":
        """Elements ``i`` with ``i % num_shards == index``."""
        from gpustrat.data.positional import ShardDataset
        return ShardDataset(self, num_shards, index)

    def enumerate(self, start: int = 0, name: str | None = None) -> "Dataset":
        """Pairs ``(i, element)`` with an int64 counter starting at ``start``."""
        from gpustrat.data.positional import EnumerateDataset
        return EnumerateDataset(self, start)

    def concatenate(self, dataset: "Dataset") -> "Dataset":
        """This dataset's elements, then ``dataset``'s (element specs must be compatible)."""
        from gpustrat.data.combining import ConcatenateDataset
        return ConcatenateDataset(self, dataset)

    def interleave(self, map_func: Callable, cycle_length: int | None = None,
                   block_length: int | None = None, num_parallel_calls: int | None = None,
                   deterministic: bool | None = None,
                   use_processes: bool | None = None) -> "Dataset":
        """Map elements to datasets and interleave them: ``cycle_length`` open at once,
        ``block_length`` consecutive elements from each (tf.data's order).

        With ``num_parallel_calls`` each open dataset is read ahead by a thread; with
        ``use_processes=True`` (or the options' ``experimental_processing``) the
        datasets are made and iterated in ``num_parallel_calls`` worker processes."""
        from gpustrat.data.interleave import InterleaveDataset
        return InterleaveDataset(self, map_func, cycle_length, block_length,
                                 num_parallel_calls, deterministic, use_processes)

    def flat_map(self, map_func: Callable) -> "Dataset":
        """Map elements to datasets and concatenate them in order."""
        return self.interleave(map_func, cycle_length=1, block_length=1)

    def padded_batch(self, batch_size: int, padded_shapes=None, padding_values=None,
                     drop_remainder: bool = False, name: str | None = None) -> "Dataset":
        """Batch elements of differing shapes, padding each component to
        ``padded_shapes`` (None entries, or no ``padded_shapes``: the batch's largest)
        with ``padding_values`` (default 0, or ``b""`` for strings)."""
        batch_size = _check_positive("batch_size", batch_size, "padded_batch")
        from gpustrat.data.padding import PaddedBatchDataset
        return PaddedBatchDataset(self, batch_size, padded_shapes, padding_values,
                                  drop_remainder)

    def rebatch(self, batch_size, drop_remainder: bool = False,
                name: str | None = None) -> "Dataset":
        """The rows of the batches regrouped into batches of ``batch_size`` (an int, or
        a list of sizes used in turn), as ``unbatch().batch(...)`` without unbatching."""
        from gpustrat.data.rebatching import RebatchDataset
        return RebatchDataset(self, batch_size, drop_remainder)

    def cache(self, filename: str = "", name: str | None = None) -> "Dataset":
        """Keep the elements of the first complete pass, in memory (``""``) or in the
        file ``filename + ".gpustrat-cache"``; an incomplete pass is never reused."""
        from gpustrat.data.caching import CacheDataset
        return CacheDataset(self, filename)

    def window(self, size: int, shift: int | None = None, stride: int = 1,
               drop_remainder: bool = False, name: str | None = None) -> "Dataset":
        """Windows of ``size`` elements ``stride`` apart, one starting every ``shift``
        elements; each window is a dataset (one per component for structured elements)."""
        from gpustrat.data.windowing import WindowDataset
        return WindowDataset(self, size, shift, stride, drop_remainder)

    def scan(self, initial_state: Any, scan_func: Callable, name: str | None = None) -> "Dataset":
        """``state, out = scan_func(state, element)`` for every element; yields ``out``."""
        from gpustrat.data.scanning import ScanDataset
        return ScanDataset(self, initial_state, scan_func)

    def unique(self, name: str | None = None) -> "Dataset":
        """Each distinct element (integer or string) once, at its first occurrence."""
        from gpustrat.data.filtering import UniqueDataset
        return UniqueDataset(self)

    def ignore_errors(self, log_warning: bool = False, name: str | None = None) -> "Dataset":
        """Drop the elements whose ``map`` function or ``filter`` predicate raises."""
        from gpustrat.data.filtering import IgnoreErrorsDataset
        return IgnoreErrorsDataset(self, log_warning)

    def group_by_window(self, key_func: Callable, reduce_func: Callable,
                        window_size: int | None = None,
                        window_size_func: Callable | None = None,
                        name: str | None = None) -> "Dataset":
        """Group elements by ``key_func``; each group of ``window_size`` (or
        ``window_size_func(key)``) goes to ``reduce_func(key, dataset)``, whose
        elements are the output."""
        from gpustrat.data.grouping import group_by_window_dataset
        return group_by_window_dataset(self, key_func, reduce_func, window_size,
                                       window_size_func)

    def bucket_by_sequence_length(self, element_length_func: Callable, bucket_boundaries,
                                  bucket_batch_sizes, padded_shapes=None,
                                  padding_values=None, pad_to_bucket_boundary: bool = False,
                                  no_padding: bool = False, drop_remainder: bool = False,
                                  name: str | None = None) -> "Dataset":
        """Batch elements of similar length together: bucket ``i`` holds lengths in
        ``[bucket_boundaries[i-1], bucket_boundaries[i])`` and is padded and batched
        by ``bucket_batch_sizes[i]``."""
        from gpustrat.data.grouping import bucket_by_sequence_length_dataset
        return bucket_by_sequence_length_dataset(
            self, element_length_func, bucket_boundaries, bucket_batch_sizes,
            padded_shapes, padding_values, pad_to_bucket_boundary, no_padding,
            drop_remainder)

    def prefetch(self, buffer_size: int) -> "Dataset":
        """Compute up to ``buffer_size`` elements ahead in a background thread."""
        from gpustrat.data.unary import PrefetchDataset
        return PrefetchDataset(self, buffer_size)

    def with_options(self, options: Options) -> "Dataset":
        """The same dataset with ``options`` merged over the pipeline's options."""
        from gpustrat.data.unary import OptionsDataset
        return OptionsDataset(self, options)

    def reduce(self, initial_state: Any, reduce_func: Callable) -> Any:
        """Fold every element into a state: ``state = reduce_func(state, element)``."""
        state = initial_state
        for element in self:
            state = reduce_func(state, element)
        return state

    def get_single_element(self) -> Any:
        """The only element; ValueError if the dataset has zero or several."""
        it = iter(self)
        try:
            try:
                first = next(it)
            except StopIteration:
                raise ValueError("get_single_element: the dataset is empty") from None
            try:
                next(it)
            except StopIteration:
                return first
            raise ValueError("get_single_element: the dataset has more than one element")
        finally:
            it.close()
