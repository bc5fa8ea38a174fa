"""Worker processes for ``map`` and ``interleave`` with ``use_processes=True``: Python
code that holds the GIL (parsing, decoding, per-record logic) runs on as many cores as
the pipeline may use. This module runs the pools and carries the messages; the stages
that use them are in :mod:`gpustrat.data.process_stages`.

Words:
    pool: the worker processes of one iterator of one node (one ``map`` or
        ``interleave`` over one epoch). It starts at the iterator's first ``next`` and
        is stopped (its processes killed and reaped) when the iterator is closed,
        garbage collected or fails, and at interpreter exit. A worker also exits by
        itself when its parent dies: a thread of the worker waits for the socket to
        the parent to hang up, which the kernel does when the parent exits for any
        reason (SIGKILL included), and looks at ``os.getppid()`` every second. The
        worker's main thread reads its tasks itself, between calls: a task sent while
        a call runs waits in the socket and wakes no thread of the worker.
    worker: a clean Python interpreter started with :mod:`subprocess` (vfork and exec:
        this process is never forked, so an initialised MPI library or CUDA context is
        never copied). It imports gpustrat and the function, which travels by value
        when it cannot be imported by name (a lambda, a closure, a function of the
        script), as :mod:`gpustrat.distribute.parameter_server.wire` packs it. The
        launcher's variables (``PMI_*``, ``OMPI_*``, ...) are removed from its
        environment (a worker is no MPI rank), ``CUDA_VISIBLE_DEVICES`` is empty (a
        worker never touches the GPU) and BLAS/OpenMP threads default to one each.
        Workers ignore SIGINT: Ctrl-C interrupts the consumer, whose iterator then
        stops them.
    task: one message to a worker: a run of consecutive input elements of a ``map``
        (one at first; more when calls are short, so that each message carries about
        2 ms of work and small outputs travel together), or a request for
        the next elements of one open ``interleave`` slot. A worker holds at most
        :data:`_DEPTH` tasks, and a ``map`` holds at most ``4 * processes`` tasks'
        elements unreturned (computed or not; room for a fast worker to run ahead of
        a slow one whose element is due first), ``2 * processes`` when a task's
        outputs reach 1 MiB: in-flight work and memory are bounded.
    segment: a file in ``/dev/shm`` (shared memory) holding the large arrays of one
        answer. The worker writes each contiguous array of at least
        :data:`_OUT_OF_BAND` bytes into it (the one copy); the consumer maps the file
        (once: a worker's segments stay mapped) and unpickles the answer with NumPy's
        arrays made over the mapping: no copy. When the last of them is freed, the
        segment goes back to its worker, which writes later answers into it (its
        pages exist already). A worker keeps at most 32 MiB of free segments; a pool
        removes every segment of its workers when it stops, and a worker its own
        when its parent dies.

An exception raised by the function travels to the consumer (pickled, or as its type
name and message when it cannot be) with the worker's formatted traceback as its
``__cause__``, and a note naming the element; it is raised when the consumer reaches
that element. A worker that dies (killed, ``os._exit``, a segfault) is a
:class:`WorkerDiedError` naming the element it was computing.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import glob
import itertools
import mmap
import os
import pickle
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing.connection import Connection
from typing import Any, Callable


_PROTOCOL = 5
#: Arrays of at least this many bytes travel through a shared-memory segment.
_OUT_OF_BAND = 32 << 10
#: Tasks a worker holds at once (one computing, one waiting: no idle gap).
_DEPTH = 2
_ALIGN = 64
#: Environment variables of MPI launchers, removed from a worker's environment.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPIR_", "HYDRA_", "HYDI_", "OMPI_", "MPICH_",
                      "I_MPI_", "SLURM_STEP_")
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "NUMEXPR_NUM_THREADS")
_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMI_LOCAL_SIZE",
                    "MV2_COMM_WORLD_LOCAL_SIZE")
_OK, _ERR = 0, 1


class WorkerDiedError(RuntimeError):
    """A worker process of a ``map`` or ``interleave`` ended while it computed an
    element (killed, ``os._exit``, a crash in an extension)."""


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text (the
    ``__cause__`` of the exception raised in the consumer)."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self):
        return f'\n"""\n{self.text}"""'


def process_count() -> int:
    """Processes for ``num_parallel_calls=AUTOTUNE`` with processes: the cores this
    process may use (``os.sched_getaffinity``). Under an MPI launcher that binds no
    ranks (each sees every core of the machine), the node's cores shared by the ranks
    on it (read from the launcher's environment, without initialising MPI)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    if cores == (os.cpu_count() or cores):
        for name in _LOCAL_SIZE_VARS:
            try:
                local = int(os.environ.get(name, "1"))
            except ValueError:
                continue
            if local > 1:
                return max(1, cores // local)
    return max(1, cores)


def _shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["CUDA_VISIBLE_DEVICES"] = ""
    for name in _ONE_THREAD:
        env.setdefault(name, "1")
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def _pack_function(fn: Callable, what: str) -> bytes:
    from gpustrat.distribute.parameter_server import wire  # noqa: PLC0415
    try:
        blob, arrays = wire.pack(fn, f"{what}'s function")
    except TypeError as e:
        raise TypeError(f"{what}: use_processes=True runs the function in worker "
                        f"processes, and {str(e)[0].lower()}{str(e)[1:]}") from None
    return pickle.dumps((blob, arrays), _PROTOCOL)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its connection"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


def _short(element) -> str:
    """``element`` for a message: a NumPy scalar as its value (``2``, not
    ``np.int64(2)``), anything cut to 120 characters."""
    if getattr(element, "ndim", None) == 0 and hasattr(element, "item"):
        element = element.item()
    text = repr(element)
    return text if len(text) <= 120 else text[:117] + "..."


# --- answers: pickles whose large arrays travel in a segment ----------------------

class _Segments:
    """A worker's segments: new files, and the ones the consumer has let go of (all
    its arrays over them freed), kept for reuse (writing into a file's existing
    pages costs a copy; a new file also allocates and zeroes them)."""

    #: Free segments kept: up to this many bytes, and at least 2 of each size.
    _KEEP_BYTES = 32 << 20

    def __init__(self, shm_dir: str, prefix: str):
        self.dir = shm_dir
        self.prefix = f"{prefix}-{os.getpid()}"
        self._count = itertools.count()
        self._free: dict = {}   # size -> [names]
        self._free_bytes = 0
        self.dropped: list = []  # removed since the last answer (the consumer unmaps them)
        self._maps: dict = {}    # name -> this process's mapping of it

    def take(self, size: int) -> tuple[str, mmap.mmap]:
        """A segment of ``size`` bytes (a free one, else a new one): its name and
        mapping here."""
        free = self._free.get(size)
        if free:
            self._free_bytes -= size
            name = free.pop()
            return name, self._maps[name]
        name = f"{self.prefix}-{next(self._count)}"
        fd = os.open(os.path.join(self.dir, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = self._maps[name] = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        return name, mm

    def give_back(self, freed) -> None:
        for name, size in freed:
            free = self._free.setdefault(size, [])
            if len(free) < 2 or self._free_bytes + size <= self._KEEP_BYTES:
                free.append(name)
                self._free_bytes += size
            else:
                _unlink(os.path.join(self.dir, name))
                self._maps.pop(name).close()
                self.dropped.append(name)

    def remove_all(self) -> None:
        for path in glob.glob(os.path.join(self.dir, self.prefix + "-*")):
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


#: Segment sizes are rounded up to this, so that similar answers reuse segments.
_SEGMENT_GRAIN = 64 << 10


def _encode(obj, segments: _Segments) -> bytes:
    """``obj`` pickled, its large contiguous buffers written to a segment."""
    bufs: list = []

    def out_of_band(pb: pickle.PickleBuffer) -> bool:
        m = pb.raw()
        if m.nbytes < _OUT_OF_BAND:
            return True
        bufs.append(m)
        return False

    head = pickle.dumps(obj, _PROTOCOL, buffer_callback=out_of_band)
    if not bufs:
        return pickle.dumps((head, None, None), _PROTOCOL)
    layout, offset = [], 0
    for m in bufs:
        layout.append((offset, m.nbytes))
        offset += -(-m.nbytes // _ALIGN) * _ALIGN
    size = -(-offset // _SEGMENT_GRAIN) * _SEGMENT_GRAIN
    name, mm = segments.take(size)
    for (start, n), m in zip(layout, bufs):
        mm[start:start + n] = m.cast("B") if m.format != "B" else m
    dropped, segments.dropped = segments.dropped, []
    return pickle.dumps((head, (name, size, dropped), layout), _PROTOCOL)


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class _Mappings:
    """The consumer's mappings of one worker's segments, each mapped once and kept
    while the worker keeps the segment. An answer's arrays are made over a ctypes
    object spanning its segment (a weakly referenceable exporter of the mapping's
    memory): when the last of them is freed, the segment's (name, size) goes to
    ``freed``, for its worker to write into again."""

    def __init__(self, shm_dir: str, freed: collections.deque):
        self.dir, self.freed = shm_dir, freed
        self._maps: dict = {}

    def decode(self, data: bytes):
        head, segment, layout = pickle.loads(data)
        if segment is None:
            return pickle.loads(head)
        name, size, dropped = segment
        for gone in dropped:
            self._maps.pop(gone, None)   # arrays still over it keep it mapped
        mm = self._maps.get(name)
        if mm is None:
            fd = os.open(os.path.join(self.dir, name), os.O_RDWR)
            try:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
            finally:
                os.close(fd)
            self._maps[name] = mm
        lease = (ctypes.c_char * size).from_buffer(mm)
        weakref.finalize(lease, self.freed.append, (name, size))
        view = memoryview(lease).cast("B")
        return pickle.loads(head, buffers=[view[o:o + n] for o, n in layout])

    def clear(self) -> None:
        self._maps.clear()


# --- the worker side -----------------------------------------------------------------

def _watch_parent(fd: int, parent: int, segments: list) -> None:
    """Worker thread: the worker removes its segments and exits when the parent is
    gone (its end of the socket closed, or this process re-parented). It waits for the
    peer's hang-up only, not for data: a task arriving does not wake it, so it never
    takes the GIL from a call in progress."""
    watcher = select.poll()
    watcher.register(fd, getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR)
    while True:
        try:
            hung_up = bool(watcher.poll(1000))
        except OSError:
            hung_up = True
        if hung_up or os.getppid() != parent:
            _leave(segments)


def _leave(segments: list) -> None:
    """The parent is gone: remove this worker's segments and exit."""
    for seg in segments:
        seg.remove_all()
    os._exit(0)


def _error_info(e: BaseException) -> tuple:
    try:
        blob = pickle.dumps(e, _PROTOCOL)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - the text still travels
        blob = None
    return (blob, type(e).__qualname__, str(e), traceback.format_exc(), os.getpid())


class _Slot:
    """A worker's open ``interleave`` slot: the iterator over the dataset its function
    returned for one input element."""

    def __init__(self, it, saveable: bool):
        self.it, self.saveable = it, saveable


def _reraise(error: BaseException, *args):
    """What a worker calls when the function could not be made here (an import that
    fails in a fresh interpreter): the error, with its traceback, for every element."""
    raise RuntimeError("the function could not be loaded in the worker process: "
                       f"{type(error).__name__}: {error}") from error


def _keep_freed_memory() -> None:
    """Keep the memory a call frees for the next call (glibc only): by default, the
    heap's free top goes back to the kernel after each large output, and the next
    call faults every page in again, zeroed (as the parameter server's function
    processes do, with the same settings)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return  # not glibc: its own policy stands
    mallopt(-3, 32 << 20)   # M_MMAP_THRESHOLD
    mallopt(-1, 128 << 20)  # M_TRIM_THRESHOLD


def _worker_main() -> None:
    _keep_freed_memory()
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    conn = Connection(fd)
    holder: list = []   # the segments, once known (for the watcher to remove)
    if hasattr(select, "POLLRDHUP"):
        threading.Thread(target=_watch_parent, args=(fd, parent, holder),
                         daemon=True).start()

    def next_task():
        # Tasks wait in the socket's buffer; this thread reads the next one only once
        # the last is done (without POLLRDHUP, it also looks for the parent).
        while not conn.poll(1.0):
            if os.getppid() != parent:
                _leave(holder)
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            _leave(holder)
        task, freed = pickle.loads(data)
        if freed:
            holder[0].give_back(freed)
        return task

    kind, path, fn_blob, shm_dir, prefix = next_task()
    holder.append(_Segments(shm_dir, prefix))
    sys.path[:] = path
    from gpustrat.distribute.parameter_server import wire  # noqa: PLC0415
    try:
        blob, arrays = pickle.loads(fn_blob)
        fn = wire.unpack(blob, arrays)
    except Exception as e:  # noqa: BLE001 - every call reports it
        fn = functools.partial(_reraise, e)
    if kind == "map":
        from gpustrat.data.mapping import map_output  # noqa: PLC0415
        _serve_map(conn, next_task, fn, map_output, holder[0])
    else:
        _serve_interleave(conn, next_task, fn, holder[0])


def _serve_map(conn, next_task, fn, map_output, segments) -> None:
    clock = time.perf_counter
    while True:
        first, elements = next_task()
        results = []
        t0 = clock()
        for element in elements:
            try:
                results.append((_OK, map_output(fn, element)))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                results.append((_ERR, _error_info(e)))
        conn.send_bytes(_encode((first, results, clock() - t0), segments))


def _serve_interleave(conn, next_task, fn, segments) -> None:
    from gpustrat.data import autoshard  # noqa: PLC0415
    from gpustrat.data import structure as st  # noqa: PLC0415
    from gpustrat.data.dataset import Dataset, _IterContext  # noqa: PLC0415
    from gpustrat.data.iterator_state import unsupported_nodes  # noqa: PLC0415
    slots: dict = {}
    ctx = _IterContext()
    while True:
        task = next_task()
        op, sid = task[0], task[1]
        if op == "close":
            slot = slots.pop(sid, None)
            if slot is not None:
                slot.it.close()
            continue
        elements, ended, error, state = [], False, None, None
        try:
            if op == "open":
                _, _, element, key, saved, track, what = task
                ds = st.call_with_element(fn, element)
                if not isinstance(ds, Dataset):
                    raise TypeError(f"interleave: map_func must return a Dataset, got "
                                    f"{type(ds).__name__}")
                if key is not None:
                    ds = autoshard.seeded_like_every_worker(ds, key)
                why = unsupported_nodes(ds) if track else ["not saved"]
                if why:
                    slots[sid] = _Slot(ds._iter(ctx), False)
                    if track:
                        state = ("unsaveable", f"{what} cannot save its position: "
                                 + "; ".join(why))
                else:
                    it = ds._state_iter(ctx)
                    if saved is not None:
                        it.restore(saved)
                    slots[sid] = _Slot(it, True)
                count = 0
            else:
                count = task[2]
            slot = slots[sid]
            for _ in range(max(1, count)):
                try:
                    elements.append(next(slot.it))
                except StopIteration:
                    ended = True
                    break
                if op == "open":
                    break   # the first element comes back at once
            if slot.saveable and state is None:
                state = ("state", slot.it.save())
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            error = _error_info(e)
            ended = True
        if ended and sid in slots:
            slots.pop(sid).it.close()
        conn.send_bytes(_encode((sid, elements, ended, error, state), segments))


# --- the parent side -----------------------------------------------------------------

_CODE = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "from gpustrat.data.processes import _worker_main; _worker_main()")


class _Worker:
    __slots__ = ("proc", "conn", "tasks", "index", "freed", "maps", "outbox", "_sent",
                 "_sock", "__weakref__")

    def __init__(self, proc, conn, index, shm_dir):
        self.proc, self.conn, self.index = proc, conn, index
        self.tasks: collections.deque = collections.deque()   # what each task holds
        # Bytes of messages the socket has not taken yet. The worker reads a task only
        # between calls, and may be writing a large answer meanwhile: a blocking write
        # here could wait for it while it waits for this process to read.
        self.outbox = bytearray()
        self._sent = 0   # bytes of the outbox written already
        self._sock = socket.socket(fileno=os.dup(conn.fileno()))
        # Its segments whose arrays are all freed (appended by finalizers, in whatever
        # thread frees the last array), handed back with its next task.
        self.freed: collections.deque = collections.deque()
        self.maps = _Mappings(shm_dir, self.freed)

    def send(self, task) -> None:
        """Queue a message (in ``Connection.send_bytes``'s framing) and write what the
        socket takes now without blocking; :meth:`flush` writes the rest."""
        freed = []
        while self.freed:
            freed.append(self.freed.popleft())
        data = pickle.dumps((task, freed), _PROTOCOL)
        n = len(data)
        self.outbox += (struct.pack("!i", n) if n <= 0x7fffffff
                        else struct.pack("!iQ", -1, n))
        self.outbox += data
        self.flush()

    def flush(self) -> None:
        """Write as much of the outbox as the socket takes without blocking."""
        with memoryview(self.outbox) as view:
            while self._sent < len(view):
                try:
                    self._sent += self._sock.send(view[self._sent:], socket.MSG_DONTWAIT)
                except (BlockingIOError, InterruptedError):
                    return
        self.drop()

    def drop(self) -> None:
        """Forget the outbox (all written, or the worker is gone)."""
        self.outbox.clear()
        self._sent = 0

    def close(self) -> None:
        self._sock.close()
        self.conn.close()


def _stop(workers: list, shm_dir: str, prefix: str) -> None:
    """Kill and reap the workers, remove the segments of answers never taken."""
    for w in workers:
        if w.proc.poll() is None:
            try:
                w.proc.kill()
            except OSError:
                pass
    for w in workers:
        try:
            w.close()
        except OSError:
            pass
        w.proc.wait()
        w.maps.clear()
    for path in glob.glob(os.path.join(shm_dir, prefix + "-*")):
        _unlink(path)   # arrays still mapped here stay valid
    workers.clear()


class Pool:
    """``size`` worker processes running ``fn`` for a ``map`` (``kind="map"``) or the
    datasets of an ``interleave`` (``kind="interleave"``); ``what`` names the node in
    messages."""

    def __init__(self, fn: Callable, size: int, kind: str, what: str):
        self.what, self.kind = what, kind
        blob = _pack_function(fn, what)
        self.shm_dir = _shm_dir()
        self.prefix = f"gpustrat-{os.getpid()}-{secrets.token_hex(4)}"
        self.workers: list[_Worker] = []
        self._stop = weakref.finalize(self, _stop, self.workers, self.shm_dir, self.prefix)
        env = _child_env()
        init = pickle.dumps(((kind, list(sys.path), blob, self.shm_dir, self.prefix), []),
                            _PROTOCOL)
        try:
            for i in range(size):
                mine, theirs = socket.socketpair()
                try:
                    proc = subprocess.Popen(
                        [sys.executable, "-c", _CODE, str(theirs.fileno()), str(os.getpid())],
                        pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
                finally:
                    theirs.close()
                self.workers.append(_Worker(proc, Connection(mine.detach()), i,
                                            self.shm_dir))
            for w in self.workers:   # once all are starting: a large function waits
                w.conn.send_bytes(init)   # for each to read it
        except BaseException:
            self.close()
            raise
        # The connections of the workers that hold tasks, registered once per busy
        # spell (not a new selector per wait).
        self._poller = select.poll()
        self._by_fd = {w.conn.fileno(): w for w in self.workers}
        self._polled: set = set()

    def send(self, w: _Worker, task, holds) -> None:
        """Give ``w`` a task; ``holds`` is what the task is about (for its answer and
        for the error if ``w`` dies)."""
        w.tasks.append(holds)
        try:
            self.post(w, task)
        except OSError:
            self.died(w)

    def post(self, w: _Worker, message) -> None:
        """Send ``w`` a message; what its socket does not take now goes out from
        :meth:`receive` (an OSError if ``w`` is gone)."""
        w.send(message)
        self._watch(w)

    def _watch(self, w: _Worker) -> None:
        """Poll ``w`` for answers while it holds tasks, and for room in its socket
        while its outbox holds bytes."""
        fd = w.conn.fileno()
        events = (select.POLLIN if w.tasks else 0) | (select.POLLOUT if w.outbox else 0)
        if fd in self._polled:
            if events:
                self._poller.modify(fd, events)
            else:
                self._poller.unregister(fd)
                self._polled.discard(fd)
        elif events:
            self._poller.register(fd, events)
            self._polled.add(fd)

    def receive(self, block: bool = True) -> list:
        """``(worker, what its oldest task holds, answer)`` for every answer that
        arrived (waiting for one when ``block``); messages waiting in outboxes are
        written as their sockets take them."""
        out = []
        while self._polled and not out:
            for fd, events in self._poller.poll(None if block else 0):
                w = self._by_fd[fd]
                if events & select.POLLOUT:
                    try:
                        w.flush()
                    except OSError:
                        self.died(w)
                if events & ~select.POLLOUT and not w.tasks:
                    w.drop()   # gone while it owed nothing: nothing to tell
                elif events & ~select.POLLOUT:
                    try:
                        data = w.conn.recv_bytes()
                    except (EOFError, OSError):
                        self.died(w)
                    out.append((w, w.tasks.popleft(), w.maps.decode(data)))
                self._watch(w)
            if not block:
                break
        return out

    def died(self, w: _Worker):
        """Raise the error of a worker that ended while it held tasks."""
        try:
            code = w.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        holds = w.tasks[0] if w.tasks else None
        self.close()
        raise WorkerDiedError(
            f"{self.what}: worker process {w.proc.pid} {_describe_exit(code)} while it "
            f"computed {self.describe(holds)}; the iterator stops here. A function that "
            "ends its interpreter (os._exit, a crash in an extension, the out-of-memory "
            "killer) takes its worker with it: run the pipeline without use_processes "
            "to see it fail in this process")

    describe = staticmethod(lambda holds: "an element")

    def close(self) -> None:
        self._stop()


def raise_remote(info: tuple, where: str):
    """Raise the exception a worker reported (:func:`_error_info`), its traceback text
    as the cause."""
    blob, name, message, text, pid = info
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001 - fall back to the text
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{name}: {message}")
    exc.add_note(f"(raised in worker process {pid} on {where})")
    raise exc from RemoteTraceback(text)
