"""Variables: model state that lives on every replica and stays in sync.

Words (as in tf.distribute):
- *component*: one replica's copy of a distributed variable, a plain :class:`Variable`
  holding one array on that replica's device (NumPy for ``cpu:K``, CuPy for ``gpu:K``).
  ``strategy.experimental_local_results(v)`` and ``v.values`` give them.
- *mirrored* (``synchronization=ON_WRITE``, the default under a strategy): every
  component holds the same value. An update in replica context is aggregated over
  every replica in sync (all workers) by the variable's aggregation, and the result is
  applied to every component; an update in cross-replica context applies to every
  component.
- *sync-on-read* (``ON_READ``, metrics): each replica updates its own component in
  replica context; reading in cross-replica context aggregates the components (a
  collective). In cross-replica context ``assign`` with SUM divides by the number of
  replicas in sync, and ``assign_add``/``assign_sub`` with SUM are errors.
- *plain*: a variable made outside any strategy's scope: one array, updated in place.

TensorFlow 2.21's rules are followed, with one deliberate difference: a mirrored
variable with aggregation NONE cannot be updated in replica context (TensorFlow lets
each replica write its own copy, and the copies silently diverge).

Across workers, initial values come from worker 0 (a broadcast), and every update that
needs agreement checks, with one small collective, that each worker updates the same
variable the same way; a disagreement raises the same error on every worker instead of
hanging or diverging.
"""

from __future__ import annotations

import enum
import itertools
import zlib
from typing import Any, Callable

import numpy as np

from gpustrat.devices import Device, device_of, is_gpu_array, on_device_of, to_device, to_host
from gpustrat.distribute import context
from gpustrat.reduce_util import ReduceOp

# Stamps of a checkpoint restore that waits for variables made later (gpustrat.train):
# every write takes the next number of ``_clock`` (so a restore can tell whether a
# variable was written after it), and while ``_watchers`` is positive every new
# variable notes its initial value's checksum (so that a write that bypasses
# ``_write``, such as an optimizer's fused step, shows too).
_clock = itertools.count(1)
_watchers = 0


class VariableSynchronization(enum.Enum):
    """When a distributed variable's components are brought in sync."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.Enum):
    """How the values of several replicas combine into one update (or one read)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


_AGG_OPS = {VariableAggregation.SUM: ReduceOp.SUM, VariableAggregation.MEAN: ReduceOp.MEAN}
_UPDATES = ("assign", "assign_add", "assign_sub")


def _enum(value, kind, what: str):
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind[value.strip().upper()]
        except KeyError:
            pass
    raise ValueError(f"{what}={value!r} is not a {kind.__name__}: use one of "
                     f"{', '.join(kind.__name__ + '.' + m.name for m in kind)}")


# --- values in --------------------------------------------------------------------------

def _is_python_value(x) -> bool:
    # Python numbers and lists of them get TensorFlow's default dtypes (int32, float32);
    # NumPy and CuPy values keep theirs.
    return not (isinstance(x, (np.ndarray, np.generic)) or is_gpu_array(x)
                or hasattr(x, "__array_interface__"))


def initial_array(value, dtype=None):
    """The array a variable starts from: ``value`` (or what a callable ``value``
    returns) with TensorFlow's dtype rules (a Python float is float32, an int int32)."""
    if callable(value) and not isinstance(value, Variable):
        value = value()
    if isinstance(value, Variable):
        value = value.read_value()
    if value is None:
        raise ValueError("a Variable needs an initial_value (an array, a number, or a "
                         "callable returning one)")
    if is_gpu_array(value):
        # On the value's device (CuPy copies onto the current one), so the copy is
        # queued on that device's current stream, after the work that wrote the value.
        with on_device_of(value):
            return value.astype(dtype) if dtype is not None else value.copy()
    arr = np.array(value, dtype=dtype, copy=True) if dtype is not None else np.array(value)
    if dtype is None and _is_python_value(value):
        if arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        elif arr.dtype == np.int64:
            arr = arr.astype(np.int32)
    if arr.dtype.hasobject:
        raise TypeError(f"cannot make a Variable of {type(value).__name__} values: give "
                        "numbers or arrays")
    return arr


def _host_copy(a) -> np.ndarray:
    """A host copy of array ``a`` that later updates do not change (a GPU array is read
    on its own device's current stream)."""
    return to_host(a) if is_gpu_array(a) else np.array(a, copy=True)


def _ensure_writable(arr):
    if isinstance(arr, np.ndarray) and not (arr.flags.writeable and arr.flags.c_contiguous):
        return np.array(arr, copy=True)
    return arr


# --- the plain variable ---------------------------------------------------------------------

class Variable:
    """Model state: an array that is updated in place (``tf.Variable``).

    Made inside ``strategy.scope()`` (or inside ``strategy.run``), it is a
    :class:`MirroredVariable` or, with ``synchronization=ON_READ``, a
    :class:`SyncOnReadVariable`; outside any scope, a plain variable on the device of
    its initial value (host memory for NumPy values, the GPU of a CuPy array).

    Args:
        initial_value: an array, a number, nested lists, or a callable returning one.
            A Python float gives float32, a Python int int32; NumPy and CuPy values
            keep their dtype.
        trainable: whether optimizers train it; default True, False for ON_READ.
        name: a name for messages and ``repr``.
        dtype: the dtype to cast the initial value to.
        synchronization: a :class:`VariableSynchronization` (or its name).
        aggregation: a :class:`VariableAggregation` (or its name).

    Raises:
        ValueError: under a strategy, synchronization NONE, or an integer variable
            with aggregation MEAN (as TensorFlow).
    """

    _kind = "Variable"

    def __new__(cls, initial_value=None, trainable=None, name=None, dtype=None,
                synchronization=VariableSynchronization.AUTO,
                aggregation=VariableAggregation.NONE, **kwargs):
        if cls is not Variable:
            return object.__new__(cls)
        _check_kwargs(kwargs)
        sync = _enum(synchronization, VariableSynchronization, "synchronization")
        agg = _enum(aggregation, VariableAggregation, "aggregation")
        if trainable is None:
            trainable = sync is not VariableSynchronization.ON_READ
        name = "Variable" if name is None else str(name)
        strategy, replica_ctx = context.current()
        if strategy is not None and not getattr(strategy, "is_default", False):
            from gpustrat.distribute import distributed_variables as dv  # noqa: PLC0415
            return dv.create(strategy, replica_ctx, initial_value, bool(trainable), name,
                             dtype, sync, agg)
        return Variable._plain(initial_array(initial_value, dtype), bool(trainable), name,
                               sync, agg)

    #: How many times :meth:`_write` changed this variable (lets an owner that keeps a
    #: host copy of a value, such as an optimizer's step count, see outside writes).
    _writes = 0
    #: The :func:`write_stamp` of the last :meth:`_write` (0: never written).
    _written_at = 0
    #: The initial value's checksum, noted while a checkpoint restore waits (else None).
    _initial_checksum = None

    def __init__(self, *args, **kwargs):
        # All construction happens in __new__ (which may return a subclass).
        pass

    @classmethod
    def _plain(cls, array, trainable: bool, name: str, sync, agg, device=None,
               parent=None) -> "Variable":
        v = object.__new__(Variable)
        v._array = _ensure_writable(array)
        v._device = device if device is not None else (device_of(array) or Device("cpu", 0))
        v._trainable = trainable
        v._name = name
        v._sync = sync
        v._agg = agg
        v._parent = parent
        if parent is None:
            note_creation(v)
        return v

    # --- what it is -----------------------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def shape(self) -> tuple:
        return tuple(self._array.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def trainable(self) -> bool:
        return self._trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        return self._sync

    @property
    def aggregation(self) -> VariableAggregation:
        return self._agg

    @property
    def device(self) -> str:
        """The device holding the value, e.g. ``"cpu:0"`` or ``"gpu:1"``."""
        return self._device.name

    # --- reading --------------------------------------------------------------------
    def value(self):
        """The current array (read-only on the host; it follows later updates). Use
        :meth:`read_value` for a copy to keep."""
        a = self._array
        if isinstance(a, np.ndarray):
            a = a.view()
            a.flags.writeable = False
        return a

    def read_value(self):
        """A copy of the current value, usable in arithmetic and safe to keep: on the
        variable's device, made there on the current stream after the last update."""
        a = self._array
        if type(a) is np.ndarray:
            return a.copy()
        return to_device(a, self._device, copy=True)

    def numpy(self) -> np.ndarray:
        """The value as a host NumPy array (a copy)."""
        return _host_copy(self._read_for_array())

    # --- updating -------------------------------------------------------------------
    def assign(self, value, use_locking=None, name=None, read_value=True) -> "Variable":
        """Set the value; ``value`` must have the variable's shape (no broadcasting)
        and a dtype that converts without loss of kind (no float into an int)."""
        return self._update("assign", value)

    def assign_add(self, delta, use_locking=None, name=None, read_value=True) -> "Variable":
        """Add ``delta`` (same shape) to the value."""
        return self._update("assign_add", delta)

    def assign_sub(self, delta, use_locking=None, name=None, read_value=True) -> "Variable":
        """Subtract ``delta`` (same shape) from the value."""
        return self._update("assign_sub", delta)

    def _update(self, op: str, value) -> "Variable":
        self._write(op, self._coerce(value, op))
        return self

    def _write(self, op: str, value) -> None:
        """Apply ``op`` in place with an already checked ``value``."""
        a = self._array
        self._writes += 1
        self._written_at = next(_clock)
        with self._device.activate():
            if self._device.is_gpu and type(value) is np.ndarray and value.ndim == 0:
                # A number (optimizer.iterations += 1): a scalar argument of the
                # kernel, not an upload.
                value = value[()]
            elif self._device.is_gpu or is_gpu_array(value):
                value = to_device(value, self._device)
            if op == "assign":
                a[...] = value
            elif op == "assign_add":
                a += value
            else:
                a -= value

    def _label(self) -> str:
        owner = self._parent if self._parent is not None else self
        return f"variable {owner._name!r}"

    def _coerce(self, value, op: str):
        """``value`` as an array of this variable's dtype and shape, or a clear error."""
        if isinstance(value, Variable):
            value = value.value()
        if is_gpu_array(value):
            arr = value
        else:
            try:
                arr = np.asarray(value)
            except (TypeError, ValueError) as e:
                raise TypeError(f"{op} of {self._label()}: cannot convert {value!r} to an "
                                f"array ({e})") from None
            if _is_python_value(value) and arr.dtype == np.float64 and \
                    self.dtype.kind == "f":
                arr = arr.astype(self.dtype)
        if arr.dtype != self.dtype:
            if arr.dtype.hasobject or not np.can_cast(arr.dtype, self.dtype, "same_kind"):
                raise TypeError(
                    f"{op} of {self._label()} (dtype {self.dtype}) got a value of dtype "
                    f"{arr.dtype}: values are not cast implicitly across kinds; cast it "
                    f"yourself (e.g. value.astype({str(self.dtype)!r})) if that is meant")
            with on_device_of(arr):
                arr = arr.astype(self.dtype)
        if tuple(arr.shape) != self.shape:
            raise ValueError(
                f"{op} of {self._label()} of shape {self.shape} got a value of shape "
                f"{tuple(arr.shape)}: updates do not broadcast; reshape (or broadcast_to) "
                "the value to the variable's shape")
        return arr

    # --- behaving like an array -------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        out = _host_copy(self._read_for_array())
        return out if dtype is None else out.astype(dtype, copy=False)

    def _read_for_array(self):
        return self.value()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(isinstance(o, Variable) for o in kwargs.get("out", ())):
            raise TypeError(f"a Variable cannot be the out= of {ufunc.__name__}: use "
                            "assign/assign_add/assign_sub")
        inputs = tuple(x.value() if isinstance(x, Variable) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of the scalar {self._label()}")
        return self.shape[0]

    def __getitem__(self, index):
        return self.value()[index]

    def __float__(self) -> float:
        return float(to_host(self.value()))

    def __int__(self) -> int:
        return int(to_host(self.value()))

    def __bool__(self) -> bool:
        return bool(to_host(self.value()))

    def __index__(self) -> int:
        return int(to_host(self.value()))

    def __neg__(self):
        return -self.value()

    def __pos__(self):
        return +self.value()

    def __abs__(self):
        return abs(self.value())

    # Identity, not element-wise: variables are dict keys (an optimizer's slots).
    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    def __repr__(self) -> str:
        return (f"<gs.{self._kind} {self._name!r} shape={self.shape} dtype={self.dtype} "
                f"device={self.device}, numpy={to_host(self._array)!r}>")


def _binary(name: str, reflected: bool = False) -> Callable:
    import operator  # noqa: PLC0415

    op = getattr(operator, name)

    def method(self, other):
        if isinstance(other, Variable):
            other = other.value()
        return op(other, self.value()) if reflected else op(self.value(), other)
    method.__name__ = f"__{'r' if reflected else ''}{name.strip('_')}__"
    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul"):
    setattr(Variable, f"__{_name}__", _binary(_name))
    setattr(Variable, f"__r{_name}__", _binary(_name, reflected=True))
for _name in ("lt", "le", "gt", "ge"):
    setattr(Variable, f"__{_name}__", _binary(_name))


def _check_kwargs(kwargs: dict) -> None:
    known = {"validate_shape", "caching_device", "import_scope", "constraint", "shape",
             "experimental_enable_variable_lifting"}
    bad = sorted(set(kwargs) - known)
    if bad:
        raise TypeError(f"Variable() got unexpected keyword argument(s) {bad}")
    if kwargs.get("constraint") is not None:
        raise ValueError("Variable(constraint=...) is not supported: apply the "
                         "constraint after the optimizer step with assign")


def checksum(array) -> int:
    """A 32-bit checksum of an array's bytes (equal values give equal checksums)."""
    host = np.ascontiguousarray(to_host(array))
    return zlib.crc32(host.view(np.uint8).reshape(-1)) if host.size else 0


# --- what a deferred checkpoint restore asks of variables -----------------------------

def write_stamp() -> int:
    """A new stamp: every later write of any variable has a larger ``_written_at``."""
    return next(_clock)


def watch_creations(delta: int) -> None:
    """Start (``+1``) or stop (``-1``) noting new variables' initial checksums."""
    global _watchers
    _watchers += delta


def note_creation(v: "Variable") -> None:
    """Note ``v``'s initial checksum while a checkpoint restore waits for variables."""
    if _watchers > 0:
        arrays = [c._array for c in getattr(v, "_values", (v,))]
        v._initial_checksum = checksum(arrays[0])


def written_at(v) -> int:
    """The stamp of the last write of ``v`` (any component), 0 where never written."""
    comps = getattr(v, "_values", None) or (v,)
    return max((getattr(c, "_written_at", 0) for c in comps), default=0)


def changed_since_creation(v) -> bool:
    """Whether a variable whose initial checksum was noted now holds another value (in
    any component), whatever wrote it; False where nothing was noted."""
    initial = getattr(v, "_initial_checksum", None)
    if initial is None:
        return False
    comps = getattr(v, "_values", None) or (v,)
    return any(checksum(c._array) != initial for c in comps)
