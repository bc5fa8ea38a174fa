"""``Checkpoint`` and ``CheckpointManager``: save and restore a training job's state.

Words:
    object: a value given to ``Checkpoint(name=obj)``. It is a ``gs.Variable`` (saved
        through ``numpy()``/``assign``), a plain number, or anything that saves its own
        state: ``_checkpoint_state()`` returns a state tree (see
        :mod:`gpustrat.train.format`), ``_restore_checkpoint_state(tree)`` takes it
        back, and ``_checkpoint_per_worker`` says whether each worker has its own
        (an input position) or all share one (an optimizer, a metric).
    collective: under several workers every worker calls ``save``/``write``/
        ``restore``/``read`` and ``CheckpointManager.save`` in the same order, with
        the same path, on one directory that every worker sees.

This module only walks the objects and writes files; what an object's state is, the
object decides.
"""

from __future__ import annotations

import glob
import os
import secrets
import traceback
from typing import Any

import numpy as np

from gpustrat.devices import to_host
from gpustrat.distribute.variables import Variable
from gpustrat.train import format as fmt

# A fault-injection point for tests: called on worker 0 after every worker has written
# and flushed its files, before anything is renamed into place.
_before_commit = None

_NUMBER_TYPES = (bool, int, float, np.bool_, np.integer, np.floating)


def _workers_of(objects: dict):
    """The worker group the objects live in: their strategy's, else the current one's."""
    from gpustrat.distribute import context  # noqa: PLC0415
    for obj in objects.values():
        strategy = getattr(obj, "distribute_strategy", None)
        if strategy is not None and hasattr(strategy, "workers"):
            return strategy.workers
    strategy = context.get_strategy()
    return strategy.workers


def _kind(name: str, obj) -> str:
    if isinstance(obj, Variable):
        return "variable"
    if isinstance(obj, _NUMBER_TYPES):
        return "number"
    if hasattr(obj, "_checkpoint_state") and hasattr(obj, "_restore_checkpoint_state"):
        return "per_worker" if getattr(obj, "_checkpoint_per_worker", False) else "shared"
    raise TypeError(f"Checkpoint: cannot save {name}={type(obj).__name__}: a checkpoint "
                    "holds gs.Variable, optimizers, metrics, dataset and distributed "
                    "iterators and plain numbers")


def _agree(workers, error: str | None, what: str) -> None:
    """Raise on every worker when any worker had an error (a collective)."""
    errors = workers.allgather(error) if workers.size > 1 else [error]
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        detail = "; ".join(f"worker {r}: {e}" for r, e in bad)
        raise RuntimeError(f"{what} failed on {len(bad)} of {workers.size} workers: {detail}")


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


class CheckpointLoadStatus:
    """What a restore matched: the checkpoint's objects against this Checkpoint's."""

    def __init__(self, missing: list, unused: list):
        self._missing, self._unused = missing, unused

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Raise unless every object was restored and every saved object was used."""
        if self._missing or self._unused:
            raise AssertionError(
                f"checkpoint restore was partial: objects not in the checkpoint "
                f"{self._missing}, saved objects not restored {self._unused}")
        return self

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Raise unless every object of this Checkpoint was in the checkpoint."""
        if self._missing:
            raise AssertionError(f"objects not in the checkpoint: {self._missing}")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Accept a partial restore (nothing is checked)."""
        return self


class Checkpoint:
    """Groups objects to save and restore together, as ``tf.train.Checkpoint``.

    ``Checkpoint(model_w=w, optimizer=opt, iterator=it, step=0)``; the objects are read
    back as attributes (``ckpt.step`` is the restored number after a restore).
    ``save_counter`` counts the saves made by :meth:`save` and is itself saved.
    """

    def __init__(self, **objects):
        for name, obj in objects.items():
            _kind(name, obj)
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "save_counter", 0)

    def __getattr__(self, name: str):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it has {sorted(objects)}")

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_") or name == "save_counter":
            object.__setattr__(self, name, value)
            return
        _kind(name, value)
        self._objects[name] = value

    # --- saving -----------------------------------------------------------------------
    def save(self, file_prefix: str) -> str:
        """Write a checkpoint at ``file_prefix-N`` (N = the new ``save_counter``) and
        return that path. Collective under several workers."""
        self.save_counter += 1
        return self.write(f"{os.fspath(file_prefix)}-{self.save_counter}")

    def write(self, file_prefix: str) -> str:
        """Write a checkpoint at exactly ``file_prefix`` (``save_counter`` unchanged);
        returns the path. Atomic: ``file_prefix.index`` appears last, once every
        worker's files are complete on disk. Collective under several workers."""
        path = os.fspath(file_prefix)
        workers = _workers_of(self._objects)
        rank, size = workers.rank, workers.size
        if size > 1:
            paths = workers.allgather(path)
            if len(set(paths)) != 1:
                raise ValueError(f"Checkpoint.write: the workers gave different paths "
                                 f"{paths}; every worker must write the same checkpoint "
                                 "path (one directory every worker sees)")
        token = workers.bcast(secrets.token_hex(6) if rank == 0 else None, root=0) \
            if size > 1 else secrets.token_hex(6)
        # Every worker reads every object: reading a sync-on-read variable is itself a
        # collective. Worker 0 writes the shared part, every worker its own.
        shared, local = {}, {}
        shared_arrays, local_arrays = {}, {}
        written: list[str] = []
        error = None
        try:
            directory = os.path.dirname(path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            # Shared objects first: reading them may be a collective, which every worker
            # must reach even when its own per-worker state fails afterwards.
            ordered = sorted(self._objects.items(),
                             key=lambda item: _kind(*item) == "per_worker")
            for name, obj in ordered:
                kind = _kind(name, obj)
                if kind == "variable":
                    # value(): a read-only view where the variable lives on the host,
                    # so that saving copies nothing.
                    shared[name] = {"kind": kind, "tree": fmt.encode(
                        np.asarray(to_host(obj.value())), shared_arrays, name)}
                elif kind == "number":
                    shared[name] = {"kind": kind, "tree": fmt.encode(obj, shared_arrays, name)}
                elif kind == "shared":
                    shared[name] = {"kind": type(obj).__name__, "tree": fmt.encode(
                        obj._checkpoint_state(), shared_arrays, name)}
                else:
                    local[name] = {"kind": type(obj).__name__, "tree": fmt.encode(
                        obj._checkpoint_state(), local_arrays, name)}
            mine = fmt.temp_name(fmt.worker_file(path, rank, size), token)
            written.append(mine)
            fmt.write_npz(mine, local_arrays, local)
            if rank == 0:
                data = fmt.temp_name(fmt.data_file(path), token)
                written.append(data)
                offsets = fmt.write_arrays(data, shared_arrays)
                index = fmt.temp_name(fmt.index_file(path), token)
                written.append(index)
                fmt.write_json(index, {
                    "format": fmt.FORMAT, "version": fmt.VERSION, "num_workers": size,
                    "save_counter": self.save_counter, "objects": shared,
                    "array_offsets": offsets, "per_worker_objects": sorted(local)})
        except Exception as e:  # noqa: BLE001 - reported on every worker below
            error = _describe(e)
        try:
            _agree(workers, error, f"writing checkpoint {path!r}")
        except RuntimeError:
            for f in written:
                _remove(f)
            raise
        error = None
        if rank == 0:
            try:
                if _before_commit is not None:
                    _before_commit()
                for r in range(size):
                    fmt.replace(fmt.temp_name(fmt.worker_file(path, r, size), token),
                                fmt.worker_file(path, r, size))
                fmt.replace(fmt.temp_name(fmt.data_file(path), token), fmt.data_file(path))
                # The index last: from this rename on, the path is a checkpoint.
                fmt.replace(fmt.temp_name(fmt.index_file(path), token), fmt.index_file(path))
                fmt.fsync_dir(os.path.dirname(path))
            except Exception as e:  # noqa: BLE001
                error = _describe(e)
        if size > 1:
            error = workers.bcast(error, root=0)
        if error is not None:
            raise RuntimeError(f"committing checkpoint {path!r} failed on worker 0: {error}")
        return path

    # --- restoring --------------------------------------------------------------------
    def restore(self, save_path: str) -> CheckpointLoadStatus:
        """Restore every object (and ``save_counter``) from the checkpoint at
        ``save_path``. Collective under several workers."""
        return self._load(save_path, with_counter=True)

    def read(self, save_path: str) -> CheckpointLoadStatus:
        """Restore the objects from ``save_path``, leaving ``save_counter`` as it is."""
        return self._load(save_path, with_counter=False)

    def _load(self, save_path, with_counter: bool) -> CheckpointLoadStatus:
        if save_path is None:
            raise ValueError("Checkpoint.restore: save_path is None (no checkpoint found; "
                             "CheckpointManager.latest_checkpoint is None before the first "
                             "save): check for None before restoring")
        path = os.fspath(save_path)
        workers = _workers_of(self._objects)
        rank, size = workers.rank, workers.size
        index = shared_arrays = local = local_arrays = every = None
        error = None
        try:
            if not os.path.exists(fmt.index_file(path)):
                raise FileNotFoundError(
                    f"no checkpoint at {path!r}: {fmt.index_file(path)!r} does not exist "
                    "(give the path that save() returned)")
            index = fmt.read_json(fmt.index_file(path))
            if index.get("format") != fmt.FORMAT or index.get("version") != fmt.VERSION:
                raise ValueError(f"{fmt.index_file(path)!r} is not a gpustrat checkpoint of "
                                 f"version {fmt.VERSION} (format {index.get('format')!r}, "
                                 f"version {index.get('version')!r})")
            shared_arrays = fmt.read_arrays(fmt.data_file(path), index["array_offsets"])
            saved_w = index["num_workers"]
            wanted = [n for n, o in self._objects.items() if _kind(n, o) == "per_worker"
                      and n in index["per_worker_objects"]]
            local, local_arrays, every = {}, {}, None
            if wanted and saved_w == size:
                local_arrays, local = fmt.read_npz(fmt.worker_file(path, rank, saved_w))
            elif wanted:
                # Another worker count: an object may take every saved worker's state
                # (a distributed iterator whose position is global), else it is an error.
                fixed = [n for n in wanted
                         if not hasattr(self._objects[n], "_restore_checkpoint_state_from")]
                if fixed:
                    raise ValueError(
                        f"checkpoint {path!r} holds per-worker state of {fixed} saved by "
                        f"{saved_w} workers; it cannot be restored by {size} workers: "
                        f"restart with {saved_w} workers, or restore without them")
                every = [fmt.read_npz(fmt.worker_file(path, r, saved_w))
                         for r in range(saved_w)]
                local = {n: True for n in wanted}
        except Exception as e:  # noqa: BLE001
            error = _describe(e)
        _agree(workers, error, f"reading checkpoint {path!r}")
        saved = {**index["objects"], **local}
        missing = [n for n in self._objects if n not in saved]
        unused = [n for n in saved if n not in self._objects]
        # Shared objects first: their restores may be collectives (the same everywhere).
        for name, obj in list(self._objects.items()):
            kind = _kind(name, obj)
            if name not in index["objects"] or kind == "per_worker":
                continue
            tree = fmt.decode(index["objects"][name]["tree"], shared_arrays)
            if kind == "variable":
                _assign(name, obj, tree)
            elif kind == "number":
                self._objects[name] = tree.item() if isinstance(tree, np.generic) else tree
            else:
                obj._restore_checkpoint_state(tree)
        error = None
        try:
            for name, obj in self._objects.items():
                if name not in local or _kind(name, obj) != "per_worker":
                    continue
                if every is None:
                    obj._restore_checkpoint_state(fmt.decode(local[name]["tree"],
                                                             local_arrays))
                else:
                    obj._restore_checkpoint_state_from(
                        [fmt.decode(tree[name]["tree"], arrays) for arrays, tree in every])
        except Exception as e:  # noqa: BLE001
            error = _describe(e)
        _agree(workers, error, f"restoring the per-worker state of {path!r}")
        if with_counter:
            self.save_counter = int(index["save_counter"])
        return CheckpointLoadStatus(missing, unused)


def _assign(name: str, var: Variable, value: np.ndarray) -> None:
    if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"Checkpoint: variable {name!r} has shape {tuple(var.shape)}, the "
                         f"checkpoint holds shape {tuple(value.shape)}: restore into a "
                         "variable of the saved shape")
    var.assign(value)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _checkpoint_files(path: str) -> list[str]:
    """Every file of the checkpoint at ``path`` (the index first)."""
    index = fmt.index_file(path)
    others = [f for f in glob.glob(glob.escape(path) + ".*") if f != index]
    return ([index] if os.path.exists(index) else []) + sorted(others)


_STATE_FILE = "checkpoint"


def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The newest checkpoint a :class:`CheckpointManager` recorded in ``checkpoint_dir``,
    or None (as ``tf.train.latest_checkpoint``)."""
    state = os.path.join(os.fspath(checkpoint_dir), _STATE_FILE)
    if not os.path.exists(state):
        return None
    path = fmt.read_json(state).get("model_checkpoint_path")
    if path is None:
        return None
    if not os.path.isabs(path):
        path = os.path.join(os.fspath(checkpoint_dir), path)
    return path if os.path.exists(fmt.index_file(path)) else None


class CheckpointManager:
    """Numbers checkpoints ``directory/ckpt-N`` and keeps the newest ``max_to_keep``.

    The directory's ``checkpoint`` file (JSON, replaced atomically after each save)
    records them; ``latest_checkpoint`` reads it. A checkpoint beyond ``max_to_keep`` is
    removed whole (its index first, so that it stops being a checkpoint at once).
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 checkpoint_name: str = "ckpt"):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager needs a gs.train.Checkpoint, got "
                            f"{type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or
                                        not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"CheckpointManager: max_to_keep must be a positive int or "
                             f"None (keep all), got {max_to_keep!r}")
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._prefix = os.path.join(self._directory, checkpoint_name)
        state = os.path.join(self._directory, _STATE_FILE)
        kept = []
        if os.path.exists(state):
            kept = [self._absolute(p) for p in
                    fmt.read_json(state).get("all_model_checkpoint_paths", [])]
        self._checkpoints = [p for p in kept if os.path.exists(fmt.index_file(p))]

    def _absolute(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self._directory, path)

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints, oldest first."""
        return list(self._checkpoints)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest kept checkpoint, or None before the first save."""
        return self._checkpoints[-1] if self._checkpoints else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Save a new checkpoint (``ckpt-<checkpoint_number>``, by default the new
        ``save_counter``), record it and remove the oldest beyond ``max_to_keep``.
        Returns its path. Collective under several workers."""
        ckpt = self._checkpoint
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else int(checkpoint_number)
        path = ckpt.write(f"{self._prefix}-{number}")
        kept = [p for p in self._checkpoints if p != path] + [path]
        removed = []
        if self._max_to_keep is not None and len(kept) > self._max_to_keep:
            removed, kept = kept[:-self._max_to_keep], kept[-self._max_to_keep:]
        workers = _workers_of(ckpt._objects)
        error = None
        if workers.rank == 0:
            try:
                state = os.path.join(self._directory, _STATE_FILE)
                tmp = fmt.temp_name(state, secrets.token_hex(6))
                fmt.write_json(tmp, {
                    "model_checkpoint_path": os.path.basename(path),
                    "all_model_checkpoint_paths": [os.path.basename(p) for p in kept]})
                fmt.replace(tmp, state)
                fmt.fsync_dir(self._directory)
                for old in removed:
                    for f in _checkpoint_files(old):
                        _remove(f)
            except Exception as e:  # noqa: BLE001
                error = _describe(e)
        if workers.size > 1:
            error = workers.bcast(error, root=0)
        if error is not None:
            raise RuntimeError(f"CheckpointManager.save: recording {path!r} failed on "
                               f"worker 0: {error}")
        self._checkpoints = kept
        return path
