"""Checks of the hyperparameters the algorithms share (Keras's ranges, with errors
that name the value)."""

from __future__ import annotations

import math


def fraction(name: str, value) -> float:
    """``value`` as a float in [0, 1) (a decay rate such as ``rho`` or ``beta_1``)."""
    number = _number(name, value, "in [0, 1)")
    if not 0.0 <= number < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return number


def positive(name: str, value) -> float:
    """``value`` as a positive finite float (``epsilon``)."""
    number = _number(name, value, "a positive finite number")
    if not 0.0 < number < math.inf:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return number


def non_negative(name: str, value) -> float:
    """``value`` as a non-negative finite float."""
    number = _number(name, value, "a non-negative finite number")
    if not 0.0 <= number < math.inf:
        raise ValueError(f"{name} must be a non-negative finite number, got {value!r}")
    return number


def _number(name: str, value, what: str) -> float:
    if isinstance(value, (str, bytes, bool)):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {what}, got {value!r}") from None
