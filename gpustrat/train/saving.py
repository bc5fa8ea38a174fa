"""Writing a checkpoint: the snapshot, the files, the commit; now or in the background.

Words:
    snapshot: what one save writes, taken on the calling thread: every object's state
        tree, encoded, and its arrays. A synchronous save reads variables in place
        (nothing changes them before it returns); an asynchronous one copies them (host
        arrays at once, GPU arrays by a device-to-host copy queued after the last update
        and before the next), so that training goes on while the files are written.
    commit: every worker has written and flushed its files under temporary names; one
        allgather tells every worker whether all succeeded (and each one's temporary
        name); worker 0 renames the files into place, the index last, and runs what
        the save asked to run then (a manager records the checkpoint); one broadcast
        tells every worker the outcome. A path is a checkpoint exactly when its index
        exists, so a crash at any moment leaves the previous checkpoint whole.
    commit group: the worker group the commit's two collectives run on. A synchronous
        save uses the checkpoint's workers. An asynchronous one commits from its
        background thread on a duplicate of that group (made, collectively, at the
        first asynchronous save), so its collectives never meet the training loop's;
        that needs an MPI library initialised with ``MPI_THREAD_MULTIPLE``, mpi4py's
        default. Where MPI gives less, the background thread only writes the files and
        the commit happens on the calling thread at the next ``save``, ``write``,
        ``sync`` or ``restore`` (every worker makes those calls in the same order).
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import threading
import traceback
import weakref
from typing import Callable

import numpy as np

from gpustrat import timeline as _tl
from gpustrat.devices import to_host, to_host_async
from gpustrat.distribute.variables import Variable
from gpustrat.train import format as fmt
from gpustrat.train import graph

log = logging.getLogger("gpustrat")

# A fault-injection point for tests: called on worker 0 after every worker has written
# and flushed its files, before anything is renamed into place.
_before_commit = None


class CheckpointOptions:
    """Options of a save, as ``tf.train.CheckpointOptions``.

    Args:
        experimental_enable_async_checkpoint: write in the background (TensorFlow's
            older name of ``enable_async``).
        enable_async: write in the background: ``save``/``write`` return once the
            state is copied, the files are written and committed by a background
            thread, and the next save, ``sync()`` or restore waits for it (and raises
            its error, on every worker).
    """

    def __init__(self, experimental_enable_async_checkpoint: bool = False,
                 enable_async: bool = False):
        self.experimental_enable_async_checkpoint = bool(experimental_enable_async_checkpoint)
        self.enable_async = bool(enable_async) or self.experimental_enable_async_checkpoint

    def __repr__(self) -> str:
        return f"CheckpointOptions(enable_async={self.enable_async})"


def check_options(options, where: str) -> CheckpointOptions:
    if options is None:
        return CheckpointOptions()
    if not isinstance(options, CheckpointOptions):
        raise TypeError(f"{where}: options must be a gs.train.CheckpointOptions, got "
                        f"{type(options).__name__}")
    return options


def describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def agree(workers, error: str | None, what: str) -> None:
    """Raise on every worker when any worker had an error (a collective)."""
    errors = workers.allgather(error) if workers.size > 1 else [error]
    _raise_any(errors, workers.size, what)


def _raise_any(errors: list, size: int, what: str) -> None:
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        detail = "; ".join(f"worker {r}: {e}" for r, e in bad)
        raise RuntimeError(f"{what} failed on {len(bad)} of {size} workers: {detail}")


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


class Snapshot:
    """One save's encoded trees and arrays, and the events its GPU copies complete at."""

    def __init__(self, path: str, rank: int, size: int, save_counter: int):
        self.path, self.rank, self.size, self.save_counter = path, rank, size, save_counter
        self.shared: dict = {}
        self.local: dict = {}
        self.shared_arrays: dict = {}
        self.local_arrays: dict = {}
        self.events: list = []
        self.token = secrets.token_hex(6)
        self.written: list[str] = []


@_tl.traced("checkpoint snapshot")
def take(entries: list, workers, path: str, save_counter: int,
         buffers: dict | None = None) -> Snapshot:
    """Read every entry into a :class:`Snapshot` (a collective: reading a sync-on-read
    variable or a metric reduces over the workers). ``buffers`` None reads variables in
    place; a dict copies every array, reusing the host buffers it holds from the last
    save (keyed by array name) and keeping the new ones.

    Raises:
        ValueError: the workers gave different paths (on every worker).
        RuntimeError: reading an object failed on some worker (on every worker).
    """
    snap = Snapshot(path, workers.rank, workers.size, save_counter)
    error = None
    keys = graph.VariableKeys(entries)
    # Shared objects first: reading them may be a collective, which every worker must
    # reach even where its own per-worker state fails afterwards.
    for per_worker in (False, True):
        try:
            trees, arrays = (snap.local, snap.local_arrays) if per_worker else \
                (snap.shared, snap.shared_arrays)
            for e in entries:
                if (e.kind == "per_worker") != per_worker:
                    continue
                if e.kind == "variable":
                    kind, state = "variable", e.obj
                elif e.kind == "number":
                    kind, state = "number", e.obj
                else:
                    kind, state = type(e.obj).__name__, graph.state_of(e.obj, keys)
                trees[e.key] = {"kind": kind, "tree": fmt.encode(
                    state, arrays, e.key, leaf=lambda x: isinstance(x, Variable))}
            # Only worker 0 writes the shared arrays; the others read them (a read may
            # be a collective) without copying them to the host.
            keep = per_worker or snap.rank == 0
            for key, a in arrays.items():
                arrays[key] = _host(a, key, buffers, snap.events, keep)
        except Exception as e:  # noqa: BLE001 - reported on every worker below
            error = error or describe(e)
    agree_on_path(workers, path, error, "Checkpoint.write", "write",
                  f"writing checkpoint {path!r}")
    return snap


def agree_on_path(workers, path: str, error: str | None, call: str, verb: str,
                  what: str) -> None:
    """:func:`agree`, and every worker gave the same ``path`` (one collective): else a
    ValueError (different paths) or RuntimeError (an error) on every worker."""
    paths = workers.allgather((path, error)) if workers.size > 1 else [(path, error)]
    if len({p for p, _ in paths}) != 1:
        raise ValueError(f"{call}: the workers gave different paths "
                         f"{[p for p, _ in paths]}; every worker must {verb} the same "
                         "checkpoint path (one directory every worker sees)")
    _raise_any([e for _, e in paths], workers.size, what)


def _host(a, key: str, buffers: dict | None, events: list, keep: bool = True):
    if isinstance(a, Variable):
        # value(): a read-only view where the variable lives on the host.
        a = a.value()
    if not keep:
        return None
    if buffers is None:
        return np.asarray(to_host(a))
    host, event = to_host_async(a, buffers.get(key))
    buffers[key] = host
    if event is not None:
        events.append(event)
    return host


class Job:
    """One save after its snapshot: write the files, then commit them.

    ``on_commit`` runs on worker 0 once the checkpoint is in place (before the outcome
    is broadcast, with what it returned), ``after_commit`` on every worker once the
    commit succeeded, given what ``on_commit`` returned on worker 0.
    """

    def __init__(self, snap: Snapshot, on_commit: Callable[[], object] | None = None,
                 after_commit: Callable[[object], None] | None = None):
        self.snap = snap
        self.on_commit, self.after_commit = on_commit, after_commit
        self.write_error: str | None = None

    @_tl.traced("checkpoint write")
    def write(self) -> None:
        """Write this worker's files under temporary names, flushed to disk (errors are
        kept for the commit's agreement)."""
        s = self.snap
        try:
            for event in s.events:
                event.synchronize()   # the device-to-host copies are complete
            mine = fmt.temp_name(fmt.worker_file(s.path, s.rank, s.size), s.token)
            s.written.append(mine)
            directory = os.path.dirname(s.path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            fmt.write_npz(mine, s.local_arrays, s.local)
            if s.rank == 0:
                data = fmt.temp_name(fmt.data_file(s.path), s.token)
                s.written.append(data)
                offsets, crcs = fmt.write_arrays(data, s.shared_arrays)
                index = fmt.temp_name(fmt.index_file(s.path), s.token)
                s.written.append(index)
                fmt.write_json(index, {
                    "format": fmt.FORMAT, "version": fmt.VERSION, "num_workers": s.size,
                    "save_counter": s.save_counter, "objects": s.shared,
                    "array_offsets": offsets, "array_crc32": crcs,
                    "per_worker_objects": sorted(s.local)})
        except Exception as e:  # noqa: BLE001 - agreed in commit()
            self.write_error = describe(e)

    @_tl.traced("checkpoint commit")
    def commit(self, group) -> None:
        """Agree that every worker wrote its files, rename them into place (worker 0),
        and tell every worker the outcome. Collective over ``group``.

        Raises:
            RuntimeError: on every worker, naming the workers that failed.
        """
        s = self.snap
        mine = (s.token, self.write_error)
        every = group.allgather(mine) if s.size > 1 else [mine]
        try:
            _raise_any([e for _, e in every], s.size, f"writing checkpoint {s.path!r}")
        except RuntimeError:
            for f in s.written:
                _remove(f)
            raise
        error = recorded = result = None
        if s.rank == 0:
            try:
                if _before_commit is not None:
                    _before_commit()
                for r, (token, _) in enumerate(every):
                    fmt.replace(fmt.temp_name(fmt.worker_file(s.path, r, s.size), token),
                                fmt.worker_file(s.path, r, s.size))
                fmt.replace(fmt.temp_name(fmt.data_file(s.path), s.token),
                            fmt.data_file(s.path))
                # The index last: from this rename on, the path is a checkpoint.
                fmt.replace(fmt.temp_name(fmt.index_file(s.path), s.token),
                            fmt.index_file(s.path))
                fmt.fsync_dir(os.path.dirname(s.path))
            except Exception as e:  # noqa: BLE001
                error = describe(e)
            if error is None and self.on_commit is not None:
                try:
                    result = self.on_commit()
                except Exception as e:  # noqa: BLE001
                    recorded = describe(e)
        if s.size > 1:
            error, recorded, result = group.bcast((error, recorded, result), root=0)
        if error is not None:
            raise RuntimeError(f"committing checkpoint {s.path!r} failed on worker 0: "
                               f"{error}")
        if recorded is not None:
            raise RuntimeError(f"checkpoint {s.path!r} was written, but recording it "
                               f"failed on worker 0: {recorded}")
        if self.after_commit is not None:
            self.after_commit(result)


class Background:
    """A checkpoint's asynchronous saves: one at a time, each in its own thread.

    The thread is not a daemon, so the end of the program waits for a save in flight
    (its commit included, where the commit runs in the thread).
    """

    def __init__(self):
        self.buffers: dict = {}
        self._groups: dict = {}
        self._thread: threading.Thread | None = None
        self._job: Job | None = None
        self._error: BaseException | None = None
        self._deferred = False
        self._workers = None

    def commit_group(self, workers):
        """The group a background commit runs on, or None where it must wait for the
        calling thread (collective the first time: a duplicate of ``workers``)."""
        if workers.size == 1:
            return workers
        if not workers.concurrent_collectives():
            return None
        key = id(workers)
        if key not in self._groups:
            self._groups[key] = (workers, workers.duplicate())
        return self._groups[key][1]

    def start(self, job: Job, workers) -> None:
        group = self.commit_group(workers)
        self._job, self._error, self._deferred = job, None, group is None
        self._workers = workers

        def run():
            job.write()
            if group is None:
                return
            try:
                job.commit(group)
            except BaseException as e:  # noqa: BLE001 - raised by wait()
                self._error = e
        self._thread = threading.Thread(target=run, name="gpustrat-checkpoint",
                                        daemon=False)
        self._thread.start()
        _watch(self)

    @property
    def pending(self) -> bool:
        return self._job is not None

    @_tl.traced("checkpoint wait")
    def wait(self) -> None:
        """Wait for the save in flight; commit it here where the thread could not;
        raise its error. Collective where the commit is done here."""
        job = self._job
        if job is None:
            return
        self._thread.join()
        self._job = self._thread = None
        if self._deferred:
            job.commit(self._workers)
            return
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the asynchronous save of checkpoint {job.snap.path!r} "
                               f"failed: {error}") from error

    def unreported(self) -> str | None:
        """What the end of the program leaves undone: an error not raised yet, or a
        commit that waited for the calling thread."""
        if self._job is None:
            return None
        if self._thread is not None:
            self._thread.join()
        path = self._job.snap.path
        if self._deferred:
            return (f"checkpoint {path!r} was written but not committed: with an MPI "
                    "library without MPI_THREAD_MULTIPLE, an asynchronous save commits "
                    "at the next save, sync() or restore; call checkpoint.sync() before "
                    "the program ends")
        if self._error is not None:
            return f"the asynchronous save of checkpoint {path!r} failed: {self._error}"
        return None


_live: "weakref.WeakSet[Background]" = weakref.WeakSet()
_hooked = False


def _watch(background: Background) -> None:
    global _hooked
    _live.add(background)
    if not _hooked:
        # Registered after MPI is initialised, so it runs before MPI is finalised.
        atexit.register(_report_at_exit)
        _hooked = True


def _report_at_exit() -> None:
    for background in list(_live):
        message = background.unreported()
        if message is not None:
            log.error("%s", message)
