"""``gs.train``: checkpoints of a training job (``tf.train.Checkpoint``'s names).

:class:`Checkpoint` saves and restores variables, optimizers, metrics, dataset and
distributed iterators and plain numbers; :class:`CheckpointManager` numbers checkpoints
in a directory and keeps the last few. Names load on first use: importing this package
initialises no MPI. ``docs/checkpoint.md`` describes the format and the guarantees.
"""

from gpustrat._lazy import attach as _attach

_NAMES = {
    "Checkpoint": "gpustrat.train.checkpoint",
    "CheckpointManager": "gpustrat.train.checkpoint",
    "latest_checkpoint": "gpustrat.train.checkpoint",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
