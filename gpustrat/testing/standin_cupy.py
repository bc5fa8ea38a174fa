"""The stand-in backend's ``cupy`` (and ``cupyx``): a module-like object whose
``ndarray`` is a subclass of the real one, whose creation functions allocate from the
stand-in's pool, and whose operations count launches (see
:mod:`gpustrat.testing.standin`)."""

from __future__ import annotations

import types

import numpy as np

from gpustrat.testing.standin import ADDRESS_SHIFT, ROUND, StandIn, _Block
from gpustrat.testing.standin_arrays import (_binary_cache, _elementwise_result,
                                             _operand_key, _reduction_result,
                                             make_memory_pointer, make_ndarray)
from gpustrat.testing.standin_cuda import make_cuda


class StandInCupy:
    """A module-like stand-in for ``cupy``: ``cp.ndarray`` is a subclass of the real one."""

    def __init__(self, model: StandIn, real):
        self.model = model
        self._real = real
        self.ndarray = make_ndarray(self, real)
        self._MemoryPointer = make_memory_pointer(self, real)
        self._Unowned = real.cuda.UnownedMemory
        self.cuda = make_cuda(self)
        self.cupyx = types.SimpleNamespace(empty_pinned=self.empty_pinned,
                                           zeros_pinned=self.empty_pinned)
        for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64",
                     "uint8", "uint16", "uint32", "uint64", "bool_", "complex64",
                     "complex128", "intp", "integer", "floating", "inexact", "number",
                     "newaxis", "inf", "nan", "pi", "e"):
            setattr(self, name, getattr(np, name))
        self.dtype = np.dtype
        self.result_type = np.result_type
        self.can_cast = np.can_cast
        self.promote_types = np.promote_types
        self.__name__ = "cupy (gpustrat stand-in)"
        self.__version__ = real.__version__

    def __getattr__(self, name):
        fn = getattr(np, name, None)
        if isinstance(fn, np.ufunc):
            def ufunc(*args, out=None, dtype=None, **kw):
                return self._elementwise(fn, name, args, out=out, dtype=dtype)
            ufunc.__name__ = name
            setattr(self, name, ufunc)
            return ufunc
        raise AttributeError(f"the stand-in CuPy has no {name!r}: add it to "
                             "gpustrat/testing/standin_cupy.py (what it launches, what it returns)")

    # --- arrays
    def _new(self, shape, dtype, device: int | None = None):
        """A fresh array on ``device`` (the current one): one pool allocation."""
        if type(shape) is not tuple:
            shape = tuple(shape) if isinstance(shape, (list, tuple)) else (int(shape),)
        if not isinstance(dtype, np.dtype):
            dtype = np.dtype(dtype)
        model = self.model
        try:
            tls = model._tls
            c, devs = tls.c, tls.devs
        except AttributeError:
            c, devs = model._c(), model.devs()
        if device is None:
            device = devs[-1]
        n = dtype.itemsize
        for k in shape:
            n *= k
        # The pool (StandIn.alloc, inlined: this is every array operation's cost).
        c["allocations"] += 1
        size = -(-n // ROUND) * ROUND or ROUND
        free = model._free.get((device, size))
        addr = None
        if free:
            try:
                addr = free.pop()
            except IndexError:
                pass
        if addr is None:
            with model._lock:
                addr = model._top[device]
                model._top[device] = addr + size
        blk = _Block(model._free, addr, size, device)
        return self.ndarray(shape, dtype, self._MemoryPointer(self._Unowned(addr, size, blk,
                                                                            device), 0))

    def _launch(self, n: int = 1) -> None:
        try:
            self.model._tls.c["launches"] += n
        except AttributeError:
            self.model._c()["launches"] += n
        if self.model.launch_s:
            self.model.spin()

    def _elementwise(self, fn, name, operands, out=None, dtype=None):
        shape, rdtype = _elementwise_result(fn, name, operands, dtype)
        self._launch()
        if out is not None:
            if isinstance(out, tuple):
                out = out[0]
            if tuple(out.shape) != shape and np.broadcast_shapes(out.shape, shape) != out.shape:
                raise ValueError(f"{name}: out has shape {out.shape}, the result {shape}")
            return out
        return self._new(shape, rdtype)

    def _binary(self, fn, name, a, b, inplace=False):
        """``a <op> b`` where one of them is an array of this backend (the hot path)."""
        nd = self.ndarray
        ka = (a.shape, a.dtype) if type(a) is nd else _operand_key(a)
        kb = (b.shape, b.dtype) if type(b) is nd else _operand_key(b)
        ck = (name, ka, kb, inplace)
        hit = _binary_cache.get(ck)
        if hit is None:
            shape, rdtype = _elementwise_result(fn, name, (a, b))
            if inplace and shape != a.shape:
                raise ValueError(f"non-broadcastable output operand with shape {a.shape} "
                                 f"doesn't match the broadcast shape {shape}")
            hit = _binary_cache[ck] = (shape, rdtype)
        try:
            self.model._tls.c["launches"] += 1
        except AttributeError:
            self.model._c()["launches"] += 1
        if self.model.launch_s:
            self.model.spin()
        if inplace:
            return a
        return self._new(hit[0], hit[1])

    def _copy(self, x, dtype=None):
        self._launch()
        return self._new(x.shape, x.dtype if dtype is None else dtype)

    def empty(self, shape, dtype=float, order="C"):
        return self._new(shape, dtype)

    def zeros(self, shape, dtype=float, order="C"):
        out = self._new(shape, dtype)
        self.model.count("copies")    # a memset
        return out

    def ones(self, shape, dtype=float):
        return self.full(shape, 1, dtype)

    def full(self, shape, fill_value, dtype=None):
        dtype = np.asarray(fill_value).dtype if dtype is None else dtype
        self._launch()
        return self._new(shape, dtype)

    def empty_like(self, a, dtype=None, shape=None):
        return self._new(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)

    def zeros_like(self, a, dtype=None, shape=None):
        return self.zeros(a.shape if shape is None else shape, a.dtype if dtype is None else dtype)

    def ones_like(self, a, dtype=None, shape=None):
        return self.full(a.shape if shape is None else shape, 1,
                         a.dtype if dtype is None else dtype)

    def full_like(self, a, fill_value, dtype=None, shape=None):
        return self.full(a.shape if shape is None else shape, fill_value,
                         a.dtype if dtype is None else dtype)

    def arange(self, *args, dtype=None):
        return self.asarray(np.arange(*args, dtype=dtype))

    def asarray(self, x, dtype=None, order=None):
        if isinstance(x, self._real.ndarray):
            if dtype is None or np.dtype(dtype) == x.dtype:
                return x
            return x.astype(dtype)
        if hasattr(x, "__cuda_array_interface__"):
            return self._from_interface(x.__cuda_array_interface__, x)
        host = np.asarray(x, dtype=dtype)
        out = self._new(host.shape, host.dtype)
        # As CuPy: staged through its pinned buffers, asynchronous on the current stream.
        self.model.count("copies")
        return out

    array = asarray

    def _from_interface(self, cai, owner):
        dtype = np.dtype(cai["typestr"])
        ptr = int(cai["data"][0])
        device = (ptr >> ADDRESS_SHIFT) - 1
        if not 0 <= device < self.model.num_devices:
            raise ValueError(f"address {ptr:#x} is no stand-in device memory")
        nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * dtype.itemsize
        mem = self._Unowned(ptr, nbytes, owner, device)
        return self.ndarray(tuple(cai["shape"]), dtype, self._MemoryPointer(mem, 0),
                            strides=cai.get("strides"))

    def ascontiguousarray(self, x, dtype=None):
        if isinstance(x, self._real.ndarray) and x._c_contiguous and \
                (dtype is None or np.dtype(dtype) == x.dtype):
            return x
        if not isinstance(x, self._real.ndarray):
            return self.asarray(np.ascontiguousarray(x, dtype=dtype))
        return self._copy(x, dtype)

    def asnumpy(self, x, stream=None, order="C", out=None, blocking=True):
        if isinstance(x, self._real.ndarray):
            return x.get(stream=stream, out=out, blocking=blocking)
        return np.asarray(x)

    def get_array_module(self, *args):
        return self if any(isinstance(a, self._real.ndarray) for a in args) else np

    def concatenate(self, arrays, axis=0, out=None, dtype=None):
        arrays = list(arrays)
        first = tuple(arrays[0].shape)
        ax = axis % len(first)
        shape = first[:ax] + (sum(a.shape[ax] for a in arrays),) + first[ax + 1:]
        rdtype = dtype or np.result_type(*[a.dtype for a in arrays])
        self._launch()
        return out if out is not None else self._new(shape, rdtype)

    def stack(self, arrays, axis=0, out=None):
        arrays = list(arrays)
        return self.concatenate([a.reshape(a.shape[:axis % (a.ndim + 1)] + (1,) +
                                           a.shape[axis % (a.ndim + 1):]) for a in arrays],
                                axis=axis, out=out)

    def moveaxis(self, a, source, destination):
        src = [s % a.ndim for s in (source if isinstance(source, (tuple, list)) else [source])]
        dst = [d % a.ndim for d in (destination if isinstance(destination, (tuple, list))
                                    else [destination])]
        order = [n for n in range(a.ndim) if n not in src]
        for d, s in sorted(zip(dst, src)):
            order.insert(d, s)
        return a.transpose(order)

    def broadcast_to(self, a, shape):
        return self._real.broadcast_to(a, tuple(shape))

    def where(self, cond, x=None, y=None):
        if x is None:
            return cond.nonzero()
        return self._elementwise(np.where, "where", (cond, x, y))

    def clip(self, a, a_min, a_max, out=None):
        return self._elementwise(np.clip, "clip", (a, a_min, a_max), out=out)

    def sum(self, a, axis=None, dtype=None, out=None, keepdims=False):
        return a.sum(axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def mean(self, a, axis=None, dtype=None, out=None, keepdims=False):
        return a.mean(axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def take(self, a, indices, axis=None):
        return a.take(indices, axis=axis)

    def matmul(self, a, b, out=None):
        result = a @ b
        return result if out is None else out

    dot = matmul

    def from_dlpack(self, x):
        raise TypeError("the stand-in CuPy does not import DLPack capsules")

    # --- user kernels (compiled by NVRTC on a GPU; here a launch is counted)
    def RawKernel(self, code, name, options=(), backend="nvrtc", translate_cucomplex=False,
                  enable_cooperative_groups=False, jitify=False):
        return _RawKernel(self.model, name)

    def RawModule(self, code=None, path=None, options=(), backend="nvrtc",
                  translate_cucomplex=False, enable_cooperative_groups=False,
                  name_expressions=None, jitify=False):
        return _RawModule(self.model)

    def ElementwiseKernel(self, in_params, out_params, operation, name="kernel", **kw):
        return _ElementwiseKernel(self, in_params, out_params, name)

    def ReductionKernel(self, in_params, out_params, map_expr, reduce_expr, post_map_expr,
                        identity, name="reduce_kernel", **kw):
        return _ReductionKernel(self, in_params, out_params, name)

    def fuse(self, *args, **kwargs):
        """``cupy.fuse``: the fused function is one launch; its results have the
        operands' broadcast shape and the dtypes NumPy gives the function on 0-d
        stand-ins of them."""
        def wrap(fn):
            cp = self

            def fused(*operands):
                cp._launch()
                cp.model.count("kernel_launches")
                arrays = [o for o in operands if isinstance(o, cp._real.ndarray)]
                shape = np.broadcast_shapes(*[a.shape for a in arrays]) if arrays else ()
                dummies = [np.zeros((), o.dtype) if isinstance(o, cp._real.ndarray) else o
                           for o in operands]
                with np.errstate(all="ignore"):
                    made = fn(*dummies)
                if made is None:
                    return None
                if isinstance(made, tuple):
                    return tuple(cp._new(shape, np.asarray(m).dtype) for m in made)
                return cp._new(shape, np.asarray(made).dtype)
            fused.__name__ = getattr(fn, "__name__", "fused")
            return fused
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return wrap(args[0])
        return wrap

    def empty_pinned(self, shape, dtype=float, order="C"):
        return self.model.pinned(shape, dtype)

    def get_default_memory_pool(self):
        return _Pool(self.model)

    def get_default_pinned_memory_pool(self):
        return _Pool(self.model)


class _RawKernel:
    """``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=0, stream=None)``."""

    def __init__(self, model, name):
        self.model, self.name = model, name
        self.attributes = {"max_threads_per_block": 1024}
        self.max_threads_per_block = 1024

    def __call__(self, grid, block, args, *, shared_mem=0, stream=None):
        if not isinstance(args, tuple):
            raise TypeError(f"RawKernel {self.name}: args must be a tuple, got "
                            f"{type(args).__name__}")
        c = self.model._c()
        c["kernel_launches"] += 1
        c["launches"] += 1
        if self.model.launch_s:
            self.model.spin()

    def compile(self, log_stream=None):
        pass


class _RawModule:
    """``cupy.RawModule``: ``get_function(name)`` gives a :class:`_RawKernel`."""

    def __init__(self, model):
        self.model = model
        self._functions: dict = {}

    def get_function(self, name):
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = _RawKernel(self.model, name)
        return fn

    def compile(self, log_stream=None):
        pass


class _ElementwiseKernel:
    """``cupy.ElementwiseKernel``: outputs of the inputs' broadcast shape, of the type
    the parameter list names (else the first input's dtype)."""

    def __init__(self, cp, in_params, out_params, name):
        self.cp, self.name = cp, name
        self.n_in = len([p for p in in_params.split(",") if p.strip()])
        self.out_types = []
        for p in out_params.split(","):
            words = p.split()
            try:
                self.out_types.append(np.dtype(words[0]) if len(words) > 1 else None)
            except TypeError:       # a type parameter such as T
                self.out_types.append(None)

    def __call__(self, *args, size=None, stream=None, block_size=None):
        ins, outs = args[:self.n_in], args[self.n_in:]
        c = self.cp.model._c()
        c["kernel_launches"] += 1
        c["launches"] += 1
        if self.cp.model.launch_s:
            self.cp.model.spin()
        if outs:
            return outs[0] if len(outs) == 1 else tuple(outs)
        arrays = [a for a in ins if hasattr(a, "shape")]
        shape = np.broadcast_shapes(*[tuple(a.shape) for a in arrays]) if arrays else (size,)
        made = [self.cp._new(shape, t if t is not None else arrays[0].dtype)
                for t in self.out_types]
        return made[0] if len(made) == 1 else tuple(made)


class _ReductionKernel(_ElementwiseKernel):
    """``cupy.ReductionKernel``: one launch; the output reduces ``axis`` (every axis
    by default) of the inputs' broadcast shape."""

    def __call__(self, *args, axis=None, keepdims=False, stream=None):
        ins, outs = args[:self.n_in], args[self.n_in:]
        self.cp._launch()
        c = self.cp.model._c()
        c["kernel_launches"] += 1
        if outs:
            return outs[0]
        arrays = [a for a in ins if hasattr(a, "shape")]
        shape = np.broadcast_shapes(*[tuple(a.shape) for a in arrays])
        dtype = self.out_types[0] if self.out_types[0] is not None else arrays[0].dtype
        rshape, _ = _reduction_result("sum", shape, np.dtype(dtype), axis, None, keepdims)
        return self.cp._new(rshape, dtype)


class _Pool:
    def __init__(self, model):
        self.model = model

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return sum(top - ((d + 1) << ADDRESS_SHIFT) for d, top in self.model._top.items())

    def free_all_blocks(self, stream=None):
        pass

    def n_free_blocks(self):
        return sum(len(v) for v in self.model._free.values())
