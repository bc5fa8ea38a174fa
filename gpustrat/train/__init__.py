"""``gs.train``: checkpoints of a training job (``tf.train.Checkpoint``'s names).

:class:`Checkpoint` saves and restores variables, optimizers, metrics, dataset and
distributed iterators and plain numbers, also nested in Checkpoints, containers and model
objects (restoring objects attached later too, at the next walk of the graph);
:class:`CheckpointManager` numbers checkpoints in a directory, keeps the last few (and
one every few hours) and saves at a step interval; :class:`CheckpointOptions` asks for
an asynchronous save. Names load on first use: importing this package initialises no
MPI. ``docs/checkpoint.md`` describes the format and the guarantees.
"""

from gpustrat._lazy import attach as _attach

_NAMES = {
    "Checkpoint": "gpustrat.train.checkpoint",
    "CheckpointLoadStatus": "gpustrat.train.checkpoint",
    "CheckpointManager": "gpustrat.train.manager",
    "CheckpointOptions": "gpustrat.train.saving",
    "latest_checkpoint": "gpustrat.train.manager",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
