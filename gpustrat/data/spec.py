"""Type specifications of dataset elements.

Words:
    spec: a :class:`TensorSpec`, the static description of one leaf of an element:
        its shape (a tuple whose entries are ints, or None for a dimension that is not
        known before iteration, such as the batch dimension of ``batch`` without
        ``drop_remainder``) and its NumPy dtype.
    element spec: the nested structure (tuples, lists, dicts, namedtuples) of
        TensorSpecs that mirrors a dataset's elements, as ``tf.data``'s
        ``element_spec``.
    function spec: the element spec of what a user function (``map``, ``interleave``)
        returns. A function is not traced as TensorFlow traces it, so its output shapes
        are learnt by calling it: a dimension is static only where it is the same for the
        first two elements and for inputs whose unknown dimensions take other sizes
        (:func:`probes`); everywhere else it is None, so that no later element contradicts
        the spec.
    string: text lines, file names and TFRecord records are byte strings, as
        ``tf.string``. Like TensorFlow's ``.numpy()``, a scalar string is a Python
        ``bytes`` object and a batch of strings is a NumPy array of dtype ``object``
        holding ``bytes`` (fixed-width ``S`` arrays would drop trailing zero bytes).
        The spec dtype of strings is :data:`STRING` (``object``); fixed-width bytes
        dtypes (``S5``) are described by it too.
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from gpustrat import devices, nest

# Byte strings of any length: what TF calls tf.string.
STRING = np.dtype(object)


def _norm_dtype(dtype) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.kind in "SO":
        return STRING
    if dt.kind == "U":
        return np.dtype("U")
    return dt


class TensorSpec:
    """Shape and dtype of one leaf of a dataset element.

    Args:
        shape: iterable of ints or None (unknown dimension); ``None`` for an unknown
            rank is not supported: every spec has a known rank.
        dtype: anything ``numpy.dtype`` accepts; fixed-width bytes dtypes are widened to
            :data:`STRING`.
    """

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: Iterable[int | None] = (), dtype=np.float32):
        shape = tuple(None if d is None else int(d) for d in shape)
        for d in shape:
            if d is not None and d < 0:
                raise ValueError(f"TensorSpec shape {shape} has a negative dimension; "
                                 "use None for an unknown dimension")
        self.shape = shape
        self.dtype = _norm_dtype(dtype)

    @classmethod
    def from_value(cls, value: Any) -> "TensorSpec":
        """The spec of a concrete array, NumPy scalar or Python scalar."""
        if isinstance(value, (np.ndarray, np.generic)) or devices.is_gpu_array(value):
            return cls(value.shape, value.dtype)
        if isinstance(value, bytes):
            return cls((), STRING)
        arr = np.asarray(value)
        return cls(arr.shape, arr.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def is_compatible_with(self, other: Any) -> bool:
        """True when ``other`` (a spec or a value) could be described by this spec."""
        if not isinstance(other, TensorSpec):
            other = TensorSpec.from_value(other)
        if other.dtype != self.dtype:
            return False
        if len(other.shape) != len(self.shape):
            return False
        return all(a is None or b is None or a == b for a, b in zip(self.shape, other.shape))

    def most_specific_compatible(self, other: "TensorSpec") -> "TensorSpec":
        """The narrowest spec describing values of both specs (dims that differ become None).

        Raises:
            TypeError: the dtypes or ranks differ, so no spec covers both.
        """
        if self.dtype != other.dtype or len(self.shape) != len(other.shape):
            raise TypeError(f"incompatible element specs {self} and {other}: dtypes and "
                            "ranks must match")
        shape = tuple(a if a == b else None for a, b in zip(self.shape, other.shape))
        return TensorSpec(shape, self.dtype)

    def _batched(self, batch_size: int | None) -> "TensorSpec":
        return TensorSpec((batch_size,) + self.shape, self.dtype)

    def _unbatched(self) -> "TensorSpec":
        if not self.shape:
            raise ValueError(f"cannot unbatch a scalar component ({self}): every component "
                             "needs a leading dimension")
        return TensorSpec(self.shape[1:], self.dtype)

    def __eq__(self, other: Any) -> bool:
        return (isinstance(other, TensorSpec) and self.shape == other.shape
                and self.dtype == other.dtype)

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        name = "string" if self.dtype == STRING else self.dtype.name
        return f"TensorSpec(shape={self.shape}, dtype={name})"


def spec_of(element: Any) -> Any:
    """The element spec (a structure of TensorSpecs) of a concrete element."""
    return nest.map_structure(TensorSpec.from_value, element)


def merge_specs(a: Any, b: Any) -> Any:
    """Most specific element spec covering both ``a`` and ``b`` (same structure)."""
    try:
        nest.assert_same_structure(a, b)
    except ValueError as e:
        raise TypeError(f"element structures differ: {a} vs {b} ({e})") from None
    return nest.map_structure(lambda x, y: x.most_specific_compatible(y), a, b)


def zeros_like_spec(spec: Any) -> Any:
    """An element of zeros matching ``spec`` (unknown dimensions 0; an empty dataset for
    a dataset component): what a function is called with to learn its output spec when
    its input dataset is empty."""
    def zeros(s):
        if not isinstance(s, TensorSpec):   # a DatasetSpec (a window)
            from gpustrat.data.windowing import ElementsDataset  # noqa: PLC0415
            return ElementsDataset([], s.element_spec)
        return np.zeros([d or 0 for d in s.shape], s.dtype)
    return nest.map_structure(zeros, spec)


def unknown_dims(spec: Any) -> Any:
    """``spec`` with every dimension None (the ranks and dtypes kept)."""
    return nest.map_structure(lambda s: TensorSpec((None,) * len(s.shape), s.dtype), spec)


def has_unknown_dims(spec: Any) -> bool:
    return any(d is None for s in nest.flatten(spec) for d in s.shape)


def probes(element: Any, spec: Any) -> list:
    """Elements like ``element`` (which ``spec`` describes) whose dimensions that are
    None in ``spec`` take two other sizes: ``n + 1``, and 1 (or ``n + 2`` where ``n`` is
    1 or less). Rows are repeated or dropped, so the values stay the element's own."""
    flat_spec = nest.flatten(spec)
    leaves = nest.flatten(element) if nest.is_nested(element) else [element]
    out = []
    for bigger in (True, False):
        new = []
        for leaf, s in zip(leaves, flat_spec):
            for axis, d in enumerate(s.shape):
                if d is None:
                    n = leaf.shape[axis]
                    leaf = _resized(leaf, axis, n + 1 if bigger else (1 if n > 1 else n + 2))
            new.append(leaf)
        out.append(nest.pack_sequence_as(element, new) if nest.is_nested(element) else new[0])
    return out


def _resized(leaf: Any, axis: int, size: int) -> Any:
    xp = devices.array_module(leaf)
    n = leaf.shape[axis]
    if n == 0:
        shape = list(leaf.shape)
        shape[axis] = size
        return np.full(shape, b"", dtype=object) if leaf.dtype == STRING else \
            xp.zeros(shape, dtype=leaf.dtype)
    return xp.take(leaf, xp.arange(size) % n, axis=axis)
