"""``CheckpointManager`` and ``latest_checkpoint``: numbered checkpoints in a directory.

The directory's ``checkpoint`` file (JSON: ``model_checkpoint_path``,
``all_model_checkpoint_paths``, relative to the directory) records the kept checkpoints.
It is replaced atomically (temporary name, ``fsync``, rename) right after a checkpoint's
index is in place, by worker 0, inside the save's commit: for an asynchronous save, in
the background once the files are committed, so that it never names an unfinished
checkpoint.
"""

from __future__ import annotations

import glob
import os
import secrets

from gpustrat.train import format as fmt
from gpustrat.train.checkpoint import Checkpoint
from gpustrat.train.saving import CheckpointOptions, check_options

_STATE_FILE = "checkpoint"


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
    """Numbers checkpoints ``directory/ckpt-N`` and keeps the newest ``max_to_keep``.

    The directory's ``checkpoint`` file records them; ``latest_checkpoint`` reads it.
    A checkpoint beyond ``max_to_keep`` is removed whole (its index first, so that it
    stops being a checkpoint at once).
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
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    @property
    def checkpoints(self) -> list[str]:
        """The kept checkpoints, oldest first (committed ones only)."""
        return list(self._checkpoints)

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest kept checkpoint, or None before the first save. A save still in
        the background is not named until it is committed."""
        return self._checkpoints[-1] if self._checkpoints else None

    def save(self, checkpoint_number: int | None = None,
             options: CheckpointOptions | None = None) -> str:
        """Save a new checkpoint (``ckpt-<checkpoint_number>``, by default the new
        ``save_counter``), record it and remove the oldest beyond ``max_to_keep``.
        Returns its path. Collective under several workers. With
        ``CheckpointOptions(enable_async=True)`` the checkpoint is written, committed
        and recorded in the background (see :meth:`Checkpoint.write`)."""
        options = check_options(options, "CheckpointManager.save")
        ckpt = self._checkpoint
        ckpt.sync()   # the previous save is recorded before this one is numbered
        ckpt.save_counter += 1
        number = ckpt.save_counter if checkpoint_number is None else int(checkpoint_number)
        path = f"{self._prefix}-{number}"
        return ckpt._write(path, options, on_commit=lambda: self._record(path),
                           after_commit=lambda: self._keep(path))

    def _kept(self, path: str) -> tuple[list, list]:
        kept = [p for p in self._checkpoints if p != path] + [path]
        if self._max_to_keep is not None and len(kept) > self._max_to_keep:
            return kept[-self._max_to_keep:], kept[:-self._max_to_keep]
        return kept, []

    def _record(self, path: str) -> None:
        """Worker 0, once ``path`` is committed: the state file, then the removals."""
        kept, removed = self._kept(path)
        state = os.path.join(self._directory, _STATE_FILE)
        tmp = fmt.temp_name(state, secrets.token_hex(6))
        fmt.write_json(tmp, {"model_checkpoint_path": os.path.basename(path),
                             "all_model_checkpoint_paths": [os.path.basename(p)
                                                            for p in kept]})
        fmt.replace(tmp, state)
        fmt.fsync_dir(self._directory)
        for old in removed:
            for f in _checkpoint_files(old):
                _remove(f)

    def _keep(self, path: str) -> None:
        """Every worker, once ``path`` is committed and recorded."""
        self._checkpoints = self._kept(path)[0]

    def sync(self) -> None:
        """Wait for the checkpoint's asynchronous save in flight (as
        :meth:`Checkpoint.sync`)."""
        self._checkpoint.sync()
