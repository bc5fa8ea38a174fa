"""Transformations of one or more datasets (``batch``, ``map``, ``shuffle``, ...).

Each class is one ``tf.data`` transformation with its semantics and cardinality rule.
Words used below:
    input: the dataset a transformation reads (``_input``), or several for ``zip`` and
        ``concatenate``.
    epoch (of a shuffle): the number of times this shuffle node has been iterated,
        counted per node. The order of epoch ``e`` is drawn from a NumPy generator seeded
        with ``(seed, e)``, so a fixed seed gives the same first-epoch order in every
        process, and later epochs differ (unless ``reshuffle_each_iteration=False``,
        which keeps epoch 0's order).
"""

from __future__ import annotations

import copy
import itertools
import math
import os
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data import parallel
from gpustrat.data import spec as specs
from gpustrat.data import structure as st
from gpustrat.data.dataset import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY,
                                   Dataset, _check_int, _check_positive, _IterContext,
                                   autotune_parallelism, rows_of_batches)
from gpustrat.data.iterator_state import (FunctionIterator, ParallelMapIterator,
                                          PrefetchIterator, StateIterator,
                                          load_element, pack_elements, resume_epochs,
                                          save_element, unpack_elements)
from gpustrat.data.options import Options
from gpustrat.data.spec import TensorSpec, merge_specs, spec_of, zeros_like_spec

_INT64 = np.dtype(np.int64)


def _close(it) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        close()


class UnaryDataset(Dataset):
    """A transformation of one input dataset."""

    def __init__(self, input_dataset: Dataset):
        if not isinstance(input_dataset, Dataset):
            raise TypeError(f"expected a Dataset as input, got {type(input_dataset).__name__}")
        self._input = input_dataset

    def _inputs(self):
        return (self._input,)

    def _with_inputs(self, inputs):
        new = copy.copy(self)
        new._input = inputs[0]
        new.__dict__.pop("_spec_cache", None)
        return new

    def _cardinality(self):
        return self._input._cardinality()

    def _compute_spec(self):
        return self._input.element_spec


class BatchDataset(UnaryDataset):
    """``batch(b, drop_remainder)`` by stacking elements (sources that can slice fuse instead)."""

    def __init__(self, input_dataset, batch_size: int, drop_remainder: bool):
        super().__init__(input_dataset)
        self._batch_size, self._drop = batch_size, drop_remainder

    def batch_rows(self):
        return rows_of_batches(self._input.cardinality(), self._batch_size, self._drop)

    def _iter(self, ctx):
        b = self._batch_size
        it = self._input._iter(ctx)
        try:
            first = next(it, _MISSING)
            if first is _MISSING:
                return
            flatten, pack = st.make_plan(first)
            single = len(flatten(first)) == 1 and not nest.is_nested(first)

            def build(chunk):
                if single:
                    return st.stack(chunk)
                columns = zip(*[flatten(e) for e in chunk])
                return pack([st.stack(list(c)) for c in columns])

            chunk = []
            for element in itertools.chain((first,), it):
                chunk.append(element)
                if len(chunk) == b:
                    out, chunk = build(chunk), []
                    yield out
            if chunk and not self._drop:
                yield build(chunk)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        # A batch is built inside one next(): between calls there is no partial buffer,
        # so the state is the input's.
        b, drop = self._batch_size, self._drop
        plan = []

        def build(chunk):
            if not plan:
                flatten, pack = st.make_plan(chunk[0])
                plan.extend((flatten, pack, len(flatten(chunk[0])) == 1
                             and not nest.is_nested(chunk[0])))
            flatten, pack, single = plan
            if single:
                return st.stack(chunk)
            columns = zip(*[flatten(e) for e in chunk])
            return pack([st.stack(list(c)) for c in columns])

        def step_fn(it):
            if it.fields["done"]:
                raise StopIteration
            chunk = []
            for element in it._inputs[0]:
                chunk.append(element)
                if len(chunk) == b:
                    return build(chunk)
            it.fields["done"] = True
            if chunk and not drop:
                return build(chunk)
            raise StopIteration
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, done=False)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._batch_size if self._drop else math.ceil(n / self._batch_size)

    def _compute_spec(self):
        dim = self._batch_size if self._drop else None
        return nest.map_structure(lambda s: s._batched(dim), self._input.element_spec)


_MISSING = object()


def _function_spec(dataset: Dataset, output_spec: Callable[[Any], Any]) -> Any:
    """The spec of a function's outputs over ``dataset``'s elements, where
    ``output_spec(element)`` calls the function and returns the spec of its output.

    The function is called on the first element (zeros like the input spec when the
    input is empty), on the second, and on the first with the input's unknown
    dimensions resized (:func:`gpustrat.data.spec.probes`); a dimension that differs
    between these outputs is None. Where a probe fails, or changes the structure, dtype
    or rank, every dimension is None.
    """
    gen = dataset._iter(_IterContext(peek=True))
    try:
        first = next(gen, _MISSING)
        second = _MISSING if first is _MISSING else next(gen, _MISSING)
    finally:
        _close(gen)
    in_spec = dataset.element_spec
    if first is _MISSING:
        first = zeros_like_spec(in_spec)
    spec = output_spec(first)
    others = [] if second is _MISSING else [second]
    if specs.has_unknown_dims(in_spec):
        others += specs.probes(first, in_spec)
    for element in others:
        try:
            with np.errstate(all="ignore"):
                spec = merge_specs(spec, output_spec(element))
        except Exception:  # noqa: BLE001 - a probe the function cannot take tells nothing
            return specs.unknown_dims(spec)
    return spec


def _check_unbatchable(spec: Any) -> None:
    """Refuse to unbatch elements whose spec shows components with different leading
    sizes (every element would fail, or an empty input would pass unnoticed)."""
    sizes = []
    for s in nest.flatten(spec):
        if not s.shape:
            raise ValueError(f"unbatch: component {s} is a scalar; unbatching needs a "
                             f"leading dimension in every component (element_spec {spec})")
        if s.shape[0] is not None and s.shape[0] not in sizes:
            sizes.append(s.shape[0])
    if len(sizes) > 1:
        raise ValueError(f"unbatch: the components' leading dimensions are known to differ "
                         f"({' and '.join(map(str, sizes))}, element_spec {spec}); every "
                         "component must have the same number of rows")


class UnbatchDataset(UnaryDataset):
    """``unbatch()``: every row of every element becomes an element."""

    def _input_spec(self) -> Any:
        try:
            spec = self._input.element_spec
        except ValueError:
            return None  # an input too empty to have a spec has nothing to unbatch
        _check_unbatchable(spec)
        return spec

    def _iter(self, ctx):
        self._input_spec()
        it = self._input._iter(ctx)
        try:
            flatten = pack = None
            for element in it:
                if not nest.is_nested(element):
                    if np.ndim(element) == 0:
                        raise ValueError("unbatch: element is a scalar; unbatching needs "
                                         "a leading dimension")
                    yield from element
                    continue
                if flatten is None:
                    flatten, pack = st.make_plan(element)
                leaves = flatten(element)
                dims = [st.leading_dim(v) for v in leaves]
                if len(set(dims)) != 1:
                    raise ValueError(f"unbatch: components have different leading "
                                     f"dimensions {dims}; they must all be equal")
                for row in zip(*leaves):
                    yield pack(row)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        self._input_spec()
        return _UnbatchIterator(self._input._state_iter(ctx))

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        # As tf.data: known only when every component has the same known, non-zero
        # leading dimension (an empty input with an unknown batch dimension is unknown).
        dims = {s.shape[0] for s in nest.flatten(self._input_spec() or ()) if s.shape}
        if len(dims) == 1 and dims != {None} and dims != {0}:
            return n * dims.pop()
        return UNKNOWN_CARDINALITY

    def _compute_spec(self):
        spec = self._input.element_spec
        _check_unbatchable(spec)
        return nest.map_structure(lambda s: s._unbatched(), spec)


def _resolve_parallelism(num_parallel_calls, what: str) -> int | None:
    if num_parallel_calls is None:
        return None
    if num_parallel_calls == AUTOTUNE:
        return autotune_parallelism()
    n = _check_positive("num_parallel_calls", num_parallel_calls, what)
    return n


_STRUCTURES = (tuple, dict)


class MapDataset(UnaryDataset):
    """``map(fn, num_parallel_calls, deterministic)``."""

    def __init__(self, input_dataset, map_func: Callable, num_parallel_calls, deterministic):
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"map: map_func must be callable, got {type(map_func).__name__}")
        self._fn = map_func
        self._parallelism = _resolve_parallelism(num_parallel_calls, "map")
        self._deterministic = deterministic

    def _call(self, element):
        out = st.call_with_element(self._fn, element)
        if type(out) is np.ndarray:
            return out
        if type(out) is list:
            # As tf.data: a returned list is a tuple of components (often the result of a
            # function giving several arrays), not one array stacked from them.
            out = tuple(out)
        out = st.normalize(out)
        if isinstance(out, _STRUCTURES) and not (
                type(out) is tuple and out and not isinstance(out[0], _STRUCTURES)):
            # (A tuple led by a leaf, the common structure, has a component.)
            st.check_has_component(out, "map's function")
        return out

    def _in_order(self) -> "MapDataset | None":
        """This map keeping the input order, or None when it already does (a parallel
        map with ``deterministic=False`` yields results as they complete)."""
        if self._parallelism is None or self._parallelism == 1 or self._deterministic or (
                self._deterministic is None and self.options().deterministic is not False):
            return None
        new = copy.copy(self)
        new._deterministic = True
        return new

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        call = self._call
        if self._parallelism is None or self._parallelism == 1 or ctx.peek:
            try:
                for element in it:
                    yield call(element)
            finally:
                _close(it)
            return
        deterministic = self._deterministic
        if deterministic is None:
            deterministic = self.options().deterministic is not False
        yield from parallel.parallel_map(it, call, self._parallelism, deterministic)

    def _state_iter(self, ctx):
        source = self._input._state_iter(ctx)
        call = self._call
        if self._parallelism is None or self._parallelism == 1:
            return FunctionIterator((source,), lambda it: call(next(it._inputs[0])))
        deterministic = self._deterministic
        if deterministic is None:
            deterministic = self.options().deterministic is not False
        return ParallelMapIterator(source, call, self._parallelism, deterministic)

    def _compute_spec(self):
        # The function decides the spec (see _function_spec).
        return _function_spec(self._input, lambda element: spec_of(self._call(element)))


def _kept(pred, element) -> bool:
    """``filter``'s verdict on one element: the predicate's scalar boolean."""
    keep = st.call_with_element(pred, element)
    if type(keep) is not bool:
        if np.ndim(keep) != 0:
            raise ValueError(f"filter: predicate must return a scalar boolean, "
                             f"got a value of shape {np.shape(keep)}")
        keep = bool(keep)
    return keep


class FilterDataset(UnaryDataset):
    """``filter(predicate)``."""

    def __init__(self, input_dataset, predicate: Callable):
        super().__init__(input_dataset)
        if not callable(predicate):
            raise TypeError(f"filter: predicate must be callable, got {type(predicate).__name__}")
        self._predicate = predicate

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        pred = self._predicate
        try:
            for element in it:
                if _kept(pred, element):
                    yield element
        finally:
            _close(it)

    def _state_iter(self, ctx):
        pred = self._predicate

        def step_fn(it):
            for element in it._inputs[0]:
                if _kept(pred, element):
                    return element
            raise StopIteration
        return FunctionIterator((self._input._state_iter(ctx),), step_fn)

    def _cardinality(self):
        return UNKNOWN_CARDINALITY  # as tf.data, even for an empty input


class ShuffleDataset(UnaryDataset):
    """``shuffle(buffer_size, seed, reshuffle_each_iteration)`` with tf.data's buffer."""

    def __init__(self, input_dataset, buffer_size: int, seed, reshuffle_each_iteration: bool):
        super().__init__(input_dataset)
        self._buffer_size = _check_positive("buffer_size", buffer_size, "shuffle")
        # An unseeded shuffle draws a seed here; distributing the dataset under the DATA
        # policy replaces it with one agreed by every worker
        # (autoshard.same_order_everywhere).
        self._seeded = seed is not None
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        elif isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise ValueError(f"shuffle: seed must be a non-negative int or None, got {seed!r}")
        self._seed = int(seed)
        self._reshuffle = bool(reshuffle_each_iteration)
        self._epochs = itertools.count()

    def _with_inputs(self, inputs):
        new = super()._with_inputs(inputs)
        new._epochs = itertools.count()
        return new

    def _with_seed(self, seed: int) -> "ShuffleDataset":
        """The same shuffle with another seed, counting its epochs from 0."""
        new = copy.copy(self)
        new._seed, new._seeded = int(seed), True
        new._epochs = itertools.count()
        return new

    def _iter(self, ctx):
        epoch = 0 if (ctx.peek or not self._reshuffle) else next(self._epochs)
        rng = np.random.default_rng([self._seed, epoch])
        it = self._input._iter(ctx)
        try:
            buf = list(itertools.islice(it, self._buffer_size))
            exhausted = len(buf) < self._buffer_size
            # Uniform draws in batches: one NumPy call per 1024 picks.
            draws, k = rng.random(1024).tolist(), 0
            while buf:
                if k == 1024:
                    draws, k = rng.random(1024).tolist(), 0
                idx = int(draws[k] * len(buf))
                k += 1
                out = buf[idx]
                nxt = _MISSING if exhausted else next(it, _MISSING)
                if nxt is _MISSING:
                    exhausted = True
                    buf[idx] = buf[-1]
                    buf.pop()
                else:
                    buf[idx] = nxt
                yield out
        finally:
            _close(it)

    def _state_iter(self, ctx):
        return _ShuffleIterator(self, self._input._state_iter(ctx))

    def _epoch_restored(self, epoch: int, seed: int) -> None:
        """A restored iterator is at ``epoch`` of ``seed``: later iterations reshuffle
        from the next epoch, with that seed (an unseeded shuffle keeps the seed the
        saved job drew)."""
        resume_epochs(self, epoch, seed)


class RepeatDataset(UnaryDataset):
    """``repeat(count)``: None or -1 repeats forever (an empty input stays empty)."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = -1 if count is None else _check_int("count", count, "repeat")

    def _iter(self, ctx):
        passes = itertools.count() if self._count < 0 else range(self._count)
        for _ in passes:
            it = self._input._iter(ctx)
            got = False
            try:
                for element in it:
                    got = True
                    yield element
            finally:
                _close(it)
            if not got:
                return

    def _state_iter(self, ctx):
        return _RepeatIterator(self, ctx)

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count < 0:
            return 0 if n == 0 else INFINITE_CARDINALITY
        if self._count == 0:
            return 0
        if n < 0:
            return n
        return n * self._count


class TakeDataset(UnaryDataset):
    """``take(count)``: at most ``count`` elements; -1 takes all."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = _check_int("count", count, "take")

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            yield from (it if self._count < 0 else itertools.islice(it, self._count))
        finally:
            _close(it)

    def _state_iter(self, ctx):
        count = self._count

        def step_fn(it):
            if 0 <= count <= it.fields["taken"]:
                raise StopIteration
            element = next(it._inputs[0])
            it.fields["taken"] += 1
            return element
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, taken=0)

    def _cardinality(self):
        n = self._input._cardinality()
        if self._count < 0:
            return n
        if n == UNKNOWN_CARDINALITY:
            return n
        if n == INFINITE_CARDINALITY:
            return self._count
        return min(n, self._count)


class SkipDataset(UnaryDataset):
    """``skip(count)``: drop the first ``count`` elements; -1 drops all."""

    def __init__(self, input_dataset, count):
        super().__init__(input_dataset)
        self._count = _check_int("count", count, "skip")

    def _iter(self, ctx):
        if self._count < 0:
            return
        it = self._input._iter(ctx)
        try:
            yield from itertools.islice(it, self._count, None)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        count = self._count

        def step_fn(it):
            if count < 0:
                raise StopIteration
            source = it._inputs[0]
            while it.fields["skipped"] < count:
                next(source)
                it.fields["skipped"] += 1
            return next(source)
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, skipped=0)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n  # as tf.data, even for skip(-1)
        if self._count < 0:
            return 0
        return max(0, n - self._count)


class ShardDataset(UnaryDataset):
    """``shard(num_shards, index)``: element i goes to shard ``i % num_shards``."""

    def __init__(self, input_dataset, num_shards: int, index: int):
        super().__init__(input_dataset)
        self._num = _check_positive("num_shards", num_shards, "shard")
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"shard: index must be an int, got {index!r}")
        if not 0 <= index < self._num:
            raise ValueError(f"shard: index {index} is out of range for {self._num} shards; "
                             f"it must be in [0, {self._num})")
        self._index = int(index)

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            yield from itertools.islice(it, self._index, None, self._num)
        finally:
            _close(it)

    def _state_iter(self, ctx):
        index, num = self._index, self._num

        def step_fn(it):
            source = it._inputs[0]
            for _ in range(num - 1 if it.fields["started"] else index):
                next(source)
            it.fields["started"] = True
            return next(source)
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, started=False)

    def _cardinality(self):
        n = self._input._cardinality()
        if n < 0:
            return n
        return n // self._num + (1 if self._index < n % self._num else 0)


class EnumerateDataset(UnaryDataset):
    """``enumerate(start)``: ``(int64 counter, element)`` pairs."""

    def __init__(self, input_dataset, start: int = 0):
        super().__init__(input_dataset)
        self._start = _check_int("start", start, "enumerate")

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            for i, element in zip(itertools.count(self._start), it):
                yield np.int64(i), element
        finally:
            _close(it)

    def _state_iter(self, ctx):
        def step_fn(it):
            element = next(it._inputs[0])
            i = it.fields["i"]
            it.fields["i"] = i + 1
            return np.int64(i), element
        return FunctionIterator((self._input._state_iter(ctx),), step_fn, i=self._start)

    def _compute_spec(self):
        return (TensorSpec((), _INT64), self._input.element_spec)


class PrefetchDataset(UnaryDataset):
    """``prefetch(n)``: a background thread keeps up to ``n`` elements ready.

    ``adaptive`` (what ``prefetch(AUTOTUNE)`` gives, with 2 elements) starts the thread
    only when producing an element costs more than handing it over from a thread
    (:func:`gpustrat.data.parallel.adaptive_prefetch`).
    """

    def __init__(self, input_dataset, buffer_size: int, adaptive: bool = False):
        super().__init__(input_dataset)
        self._adaptive = adaptive or buffer_size == AUTOTUNE
        if buffer_size == AUTOTUNE:
            buffer_size = 2
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, (int, np.integer)) \
                or buffer_size < 0:
            raise ValueError(f"prefetch: buffer_size must be a non-negative int or AUTOTUNE, "
                             f"got {buffer_size!r}")
        self._buffer_size = int(buffer_size)

    def batch_rows(self):
        return self._input.batch_rows()

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        if self._buffer_size == 0 or ctx.peek:
            return it
        if self._adaptive:
            return parallel.adaptive_prefetch(it, self._buffer_size)
        return parallel.prefetch(it, self._buffer_size)

    def _state_iter(self, ctx):
        it = self._input._state_iter(ctx)
        if self._buffer_size == 0:
            return it
        return PrefetchIterator(it, self._buffer_size, self._adaptive,
                                parallel.ADAPTIVE_MIN_COST_S, parallel.ADAPTIVE_PROBE)


class OptionsDataset(UnaryDataset):
    """``with_options(options)``: the input, with options attached."""

    def __init__(self, input_dataset, options: Options):
        super().__init__(input_dataset)
        if not isinstance(options, Options):
            raise TypeError(f"with_options needs an Options object, got {type(options).__name__}")
        self._own_options = options

    def batch_rows(self):
        return self._input.batch_rows()

    def _iter(self, ctx):
        return self._input._iter(ctx)

    def _state_iter(self, ctx):
        return self._input._state_iter(ctx)


def _check_zip_structure(structure: Any) -> None:
    """Datasets in tuples, dicts and namedtuples. A list is refused, as tf.data does: it
    would make elements whose lists are structures, where a list is otherwise one array."""
    stack = [structure]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            raise TypeError(f"zip takes a (nested) structure of Datasets in tuples and dicts, "
                            f"found a list of {len(x)}: use a tuple instead")
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, tuple):
            stack.extend(x)
        elif not isinstance(x, Dataset):
            raise TypeError(f"zip takes a (nested) structure of Datasets, found "
                            f"{type(x).__name__} {x!r:.60}")


class ZipDataset(Dataset):
    """``Dataset.zip(structure of datasets)``: stops at the shortest input."""

    def __init__(self, structure: Any):
        _check_zip_structure(structure)
        flat = nest.flatten(structure)
        if not flat:
            raise ValueError(f"zip: {structure!r} holds no dataset; zip needs at least one")
        self._structure = structure
        self._datasets = tuple(flat)

    def _inputs(self):
        return self._datasets

    def _with_inputs(self, inputs):
        return ZipDataset(nest.pack_sequence_as(self._structure, list(inputs)))

    def _iter(self, ctx):
        its = [d._iter(ctx) for d in self._datasets]
        try:
            if nest.is_nested(self._structure):
                structure = self._structure
                _, pack = st.make_plan(structure)
                for row in zip(*its):
                    yield pack(row)
            else:
                yield from its[0]
        finally:
            for it in its:
                _close(it)

    def _state_iter(self, ctx):
        nested = nest.is_nested(self._structure)
        _, pack = st.make_plan(self._structure)

        def step_fn(it):
            row = [next(i) for i in it._inputs]
            return pack(row) if nested else row[0]
        return FunctionIterator([d._state_iter(ctx) for d in self._datasets], step_fn)

    def _cardinality(self):
        ns = [d._cardinality() for d in self._datasets]
        if UNKNOWN_CARDINALITY in ns:
            return UNKNOWN_CARDINALITY
        finite = [n for n in ns if n >= 0]
        return min(finite) if finite else INFINITE_CARDINALITY

    def _compute_spec(self):
        return nest.map_structure(lambda d: d.element_spec, self._structure)


class ConcatenateDataset(Dataset):
    """``a.concatenate(b)``."""

    def __init__(self, first: Dataset, second: Dataset):
        if not isinstance(second, Dataset):
            raise TypeError(f"concatenate needs a Dataset, got {type(second).__name__}")
        self._first, self._second = first, second

    def _inputs(self):
        return (self._first, self._second)

    def _with_inputs(self, inputs):
        return ConcatenateDataset(*inputs)

    def _iter(self, ctx):
        # tf.data refuses incompatible inputs when the dataset is built; here the specs
        # may need user code to run (a peek), so the check waits for the first element.
        try:
            self.element_spec
        except ValueError:
            pass  # an input too empty to have a spec conflicts with nothing
        for d in (self._first, self._second):
            it = d._iter(ctx)
            try:
                yield from it
            finally:
                _close(it)

    def _state_iter(self, ctx):
        try:
            self.element_spec
        except ValueError:
            pass

        def step_fn(it):
            while it.fields["which"] < 2:
                try:
                    return next(it._inputs[it.fields["which"]])
                except StopIteration:
                    it.fields["which"] += 1
            raise StopIteration
        return FunctionIterator((self._first._state_iter(ctx), self._second._state_iter(ctx)),
                                step_fn, which=0)

    def _cardinality(self):
        a, b = self._first._cardinality(), self._second._cardinality()
        if INFINITE_CARDINALITY in (a, b):
            return INFINITE_CARDINALITY
        if UNKNOWN_CARDINALITY in (a, b):
            return UNKNOWN_CARDINALITY
        return a + b

    def _compute_spec(self):
        a, b = self._first.element_spec, self._second.element_spec
        try:
            return merge_specs(a, b)
        except TypeError as e:
            raise TypeError(f"concatenate: the datasets' element specs are incompatible: "
                            f"{a} vs {b} ({e})") from None



class _UnbatchIterator(StateIterator):
    """``unbatch``: the state is the input's plus the batch being split and the next row."""

    def __init__(self, source: StateIterator):
        self._inputs = (source,)
        self._element, self._rows, self._row = None, [], 0
        self._plan = None

    def __next__(self):
        while self._element is None or self._row >= len(self._rows):
            self._set(next(self._inputs[0]), 0)
        row = self._rows[self._row]
        self._row += 1
        return row

    def _set(self, element, row: int) -> None:
        if not nest.is_nested(element):
            if np.ndim(element) == 0:
                raise ValueError("unbatch: element is a scalar; unbatching needs a "
                                 "leading dimension")
            rows = list(element)
        else:
            if self._plan is None:
                self._plan = st.make_plan(element)
            flatten, pack = self._plan
            leaves = flatten(element)
            dims = [st.leading_dim(v) for v in leaves]
            if len(set(dims)) != 1:
                raise ValueError(f"unbatch: components have different leading "
                                 f"dimensions {dims}; they must all be equal")
            rows = [pack(r) for r in zip(*leaves)]
        self._element, self._rows, self._row = element, rows, row

    def save(self):
        current = None if self._element is None or self._row >= len(self._rows) \
            else {"element": save_element(self._element), "row": self._row}
        return {"input": self._inputs[0].save(), "current": current}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        if state["current"] is not None:
            self._set(load_element(state["current"]["element"]),
                      int(state["current"]["row"]))


class _ShuffleIterator(StateIterator):
    """``shuffle`` with the same draws as ``ShuffleDataset._iter``; the state is the
    buffer, the generator's state, the unused draws and the input's state."""

    def __init__(self, node: ShuffleDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._started = False
        # The epoch and seed are fixed when the iterator is made, so that the position
        # saved before the first element already says which order the epoch has.
        self._epoch = next(node._epochs) if node._reshuffle else 0
        self._seed = node._seed
        self._rng = None
        self._buf: list = []
        self._exhausted = False
        self._draws, self._k = [], 0

    def _start(self):
        node = self._node
        self._rng = np.random.default_rng([self._seed, self._epoch])
        source = self._inputs[0]
        self._buf = list(itertools.islice(source, node._buffer_size))
        self._exhausted = len(self._buf) < node._buffer_size
        self._draws, self._k = self._rng.random(1024).tolist(), 0
        self._started = True

    def __next__(self):
        if not self._started:
            self._start()
        buf = self._buf
        if not buf:
            raise StopIteration
        if self._k == 1024:
            self._draws, self._k = self._rng.random(1024).tolist(), 0
        idx = int(self._draws[self._k] * len(buf))
        self._k += 1
        out = buf[idx]
        nxt = _MISSING if self._exhausted else next(self._inputs[0], _MISSING)
        if nxt is _MISSING:
            self._exhausted = True
            buf[idx] = buf[-1]
            buf.pop()
        else:
            buf[idx] = nxt
        return out

    def save(self):
        if not self._started:
            return {"started": False, "epoch": self._epoch, "seed": self._seed,
                    "input": self._inputs[0].save()}
        return {"started": True, "epoch": self._epoch, "seed": self._seed,
                "rng": self._rng.bit_generator.state,
                "buffer": pack_elements(self._buf), "exhausted": self._exhausted,
                "draws": np.asarray(self._draws[self._k:], np.float64),
                "input": self._inputs[0].save()}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        self._epoch, self._seed = int(state["epoch"]), int(state["seed"])
        self._node._epoch_restored(self._epoch, self._seed)
        if not state["started"]:
            return
        self._started = True
        self._rng = np.random.default_rng()
        self._rng.bit_generator.state = state["rng"]
        self._buf = unpack_elements(state["buffer"])
        self._exhausted = bool(state["exhausted"])
        self._draws = state["draws"].tolist()
        self._k = 1024 - len(self._draws)
        self._draws = [0.0] * self._k + self._draws


class _RepeatIterator(StateIterator):
    """``repeat``: the state is the pass number and the current pass's input state."""

    def __init__(self, node: RepeatDataset, ctx):
        self._node, self._ctx = node, ctx
        self._inputs = [None]
        self._pass, self._got, self._done = 0, False, False

    def __next__(self):
        node = self._node
        while not self._done:
            if self._inputs[0] is None:
                if 0 <= node._count <= self._pass:
                    self._done = True
                    break
                self._inputs[0] = node._input._state_iter(self._ctx)
                self._got = False
            try:
                element = next(self._inputs[0])
            except StopIteration:
                self._inputs[0].close()
                self._inputs[0] = None
                if not self._got:
                    self._done = True
                    break
                self._pass += 1
                continue
            self._got = True
            return element
        raise StopIteration

    def save(self):
        current = self._inputs[0]
        return {"pass": self._pass, "got": self._got, "done": self._done,
                "input": None if current is None else current.save()}

    def restore(self, state):
        self._pass, self._got, self._done = int(state["pass"]), bool(state["got"]), \
            bool(state["done"])
        if state["input"] is not None:
            self._inputs[0] = self._node._input._state_iter(self._ctx)
            self._inputs[0].restore(state["input"])
