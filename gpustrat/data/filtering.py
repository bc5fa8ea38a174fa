"""``unique`` and ``ignore_errors``: transformations that drop elements.

Words:
    unique: keeps the first occurrence of every distinct element, in input order. The
        element must be one component of integers or strings (``tf.data`` allows
        int32, int64 and string). A 1-D integer ``from_tensor_slices`` source is done in
        one ``numpy.unique`` call per epoch instead of a set lookup per element.
    ignore_errors: an element whose ``map`` function or ``filter`` predicate raises
        (anywhere in the pipeline above, parallel maps included; not inside the
        datasets an ``interleave``/``flat_map`` function makes, nor below a ``cache``)
        is dropped where it failed, and the rest of the input flows on. An error that ends a stage (a generator or a
        file reader raising) ends the input quietly. With ``log_warning=True`` each
        dropped element is logged (logger ``gpustrat``) with its exception.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data.dataset import UNKNOWN_CARDINALITY, Dataset
from gpustrat.data.iterator_state import FunctionIterator, IndexedIterator, StateIterator
from gpustrat.data.mapping import FilterDataset, MapDataset
from gpustrat.data.spec import STRING
from gpustrat.data.unary import UnaryDataset, _close

log = logging.getLogger("gpustrat")


class UniqueDataset(UnaryDataset):
    """``unique()``: each distinct element once, at its first occurrence."""

    def _cardinality(self):
        return UNKNOWN_CARDINALITY  # as tf.data, even for an infinite input

    def _compute_spec(self):
        spec = self._input.element_spec
        if nest.is_nested(spec):
            raise TypeError(f"unique needs elements of one component, but the element_spec "
                            f"is {spec}; map the elements to one integer or string first")
        if spec.dtype != STRING and spec.dtype.kind not in "iu":
            raise TypeError(f"unique supports integer and string elements, not "
                            f"{spec.dtype.name} (element_spec {spec})")
        return spec

    def _sliced_array(self) -> np.ndarray | None:
        """The input's single 1-D integer array, when it is a ``from_tensor_slices``."""
        from gpustrat.data.sources import TensorSliceDataset  # noqa: PLC0415
        src = self._input
        if type(src) is not TensorSliceDataset or nest.is_nested(src._structure):
            return None
        arr = src._leaves[0]
        if type(arr) is not np.ndarray or arr.ndim != 1 or arr.dtype.kind not in "iu":
            return None
        return arr

    def _unique_array(self) -> np.ndarray | None:
        arr = self._sliced_array()
        if arr is None:
            return None
        _, first = np.unique(arr, return_index=True)
        return arr[np.sort(first)]

    def _iter(self, ctx):
        values = self._unique_array()
        if values is not None:
            self.element_spec  # unsupported dtypes are an error before any element
            yield from values
            return
        seen: set = set()
        it = self._input._iter(ctx)
        try:
            for element in it:
                if not seen:
                    self.element_spec  # as above, once there is an element
                key = _key(element)
                if key not in seen:
                    seen.add(key)
                    yield element
        finally:
            _close(it)

    def _state_iter(self, ctx):
        values = self._unique_array()
        if values is not None:
            self.element_spec
            return IndexedIterator(len(values), values.__getitem__)
        return _UniqueIterator(self, self._input._state_iter(ctx))

    def _batch_fused(self, batch_size, drop_remainder):
        if self._sliced_array() is None:
            return None
        return _UniqueBatches(self, batch_size, drop_remainder)


class _UniqueIterator(StateIterator):
    """``unique``: the state is the input's and the set of elements seen so far (it
    grows with the number of distinct elements)."""

    def __init__(self, node: UniqueDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._seen: set = set()
        self._gen = self._elements()

    def _elements(self):
        # A generator started after any restore (self._seen is then the restored set).
        seen = self._seen
        add = seen.add
        for element in self._inputs[0].fast_iter():
            if not seen:
                self._node.element_spec  # unsupported dtypes: an error before any element
            key = _key(element)
            if key not in seen:
                add(key)
                yield element

    def fast_iter(self):
        return self._gen

    def __next__(self):
        return next(self._gen)

    def save(self):
        # NumPy scalars one array per dtype (a million ints are 8 MB, not a million
        # entries); bytes and the keys of arrays as they are.
        scalars: dict[str, list] = {}
        other = []
        for key in self._seen:
            if isinstance(key, np.generic):
                scalars.setdefault(key.dtype.str, []).append(key)
            else:
                other.append(key)
        return {"input": self._inputs[0].save(), "other": other,
                "scalars": [np.array(v, dtype=np.dtype(t)) for t, v in scalars.items()]}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        seen = self._seen
        seen.update(state["other"])
        for arr in state["scalars"]:
            seen.update(arr)


class _UniqueBatches(Dataset):
    """``from_tensor_slices(ints).unique().batch(B)``: slices of one ``numpy.unique``."""

    def __init__(self, unique: UniqueDataset, batch_size: int, drop_remainder: bool):
        self._unique, self._b, self._drop = unique, batch_size, drop_remainder

    def _inputs(self):
        return (self._unique,)

    def _with_inputs(self, inputs):
        return inputs[0].batch(self._b, self._drop)

    def _iter(self, ctx):
        values = self._unique._unique_array()
        n, b = len(values), self._b
        end = n - n % b if self._drop else n
        for i in range(0, end, b):
            yield values[i:i + b]

    def _state_iter(self, ctx):
        values = self._unique._unique_array()
        n, b = len(values), self._b
        end = n - n % b if self._drop else n
        return IndexedIterator(-(-end // b), lambda k: values[k * b:min(end, k * b + b)])

    def _compute_spec(self):
        s = self._unique.element_spec
        return s._batched(self._b if self._drop else None)


def _key(element: Any):
    if isinstance(element, (bytes, np.generic)):
        return element
    if isinstance(element, np.ndarray):
        if element.dtype == object:
            return (element.shape, tuple(element.reshape(-1).tolist()))
        return (element.shape, element.tobytes())
    return element


_FAILED = object()


class _DropFailed(UnaryDataset):
    """Passes on its input's elements except the ones whose function failed."""

    def __init__(self, input_dataset: Dataset, spec_of_node: Dataset):
        super().__init__(input_dataset)
        self._spec_node = spec_of_node

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        try:
            for element in it:
                if element is not _FAILED:
                    yield element
        finally:
            _close(it)

    def _state_iter(self, ctx):
        def step_fn(it):
            for element in it._inputs[0]:
                if element is not _FAILED:
                    return element
            raise StopIteration
        return FunctionIterator((self._input._state_iter(ctx),), step_fn)

    def _cardinality(self):
        return UNKNOWN_CARDINALITY

    def _compute_spec(self):
        try:
            return self._spec_node.element_spec
        except Exception:  # noqa: BLE001 - the function fails on the elements probed
            return Dataset._compute_spec(self)  # from the first element kept


def _guarded(fn: Callable, failed: Any, warn: bool) -> Callable:
    def call(*args):
        try:
            return fn(*args)
        except Exception as e:  # the element is dropped, as tf.data's ignore_errors does
            if warn:
                log.warning("ignore_errors: dropped an element: %r", e)
            return failed
    return call


def _resilient(dataset: Dataset, warn: bool) -> Dataset:
    """The pipeline with every map and filter dropping the elements it fails on."""
    from gpustrat.data.caching import CacheDataset  # noqa: PLC0415
    memo: dict[int, Dataset] = {}

    def rebuild(node: Dataset) -> Dataset:
        done = memo.get(id(node))
        if done is not None:
            return done
        if isinstance(node, CacheDataset):
            new = node  # what a cache replays has already been computed
        else:
            inputs = node._inputs()
            new_inputs = tuple(rebuild(i) for i in inputs)
            new = node if all(a is b for a, b in zip(inputs, new_inputs)) else \
                node._with_inputs(new_inputs)
            if isinstance(node, MapDataset):
                new = copy.copy(new)
                new.__dict__.pop("_spec_cache", None)
                new._call = _guarded(node._call, _FAILED, warn)
                new._drop_errors = (_FAILED, warn)   # for a map on processes
                new = _DropFailed(new, node)
            elif isinstance(node, FilterDataset):
                new = copy.copy(new)
                new.__dict__.pop("_spec_cache", None)
                new._predicate = _guarded(node._predicate, False, warn)
        memo[id(node)] = new
        return new

    return rebuild(dataset)


class IgnoreErrorsDataset(UnaryDataset):
    """``ignore_errors(log_warning=False)``."""

    def __init__(self, input_dataset: Dataset, log_warning: bool = False):
        super().__init__(input_dataset)
        self._warn = bool(log_warning)

    def _with_inputs(self, inputs):
        new = super()._with_inputs(inputs)
        new.__dict__.pop("_resilient_cache", None)
        return new

    def _cardinality(self):
        return UNKNOWN_CARDINALITY  # as tf.data

    def _compute_spec(self):
        return self._source().element_spec

    def _source(self) -> Dataset:
        source = self.__dict__.get("_resilient_cache")
        if source is None:
            source = _resilient(self._input, self._warn)
            self.__dict__["_resilient_cache"] = source
        return source

    def _state_iter(self, ctx):
        return _IgnoreErrorsIterator(self._source()._state_iter(ctx), self._warn)

    def _iter(self, ctx):
        it = self._source()._iter(ctx)
        try:
            while True:
                try:
                    element = next(it)
                except StopIteration:
                    return
                except Exception as e:  # a stage ended with an error: so does the input
                    if self._warn:
                        log.warning("ignore_errors: the input ended with an error: %r", e)
                    return
                yield element
        finally:
            _close(it)


class _IgnoreErrorsIterator(StateIterator):
    """``ignore_errors``: the state is the input's (the pipeline whose maps and filters
    drop what they fail on), or only that it ended, after an error ended it."""

    def __init__(self, source: StateIterator, warn: bool):
        self._inputs = (source,)
        self._warn = warn
        self._ended = False

    def __next__(self):
        if self._ended:
            raise StopIteration
        try:
            return next(self._inputs[0])
        except StopIteration:
            raise
        except Exception as e:  # a stage ended with an error: so does the input
            if self._warn:
                log.warning("ignore_errors: the input ended with an error: %r", e)
            self._ended = True
            raise StopIteration from None

    def save(self):
        return {"ended": True} if self._ended else \
            {"ended": False, "input": self._inputs[0].save()}

    def restore(self, state):
        if state["ended"]:
            self._ended = True
        else:
            self._inputs[0].restore(state["input"])
