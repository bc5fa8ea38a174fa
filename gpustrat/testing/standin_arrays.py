"""The stand-in backend's arrays: a subclass of the real ``cupy.ndarray`` whose
operations count a launch and return an array of the result's shape and dtype, and a
``MemoryPointer`` whose copies are counted.

The shape and dtype of a result come from NumPy's rules applied to 0-d stand-ins of the
operands (once per kind of operands, then from a cache), never from computing it.
"""

from __future__ import annotations

import numpy as np

_DUMMY_SCALARS = {bool: True, int: 1, float: 1.0, complex: 1j}


def _operand_key(o):
    if isinstance(o, np.ndarray):
        return ("a", o.shape, o.dtype)
    cls = type(o)
    if cls in _DUMMY_SCALARS:
        return cls
    if isinstance(o, np.generic):
        return ("s", o.dtype)
    if hasattr(o, "shape") and hasattr(o, "dtype"):   # a CuPy array
        return ("a", tuple(o.shape), np.dtype(o.dtype))
    return ("v", repr(o))


def _dummy(key, o):
    if isinstance(key, tuple):
        if key[0] == "a":
            return np.zeros((), key[2])
        if key[0] == "s":
            return key[1].type(1)
        return o
    return _DUMMY_SCALARS[key]


def _shapes(keys) -> list:
    return [k[1] for k in keys if isinstance(k, tuple) and k[0] == "a"]


_elementwise_cache: dict = {}
_binary_cache: dict = {}


def _elementwise_result(fn, name: str, operands, dtype=None):
    """``(shape, dtype)`` of ``fn(*operands)`` for a NumPy ufunc-like ``fn``."""
    keys = tuple(_operand_key(o) for o in operands)
    ck = (name, keys, dtype)
    hit = _elementwise_cache.get(ck)
    if hit is None:
        shape = np.broadcast_shapes(*_shapes(keys))
        with np.errstate(all="ignore"):
            kw = {} if dtype is None else {"dtype": dtype}
            out = np.asarray(fn(*[_dummy(k, o) for k, o in zip(keys, operands)], **kw))
        hit = _elementwise_cache[ck] = (shape, out.dtype)
    return hit


_reduce_cache: dict = {}


def _reduction_result(name: str, shape: tuple, dtype: np.dtype, axis, out_dtype, keepdims):
    ck = (name, shape, dtype, axis if not isinstance(axis, list) else tuple(axis),
          out_dtype, keepdims)
    hit = _reduce_cache.get(ck)
    if hit is None:
        nd = len(shape)
        if axis is None:
            axes = set(range(nd))
        else:
            axes = {int(a) % nd if nd else 0 for a in (axis if isinstance(axis, (tuple, list))
                                                       else (axis,))}
        if keepdims:
            rshape = tuple(1 if i in axes else n for i, n in enumerate(shape))
        else:
            rshape = tuple(n for i, n in enumerate(shape) if i not in axes)
        kw = {} if out_dtype is None else {"dtype": out_dtype}
        with np.errstate(all="ignore"):
            rdtype = np.asarray(getattr(np, name)(np.ones((1,), dtype), **kw)).dtype
        hit = _reduce_cache[ck] = (rshape, rdtype)
    return hit


def _matmul_shape(a: tuple, b: tuple) -> tuple:
    if not a or not b:
        raise ValueError("matmul: a 0-d operand")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ValueError(f"matmul: shapes {a} and {b} are not aligned")
    batch = np.broadcast_shapes(a2[:-2], b2[:-2])
    out = batch + (a2[-2], b2[-1])
    if len(a) == 1:
        out = out[:-2] + out[-1:]
    if len(b) == 1:
        out = out[:-1]
    return out


def _is_basic_index(key) -> bool:
    if isinstance(key, tuple):
        return all(k is None or k is Ellipsis or type(k) in (int, slice) or
                   isinstance(k, (np.integer,)) for k in key)
    return key is None or key is Ellipsis or type(key) in (int, slice) or \
        isinstance(key, np.integer)


def make_memory_pointer(cp, real):
    model = cp.model

    class MemoryPointer(real.cuda.MemoryPointer):
        """CuPy's ``MemoryPointer`` whose asynchronous copies are counted, not made."""

        def __add__(self, offset):
            return MemoryPointer(self.mem, self.ptr - self.mem.ptr + int(offset))

        def __sub__(self, offset):
            return self.__add__(-int(offset))

        def copy_from_device_async(self, src, size, stream=None):
            model.count("copies")

        def copy_from_host_async(self, mem, size, stream=None):
            model.count("copies")

        def copy_to_host_async(self, mem, size, stream=None):
            model.count("copies")

        def copy_from_device(self, src, size):
            model.count("copies")

        def copy_from_host(self, mem, size):
            model.count("copies")
            model.host_sync("copy_from_host")

        def copy_to_host(self, mem, size):
            model.count("copies")
            model.host_sync("copy_to_host")

        def memset_async(self, value, size, stream=None):
            model.count("copies")

        def memset(self, value, size):
            model.count("copies")
            model.host_sync("memset")

    return MemoryPointer


def make_ndarray(cp, real):
    model = cp.model
    base = real.ndarray

    class ndarray(base):
        """A real ``cupy.ndarray`` whose operations count a launch instead of running."""

        __slots__ = ()      # as CuPy's: no attributes of its own, no weak references

        # --- the CUDA Array Interface (CuPy's asks the driver for the current stream)
        @property
        def __cuda_array_interface__(self):
            ptr = self.data.ptr
            s = cp.cuda.get_current_stream()
            return {"shape": self.shape, "typestr": self.dtype.str, "descr": [("", self.dtype.str)],
                    "version": 3, "data": (ptr, False),
                    "strides": None if self._c_contiguous else self.strides,
                    "stream": s.ptr or 1}

        def __array__(self, *args, **kw):
            raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                            "Please use `.get()` to construct a NumPy array explicitly.")

        def __repr__(self):
            return (f"stand-in cupy.ndarray(shape={self.shape}, dtype={self.dtype}, "
                    f"gpu:{self.data.device_id})")

        __str__ = __repr__

        # --- reading back: host synchronizations
        def get(self, stream=None, order="C", out=None, blocking=True):
            model.count("copies")
            if blocking:
                model.host_sync("get")
            if out is not None:
                return out
            return np.zeros(self.shape, self.dtype)

        def set(self, arr, stream=None):
            if not isinstance(arr, np.ndarray):
                raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
            if arr.dtype != self.dtype or arr.shape != self.shape:
                raise ValueError(f"set: {arr.shape} {arr.dtype} into {self.shape} {self.dtype}")
            model.count("copies")
            if stream is None or not model.is_pinned(arr):
                model.host_sync("set (a copy from pageable host memory)")

        def item(self):
            model.count("copies")
            model.host_sync("item")
            return np.zeros((), self.dtype).item()

        def tolist(self):
            return self.get().tolist()

        def __float__(self):
            return float(self.item())

        def __int__(self):
            return int(self.item())

        def __bool__(self):
            if self.size != 1:
                raise ValueError("The truth value of an array with more than one element "
                                 "is ambiguous.")
            return bool(self.item())

        def __complex__(self):
            return complex(self.item())

        def __index__(self):
            return int(self.item())

        # --- copies and views
        def copy(self, order="C"):
            return cp._copy(self)

        def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
            if not copy and np.dtype(dtype) == self.dtype:
                return self
            return cp._copy(self, dtype)

        def fill(self, value):
            cp._launch()

        def reshape(self, *shape, order="C"):
            if self._c_contiguous:
                return base.reshape(self, *shape)
            return cp._copy(self).reshape(*shape)

        def ravel(self, order="C"):
            return self.reshape(-1)

        def flatten(self, order="C"):
            return cp._copy(self).reshape(-1)

        def __getitem__(self, key):
            if _is_basic_index(key):
                return base.__getitem__(self, key)
            cp._launch()      # a gather
            keys = key if isinstance(key, tuple) else (key,)
            dummy_keys = tuple(np.zeros(k.shape, k.dtype) if isinstance(k, base) else k
                               for k in keys)
            if any(np.asarray(k).dtype == np.bool_ for k in dummy_keys
                   if not (k is None or k is Ellipsis or isinstance(k, slice))):
                model.host_sync("boolean-mask indexing (the result's size)")
            shape = np.lib.stride_tricks.as_strided(
                np.zeros(1, np.bool_), self.shape, (0,) * self.ndim)[dummy_keys].shape
            return cp._new(shape, self.dtype)

        def __setitem__(self, key, value):
            # As CuPy: the target's view, then one launch writing it.
            if _is_basic_index(key):
                base.__getitem__(self, key)
            cp._launch()

        def take(self, indices, axis=None):
            cp._launch()
            ishape = tuple(indices.shape) if hasattr(indices, "shape") else np.shape(indices)
            if axis is None:
                shape = ishape
            else:
                ax = axis % self.ndim
                shape = self.shape[:ax] + ishape + self.shape[ax + 1:]
            return cp._new(shape, self.dtype)

        # --- reductions
        def _reduce(self, name, axis=None, dtype=None, out=None, keepdims=False):
            shape, rdtype = _reduction_result(name, self.shape, self.dtype, axis,
                                              None if dtype is None else np.dtype(dtype),
                                              keepdims)
            cp._launch()
            if out is not None:
                if tuple(out.shape) != shape:
                    raise ValueError(f"{name}: out has shape {out.shape}, the result {shape}")
                return out
            return cp._new(shape, rdtype)

        def sum(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("sum", axis, dtype, out, keepdims)

        def prod(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("prod", axis, dtype, out, keepdims)

        def mean(self, axis=None, dtype=None, out=None, keepdims=False):
            return self._reduce("mean", axis, dtype, out, keepdims)

        def var(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            return self._reduce("var", axis, dtype, out, keepdims)

        def std(self, axis=None, dtype=None, out=None, ddof=0, keepdims=False):
            return self._reduce("std", axis, dtype, out, keepdims)

        def max(self, axis=None, out=None, keepdims=False):
            return self._reduce("max", axis, None, out, keepdims)

        def min(self, axis=None, out=None, keepdims=False):
            return self._reduce("min", axis, None, out, keepdims)

        def any(self, axis=None, out=None, keepdims=False):
            return self._reduce("any", axis, None, out, keepdims)

        def all(self, axis=None, out=None, keepdims=False):
            return self._reduce("all", axis, None, out, keepdims)

        def argmax(self, axis=None, out=None, keepdims=False):
            return self._reduce("argmax", axis, None, out, keepdims)

        def argmin(self, axis=None, out=None, keepdims=False):
            return self._reduce("argmin", axis, None, out, keepdims)

        def clip(self, min=None, max=None, out=None):
            return cp._elementwise(np.clip, "clip", (self, min, max), out=out)

        def nonzero(self):
            model.host_sync("nonzero (the result's size)")
            cp._launch()
            return tuple(cp._new((0,), np.int64) for _ in range(self.ndim))

        def dot(self, b, out=None):
            result = self.__matmul__(b)
            return result if out is None else out

        # --- arithmetic
        def __matmul__(self, other):
            cp._launch()
            return cp._new(_matmul_shape(self.shape, tuple(other.shape)),
                           np.result_type(self.dtype, other.dtype))

        def __rmatmul__(self, other):
            cp._launch()
            return cp._new(_matmul_shape(tuple(other.shape), self.shape),
                           np.result_type(self.dtype, other.dtype))

        def __neg__(self):
            return cp._elementwise(np.negative, "negative", (self,))

        def __pos__(self):
            return cp._copy(self)

        def __abs__(self):
            return cp._elementwise(np.absolute, "absolute", (self,))

        def __invert__(self):
            return cp._elementwise(np.invert, "invert", (self,))

        __hash__ = base.__hash__

        # NumPy's functions and ufuncs called on these arrays.
        def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
            if method != "__call__":
                return NotImplemented
            return cp._elementwise(ufunc, ufunc.__name__, inputs, out=kwargs.get("out"),
                                   dtype=kwargs.get("dtype"))

        def __array_function__(self, func, types, args, kwargs):
            fn = getattr(cp, func.__name__, None)
            if fn is None:
                return NotImplemented
            return fn(*args, **kwargs)

    def binary(fn, name, reflected=False, inplace=False):
        if inplace:
            def method(self, other):
                return cp._binary(fn, name, self, other, inplace=True)
        elif reflected:
            def method(self, other):
                return cp._binary(fn, name, other, self)
        else:
            def method(self, other):
                return cp._binary(fn, name, self, other)
        return method

    for name, fn in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                     ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                     ("pow", np.power), ("mod", np.mod), ("and", np.bitwise_and),
                     ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                     ("lshift", np.left_shift), ("rshift", np.right_shift)):
        setattr(ndarray, f"__{name}__", binary(fn, name))
        setattr(ndarray, f"__r{name}__", binary(fn, name, reflected=True))
        setattr(ndarray, f"__i{name}__", binary(fn, name, inplace=True))
    for name, fn in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less),
                     ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal)):
        setattr(ndarray, f"__{name}__", binary(fn, name))
    # kernels/_launch.py and devices.py recognise CuPy arrays by their class's module.
    ndarray.__module__ = "cupy._core.core"
    ndarray.__qualname__ = ndarray.__name__ = "ndarray"
    return ndarray
