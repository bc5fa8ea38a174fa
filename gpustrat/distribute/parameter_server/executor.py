"""The function process of a worker rank: runs scheduled functions one at a time.

Started by the worker rank as ``python -m gpustrat.distribute.parameter_server.executor
FD``, it talks to its rank over the socket ``FD`` (see :mod:`.pipe`).
It never initialises MPI: variable reads and updates go to the worker rank, which
forwards them to the servers. It holds this worker's per-worker values (its datasets,
iterators and other resources, see :mod:`.values`); a replacement process makes them
again.
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import threading
import traceback

from gpustrat.distribute.parameter_server import variables as remote
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.channel import ServerLostError
from gpustrat.distribute.parameter_server.pipe import Pipe

#: This process's state: the connection, the worker's index and count, its devices,
#: this worker's per-worker values (number -> object) and why those that could not be
#: made here are missing (number -> text).
state = {"conn": None, "worker": None, "num_workers": None, "devices": None,
         "resources": {}, "missing": {}}

#: The replicas of ``strategy.run`` are threads: one request at a time on the socket.
_request_lock = threading.Lock()

#: glibc's malloc serves blocks below this from its heap (the default threshold,
#: which grows with the blocks freed, still maps most of a step's first arrays).
_MMAP_THRESHOLD = 32 << 20
#: ... and gives the heap's free top back to the kernel beyond this many bytes (the
#: default, twice the largest block freed so far, is below what one step frees).
_TRIM_THRESHOLD = 128 << 20

_ERRORS = {"ValueError": ValueError, "TypeError": TypeError, "MemoryError": MemoryError,
           "KeyError": KeyError, "ServerLostError": ServerLostError}


def _request(server: int, op: str, args: tuple = (), arrays=()):
    conn = state["conn"]
    with _request_lock:
        conn.send(("var", server, op, args), arrays)
        (kind, status, payload), out = conn.recv()
    if status != "ok":
        name, text = payload
        raise _ERRORS.get(name, RuntimeError)(text)
    return payload, out


def is_dataset(obj) -> bool:
    from gpustrat.data import Dataset  # noqa: PLC0415
    from gpustrat.distribute.input_lib import _DistributedBase  # noqa: PLC0415
    return isinstance(obj, (Dataset, _DistributedBase))


def make_dataset(source):
    """The dataset of ``create_per_worker_dataset(source)`` on this worker."""
    ds = source() if callable(source) and not is_dataset(source) else source
    from gpustrat.distribute.parameter_server.strategy import DeferredDataset  # noqa
    if isinstance(ds, DeferredDataset):
        ds = ds.make()
    if not is_dataset(ds):
        raise TypeError(
            f"the dataset function returned {type(ds).__name__} ({ds!r:.80}), not a "
            "dataset: return a gs.data.Dataset (or the result of "
            "strategy.experimental_distribute_dataset / distribute_datasets_from_function)")
    return ds


def _setup(kind: str, ident: int, payload, arrays):
    """Make this worker's value ``ident``: sent (``value``) or the result of a call."""
    if kind == "value":
        value = wire.unpack(payload, arrays)
    elif kind == "call":
        fn, args, kwargs = wire.unpack(payload, arrays)
        value = fn(*args, **kwargs)
    else:
        raise ValueError(f"unknown setup {kind!r}")
    state["resources"][ident] = value


def how_it_ended(e: BaseException) -> str:
    """What a function did that raised ``e``, a BaseException that is not an
    Exception (``sys.exit``, ``KeyboardInterrupt``): in the words of a message."""
    if isinstance(e, SystemExit):
        return "called sys.exit()" if e.code is None else f"called sys.exit({e.code!r})"
    return f"raised {type(e).__name__}" + (f" ({e})" if str(e) else "")


def _error_blob(e: BaseException):
    try:
        return pickle.dumps(e, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - the text still travels
        return None


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its worker rank dies (a launcher that ends
    the job kills the ranks, not their children)."""
    try:
        import ctypes  # noqa: PLC0415
        import signal  # noqa: PLC0415
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _keep_freed_memory() -> None:
    """Keep the memory that a function frees for the next call (glibc only).

    A step makes and frees the same large arrays every time (weights read, activations,
    gradients). With glibc's default settings the heap's free top goes back to the
    kernel at the end of each step, and the next step faults every page in again,
    zeroed: that doubled the processor time of a training step of a small MLP. Here
    the process keeps up to :data:`_TRIM_THRESHOLD` bytes that it freed.
    """
    try:
        import ctypes  # noqa: PLC0415
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc: its own policy stands
    mallopt(-3, _MMAP_THRESHOLD)  # M_MMAP_THRESHOLD
    mallopt(-1, _TRIM_THRESHOLD)  # M_TRIM_THRESHOLD


def main(fd: int, parent: int | None = None) -> None:
    _die_with_parent()
    _keep_freed_memory()
    if parent is not None and os.getppid() != parent:
        return  # the rank died before the request above took effect
    conn = state["conn"] = Pipe(socket.socket(fileno=fd))
    remote.set_requester(_request)
    while True:
        try:
            header, arrays = conn.recv()
        except (EOFError, OSError):
            return  # the worker rank is gone
        kind = header[0]
        if kind == "stop":
            return
        if kind == "init":
            info = header[1]
            state.update(worker=info["worker"], num_workers=info["num_workers"],
                         devices=info["devices"])
            state["missing"].update(info.get("broken", {}))
            continue
        if kind == "setup":
            _, what, ident, payload, notify = header
            try:
                _setup(what, ident, payload, arrays)
                err = None
            except Exception as e:  # noqa: BLE001
                err = (type(e).__name__, f"{type(e).__name__}: {e}")
            except BaseException as e:  # noqa: BLE001 - sys.exit ends nothing here
                err = ("RuntimeError", f"the function making it {how_it_ended(e)}")
                state["missing"][ident] = (f"worker {state['worker']} has no per-worker "
                                           f"value #{ident}: making it failed there with "
                                           f"{err[1]}")
            conn.send(("setup_done", ident, notify, err))
            continue
        if kind == "run":
            _, task_id, blob = header
            try:
                fn, args, kwargs = wire.unpack(blob, arrays)
                result = fn(*args, **kwargs)
            except StopIteration as e:
                from gpustrat.errors import OutOfRangeError  # noqa: PLC0415
                err = OutOfRangeError(str(e) or "End of sequence: a per-worker iterator "
                                      "ran out of data")
                conn.send(("error", task_id, _error_blob(err),
                                      "".join(traceback.format_exc())))
                continue
            except BaseException as e:  # noqa: BLE001 - reported to the coordinator
                conn.send(("error", task_id, _error_blob(e),
                                      "".join(traceback.format_exc())))
                continue
            try:
                out, out_arrays = wire.pack(result, "the function's result")
            except TypeError as e:
                conn.send(("error", task_id, _error_blob(e), str(e)))
                continue
            conn.send(("done", task_id, out), out_arrays)


if __name__ == "__main__":
    # Run the imported module's main, so that its state is the one that per-worker
    # iterators and the strategy find. Functions defined in the coordinator's script
    # arrive by value.
    from gpustrat.distribute.parameter_server import executor as _self
    _self.main(int(sys.argv[1]), int(sys.argv[2]))
