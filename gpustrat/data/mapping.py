"""``map`` and ``filter``: transformations that call a user function on every element,
and the spec of a function's outputs over a dataset."""

from __future__ import annotations

import copy
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data import parallel
from gpustrat.data import spec as specs
from gpustrat.data import structure as st
from gpustrat.data.dataset import (AUTOTUNE, UNKNOWN_CARDINALITY, Dataset, _check_positive,
                                   _IterContext, autotune_parallelism)
from gpustrat.data.iterator_state import FunctionIterator, ParallelMapIterator
from gpustrat.data.process_stages import ProcessMapIterator, process_map
from gpustrat.data.spec import merge_specs, spec_of, zeros_like_spec
from gpustrat.data.unary import _MISSING, UnaryDataset, _close


#: Elements read past the second, at most, for one that differs from the first.
_MORE_PROBES = 4


def _same_element(a: Any, b: Any) -> bool:
    """Whether two elements hold the same values in the same structure (False when in
    doubt)."""
    try:
        fa, fb = nest.flatten(a), nest.flatten(b)
        if len(fa) != len(fb) or nest.describe(a) != nest.describe(b):
            return False
        for x, y in zip(fa, fb):
            x, y = np.asarray(x), np.asarray(y)
            if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
                return False
        return True
    except Exception:  # noqa: BLE001 - values NumPy cannot compare: not the same
        return False


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
        # A second element equal to the first shows nothing about how the output
        # depends on values (range(x) over 3, 3, 5): a few more are read for one that
        # differs.
        for _ in range(_MORE_PROBES):
            if second is _MISSING or not _same_element(first, second):
                break
            second = next(gen, _MISSING)
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


def _resolve_parallelism(num_parallel_calls, what: str) -> int | None:
    if num_parallel_calls is None:
        return None
    if num_parallel_calls == AUTOTUNE:
        return autotune_parallelism()
    n = _check_positive("num_parallel_calls", num_parallel_calls, what)
    return n


_STRUCTURES = (tuple, dict)


def map_output(fn: Callable, element):
    """``fn(element)`` (a tuple unpacked into arguments) as a dataset element."""
    out = st.call_with_element(fn, element)
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


def check_use_processes(use_processes, num_parallel_calls, what: str):
    """``use_processes`` checked: None (the pipeline's options decide), True or False."""
    if use_processes is not None and not isinstance(use_processes, bool):
        raise TypeError(f"{what}: use_processes must be True, False or None, got "
                        f"{type(use_processes).__name__} {use_processes!r}")
    if use_processes and num_parallel_calls is None:
        raise ValueError(f"{what}: use_processes=True runs the calls in "
                         "num_parallel_calls worker processes, but num_parallel_calls is "
                         "None (calls in this process, one at a time): give "
                         "num_parallel_calls (an int, or AUTOTUNE for one process per core)")
    return use_processes


def processes_for(parallelism, autotune: bool, use_processes, options) -> int | None:
    """Worker processes for a parallel stage (None: threads, or no parallelism): when
    ``use_processes`` is True, or None and the options' ``experimental_processing``
    asks for them; AUTOTUNE gives one per core this process may use, at most
    ``max_processes``."""
    if parallelism is None:
        return None
    if use_processes is None:
        use_processes = bool(options.experimental_processing.use_processes)
    if not use_processes:
        return None
    if not autotune:
        return parallelism
    from gpustrat.data.processes import process_count  # noqa: PLC0415
    n = process_count()
    cap = options.experimental_processing.max_processes
    return n if cap is None else max(1, min(n, cap))


class MapDataset(UnaryDataset):
    """``map(fn, num_parallel_calls, deterministic)``."""

    def __init__(self, input_dataset, map_func: Callable, num_parallel_calls, deterministic,
                 use_processes=None):
        super().__init__(input_dataset)
        if not callable(map_func):
            raise TypeError(f"map: map_func must be callable, got {type(map_func).__name__}")
        self._fn = map_func
        self._parallelism = _resolve_parallelism(num_parallel_calls, "map")
        self._autotune = num_parallel_calls == AUTOTUNE
        self._deterministic = deterministic
        self._use_processes = check_use_processes(use_processes, num_parallel_calls, "map")

    def _call(self, element):
        return map_output(self._fn, element)

    def _processes(self, ctx=None) -> int | None:
        """The number of worker processes this map's calls run in (None: threads, or
        inline)."""
        return processes_for(self._parallelism, self._autotune, self._use_processes,
                             self.options() if ctx is None else ctx.options(self))

    def _on_error(self):
        # ignore_errors gives its maps (failed value, warn): see filtering._resilient.
        return self.__dict__.get("_drop_errors")

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
        if self._parallelism is None or ctx.peek or (
                self._parallelism == 1 and self._processes(ctx) is None):
            try:
                for element in it:
                    yield call(element)
            finally:
                _close(it)
            return
        deterministic = self._deterministic
        if deterministic is None:
            deterministic = self.options().deterministic is not False
        processes = self._processes(ctx)
        if processes is not None:
            yield from process_map(it, self._fn, processes, deterministic, "map",
                                   self._on_error())
            return
        yield from parallel.parallel_map(it, call, self._parallelism, deterministic)

    def _state_iter(self, ctx):
        source = self._input._state_iter(ctx)
        call = self._call
        if self._parallelism is None or (self._parallelism == 1 and
                                         self._processes(ctx) is None):
            return FunctionIterator((source,), lambda it: call(next(it._inputs[0])))
        deterministic = self._deterministic
        if deterministic is None:
            deterministic = self.options().deterministic is not False
        processes = self._processes(ctx)
        if processes is not None:
            return ProcessMapIterator(source, self._fn, processes, deterministic, "map",
                                      self._on_error())
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
