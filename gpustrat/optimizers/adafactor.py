"""Adafactor (Shazeer and Stern, "Adaptive Learning Rates with Sublinear Memory Cost"), as
Keras writes it."""

from __future__ import annotations

import math

from gpustrat.devices import array_module
from gpustrat.optimizers.base import Optimizer


class Adafactor(Optimizer):
    """``keras.optimizers.Adafactor``: with ``t`` the step (from 1),
    ``rho = min(lr, 1 / sqrt(t))``, ``alpha = max(epsilon_2, rms(w)) * rho``,
    ``g2 = g**2 + epsilon_1`` and ``beta = 1 - t**beta_2_decay``. A variable of rank 2
    or more keeps the factored second moment: ``r = beta * r + (1 - beta) * mean(g2,
    -1)``, ``c = beta * c + (1 - beta) * mean(g2, -2)``, ``v = r / mean(r, -1) (x) c``;
    one of rank 0 or 1 keeps ``v = beta * v + (1 - beta) * g2``. Then ``u = g /
    sqrt(v)``, ``w -= alpha * u / max(1, rms(u) / clip_threshold)``.

    Slots: ``r`` (the variable's shape without its last axis), ``c`` (without its
    second-to-last) and ``velocity`` (the variable's shape); ``r`` and ``c`` are scalars
    for a variable of rank below 2 (unused, as in Keras). Each variable is updated on
    its own (``rms`` is per variable).

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`); with
            ``relative_step`` a number is capped at ``1 / sqrt(t)``.
        beta_2_decay (-0.8), epsilon_1 (1e-30), epsilon_2 (1e-3), clip_threshold (1.0),
        relative_step (True): Keras's defaults.
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold",
                       "relative_step")
    slot_names = ("r", "c", "velocity")

    def __init__(self, learning_rate=0.001, beta_2_decay=-0.8, epsilon_1=1e-30,
                 epsilon_2=1e-3, clip_threshold=1.0, relative_step=True,
                 name: str = "Adafactor", compression=None, **common):
        self.beta_2_decay = float(beta_2_decay)
        self.epsilon_1 = float(epsilon_1)
        self.epsilon_2 = float(epsilon_2)
        self.clip_threshold = float(clip_threshold)
        self.relative_step = bool(relative_step)
        super().__init__(learning_rate, name, compression, **common)

    def slot_shape(self, name: str, shape: tuple) -> tuple:
        # Only the factored second moments r and c have shapes of their own; every other
        # slot (velocity, and the base class's accumulator and EMA average) is shaped as
        # the variable.
        if name not in ("r", "c"):
            return shape
        if len(shape) < 2:
            return ()
        return shape[:-1] if name == "r" else shape[:-2] + shape[-1:]

    def flat_ok(self, names: list) -> bool:
        return False     # rms(w) and rms(u) are each variable's own

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        cap = 1.0 / math.sqrt(step)
        if not callable(self._learning_rate) and self.relative_step:
            lr = min(lr, cap)
        rho = min(lr, cap)
        # Python floats (weak scalars): the arithmetic stays in the variable's dtype.
        alpha = xp.maximum(_rms(param), self.epsilon_2) * rho
        g2 = grad * grad + self.epsilon_1
        beta = 1.0 - step ** self.beta_2_decay
        v = slots["velocity"]
        if param.ndim >= 2:
            r, c = slots["r"], slots["c"]
            r[...] = r * beta + g2.mean(axis=-1) * (1 - beta)
            c[...] = c * beta + g2.mean(axis=-2) * (1 - beta)
            rows = r / r.mean(axis=-1, keepdims=True)
            v[...] = rows.reshape(rows.shape + (1,)) * c.reshape(
                c.shape[:-1] + (1,) + c.shape[-1:])
        else:
            v[...] = v * beta + g2 * (1 - beta)
        u = grad / xp.sqrt(v)
        u_hat = u / xp.maximum(_rms(u) / self.clip_threshold, 1.0)
        param -= u_hat * alpha

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_2_decay": self.beta_2_decay,
                "epsilon_1": self.epsilon_1, "epsilon_2": self.epsilon_2,
                "clip_threshold": self.clip_threshold, "relative_step": self.relative_step}


def _rms(x):
    xp = array_module(x)
    return xp.sqrt((x * x).mean())
