"""``CheckpointManager`` and ``latest_checkpoint``: numbered checkpoints in a directory.

Words (``tf.train.CheckpointManager``'s):
    active set: the checkpoints the manager may still delete, oldest first, each with
        the time it was saved; ``checkpoints`` lists them.
    preserved: a checkpoint that left the active set (beyond ``max_to_keep``) at least
        ``keep_checkpoint_every_n_hours`` after the last preserved one: it is kept on
        disk and no manager deletes it; ``last_preserved_timestamp`` is its time (at
        first, one second before the first manager of the directory was made).

The directory's ``checkpoint`` file (JSON, with the fields of TensorFlow's
``CheckpointState``: ``model_checkpoint_path``, ``all_model_checkpoint_paths`` (the
active set, relative to the directory), ``all_model_checkpoint_timestamps`` and
``last_preserved_timestamp``, in seconds since the epoch) records the manager's state,
so that a manager made later in the directory goes on with it. It is replaced
atomically (temporary name, ``fsync``, rename) right after a checkpoint's index is in
place, by worker 0, inside the save's commit (for an asynchronous save, in the
background once the files are committed, so that it never names an unfinished
checkpoint); worker 0's times are broadcast with the commit's outcome, so that every
worker keeps the same state.
"""

from __future__ import annotations

import glob
import logging
import numbers
import os
import time

import numpy as np

from gpustrat.train import format as fmt
from gpustrat.train.checkpoint import Checkpoint
from gpustrat.train.saving import CheckpointOptions, check_options

_STATE_FILE = fmt.STATE_FILE
log = logging.getLogger("gpustrat")


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
    """Numbers checkpoints ``directory/ckpt-N``, keeps the newest ``max_to_keep`` (and
    one every ``keep_checkpoint_every_n_hours``), as ``tf.train.CheckpointManager``.

    Args:
        checkpoint: the ``gs.train.Checkpoint`` to save.
        directory: where the checkpoints and the ``checkpoint`` state file go. A state
            file there from an earlier manager is taken up: its active set, times and
            latest checkpoint.
        max_to_keep: how many checkpoints the active set keeps; the oldest beyond it
            leave it after each save, deleted unless preserved. None keeps all.
        keep_checkpoint_every_n_hours: a checkpoint leaving the active set is
            preserved (kept, and no longer listed in ``checkpoints``) when it was saved
            at least this many hours after the last preserved one. None preserves none.
        checkpoint_name: the checkpoints' name before ``-N``.
        step_counter: a variable (or number) holding the training step, read by
            :meth:`save` when ``checkpoint_interval`` is given; it must be the same on
            every worker (a mirrored variable is).
        checkpoint_interval: the fewest steps between two saves: :meth:`save` saves
            nothing until ``step_counter`` reached the last saved step plus this.
        init_fn: called by :meth:`restore_or_initialize` when there is no checkpoint.
        last_checkpoint_step: the step of the last checkpoint, where the interval
            counts from (None: the first save saves).

    Raises:
        ValueError: ``max_to_keep`` not a positive int or None;
            ``checkpoint_interval`` without ``step_counter``.
    """

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int | None = 5,
                 keep_checkpoint_every_n_hours: float | None = None,
                 checkpoint_name: str = "ckpt", step_counter=None,
                 checkpoint_interval: int | None = None, init_fn=None,
                 last_checkpoint_step: int | None = None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"CheckpointManager needs a gs.train.Checkpoint, got "
                            f"{type(checkpoint).__name__}")
        if max_to_keep is not None and (isinstance(max_to_keep, bool) or
                                        not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"CheckpointManager: max_to_keep must be a positive int or "
                             f"None (keep all), got {max_to_keep!r}")
        if keep_checkpoint_every_n_hours is not None and (
                isinstance(keep_checkpoint_every_n_hours, bool) or
                not isinstance(keep_checkpoint_every_n_hours, numbers.Real)):
            raise TypeError(
                f"CheckpointManager: keep_checkpoint_every_n_hours must be a number of "
                f"hours or None, got {keep_checkpoint_every_n_hours!r} (checkpoint_name "
                "is the fifth argument, as in TensorFlow: pass it by keyword)")
        if checkpoint_interval is not None and step_counter is None:
            raise ValueError("CheckpointManager: step_counter must be given with "
                             "checkpoint_interval (the step the interval counts)")
        self._checkpoint = checkpoint
        self._directory = os.fspath(directory)
        self._max_to_keep = max_to_keep
        self._keep_hours = keep_checkpoint_every_n_hours
        self._prefix = os.path.join(self._directory, checkpoint_name)
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._last_checkpoint_step = last_checkpoint_step
        self._init_fn = init_fn
        self._take_up(os.path.join(self._directory, _STATE_FILE))

    def _take_up(self, state_file: str) -> None:
        """The active set, times and latest checkpoint of the state file, as
        TensorFlow's manager recovers them; none where there is no state file."""
        now = time.time()
        self._active: dict[str, float] = {}
        if not os.path.exists(state_file):
            self._latest = None
            # A second back, so that a manager made again at once still counts from it.
            self._last_preserved = now - 1.0
            return
        state = fmt.read_json(state_file)
        latest = state.get("model_checkpoint_path")
        latest = None if latest is None else self._absolute(latest)
        self._latest = latest if latest and os.path.exists(fmt.index_file(latest)) else None
        paths = [self._absolute(p) for p in state.get("all_model_checkpoint_paths", [])]
        stamps = list(state.get("all_model_checkpoint_timestamps") or [])
        preserved = state.get("last_preserved_timestamp")
        if preserved is None:
            # A state file without times (written by gpustrat before it kept them):
            # its checkpoints stay in the active set.
            preserved, stamps = now - 1.0, [now] * len(paths)
        elif not stamps:
            stamps = [preserved] * len(paths)
        if now < preserved:
            log.warning("time.time() returned a value %f seconds behind the last "
                        "preserved checkpoint timestamp", preserved - now)
            preserved = now
        self._last_preserved = preserved
        for path, stamp in zip(paths, stamps):
            stamp = min(stamp, now)
            if stamp > preserved and os.path.exists(fmt.index_file(path)):
                self._active[path] = stamp

    def _absolute(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self._directory, path)

    @property
    def directory(self) -> str:
        return self._directory

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoint_interval(self) -> int | None:
        return self._checkpoint_interval

    @property
    def checkpoints(self) -> list[str]:
        """The active set, oldest first (committed checkpoints only; preserved ones are
        not listed, as in TensorFlow)."""
        return list(self._active)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint (that of the state file before the first save), or
        None. A save still in the background is not named until it is committed."""
        return self._latest

    def _step(self):
        counter = self._step_counter
        value = counter.numpy() if hasattr(counter, "numpy") else counter
        value = np.asarray(value)
        if value.shape != ():
            raise ValueError(f"CheckpointManager: step_counter must hold one number, "
                             f"got shape {value.shape}")
        return value.item()

    def save(self, checkpoint_number: int | None = None, check_interval: bool = True,
             options: CheckpointOptions | None = None) -> str | None:
        """Save a new checkpoint (``ckpt-<checkpoint_number>``, by default the new
        ``save_counter``; ``save_counter`` is incremented either way), record it and
        let the oldest beyond ``max_to_keep`` leave the active set (deleted whole unless
        preserved). Collective under several workers. With
        ``CheckpointOptions(enable_async=True)`` the checkpoint is written, committed
        and recorded in the background (see :meth:`Checkpoint.write`).

        With ``checkpoint_interval``: nothing is saved (None is returned) when
        ``step_counter`` equals the last saved step, or, with ``check_interval``, is
        below it plus the interval.

        Returns:
            The new checkpoint's path, or None when the interval skipped the save.
        """
        options = check_options(options, "CheckpointManager.save")
        if self._checkpoint_interval is not None:
            step = self._step()
            last = self._last_checkpoint_step
            if last is not None:
                if step == last:
                    return None
                if check_interval and step < last + self._checkpoint_interval:
                    return None
            self._last_checkpoint_step = step
        ckpt = self._checkpoint
        ckpt.sync()   # the previous save is recorded before this one is numbered
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else int(checkpoint_number)
        path = f"{self._prefix}-{number}"
        return ckpt._write(path, options, on_commit=lambda: self._record(path),
                           after_commit=self._keep)

    def _sweep(self, path: str, stamp: float) -> tuple[dict, float, list]:
        """The active set and last preserved time once ``path`` (saved at ``stamp``)
        joined, and the checkpoints to delete (TensorFlow's ``_sweep``)."""
        active = {p: t for p, t in self._active.items() if p != path}
        active[path] = stamp
        preserved, removed = self._last_preserved, []
        if self._max_to_keep:
            while len(active) > self._max_to_keep:
                old = next(iter(active))
                old_stamp = active.pop(old)
                if self._keep_hours is not None and \
                        old_stamp - self._keep_hours * 3600.0 >= preserved:
                    preserved = old_stamp
                    continue
                removed.append(old)
        return active, preserved, removed

    def _record(self, path: str) -> dict:
        """Worker 0, once ``path`` is committed: the state file, then the removals.
        Returns the new state, which every worker takes (:meth:`_keep`)."""
        active, preserved, removed = self._sweep(path, time.time())
        fmt.write_state(self._directory, {
            "model_checkpoint_path": os.path.basename(path),
            "all_model_checkpoint_paths": [os.path.basename(p) for p in active],
            "all_model_checkpoint_timestamps": list(active.values()),
            "last_preserved_timestamp": preserved})
        for old in removed:
            for f in _checkpoint_files(old):
                _remove(f)
        return {"latest": path, "active": list(active.items()), "preserved": preserved}

    def _keep(self, state: dict) -> None:
        """Every worker, once a checkpoint is committed and recorded: worker 0's state."""
        self._active = dict(state["active"])
        self._last_preserved = state["preserved"]
        self._latest = state["latest"]

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint, or call ``init_fn`` where there is none.
        Collective under several workers.

        Returns:
            The restored checkpoint's path, or None (nothing restored).
        """
        self.sync()
        if self._latest is not None:
            self._checkpoint.restore(self._latest)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = self._step()
            return self._latest
        if self._init_fn is not None:
            self._init_fn()
        return None

    def sync(self) -> None:
        """Wait for the checkpoint's asynchronous save in flight (as
        :meth:`Checkpoint.sync`)."""
        self._checkpoint.sync()
