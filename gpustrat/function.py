"""``gs.function``: ``tf.function``'s decorator for a training step, which on GPUs
captures the step once as one CUDA graph per device and replays it.

Words:
- *trace key*: what tells two calls apart, as ``tf.function``'s trace cache does: the
  structure of the arguments; for an array (NumPy, CuPy) or a distributed value its
  kind, shape and dtype (and a distributed value's devices), never its values; a
  Python scalar (``bool``, ``int``, ``float``, ``str``, None) by value, so that a new
  value is a new trace, as in ``tf.function``; any other object by equality where it
  is hashable, else by identity. With ``input_signature``, the signature is the one
  key, and arguments are checked against it. With ``reduce_retracing``, a second
  shape of the same structure makes a key whose differing dimensions match any size.
- *trace*: the first call with a new key (:meth:`Function.experimental_get_tracing_count`
  counts them). Where nothing is captured, every call calls the Python function: a
  port keeps its decorator, and nothing else changes.
- *capture*: on GPU strategies, after ``warmup_steps`` calls of a key, the next call
  of that key is recorded as one CUDA graph per local GPU and each later call of it
  replays the graphs (see :mod:`gpustrat.capture` for what is captured and how).

The default, ``capture="auto"``, captures where capture can help and where it is
known to give what the eager step gives: every local device a GPU, one worker, and a
strategy known (``strategy=``, the one whose ``run`` the function called in its
warm-up steps). A step that cannot be captured (a host read of device data, a
Python number it returns, see docs/function.md) is then run eagerly from then on,
with one warning naming the operation and the line; ``capture=True`` raises
:class:`CaptureError` instead, and ``capture=False`` never captures. On CPU devices
there is nothing to capture: a CPU step's host cost is its NumPy work.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any, Callable

import numpy as np

from gpustrat import nest
from gpustrat.devices import is_gpu_array
from gpustrat.distribute import context
from gpustrat.values import DistributedValues

__all__ = ["function", "Function", "CaptureError"]

#: Warm-up calls of a key before it is captured: the first call builds the step's
#: plans (optimizer slots, fusion buffers, launch tables, NCCL communicators), the
#: second shows the steady state that the capture records.
DEFAULT_WARMUP_STEPS = 2
#: Captures of one key whose guards (the Python values a captured step read, such
#: as the learning rate) kept changing, after which the key runs eagerly.
MAX_RECAPTURES = 3

_SCALARS = (bool, int, float, complex, str, bytes, type(None))


class CaptureError(RuntimeError):
    """A step that cannot be captured as a CUDA graph: names the operation and the
    line of the user's code that issued it, and what to do instead."""


class _Observed(threading.local):
    """The strategies whose ``run`` a warm-up call of a function called."""

    def __init__(self):
        self.stack: list = []


observed = _Observed()


def note_run(strategy) -> None:
    """Called by ``Strategy.run``: tell the gs.function calling it which strategy runs."""
    if observed.stack:
        seen = observed.stack[-1]
        if strategy not in seen:
            seen.append(strategy)


def function(fn: Callable | None = None, *, input_signature=None, autograph: bool = True,
             jit_compile=None, reduce_retracing: bool = False,
             experimental_relax_shapes=None, experimental_implements=None,
             experimental_autograph_options=None, experimental_attributes=None,
             experimental_follow_type_hints=None, experimental_compile=None,
             name: str | None = None, capture="auto", warmup_steps: int =
             DEFAULT_WARMUP_STEPS, strategy=None):
    """``tf.function``'s spelling: ``@gs.function``, ``@gs.function(...)`` or
    ``gs.function(fn, ...)``; on functions and methods.

    Args:
        input_signature: a sequence of specs with ``shape`` and ``dtype``
            (``gs.data.TensorSpec``; None dimensions match any size), one per
            positional argument: every call is checked against it and shares one trace.
        autograph: accepted; Python control flow always runs as Python.
        jit_compile: None or False. True is refused: there is no XLA here; on GPUs a
            step is captured as a CUDA graph instead (``capture``).
        reduce_retracing: relax a key's shapes after a second shape (as TensorFlow's).
            ``experimental_relax_shapes`` is its former name.
        capture: ``"auto"`` (the default), True (capture or raise
            :class:`CaptureError`) or False (always call the Python function).
        warmup_steps: eager calls of a key before it is captured (at least 1).
        strategy: the strategy the function runs; by default the one whose ``run``
            it called during its warm-up calls.
        experimental_*: accepted and ignored, as they change nothing here.
    """
    if jit_compile or experimental_compile:
        raise ValueError(
            "gs.function(jit_compile=True): there is no XLA compiler in gpustrat; the "
            "step's own array calls run as they are. On GPUs, gs.function captures the "
            "step as a CUDA graph instead (capture='auto', the default), which removes "
            "its per-step host cost; drop jit_compile")
    if capture not in ("auto", True, False):
        raise ValueError(f"gs.function(capture={capture!r}): use 'auto', True or False")
    if not isinstance(warmup_steps, int) or isinstance(warmup_steps, bool) or warmup_steps < 1:
        raise ValueError(f"gs.function(warmup_steps={warmup_steps!r}): give an int >= 1 "
                         "(the first call builds the step's plans, so it is never captured)")
    relax = bool(reduce_retracing or experimental_relax_shapes)
    options = dict(input_signature=_signature(input_signature), relax=relax,
                   capture=capture, warmup_steps=warmup_steps, strategy=strategy, name=name)

    def decorate(f):
        if not callable(f):
            raise TypeError(f"gs.function decorates a callable, got {type(f).__name__}")
        return Function(f, **options)
    return decorate if fn is None else decorate(fn)


#: ``gs.function.CaptureError``: the error a refused capture raises.
function.CaptureError = CaptureError


def _signature(sig):
    if sig is None:
        return None
    out = []
    for s in sig:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise TypeError(f"input_signature holds {s!r}: give specs with a shape and a "
                            "dtype, such as gs.data.TensorSpec((None, 20), 'float32')")
        out.append((tuple(None if d is None else int(d) for d in s.shape), np.dtype(s.dtype)))
    return tuple(out)


class Function:
    """What :func:`function` returns: call it as the Python function.

    Attributes:
        python_function: the decorated function.
    """

    def __init__(self, fn, *, input_signature, relax, capture, warmup_steps, strategy,
                 name, instance=None):
        self.python_function = fn
        self._input_signature = input_signature
        self._relax = relax
        self._capture = capture
        self._warmup = warmup_steps
        self._strategy = strategy
        self._instance = instance
        self.__name__ = name or getattr(fn, "__name__", "function")
        functools.update_wrapper(self, fn, updated=())
        self._lock = threading.RLock()
        #: trace key -> the key's state: calls, and its captured graphs when captured.
        self._traces: dict = {}
        self._relaxed: dict = {}     # structure -> relaxed key (reduce_retracing)
        self._tracing_count = 0
        self._bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # --- methods: a Function per instance, as tf.function's ---------------------------
    def __get__(self, instance, owner=None):
        if instance is None:
            return self
        try:
            bound = self._bound.get(instance)
        except TypeError:     # not weakly referenceable
            bound = None
        if bound is None:
            bound = Function(self.python_function, input_signature=self._input_signature,
                             relax=self._relax, capture=self._capture,
                             warmup_steps=self._warmup, strategy=self._strategy,
                             name=self.__name__, instance=instance)
            try:
                self._bound[instance] = bound
            except TypeError:
                pass
        return bound

    @property
    def input_signature(self):
        return self._input_signature

    def experimental_get_tracing_count(self) -> int:
        """How many traces were made: one per trace key seen (a re-capture of a key
        whose guards changed counts too)."""
        return self._tracing_count

    def get_concrete_function(self, *args, **kwargs):
        raise NotImplementedError(
            "gs.function has no concrete functions (there is no TensorFlow graph to give): "
            "call the function itself")

    def __repr__(self) -> str:
        return f"<gs.function {self.__name__}>"

    # --- calls -----------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        if self._instance is not None:
            args = (self._instance,) + args
        if context.current()[1] is not None:
            # Called by strategy.run in a replica (a decorated replica function): the
            # replicas' work is captured, if at all, by a gs.function around run.
            # No lock is held: replicas call it at once and meet in its collectives.
            return self.python_function(*args, **kwargs)
        with self._lock:
            key, exact = self._key(args, kwargs)
            state = self._traces.get(key)
            if state is None:
                state = self._traces[key] = _KeyState()
                self._tracing_count += 1
            state.calls += 1
            if state.graphs is not None:
                out = state.graphs.replay(args, kwargs)
                if out is not _RECAPTURE:
                    return out
                # A Python value the captured step read has changed (the guard says
                # which): capture again, as tf.function traces again.
                state.graphs = None
                state.recaptures += 1
                self._tracing_count += 1
                if state.recaptures >= MAX_RECAPTURES:
                    state.eager_reason = (f"{state.last_guard}, in {state.recaptures} "
                                          "captures in a row: capturing again each step "
                                          "costs more than it saves")
                    _warn_eager(self, state.eager_reason)
            if exact and state.eager_reason is None and self._capture is not False and \
                    state.calls > self._warmup:
                graphs = self._try_capture(state, args, kwargs)
                if graphs is not None:
                    state.graphs = graphs
                    return graphs.first_result
            learn = state.strategies is None and self._capture is not False
        if not learn:
            return self.python_function(*args, **kwargs)
        # A warm-up call: note which strategy the function runs.
        seen: list = []
        observed.stack.append(seen)
        try:
            return self.python_function(*args, **kwargs)
        finally:
            observed.stack.pop()
            state.strategies = seen

    def _try_capture(self, state, args, kwargs):
        """The key's graphs, or None where it runs eagerly (capture does not apply:
        CPU devices, no single strategy; or it failed, with ``capture="auto"``)."""
        from gpustrat import capture  # noqa: PLC0415 - the CuPy-facing code, on use
        strategy = self._strategy
        if strategy is None:
            found = state.strategies or []
            if len(found) != 1:
                if self._capture is True:
                    raise CaptureError(
                        f"gs.function({self.__name__}, capture=True): the function ran "
                        f"{len(found)} strategies in its warm-up calls; capture needs "
                        "one: pass strategy= to gs.function")
                state.eager_reason = "no single strategy ran"
                return None
            strategy = found[0]
        why_not = capture.unsupported(strategy)
        if why_not is not None:
            if self._capture is True:
                raise CaptureError(f"gs.function({self.__name__}, capture=True): {why_not}")
            state.eager_reason = why_not     # quietly: CPU devices have nothing to capture
            return None
        try:
            return capture.StepGraphs.capture(self.__name__, self.python_function,
                                              strategy, args, kwargs, state)
        except CaptureError as e:
            if self._capture is True:
                raise
            state.eager_reason = str(e)
            _warn_eager(self, state.eager_reason)
            return None

    def _key(self, args, kwargs):
        """``(key, exact)``: exact is False for a relaxed key (never captured)."""
        if self._input_signature is not None:
            self._check_signature(args, kwargs)
            known = all(d is not None for shape, _ in self._input_signature for d in shape)
            return ("signature", self._input_signature), known
        key = (_key_of(args), _key_of(kwargs))
        if not self._relax:
            return key, True
        layout = (_key_of(args, shapes=False), _key_of(kwargs, shapes=False))
        known = self._relaxed.get(layout)
        if known is None:
            self._relaxed[layout] = (key, True)
            return key, True
        if _matches(known[0], key):
            return known
        relaxed = (_relax(known[0], key), False)
        self._relaxed[layout] = relaxed
        return relaxed

    def _check_signature(self, args, kwargs):
        sig = self._input_signature
        if kwargs or len(args) != len(sig):
            raise TypeError(f"{self.__name__} has input_signature of {len(sig)} arguments; "
                            f"it was called with {len(args)} positional and "
                            f"{len(kwargs)} keyword arguments")
        for i, (a, (shape, dtype)) in enumerate(zip(args, sig)):
            comps = a.values if isinstance(a, DistributedValues) else (a,)
            for c in comps:
                cs = getattr(c, "shape", None)
                cd = getattr(c, "dtype", None)
                ok = cs is not None and len(cs) == len(shape) and \
                    all(s is None or s == d for s, d in zip(shape, cs)) and \
                    np.dtype(cd) == dtype
                if not ok:
                    raise TypeError(
                        f"{self.__name__}: argument {i} ({_describe(c)}) does not match "
                        f"its input_signature entry (shape {shape}, dtype {dtype})")


class _KeyState:
    __slots__ = ("calls", "graphs", "strategies", "eager_reason", "recaptures",
                 "last_guard")
    # eager_reason: why the key runs eagerly from now on (None: it may be captured);
    # last_guard: the Python value whose change made the last re-capture.

    def __init__(self):
        self.calls = 0
        self.graphs = None
        self.strategies = None
        self.eager_reason = None
        self.recaptures = 0
        self.last_guard = None


#: What :meth:`StepGraphs.replay` returns when a guard changed: capture again.
_RECAPTURE = object()


def _warn_eager(fn: Function, reason: str) -> None:
    warnings.warn(f"gs.function({fn.__name__}) runs eagerly from now on for these "
                  f"arguments: {reason}", RuntimeWarning, stacklevel=3)


def _describe(x) -> str:
    shape = getattr(x, "shape", None)
    return f"{type(x).__name__} of shape {tuple(shape)} {getattr(x, 'dtype', '')}" \
        if shape is not None else repr(x)


_SCALAR_TYPES = frozenset(_SCALARS)
#: Marks an array's key: ``(_ARRAY, type, shape, dtype)`` (shape: its rank, for the
#: structure of a relaxed key).
_ARRAY = "array"


def _key_of(x: Any, shapes: bool = True):
    """The trace key of one argument (see the module docstring)."""
    t = type(x)
    if t in _SCALAR_TYPES:
        return (t, x) if shapes else (t,)
    if t is tuple or t is list:
        return (t, tuple([_key_of(v, shapes) for v in x]))
    if isinstance(x, DistributedValues):
        return (t, x.devices, tuple([_key_of(v, shapes) for v in x.values]))
    if isinstance(x, np.generic):          # a NumPy scalar: by value, as a Python one
        return (t, x.item()) if shapes else (t,)
    shape = getattr(x, "shape", None)
    if shape is not None and hasattr(x, "dtype") and not isinstance(x, type):
        return (_ARRAY, t, tuple(shape) if shapes else len(shape), x.dtype)
    if isinstance(x, dict):
        return ("dict", tuple((k, _key_of(x[k], shapes)) for k in sorted(x, key=repr)))
    if isinstance(x, (tuple, list)):
        return (t, tuple(_key_of(v, shapes) for v in x))
    try:
        hash(x)
        return ("object", t, x)
    except TypeError:
        return ("id", t, id(x))


def _relax(a, b):
    """A key matching both ``a`` and ``b``: shapes' differing dimensions become None."""
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        if len(a) == 4 and a[0] == _ARRAY and b[0] == _ARRAY and a[1] is b[1] and \
                a[3] == b[3] and len(a[2]) == len(b[2]):
            return a[:2] + (tuple(x if x == y else None for x, y in zip(a[2], b[2])), a[3])
        return tuple(_relax(x, y) for x, y in zip(a, b))
    return a if a == b else None


def _matches(relaxed, key) -> bool:
    if relaxed is None:
        return True
    if isinstance(relaxed, tuple) and isinstance(key, tuple) and len(relaxed) == len(key):
        return all(_matches(r, k) for r, k in zip(relaxed, key))
    return relaxed == key


def map_leaves(fn: Callable, structure: Any) -> Any:
    """``structure`` with every leaf (a distributed value's components included)
    replaced by ``fn(leaf)``."""
    def leaf(v):
        if isinstance(v, DistributedValues):
            return type(v)([fn(c) for c in v.values], v.devices)
        return fn(v)
    if not nest.is_nested(structure):
        return leaf(structure)
    return nest.map_structure(leaf, structure)
