"""Errors that gpustrat raises on purpose, so that callers can catch them by kind."""

from __future__ import annotations


class CollectiveTimeout(TimeoutError):
    """A collective between workers did not complete before its deadline.

    Usually another rank died, is stuck, or skipped the collective. The deadline is
    ``GPUSTRAT_TIMEOUT`` seconds (default 300).
    """


class CollectiveMismatch(RuntimeError):
    """Workers issued different collectives at the same point (a reduce on one rank, a
    gather on another; or, with ``GPUSTRAT_DEBUG_COLLECTIVES=1``, the same collective
    from different lines of code). Raised on every rank, before any data moves, naming
    each rank's operation."""


class LayoutMismatch(CollectiveMismatch, ValueError):
    """Workers issued the same collective on values of different shapes or dtypes (a
    partial batch reduced with ``axis=None``, say). Raised on every rank, naming each
    rank's shape and dtype; a ValueError too, as bad input is."""


class StateMismatch(CollectiveMismatch, ValueError):
    """Workers issued the same collective but hold state that must be the same on every
    worker and is not (an optimizer's learning rate, hyperparameters or ``iterations``;
    the resets and updates of a metric being read). Raised on every rank, naming each
    rank's values; a ValueError too, as bad input is."""


class OutOfRangeError(StopIteration):
    """``get_next()`` past the end of a distributed dataset (``tf.errors.OutOfRangeError``).

    A StopIteration, so that ``except StopIteration`` catches it too."""
