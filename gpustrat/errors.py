"""Errors that gpustrat raises on purpose, so that callers can catch them by kind."""

from __future__ import annotations


class CollectiveTimeout(TimeoutError):
    """A collective between workers did not complete before its deadline.

    Usually another rank died, is stuck, or skipped the collective. The deadline is
    ``GPUSTRAT_TIMEOUT`` seconds (default 300).
    """


class CollectiveMismatch(RuntimeError):
    """Workers issued different collectives at the same point (different op, shape or
    dtype, or one rank skipped a call). Raised on every rank, only in the debug mode
    that ``GPUSTRAT_DEBUG_COLLECTIVES=1`` turns on."""


class OutOfRangeError(StopIteration):
    """``get_next()`` past the end of a distributed dataset (``tf.errors.OutOfRangeError``).

    A StopIteration, so that ``except StopIteration`` catches it too."""
