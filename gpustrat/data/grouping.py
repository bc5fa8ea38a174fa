"""``group_by_window`` and ``bucket_by_sequence_length``.

Words:
    key: what ``key_func(element)`` returns, an integer scalar; elements with the same
        key form a group.
    window: a group that reached its size (``window_size``, or ``window_size_func(key)``
        asked once per key and iteration). It is handed at once to
        ``reduce_func(key, window_dataset)`` as a dataset of its elements (with the
        input's element spec), and the elements of the dataset it returns are the
        output. When the input ends, the groups left over are handed over too, smallest
        key first (``tf.data``'s order).
    bucket: ``bucket_by_sequence_length`` keys each element by the bucket its length
        (``element_length_func(element)``) falls in: bucket ``i`` holds lengths in
        ``[bucket_boundaries[i-1], bucket_boundaries[i])``, the first from minus
        infinity and the last to plus infinity; each bucket's windows are padded and
        batched by ``bucket_batch_sizes[i]``.

The element spec is that of the dataset ``reduce_func`` returns for an empty window
(so it is derived from the input's spec, like ``tf.data``'s tracing), and the
cardinality is unknown (infinite for an infinite input), as in ``tf.data``.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import (INFINITE_CARDINALITY, UNKNOWN_CARDINALITY, Dataset,
                                   _check_positive)
from gpustrat.data.iterator_state import (StateIterator, pack_elements, state_iter_of,
                                          unpack_elements)
from gpustrat.data.spec import TensorSpec
from gpustrat.data.unary import UnaryDataset, _close
from gpustrat.data.windowing import ElementsDataset


def _integer(value: Any, what: str, func: str) -> int:
    """``value`` (a Python or NumPy integer scalar) as an int; TypeError otherwise."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{func} must return an integer scalar for {what}, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iu":
        return int(value)
    raise TypeError(f"{func} must return an integer scalar for {what}, got "
                    f"{type(value).__name__} {value!r}")


class GroupByWindowDataset(UnaryDataset):
    """``group_by_window(key_func, reduce_func, window_size, window_size_func)``."""

    def __init__(self, input_dataset: Dataset, key_func: Callable, reduce_func: Callable,
                 window_size: int | None = None, window_size_func: Callable | None = None,
                 spec_func: Callable[[], Any] | None = None):
        super().__init__(input_dataset)
        if (window_size is None) == (window_size_func is None):
            raise ValueError("group_by_window: give exactly one of window_size and "
                             "window_size_func")
        for name, f in (("key_func", key_func), ("reduce_func", reduce_func)):
            if not callable(f):
                raise TypeError(f"group_by_window: {name} must be callable, got "
                                f"{type(f).__name__}")
        if window_size is not None:
            size = _check_positive("window_size", window_size, "group_by_window")
            window_size_func = lambda key: size  # noqa: E731
        elif not callable(window_size_func):
            raise TypeError(f"group_by_window: window_size_func must be callable, got "
                            f"{type(window_size_func).__name__}")
        self._key_func, self._reduce_func = key_func, reduce_func
        self._size_func = window_size_func
        # The caller may know the spec better (bucket_by_sequence_length).
        self._spec_func = spec_func

    def _cardinality(self):
        n = self._input._cardinality()
        return INFINITE_CARDINALITY if n == INFINITE_CARDINALITY else UNKNOWN_CARDINALITY

    def _reduce(self, key: int, elements: list, spec: Any) -> Dataset:
        out = self._reduce_func(np.int64(key), ElementsDataset(elements, spec))
        if not isinstance(out, Dataset):
            raise TypeError(f"group_by_window: reduce_func must return a Dataset, got "
                            f"{type(out).__name__} for key {key}")
        return out

    def _compute_spec(self):
        if self._spec_func is not None:
            return self._spec_func()
        return self._reduce(0, [], self._input.element_spec).element_spec

    def _iter(self, ctx):
        groups: dict[int, list] = {}
        sizes: dict[int, int] = {}
        it = self._input._iter(ctx)

        def flush(key):
            out = self._reduce(key, groups.pop(key), self._input.element_spec)._iter(ctx)
            try:
                yield from out
            finally:
                _close(out)

        try:
            for element in it:
                key = self._key_of(element)
                size = sizes.get(key)
                if size is None:
                    size = sizes[key] = self._size_of(key)
                group = groups.setdefault(key, [])
                group.append(element)
                if len(group) == size:
                    yield from flush(key)
            for key in sorted(groups):
                yield from flush(key)
        finally:
            _close(it)


    def _key_of(self, element) -> int:
        return _integer(st.call_with_element(self._key_func, element), "its key",
                        "group_by_window: key_func")

    def _size_of(self, key: int) -> int:
        size = _integer(self._size_func(np.int64(key)), f"key {key}",
                        "group_by_window: window_size_func")
        if size < 1:
            raise ValueError(f"group_by_window: the window size must be positive, got "
                             f"{size} for key {key}")
        return size

    def _state_iter(self, ctx):
        return _GroupIterator(self, ctx)


class _GroupIterator(StateIterator):
    """``group_by_window``: the state is the input's, the open groups (each key's
    elements so far and window size) and the window being handed out: its key, its
    elements and the state of the dataset ``reduce_func`` made of it (a restore calls
    ``reduce_func`` on those elements again)."""

    def __init__(self, node: GroupByWindowDataset, ctx):
        self._node, self._ctx = node, ctx
        self._source = node._input._state_iter(ctx)
        self._groups: dict[int, list] = {}
        self._sizes: dict[int, int] = {}
        self._ended = False
        self._current = None   # (key, elements, state iterator of the reduced dataset)

    @property
    def _inputs(self):
        return [self._source] + ([self._current[2]] if self._current else [])

    def _open(self, key: int, elements: list, state=None) -> None:
        node = self._node
        it = state_iter_of(node._reduce(key, elements, node._input.element_spec),
                           self._ctx, "group_by_window: a dataset that reduce_func returned")
        if state is not None:
            it.restore(state)
        self._current = (key, elements, it)

    def __next__(self):
        node = self._node
        while True:
            if self._current is not None:
                try:
                    return next(self._current[2])
                except StopIteration:
                    self._current[2].close()
                    self._current = None
            if not self._ended:
                try:
                    element = next(self._source)
                except StopIteration:
                    self._ended = True
                    continue
                key = node._key_of(element)
                size = self._sizes.get(key)
                if size is None:
                    size = self._sizes[key] = node._size_of(key)
                group = self._groups.setdefault(key, [])
                group.append(element)
                if len(group) == size:
                    self._open(key, self._groups.pop(key))
            elif self._groups:
                key = min(self._groups)   # the groups left over, smallest key first
                self._open(key, self._groups.pop(key))
            else:
                raise StopIteration

    def save(self):
        current = self._current
        return {"input": self._source.save(), "ended": self._ended,
                "groups": [[k, pack_elements(g)] for k, g in self._groups.items()],
                "sizes": [[k, v] for k, v in self._sizes.items()],
                "current": None if current is None else {
                    "key": current[0], "elements": pack_elements(current[1]),
                    "state": current[2].save()}}

    def restore(self, state):
        self._source.restore(state["input"])
        self._ended = bool(state["ended"])
        self._groups = {int(k): unpack_elements(g) for k, g in state["groups"]}
        self._sizes = {int(k): int(v) for k, v in state["sizes"]}
        current = state["current"]
        if current is not None:
            self._open(int(current["key"]), unpack_elements(current["elements"]),
                       current["state"])

    def close(self):
        if self._current is not None:
            self._current[2].close()
        self._source.close()


def group_by_window_dataset(dataset: Dataset, key_func: Callable, reduce_func: Callable,
                            window_size: int | None = None,
                            window_size_func: Callable | None = None) -> Dataset:
    """:meth:`Dataset.group_by_window`."""
    return GroupByWindowDataset(dataset, key_func, reduce_func, window_size,
                                window_size_func)


def bucket_by_sequence_length_dataset(dataset: Dataset, element_length_func: Callable,
                                      bucket_boundaries, bucket_batch_sizes,
                                      padded_shapes=None, padding_values=None,
                                      pad_to_bucket_boundary: bool = False,
                                      no_padding: bool = False,
                                      drop_remainder: bool = False) -> Dataset:
    """:meth:`Dataset.bucket_by_sequence_length`."""
    boundaries = [int(b) for b in bucket_boundaries]
    sizes = [_check_positive("bucket_batch_sizes", b, "bucket_by_sequence_length")
             for b in bucket_batch_sizes]
    if len(sizes) != len(boundaries) + 1:
        raise ValueError(f"bucket_by_sequence_length: len(bucket_batch_sizes) must be "
                         f"len(bucket_boundaries) + 1, got {len(sizes)} batch sizes for "
                         f"{len(boundaries)} boundaries")
    if any(a >= b for a, b in zip(boundaries, boundaries[1:])):
        raise ValueError(f"bucket_by_sequence_length: bucket_boundaries must be strictly "
                         f"increasing, got {boundaries}")
    if not callable(element_length_func):
        raise TypeError(f"bucket_by_sequence_length: element_length_func must be callable, "
                        f"got {type(element_length_func).__name__}")

    def bucket(*args):
        length = _integer(element_length_func(*args), "an element's length",
                          "bucket_by_sequence_length: element_length_func")
        return bisect.bisect_right(boundaries, length)

    def key_func(*element):
        return bucket(*element)

    def shapes_for(key: int | None):
        spec = dataset.element_spec
        shapes = padded_shapes
        if shapes is None:
            shapes = _pack_leaves(spec, [s.shape for s in nest.flatten(spec)]) \
                if nest.is_nested(spec) else spec.shape
        if not pad_to_bucket_boundary or key is None:
            return shapes
        if key == len(boundaries):
            raise ValueError(f"bucket_by_sequence_length: with pad_to_bucket_boundary=True "
                             f"every element must be shorter than the last boundary "
                             f"{boundaries[-1] if boundaries else None}; an element fell "
                             "past it")
        fill = boundaries[key] - 1
        return _map_shapes(spec, shapes, lambda shape: tuple(fill if d is None else d
                                                             for d in shape))

    def reduce_func(key, window: Dataset) -> Dataset:
        k = int(key)
        if no_padding:
            return window.batch(sizes[k], drop_remainder=drop_remainder)
        return window.padded_batch(sizes[k], shapes_for(k), padding_values,
                                   drop_remainder=drop_remainder)

    def window_size_func(key):
        return sizes[int(key)]

    # As tf.data: the batch size depends on the bucket, so the batch dimension is None,
    # and so are dimensions padded to a bucket's boundary.
    def spec_func():
        template = ElementsDataset([], dataset.element_spec)
        if no_padding:
            spec = template.batch(1).element_spec
        else:
            spec = template.padded_batch(1, shapes_for(None), padding_values).element_spec
        return nest.map_structure(lambda s: TensorSpec((None,) + s.shape[1:], s.dtype), spec)

    return GroupByWindowDataset(dataset, key_func, reduce_func,
                                window_size_func=window_size_func, spec_func=spec_func)


def _map_shapes(spec: Any, shapes: Any, fn: Callable) -> Any:
    """``fn`` applied to every shape of a padded_shapes value laid out like ``spec``."""
    if not nest.is_nested(spec):
        return fn(tuple(shapes))
    from gpustrat.data.padding import _flatten_up_to  # noqa: PLC0415
    flat = [fn(tuple(s)) for s in _flatten_up_to(spec, shapes, "padded_shapes")]
    return _pack_leaves(spec, flat)


def _pack_leaves(spec: Any, leaves: list) -> Any:
    """``leaves`` (tuples, which nest would walk into) placed at ``spec``'s leaves."""
    it = iter(leaves)

    def build(s):
        if isinstance(s, dict):
            return {k: build(s[k]) for k in sorted(s)} if type(s) is dict else \
                type(s)((k, build(s[k])) for k in sorted(s))
        if nest.is_namedtuple(s):
            return type(s)(*[build(v) for v in s])
        if isinstance(s, (tuple, list)):
            return type(s)(build(v) for v in s)
        return next(it)
    return build(spec)
