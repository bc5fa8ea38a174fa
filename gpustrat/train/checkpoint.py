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
import warnings

from gpustrat.train import format as fmt
from gpustrat.train import graph, restoring, saving
from gpustrat.train.restoring import CheckpointLoadStatus
from gpustrat.train.saving import CheckpointOptions, check_options

__all__ = ["Checkpoint", "CheckpointLoadStatus", "CheckpointOptions"]


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
            graph.check_positions(name, obj)
        object.__setattr__(self, "_objects", dict(objects))
        object.__setattr__(self, "save_counter", 0)
        object.__setattr__(self, "_background", saving.Background())
        object.__setattr__(self, "_pending", None)

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
        graph.check_positions(name, value)
        self._objects[name] = value

    def _graph(self, restoring: bool = False) -> list:
        return graph.walk(self._objects, self, allow_empty=restoring)

    def _walk_pending(self) -> None:
        """Restore what an earlier restore left pending and the graph now holds."""
        pending = self.__dict__.get("_pending")
        if pending is not None:
            pending.walk(self)

    # --- saving -----------------------------------------------------------------------
    def save(self, file_prefix: str, options: CheckpointOptions | None = None) -> str:
        """Write a checkpoint at ``file_prefix-N`` (N = the new ``save_counter``) and
        return that path. Collective under several workers; with
        ``CheckpointOptions(enable_async=True)`` the files are written in the
        background (see :meth:`write`)."""
        options = check_options(options, "Checkpoint.save")
        self.sync()
        self.save_counter += 1
        path = f"{os.fspath(file_prefix)}-{self.save_counter}"
        return self._write(path, options, on_commit=lambda: record_latest(path))

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
        self._walk_pending()
        entries = self._graph()
        workers = restoring.workers_of(entries)
        self._warn_without_input(entries, workers)
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

    def _warn_without_input(self, entries: list, workers) -> None:
        """Warn once (on worker 0) when this checkpoint holds trained state but no
        iterator while steps were taken from distributed iterators: a restored job
        would start the input from the beginning of the epoch."""
        if self.__dict__.get("_warned_input") or workers.input_steps == 0 or \
                workers.rank != 0:
            return
        if any(e.kind == "per_worker" for e in entries) or \
                not any(e.kind in ("variable", "shared") for e in entries):
            return
        object.__setattr__(self, "_warned_input", True)
        warnings.warn(
            "Checkpoint holds variables trained from a distributed iterator but not the "
            f"iterator ({workers.input_steps} steps taken so far): a job restored from it "
            "starts its input from the beginning of the epoch (an unseeded shuffle in a "
            "new order), not where the saved job was. Add the iterator to the Checkpoint "
            "(Checkpoint(..., iterator=iterator)) to resume exactly; see "
            "docs/checkpoint.md", UserWarning, stacklevel=4)

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

        Objects of this Checkpoint that the checkpoint lacks stay as they are (as
        TensorFlow): the returned status tells, by key (``assert_consumed``,
        ``assert_existing_objects_matched``). Saved objects this Checkpoint lacks wait:
        objects attached or made later at their keys get their values at the status's
        methods and at this Checkpoint's next save, write, restore or read (see
        :mod:`gpustrat.train.restoring`).

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

    def _load(self, save_path, with_counter: bool):
        call = "Checkpoint.restore" if with_counter else "Checkpoint.read"
        if save_path is None:
            # As TensorFlow: no checkpoint yet (latest_checkpoint of a fresh directory)
            # restores nothing, on every worker alike.
            self.sync()
            workers = restoring.workers_of(self._graph(restoring=True))
            saving.agree_on_path(workers, None, None, call, "restore",
                                 "restoring no checkpoint")
            return restoring.InitializationOnlyStatus()
        self.sync()
        self._walk_pending()
        path = os.fspath(save_path)
        entries = self._graph(restoring=True)
        workers = restoring.workers_of(entries)
        saved = error = None
        try:
            saved = restoring.read(path, entries, workers)
        except Exception as e:  # noqa: BLE001
            error = saving.describe(e)
        saving.agree_on_path(workers, path, error, call, "restore",
                             f"reading checkpoint {path!r}")
        targets = [e for e in entries if e.key in saved.keys]
        restoring.restore(entries, targets, saved, workers)
        if with_counter:
            self.save_counter = int(saved.index["save_counter"])
        # What the graph lacks waits for objects attached later (this restore's values
        # replace what an earlier one left pending).
        previous = self.__dict__.get("_pending")
        if previous is not None:
            previous.close()
        pending = None
        if saved.keys - {e.key for e in targets}:
            pending = restoring.Pending(saved, entries, targets)
        object.__setattr__(self, "_pending", pending)
        return CheckpointLoadStatus(self, pending, saved.keys, {e.key for e in targets})


def record_latest(path: str) -> None:
    """Name ``path`` the latest checkpoint of its directory (what ``Checkpoint.save``
    records, as TensorFlow's: that one checkpoint, for ``latest_checkpoint``)."""
    name = os.path.basename(path)
    fmt.write_state(os.path.dirname(path) or ".", {
        "model_checkpoint_path": name, "all_model_checkpoint_paths": [name]})
