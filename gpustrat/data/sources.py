"""In-memory sources: ``range``, ``from_tensors``, ``from_tensor_slices``, ``from_generator``.

Words:
    slice source: ``from_tensor_slices(x)``: element i is ``x[i]`` for every component.
    fused batch: ``from_tensor_slices(x).batch(B)`` and ``range(n).batch(B)`` do not
        batch element by element: they become one source node that yields
        ``x[i:i + B]`` (a view of the caller's array, no copy) or ``arange`` chunks. The
        per-batch cost is then one slice per component, which is what makes the data
        path fast enough to feed a GPU from Python.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import Dataset, _IterContext, rows_of_batches
from gpustrat.data.iterator_state import FunctionIterator, IndexedIterator, StateIterator
from gpustrat.data.spec import STRING, TensorSpec, spec_of

# Range is produced in chunks of this many values: one arange per chunk instead of
# one Python int conversion per element, without materialising huge ranges.
_RANGE_CHUNK = 4096


def _range_len(start: int, stop: int, step: int) -> int:
    return len(range(start, stop, step))


class RangeDataset(Dataset):
    """``Dataset.range(stop)`` / ``(start, stop)`` / ``(start, stop, step)``."""

    def __init__(self, *args, dtype=np.int64):
        if not 1 <= len(args) <= 3:
            raise TypeError(f"range takes 1 to 3 arguments (start, stop, step), got {len(args)}")
        for a in args:
            if isinstance(a, bool) or not isinstance(a, (int, np.integer)):
                raise TypeError(f"range arguments must be ints, got {a!r}")
        r = range(*[int(a) for a in args])  # raises ValueError for step 0, like range
        self._start, self._stop, self._step = r.start, r.stop, r.step
        self._dtype = np.dtype(dtype)

    def _iter(self, ctx: _IterContext):
        start, stop, step = self._start, self._stop, self._step
        n = _range_len(start, stop, step)
        for c in range(0, n, _RANGE_CHUNK):
            first = start + c * step
            last = start + min(n, c + _RANGE_CHUNK) * step
            yield from np.arange(first, last, step, dtype=self._dtype)

    def _state_iter(self, ctx):
        start, step, dtype = self._start, self._step, self._dtype
        n = _range_len(start, self._stop, step)

        def body(keys):
            # The values come from arange chunks as in _iter, one key taken with each
            # (all in C: 4x faster than a NumPy scalar made per key), so the position
            # is still the keys' length hint.
            first = n - keys.__length_hint__()
            chunks = (np.arange(start + i * step, start + min(n, i + _RANGE_CHUNK) * step,
                                step, dtype=dtype) for i in range(first, n, _RANGE_CHUNK))
            return map(operator.itemgetter(1), zip(keys, itertools.chain.from_iterable(chunks)))
        return IndexedIterator(n, None, start, step, body)

    def _cardinality(self) -> int:
        return _range_len(self._start, self._stop, self._step)

    def _compute_spec(self):
        return TensorSpec((), self._dtype)

    def _batch_fused(self, batch_size, drop_remainder):
        return RangeBatchDataset(self._start, self._stop, self._step, self._dtype,
                                 batch_size, drop_remainder)


class RangeBatchDataset(Dataset):
    """``range(...).batch(B)`` fused: each batch is one ``arange`` call."""

    def __init__(self, start, stop, step, dtype, batch_size, drop_remainder):
        self._start, self._stop, self._step = start, stop, step
        self._dtype = dtype
        self._batch_size, self._drop = batch_size, drop_remainder

    def _iter(self, ctx):
        start, step, b = self._start, self._step, self._batch_size
        n = _range_len(start, self._stop, step)
        end = n - n % b if self._drop else n
        for i in range(0, end, b):
            yield np.arange(start + i * step, start + min(end, i + b) * step, step,
                            dtype=self._dtype)

    def _state_iter(self, ctx):
        start, step, b, dtype = self._start, self._step, self._batch_size, self._dtype
        n = _range_len(start, self._stop, step)
        end = n - n % b if self._drop else n

        def get(k):
            i = k * b
            return np.arange(start + i * step, start + min(end, i + b) * step, step,
                             dtype=dtype)
        return IndexedIterator(-(-end // b), get)

    def _cardinality(self):
        n = _range_len(self._start, self._stop, self._step)
        return n // self._batch_size if self._drop else math.ceil(n / self._batch_size)

    def _compute_spec(self):
        return TensorSpec((self._batch_size if self._drop else None,), self._dtype)

    def batch_rows(self):
        return rows_of_batches(_range_len(self._start, self._stop, self._step),
                               self._batch_size, self._drop)


class TensorsDataset(Dataset):
    """``from_tensors(x)``: the single element ``x``."""

    def __init__(self, tensors: Any):
        self._element = st.normalize(tensors)
        st.check_has_component(self._element, "from_tensors")

    def _iter(self, ctx):
        yield self._element

    def _state_iter(self, ctx):
        def step_fn(it):
            if it.fields["done"]:
                raise StopIteration
            it.fields["done"] = True
            return self._element
        return FunctionIterator((), step_fn, done=False)

    def _cardinality(self):
        return 1

    def _compute_spec(self):
        return spec_of(self._element)


class TensorSliceDataset(Dataset):
    """``from_tensor_slices(x)``: element i holds row i of every component of ``x``."""

    def __init__(self, tensors: Any):
        element = st.normalize(tensors)
        self._structure = element
        self._leaves = nest.flatten(element)
        if not self._leaves:
            raise ValueError("from_tensor_slices needs at least one component")
        lengths = []
        for i, leaf in enumerate(self._leaves):
            if np.ndim(leaf) == 0:
                raise ValueError(f"from_tensor_slices: component {i} is a scalar "
                                 f"({leaf!r}); every component needs a first dimension to "
                                 "slice (use from_tensors for a single element)")
            lengths.append(st.leading_dim(leaf))
        if len(set(lengths)) != 1:
            raise ValueError(f"from_tensor_slices: all components need the same first "
                             f"dimension, got {lengths} (in flattened component order)")
        self._n = lengths[0]
        self._flatten, self._pack = st.make_plan(element)

    def _iter(self, ctx):
        leaves = self._leaves
        if len(leaves) == 1 and not nest.is_nested(self._structure):
            yield from leaves[0]
            return
        pack = self._pack
        for row in zip(*leaves):
            yield pack(row)

    def _state_iter(self, ctx):
        leaves, pack = self._leaves, self._pack
        if len(leaves) == 1 and not nest.is_nested(self._structure):
            return IndexedIterator(self._n, leaves[0].__getitem__)
        return IndexedIterator(self._n, lambda i: pack([a[i] for a in leaves]))

    def _cardinality(self):
        return self._n

    def _compute_spec(self):
        return nest.map_structure(lambda s: s._unbatched(), spec_of(self._structure))

    def _batch_fused(self, batch_size, drop_remainder):
        return SlicedBatchDataset(self._structure, batch_size, drop_remainder)


class SlicedBatchDataset(Dataset):
    """``from_tensor_slices(x).batch(B)`` fused: batch j is ``x[j*B:(j+1)*B]`` (a view)."""

    def __init__(self, structure: Any, batch_size: int, drop_remainder: bool):
        self._structure = structure
        self._leaves = nest.flatten(structure)
        self._n = st.leading_dim(self._leaves[0])
        self._batch_size, self._drop = batch_size, drop_remainder
        self._flatten, self._pack = st.make_plan(structure)

    def _iter(self, ctx):
        n, b = self._n, self._batch_size
        end = n - n % b if self._drop else n
        if len(self._leaves) == 1 and not nest.is_nested(self._structure):
            a = self._leaves[0]
            for i in range(0, end, b):
                yield a[i:i + b]
            return
        leaves, pack = self._leaves, self._pack
        for i in range(0, end, b):
            j = i + b
            yield pack([a[i:j] for a in leaves])

    def _state_iter(self, ctx):
        count, body = self.__dict__.get("_batches") or self._batch_body()
        return IndexedIterator(count, None, 0, self._batch_size, body)

    def _batch_body(self) -> tuple:
        """``(number of batches, body)``: ``body(starts)`` yields the batch at each
        start (the last one of a partial epoch ends past n, where slicing stops at n);
        worked out once, as every epoch's iterator needs it."""
        n, b = self._n, self._batch_size
        end = n - n % b if self._drop else n
        leaves, pack = self._leaves, self._pack
        if len(leaves) == 1 and not nest.is_nested(self._structure):
            a = leaves[0]

            def body(starts):
                for i in starts:
                    yield a[i:i + b]
        else:
            def body(starts):
                for i in starts:
                    j = i + b
                    yield pack([x[i:j] for x in leaves])
        self.__dict__["_batches"] = (-(-end // b), body)
        return self.__dict__["_batches"]

    def _cardinality(self):
        n, b = self._n, self._batch_size
        return n // b if self._drop else math.ceil(n / b)

    def batch_rows(self):
        return rows_of_batches(self._n, self._batch_size, self._drop)

    def _compute_spec(self):
        dim = self._batch_size if self._drop else None
        return nest.map_structure(lambda s: TensorSpec((dim,) + s.shape[1:], s.dtype),
                                  spec_of(self._structure))


def _signature_from_types(output_types, output_shapes):
    """An output_signature from the older ``output_types``/``output_shapes`` pair.

    Without ``output_shapes`` only the dtypes are checked: the specs carry shape ``()``
    and the checks ignore it (``tf.data`` gives such components an unknown shape).
    """
    if output_shapes is None:
        return nest.map_structure(lambda t: TensorSpec((), t), output_types)
    if not nest.is_nested(output_types):
        return TensorSpec(output_shapes, output_types)
    return nest.map_structure(lambda t, s: TensorSpec(s.shape, t), output_types,
                              _shapes_like(output_types, output_shapes))


def _shapes_like(types, shapes):
    """``shapes`` (whose leaves are shape tuples) packed into ``types``' structure."""
    if not nest.is_nested(types):
        return _ShapeLeaf(shapes)
    if isinstance(types, dict):
        return {k: _shapes_like(types[k], shapes[k]) for k in types}
    return type(types)(*[_shapes_like(t, s) for t, s in zip(types, shapes)]) \
        if nest.is_namedtuple(types) else type(types)(
            _shapes_like(t, s) for t, s in zip(types, shapes))


class _ShapeLeaf:
    """A shape wrapped so that nest treats it as one leaf, not as a tuple."""

    def __init__(self, shape):
        self.shape = shape


class GeneratorDataset(Dataset):
    """``from_generator``: elements of ``generator(*args)``, checked against a signature;
    its position is saved when ``generator`` is a class with ``get_state``/``set_state``."""

    def __init__(self, generator: Callable, output_types=None, output_shapes=None,
                 args=None, output_signature=None):
        if not callable(generator):
            raise TypeError(f"from_generator needs a callable that returns an iterator "
                            f"(each epoch calls it again), got {type(generator).__name__}")
        self._check_shapes = True
        if output_signature is None and output_types is not None:
            output_signature = _signature_from_types(output_types, output_shapes)
            self._check_shapes = output_shapes is not None
        if output_signature is not None:
            for s in nest.flatten(output_signature):
                if not isinstance(s, TensorSpec):
                    raise TypeError(f"output_signature must be a structure of TensorSpec, "
                                    f"found {s!r}")
        self._generator = generator
        self._args = tuple(args) if args is not None else ()
        self._signature = output_signature

    def _name(self) -> str:
        return getattr(self._generator, "__name__", type(self._generator).__name__)

    def _has_state_methods(self) -> bool:
        """Whether ``generator`` declares that its objects save their position: it has
        callable ``get_state`` and ``set_state`` attributes (a class defining them)."""
        if getattr(self._generator, "_saves_position", False):  # a SequenceGenerator
            return True
        return callable(getattr(self._generator, "get_state", None)) and \
            callable(getattr(self._generator, "set_state", None))

    def _state_unsupported(self):
        if self._has_state_methods():
            return None
        return (f"from_generator({self._name()}) cannot save its position: a Python "
                "generator's state cannot be saved; build the source from range, "
                "from_tensor_slices or files, make the generator's input an index dataset "
                "(range(n).map(load_item)), iterate a sequence with "
                "from_generator(gs.data.SequenceGenerator(items)), or pass as generator "
                "a class whose objects are iterators with get_state() and "
                "set_state(state) methods")

    def _checker(self):
        """``check(element, index)``: the element conformed to the signature."""
        sig = self._signature
        if sig is None:
            return lambda element, index: st.normalize(element)
        specs = nest.flatten(sig)
        flatten, pack = st.make_plan(sig)
        check_shapes = self._check_shapes
        return lambda element, index: _conform(element, sig, specs, flatten, pack, index,
                                               check_shapes)

    def _iter(self, ctx):
        it = iter(self._generator(*self._args))
        check = self._checker()
        try:
            for index, element in enumerate(it):
                yield check(element, index)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _state_iter(self, ctx):
        return _GeneratorIterator(self)

    def _compute_spec(self):
        if self._signature is not None and self._check_shapes:
            return self._signature
        return super()._compute_spec()


class _GeneratorIterator(StateIterator):
    """``from_generator`` over a class whose objects save their position: the state is
    the elements returned and what the object's ``get_state()`` returns; a restore
    makes a new object and calls its ``set_state`` before iterating it."""

    def __init__(self, node: GeneratorDataset):
        self._node = node
        self._check = node._checker()
        self._obj = self._it = None
        self._index = 0

    def _make(self) -> None:
        node = self._node
        self._obj = node._generator(*node._args)
        for method in ("get_state", "set_state"):
            if not callable(getattr(self._obj, method, None)):
                raise TypeError(f"from_generator({node._name()}): the object it returned, "
                                f"a {type(self._obj).__name__}, has no {method}() method; "
                                "the objects of a generator class that saves its position "
                                "need get_state() and set_state(state)")

    def __next__(self):
        if self._it is None:
            if self._obj is None:
                self._make()
            self._it = iter(self._obj)
        element = self._check(next(self._it), self._index)
        self._index += 1
        return element

    def save(self):
        if self._obj is None:
            return {"started": False}
        return {"started": True, "index": self._index, "state": self._obj.get_state()}

    def restore(self, state):
        if not state["started"]:
            return
        self._make()
        self._obj.set_state(state["state"])
        self._index = int(state["index"])

    def close(self):
        close = getattr(self._it, "close", None)
        if close is not None:
            close()


class SequenceGenerator:
    """A ``from_generator`` generator over a re-iterable sequence (a list, tuple,
    ``range`` or array of items: indices, file names, records) whose position is saved
    as an index, so that a restored pipeline resumes exactly at the next item.

    ``Dataset.from_generator(SequenceGenerator(items), output_signature=...)`` yields
    ``items[0], items[1], ...`` each epoch, as a generator function looping over
    ``items`` would, and saves its position (a Python generator cannot). The sequence
    must hold the same items when the job is restored (its length is checked).
    """

    _saves_position = True

    def __init__(self, sequence):
        if not hasattr(sequence, "__len__") or not hasattr(sequence, "__getitem__") or \
                isinstance(sequence, (str, bytes, dict)):
            raise TypeError(f"SequenceGenerator needs a sequence with len() and indexing "
                            f"(a list, tuple, range or array), got {type(sequence).__name__}; "
                            "for an iterator, make a list of it first")
        self.sequence = sequence
        self.__name__ = f"SequenceGenerator of {len(sequence)} items"

    def __call__(self) -> "_SequenceIterator":
        return _SequenceIterator(self.sequence)


class _SequenceIterator:
    """One epoch of a :class:`SequenceGenerator`: its position is the next index."""

    def __init__(self, sequence):
        self._sequence = sequence
        self._index = 0

    def __iter__(self):
        return self

    def __next__(self):
        i = self._index
        if i >= len(self._sequence):
            raise StopIteration
        self._index = i + 1
        return self._sequence[i]

    def get_state(self) -> dict:
        return {"index": self._index, "length": len(self._sequence)}

    def set_state(self, state: dict) -> None:
        if int(state["length"]) != len(self._sequence):
            raise ValueError(f"SequenceGenerator: the position was saved over a sequence "
                             f"of {int(state['length'])} items, but this one holds "
                             f"{len(self._sequence)}; restore with the same items")
        self._index = int(state["index"])


def _flatten_up_to(sig, element, path: str = "") -> list:
    """``element``'s values at the leaf positions of ``sig`` (lists there are values)."""
    if not nest.is_nested(sig):
        return [element]
    where = path or "the top"
    if isinstance(sig, dict):
        if not isinstance(element, dict) or sorted(element) != sorted(sig):
            raise ValueError(f"expected a dict with keys {sorted(sig)} at {where}, got "
                             f"{type(element).__name__}")
        return [v for k in sorted(sig) for v in _flatten_up_to(sig[k], element[k],
                                                                 f"{path}[{k!r}]")]
    if not isinstance(element, (tuple, list)) or len(element) != len(sig):
        raise ValueError(f"expected a sequence of {len(sig)} at {where}, got "
                         f"{type(element).__name__}")
    return [v for i, (s, e) in enumerate(zip(sig, element))
            for v in _flatten_up_to(s, e, f"{path}[{i}]")]


def _conform(element, sig, specs, flatten, pack, index, check_shapes=True):
    """``element`` as NumPy leaves matching ``sig`` (its dtypes only, unless
    ``check_shapes``); a clear error otherwise."""
    try:
        leaves = _flatten_up_to(sig, element)
    except ValueError as e:
        raise TypeError(f"from_generator: element {index} does not match output_signature: "
                        f"{e}; expected the structure {sig}, got {element!r}") from None
    out = []
    for c, (spec, value) in enumerate(zip(specs, leaves)):
        arr = _as_dtype(value, spec.dtype)
        if arr is None or (check_shapes and not spec.is_compatible_with(arr)):
            got = TensorSpec.from_value(value)
            where = f" component {c}" if len(specs) > 1 else ""
            expected = spec if check_shapes else \
                f"dtype {'string' if spec.dtype == STRING else spec.dtype.name}"
            raise TypeError(
                f"from_generator: element {index}{where} does not match output_signature: "
                f"expected {expected}, got {got}")
        out.append(arr)
    return pack(out)


def _as_dtype(value, dtype: np.dtype):
    """``value`` converted to ``dtype`` when that loses nothing, else None."""
    if dtype == STRING:
        if isinstance(value, (bytes, str, np.bytes_, np.str_)):
            return st.to_leaf(bytes(value) if isinstance(value, np.bytes_) else str(value)
                              if isinstance(value, np.str_) else value)
        if isinstance(value, list):
            value = st.to_leaf(value)
        if isinstance(value, np.ndarray) and value.dtype.kind in "OS":
            return value.astype(object) if value.dtype.kind == "S" else value
        return None
    if isinstance(value, (np.ndarray, np.generic)):
        if value.dtype == dtype:
            return value
        # tf.data casts NumPy numbers to the declared numeric dtype as astype does
        # (float64 to float32, even float to int); Python numbers must fit exactly.
        if np.can_cast(value.dtype, dtype, "safe") or (
                value.dtype.kind in "biufc" and np.dtype(dtype).kind in "biufc"):
            return value.astype(dtype)
        return None
    if isinstance(value, (bytes, str)):
        return None
    arr = np.asarray(value)
    if arr.dtype.kind in "OUS":
        return None
    conv = np.asarray(value, dtype=dtype)
    if arr.size and not np.array_equal(conv, arr):
        return None  # the Python value does not fit the dtype (overflow, fraction)
    return conv[()] if conv.ndim == 0 else conv
