"""What travels between the coordinator, servers, workers and function processes.

Words:
- *packing*: an object is pickled with every NumPy array taken out (a persistent id
  stands in its place); the arrays travel separately as raw buffers: through mpi4py's
  upper-case ``Isend``/``Irecv`` between ranks, and through shared memory (or the
  socket) to a worker's function process (:mod:`.pipe`). So control messages stay
  small and arrays are never pickled. An array's *layout* (:func:`metas`) is its shape
  and its dtype, described exactly (:func:`describe_dtype`): ``dtype.str`` for
  numbers, strings, ``datetime64`` and the like, the dtype itself (pickled) for a
  structured one, whose field names and offsets ``dtype.str`` (``|V12``) would lose.
  Arrays of Python objects (and structured arrays with object fields) are pickled
  with the rest.
- *functions*: a function importable by its module and qualified name (a module-level
  function of an importable module) travels by reference, as pickle does. Any other
  function (one defined in the script run by ``mpiexec``, a lambda, a nested function)
  travels by value: its code object (``marshal``, the same Python on every rank), its
  defaults, the contents of its closure cells and the globals its code names, each
  packed the same way (modules by name). A value that cannot travel (a lock, an open
  file, a class defined in the script) is a ``TypeError`` naming it.
- *state of this process*: a ``gs.Variable`` or a metric made outside
  ``strategy.scope()`` holds its value here; a copy on a worker would be updated and
  never read. Packing one is a ``TypeError`` naming it (the variables made in the scope
  live on the servers and travel as handles).
"""

from __future__ import annotations

import builtins
import dis
import importlib
import io
import marshal
import pickle
import types

import numpy as np

_PROTOCOL = pickle.HIGHEST_PROTOCOL


def contiguous(a, dtype=None) -> np.ndarray:
    """``a`` as a C-contiguous array (``np.ascontiguousarray`` would make a 0-d array
    1-d)."""
    a = np.asarray(a, dtype=dtype)
    return a if a.flags.c_contiguous else np.array(a, order="C")


def _importable(obj) -> bool:
    """Whether pickle's by-reference lookup finds this very object in another process."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return False
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:  # noqa: BLE001 - any failure means "not by reference"
        return False
    return found is obj


#: Instructions that name a global (``co_names`` also holds attribute names: ``np.log``
#: names ``log``, which must not bring a global ``log`` along).
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME",
                         "STORE_NAME", "DELETE_NAME"})


def _global_names(code: types.CodeType, out: set) -> set:
    """The globals ``code`` (and the code nested in it) reads or writes."""
    for ins in dis.get_instructions(code):
        if ins.opname in _GLOBAL_OPS:
            out.add(ins.argval)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _global_names(c, out)
    return out


def _make_function(code_bytes: bytes, name: str, qualname: str, module: str,
                   n_cells: int):
    code = marshal.loads(code_bytes)
    cells = tuple(types.CellType() for _ in range(n_cells)) or None
    fn = types.FunctionType(code, {"__builtins__": builtins, "__name__": module}, name,
                            None, cells)
    fn.__qualname__ = qualname
    fn.__module__ = module
    return fn


def _fill_function(fn, state) -> None:
    glob, defaults, kwdefaults, cells, fdict = state
    fn.__globals__.update(glob)
    fn.__defaults__ = defaults
    fn.__kwdefaults__ = kwdefaults
    for cell, value in zip(fn.__closure__ or (), cells):
        if value is not _EMPTY:
            cell.cell_contents = value
    fn.__dict__.update(fdict)


class Unsendable(TypeError):
    """Raised while packing by an object that says why it cannot travel: :func:`pack`
    reports its message as it is, without the general advice on pickling."""


#: (Variable, Metric, the kinds of variable held on the servers), imported at first use
#: (this module is imported by the variables').
_state_classes = None


def _held_here(obj) -> str | None:
    """Why ``obj`` cannot travel, when it is a variable or a metric whose value is held
    in this process (made outside the strategy's scope); None otherwise."""
    global _state_classes
    if _state_classes is None:
        from gpustrat.distribute.parameter_server.variables import (  # noqa: PLC0415
            _HeldElsewhere)
        from gpustrat.distribute.variables import Variable  # noqa: PLC0415
        from gpustrat.metrics import Metric  # noqa: PLC0415
        _state_classes = (Variable, Metric, _HeldElsewhere)
    variable, metric, remote = _state_classes
    if isinstance(obj, variable) and not isinstance(obj, remote):
        return (f"gs.{type(obj)._kind} {obj.name!r} was made outside strategy.scope(): "
                "its value is held in this process, and a worker would update a copy "
                "that nothing reads. Make it inside `with strategy.scope():` (variables "
                "made there live on the parameter servers and travel by reference)")
    if isinstance(obj, metric) and not all(isinstance(v, remote) for v in obj.variables):
        return (f"metric {obj.name!r} (gs.metrics.{type(obj).__name__}) was made outside "
                "strategy.scope(): its state is held in this process, and a worker's "
                "update_state would add to a copy that nothing reads. Make it inside "
                "`with strategy.scope():` (its state then lives on the parameter servers)")
    return None


class _Empty:
    def __reduce__(self):
        return (_empty, ())


def _empty():
    return _EMPTY


_EMPTY = _Empty()


class _Packer(pickle.Pickler):
    def __init__(self, file):
        super().__init__(file, protocol=_PROTOCOL)
        self.arrays: list = []

    def persistent_id(self, obj):
        if type(obj) is np.ndarray and not obj.dtype.hasobject:
            self.arrays.append(contiguous(obj))
            return len(self.arrays) - 1
        return None

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and not _importable(obj):
            return self._function_by_value(obj)
        why = _held_here(obj)
        if why is not None:
            raise Unsendable(why)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ == "__main__":
                raise TypeError("the script's own module (__main__) cannot be sent to a "
                                "worker: refer to the names it defines instead")
            return (importlib.import_module, (obj.__name__,))
        if isinstance(obj, type) and obj.__module__ == "__main__":
            raise TypeError(
                f"class {obj.__qualname__!r} is defined in the script run by mpiexec, so "
                "worker processes cannot import it: move it to a module on PYTHONPATH")
        return NotImplemented

    @staticmethod
    def _function_by_value(fn):
        code = fn.__code__
        g = fn.__globals__
        names = _global_names(code, set())
        glob = {k: g[k] for k in sorted(names) if k in g and k != "__builtins__"}
        cells = tuple(_cell_value(c) for c in (fn.__closure__ or ()))
        state = (glob, fn.__defaults__, fn.__kwdefaults__, cells, dict(fn.__dict__))
        return (_make_function,
                (marshal.dumps(code), fn.__name__, fn.__qualname__,
                 fn.__module__ if fn.__module__ != "__main__" else "__remote_main__",
                 len(cells)),
                state, None, None, _fill_function)


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name assigned later in the outer function)
        return _EMPTY


class _Unpacker(pickle.Unpickler):
    def __init__(self, file, arrays):
        super().__init__(file)
        self.arrays = arrays

    def persistent_load(self, pid):
        return self.arrays[pid]


def pack(obj, what: str = "value") -> tuple[bytes, list]:
    """``(pickle without arrays, [arrays])``; a ``TypeError`` naming ``what`` when
    something in ``obj`` cannot travel."""
    buf = io.BytesIO()
    p = _Packer(buf)
    try:
        p.dump(obj)
    except Unsendable as e:
        raise TypeError(f"cannot send {what} to another process: {e}") from None
    except RecursionError:
        raise TypeError(f"cannot send {what} to another process: it is nested too "
                        "deeply (or refers to itself through a non-function)") from None
    except Exception as e:  # noqa: BLE001 - pickling raises many kinds
        raise TypeError(f"cannot send {what} to another process: {e}. Functions, their "
                        "arguments and the globals they use must be picklable (plain data, "
                        "arrays, gs.Variables, functions); create other objects inside the "
                        "function instead") from None
    return buf.getvalue(), p.arrays


def unpack(blob: bytes, arrays: list):
    return _Unpacker(io.BytesIO(blob), arrays).load()


def describe_dtype(dtype: np.dtype):
    """What ``np.dtype()`` makes ``dtype`` again from, on any rank: ``dtype.str`` (a
    short string) for NumPy's own dtypes, or the dtype itself where the string loses
    something: a structured dtype's fields, the type of a dtype of another package
    (ml_dtypes' ``bfloat16`` is ``<V2``), a dtype's metadata."""
    return dtype.str if dtype.kind != "V" and dtype.metadata is None else dtype


def metas(arrays: list) -> list:
    """The arrays' layouts: ``(dtype description, shape)`` pairs."""
    return [(describe_dtype(a.dtype), a.shape) for a in arrays]


def empty_like_metas(ms: list) -> list:
    return [np.empty(shape, np.dtype(dt)) for dt, shape in ms]


# --- MPI (see channel.Channel.send) ------------------------------------------------

def raw(a: np.ndarray):
    """The bytes of a C-contiguous array, for MPI and pipes."""
    return _buffer(a)


def _buffer(a: np.ndarray):
    # 0-d and empty arrays: mpi4py takes any contiguous buffer; bytes view keeps dtype
    # out of MPI (the receiver knows it from the header). An empty one is writable, so
    # that a receive of nothing (an empty variable's value) takes it too.
    if not a.nbytes:
        return memoryview(bytearray())
    try:
        return memoryview(a).cast("B")
    except ValueError:
        # NumPy exports no buffer of datetime64 and timedelta64 arrays: their bytes
        # as uint8 (reshape(-1) is a view of a C-contiguous array, 0-d included).
        return memoryview(a.reshape(-1).view(np.uint8))


def describe_function(fn) -> str:
    """The name of ``fn`` for messages."""
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or fn)
