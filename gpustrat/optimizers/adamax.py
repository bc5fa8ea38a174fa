"""Adamax, Adam's infinity-norm variant (Kingma and Ba), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer


class Adamax(Optimizer):
    """``keras.optimizers.Adamax``: with ``t`` the step (from 1),
    ``m += (g - m) * (1 - beta_1)``, ``u = max(beta_2 * u, |g|)``,
    ``w -= lr * m / ((1 - beta_1**t) * (u + epsilon))``.

    Slots: ``momentum`` (m) and ``norm`` (u), starting at zero.

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        beta_1, beta_2: decay rates in [0, 1).
        epsilon: added to the norm (positive).
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("beta_1", "beta_2", "epsilon")
    slot_names = ("momentum", "norm")

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Adamax", compression=None, **common):
        self.beta_1 = hyper.fraction("beta_1", beta_1)
        self.beta_2 = hyper.fraction("beta_2", beta_2)
        self.epsilon = hyper.positive("epsilon", epsilon)
        super().__init__(learning_rate, name, compression, **common)

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        m, u = slots["momentum"], slots["norm"]
        m += (grad - m) * (1 - self.beta_1)
        u *= self.beta_2
        xp.maximum(u, xp.abs(grad), out=u)
        param -= (lr * m) / ((1 - self.beta_1 ** step) * (u + self.epsilon))

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon}
