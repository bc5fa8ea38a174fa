"""``Checkpoint``: save and restore a training job's state, as ``tf.train.Checkpoint``.

Words:
    object graph, savable, key: see :mod:`gpustrat.train.graph`.
    collective: under several workers every worker calls ``save``/``write``/
        ``restore``/``read``/``sync`` and ``CheckpointManager.save`` in the same order,
        with the same path, on one directory that every worker sees.

This module only walks the objects and hands them to :mod:`~gpustrat.train.saving`
(which writes files) or takes their states back; what an object's state is, the object
decides.
"""

from __future__ import annotations

import os

import numpy as np

from gpustrat.distribute.variables import Variable
from gpustrat.train import format as fmt
from gpustrat.train import graph, saving
from gpustrat.train.saving import CheckpointOptions, check_options

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointOptions"]


def _workers_of(entries: list):
    """The worker group the objects live in: their strategy's (a variable's, or that of
    the variables of a metric or an optimizer), else the current one's."""
    from gpustrat.distribute import context  # noqa: PLC0415
    for e in entries:
        for holder in (e.obj, *_variables_of(e.obj)):
            strategy = getattr(holder, "distribute_strategy", None)
            if strategy is not None and hasattr(strategy, "workers"):
                return strategy.workers
    return context.get_strategy().workers


def _variables_of(obj) -> list:
    """The variables a metric or an optimizer keeps (none for other objects)."""
    found = getattr(obj, "variables", None)
    return list(found) if isinstance(found, (list, tuple)) else []


class CheckpointLoadStatus:
    """What a restore matched: the checkpoint's keys against this Checkpoint's graph."""

    def __init__(self, missing: list, unused: list):
        self._missing, self._unused = missing, unused

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Raise unless every object was restored and every saved object was used."""
        if self._missing or self._unused:
            raise AssertionError(
                f"checkpoint restore was partial: objects of this Checkpoint not in the "
                f"checkpoint {self._missing}, saved objects not restored {self._unused}")
        return self

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Raise unless every object of this Checkpoint was in the checkpoint (saved
        objects this Checkpoint lacks are allowed: restoring a part of a checkpoint)."""
        if self._missing:
            raise AssertionError(f"objects of this Checkpoint not in the checkpoint: "
                                 f"{self._missing}")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Accept a partial restore (nothing is checked)."""
        return self


class Checkpoint:
    """Groups objects to save and restore together, as ``tf.train.Checkpoint``.

    ``Checkpoint(w=w, optimizer=opt, iterator=it, step=0, model=my_model)``; the objects
    are read back as attributes (``ckpt.step`` is the restored number after a restore).
    An object may be a nested ``Checkpoint``, a dict, list or tuple, or a plain object
    whose attributes hold savables: they are saved under path-like keys
    (``"model/layers/0/kernel"``, see :mod:`gpustrat.train.graph`). ``save_counter``
    counts the saves made by :meth:`save` and is itself saved.
    """

    _is_gpustrat_checkpoint = True

    def __init__(self, **objects):
        for name, obj in objects.items():
            graph.check_entry(name, obj)
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "save_counter", 0)
        object.__setattr__(self, "_background", saving.Background())

    def __getattr__(self, name: str):
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"Checkpoint has no object {name!r}; it has {sorted(objects)}")

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("_") or name == "save_counter":
            object.__setattr__(self, name, value)
            return
        graph.check_entry(name, value)
        self._objects[name] = value

    def _graph(self) -> list:
        return graph.walk(self._objects, self)

    # --- saving -----------------------------------------------------------------------
    def save(self, file_prefix: str, options: CheckpointOptions | None = None) -> str:
        """Write a checkpoint at ``file_prefix-N`` (N = the new ``save_counter``) and
        return that path. Collective under several workers; with
        ``CheckpointOptions(enable_async=True)`` the files are written in the
        background (see :meth:`write`)."""
        options = check_options(options, "Checkpoint.save")
        self.sync()
        self.save_counter += 1
        return self._write(f"{os.fspath(file_prefix)}-{self.save_counter}", options)

    def write(self, file_prefix: str, options: CheckpointOptions | None = None) -> str:
        """Write a checkpoint at exactly ``file_prefix`` (``save_counter`` unchanged);
        returns the path. Atomic: ``file_prefix.index`` appears last, once every
        worker's files are complete on disk. Collective under several workers.

        With ``options=CheckpointOptions(enable_async=True)`` it returns once the state
        is copied; a background thread writes and commits the files. Until then the
        path is not a checkpoint (``latest_checkpoint`` does not name it). The next
        save, :meth:`sync` or restore waits for it and raises its error, on every
        worker.
        """
        options = check_options(options, "Checkpoint.write")
        self.sync()
        return self._write(os.fspath(file_prefix), options)

    def _write(self, path: str, options: CheckpointOptions, on_commit=None,
               after_commit=None) -> str:
        entries = self._graph()
        workers = _workers_of(entries)
        background = self._background
        if options.enable_async:
            # Collective the first time: the commit group is a duplicate of the workers.
            background.commit_group(workers)
            snap = saving.take(entries, workers, path, self.save_counter,
                               buffers=background.buffers)
            background.start(saving.Job(snap, on_commit, after_commit), workers)
            return path
        snap = saving.take(entries, workers, path, self.save_counter)
        job = saving.Job(snap, on_commit, after_commit)
        job.write()
        job.commit(workers)
        return path

    def sync(self) -> None:
        """Wait until the asynchronous save in flight (if any) is written and committed;
        raise its error, on every worker. Collective under several workers."""
        background = self.__dict__.get("_background")
        if background is not None:
            background.wait()

    # --- restoring --------------------------------------------------------------------
    def restore(self, save_path: str, options: CheckpointOptions | None = None
                ) -> CheckpointLoadStatus:
        """Restore every object (and ``save_counter``) from the checkpoint at
        ``save_path``; waits for an asynchronous save first. Collective under several
        workers.

        Objects of this Checkpoint that the checkpoint lacks stay as they are, and saved
        objects this Checkpoint lacks are not used (as TensorFlow): the returned status
        tells, by key (``assert_consumed``, ``assert_existing_objects_matched``).

        All or nothing: everything is checked before anything is written, and the
        shared objects (variables, optimizers, metrics, numbers) are written only once
        every worker restored its per-worker state (iterator positions).

        Raises:
            ValueError: a key holds another kind of object than saved (a variable where
                an optimizer was saved), an optimizer or metric of another class than
                the saved one or its subclasses, a variable of another shape or dtype
                (a restore never casts, as TensorFlow), or an optimizer whose slots or
                a metric whose state differ from the saved ones; the message names the
                checkpoint key, and nothing is restored.
            RuntimeError: a per-worker restore failed on some worker (on every worker);
                the shared objects are not restored then.
        """
        check_options(options, "Checkpoint.restore")
        return self._load(save_path, with_counter=True)

    def read(self, save_path: str, options: CheckpointOptions | None = None
             ) -> CheckpointLoadStatus:
        """Restore the objects from ``save_path``, leaving ``save_counter`` as it is."""
        check_options(options, "Checkpoint.read")
        return self._load(save_path, with_counter=False)

    def _load(self, save_path, with_counter: bool) -> CheckpointLoadStatus:
        if save_path is None:
            raise ValueError("Checkpoint.restore: save_path is None (no checkpoint found; "
                             "CheckpointManager.latest_checkpoint is None before the first "
                             "save): check for None before restoring")
        self.sync()
        path = os.fspath(save_path)
        entries = self._graph()
        workers = _workers_of(entries)
        rank, size = workers.rank, workers.size
        index = shared_arrays = local = local_arrays = every = None
        error = None
        try:
            index = _read_index(path)
            shared_arrays = fmt.read_arrays(fmt.data_file(path), index["array_offsets"],
                                            index.get("array_crc32"))
            saved_w = index["num_workers"]
            wanted = [e for e in entries if e.kind == "per_worker"
                      and e.key in index["per_worker_objects"]]
            local, local_arrays = {}, {}
            if wanted and saved_w == size:
                local_arrays, local = fmt.read_npz(fmt.worker_file(path, rank, saved_w))
            elif wanted:
                # Another worker count: an object may take every saved worker's state
                # (a distributed iterator whose position is global), else it is an error.
                fixed = [e.key for e in wanted
                         if not hasattr(e.obj, "_restore_checkpoint_state_from")]
                if fixed:
                    raise ValueError(
                        f"checkpoint {path!r} holds per-worker state of {fixed} saved by "
                        f"{saved_w} workers; it cannot be restored by {size} workers: "
                        f"restart with {saved_w} workers, or restore without them")
                every = [fmt.read_npz(fmt.worker_file(path, r, saved_w))
                         for r in range(saved_w)]
                local = {e.key: True for e in wanted}
        except Exception as e:  # noqa: BLE001
            error = saving.describe(e)
        saving.agree_on_path(workers, path, error, "Checkpoint.restore" if with_counter
                             else "Checkpoint.read", "restore",
                             f"reading checkpoint {path!r}")
        # Everything is checked before anything is written: every object's kind, class,
        # shapes and dtypes (and an optimizer's or metric's own checks), then every
        # worker's per-worker state is restored (those restores are checked as they
        # go), and only when all of it succeeded on every worker are the shared objects
        # written. A mismatch restores nothing.
        mismatch = None
        writes: list = []
        try:
            writes = _prepare_shared(entries, _decode_shared(entries, index, shared_arrays))
        except Exception as e:  # noqa: BLE001 - raised on every worker below
            mismatch = e
        _agree_on_checks(workers, mismatch, path)
        saved = set(index["objects"]) | set(index["per_worker_objects"])
        mine = {e.key for e in entries}
        missing = [e.key for e in entries if e.key not in saved]
        unused = sorted(k for k in saved if k not in mine)
        error = None
        try:
            for e in entries:
                if e.key not in local:
                    continue
                if every is None:
                    e.obj._restore_checkpoint_state(fmt.decode(local[e.key]["tree"],
                                                               local_arrays))
                else:
                    e.obj._restore_checkpoint_state_from(
                        [fmt.decode(tree[e.key]["tree"], arrays) for arrays, tree in every])
        except Exception as e:  # noqa: BLE001
            error = saving.describe(e)
        saving.agree(workers, error, f"restoring the per-worker state of {path!r} (the "
                     "variables, optimizers, metrics and numbers were not restored)")
        # The shared objects' writes may be collectives (the same on every worker).
        for write in writes:
            write()
        if with_counter:
            self.save_counter = int(index["save_counter"])
        return CheckpointLoadStatus(missing, unused)


def _read_index(path: str) -> dict:
    if not os.path.exists(fmt.index_file(path)):
        raise FileNotFoundError(f"no checkpoint at {path!r}: {fmt.index_file(path)!r} does "
                                "not exist (give the path that save() returned)")
    index = fmt.read_json(fmt.index_file(path))
    if index.get("format") != fmt.FORMAT or index.get("version") != fmt.VERSION:
        raise ValueError(f"{fmt.index_file(path)!r} is not a gpustrat checkpoint of "
                         f"version {fmt.VERSION} (format {index.get('format')!r}, version "
                         f"{index.get('version')!r})")
    return index


def _saved_category(key: str, index: dict) -> str:
    if key in index["per_worker_objects"]:
        return "per_worker"
    kind = index["objects"][key]["kind"]
    return kind if kind in ("variable", "number") else "shared"


_WORDS = {"variable": "a variable", "number": "a number",
          "shared": "an object's shared state (an optimizer or metric)",
          "per_worker": "an iterator's per-worker position"}


def _decode_shared(entries: list, index: dict, arrays: dict) -> dict:
    """The saved value of every entry that the checkpoint has, checked against the
    entry (kind, variable shape) before anything is restored: a mismatch restores
    nothing. The same checks on every worker, so the error is raised on every one."""
    out = {}
    for e in entries:
        if e.key not in index["objects"] and e.key not in index["per_worker_objects"]:
            continue
        saved = _saved_category(e.key, index)
        here = e.kind
        if saved != here:
            what = type(e.obj).__name__
            raise ValueError(
                f"checkpoint key {e.key!r} holds {_WORDS[saved]}, but this Checkpoint has "
                f"{_WORDS[here]} there ({what}): restore into the structure that was "
                "saved")
        if here == "per_worker":
            continue
        if here == "shared":
            _check_class(e.key, e.obj, index["objects"][e.key]["kind"])
        value = fmt.decode(index["objects"][e.key]["tree"], arrays)
        if here == "variable":
            _check_shape(e.key, e.obj, value)
        out[e.key] = value
    return out


def _prepare_shared(entries: list, shared: dict) -> list:
    """One function per shared entry that writes its saved value, made once every entry
    was checked (an optimizer or a metric checks its own state first): a mismatch
    raises, naming the key, before anything is written."""
    writes = []
    keys = graph.VariableKeys(entries)
    for e in entries:
        if e.key not in shared:
            continue
        value = shared[e.key]
        if e.kind == "variable":
            _check_dtype(e.key, e.obj, value)
            _check_writable(e.key, e.obj)
            writes.append(lambda var=e.obj, value=value: var.assign(value))
        elif e.kind == "number":
            number = value.item() if isinstance(value, np.generic) else value
            writes.append(lambda e=e, number=number: e.owner._objects.__setitem__(e.name,
                                                                                  number))
        else:
            prepare = getattr(e.obj, "_prepare_checkpoint_restore", None)
            if prepare is None:
                writes.append(lambda obj=e.obj, value=value:
                              obj._restore_checkpoint_state(value))
                continue
            try:
                writes.append(prepare(value, keys) if getattr(
                    type(e.obj), "_checkpoint_by_variable_keys", False) else prepare(value))
            except (ValueError, TypeError) as err:
                raise type(err)(f"checkpoint key {e.key!r}: {err}") from None
    return writes


def _agree_on_checks(workers, mismatch: Exception | None, path: str) -> None:
    """Raise ``mismatch`` (as it is) on the worker that had it, and a ValueError naming
    it on the others (one collective under several workers), before any restore."""
    errors = [mismatch]
    if workers.size > 1:
        errors = workers.allgather(None if mismatch is None else saving.describe(mismatch))
    if mismatch is not None:
        raise mismatch
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if bad:
        raise ValueError(f"restoring checkpoint {path!r}: nothing was restored, because "
                         + "; ".join(f"worker {r}: {e}" for r, e in bad))


def _check_class(key: str, obj, saved: str) -> None:
    """``obj`` takes state saved from an object of class ``saved``: that class or a
    subclass of it (a class named ``saved`` among its bases)."""
    if saved in {c.__name__ for c in type(obj).__mro__}:
        return
    raise ValueError(
        f"checkpoint key {key!r} holds state saved from class {saved}, but this "
        f"Checkpoint has class {type(obj).__name__} there, whose state differs (an "
        f"optimizer's slots, a metric's totals); nothing was restored: restore into an "
        f"object of class {saved} (or a subclass), or leave the key out of the "
        "Checkpoint to start that object afresh")


def _check_shape(key: str, var: Variable, value: np.ndarray) -> None:
    if tuple(value.shape) != tuple(var.shape):
        raise ValueError(f"Checkpoint: variable {key!r} has shape {tuple(var.shape)}, the "
                         f"checkpoint holds shape {tuple(value.shape)}; nothing was "
                         "restored: restore into a variable of the saved shape")


def _check_dtype(key: str, var: Variable, value: np.ndarray) -> None:
    """A saved value is never cast, as in TensorFlow (float32 into float16 would turn
    70000 into inf; float into int would truncate)."""
    if np.dtype(value.dtype) != np.dtype(var.dtype):
        raise ValueError(f"Checkpoint: variable {key!r} has dtype {var.dtype}, the "
                         f"checkpoint holds dtype {value.dtype}; nothing was restored "
                         "(a restore never casts): restore into a variable of the saved "
                         f"dtype, e.g. gs.Variable(..., dtype={str(value.dtype)!r}), and "
                         "cast afterwards if another one is meant")


def _check_writable(key: str, var: Variable) -> None:
    """A sync-on-read variable with aggregation NONE cannot be assigned outside run."""
    from gpustrat.distribute.distributed_variables import SyncOnReadVariable  # noqa
    from gpustrat.distribute.variables import VariableAggregation  # noqa: PLC0415
    if isinstance(var, SyncOnReadVariable) and \
            var.aggregation is VariableAggregation.NONE:
        raise ValueError(f"Checkpoint: variable {key!r} is sync-on-read with aggregation "
                         "NONE, which cannot be assigned one value for all replicas; "
                         "nothing was restored: make it with aggregation SUM, MEAN or "
                         "ONLY_FIRST_REPLICA, or leave it out of the Checkpoint")
