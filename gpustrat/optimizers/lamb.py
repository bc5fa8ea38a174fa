"""LAMB (You et al., "Large Batch Optimization for Deep Learning"), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer


class Lamb(Optimizer):
    """``keras.optimizers.Lamb``: Adam's moments, ``u = m / (1 - beta_1**t) /
    (sqrt(v / (1 - beta_2**t)) + epsilon)``, then ``w -= r * lr * u`` with the trust
    ratio ``r = ||w|| / ||u||`` of each variable (1 where either norm is 0).

    Slots: ``momentum``, ``velocity``. Each variable is updated on its own (the trust
    ratio is per variable).

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        beta_1, beta_2: in [0, 1) (defaults 0.9, 0.999).
        epsilon: default 1e-7.
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("beta_1", "beta_2", "epsilon")
    slot_names = ("momentum", "velocity")

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Lamb", compression=None, **common):
        self.beta_1 = hyper.fraction("beta_1", beta_1)
        self.beta_2 = hyper.fraction("beta_2", beta_2)
        self.epsilon = hyper.positive("epsilon", epsilon)
        super().__init__(learning_rate, name, compression, **common)

    def flat_ok(self, names: list) -> bool:
        return False     # the trust ratio is each variable's own

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        m, v = slots["momentum"], slots["velocity"]
        m += (grad - m) * (1 - self.beta_1)
        v += (grad * grad - v) * (1 - self.beta_2)
        update = (m / (1.0 - self.beta_1 ** step)) / \
            (xp.sqrt(v / (1.0 - self.beta_2 ** step)) + self.epsilon)
        # The norms stay on the variable's device (no host read).
        w_norm = xp.sqrt((param * param).sum())
        u_norm = xp.sqrt((update * update).sum())
        both = (w_norm > 0) & (u_norm > 0)
        ratio = xp.where(both, w_norm / xp.where(both, u_norm, 1), 1)
        param -= update * (ratio * lr).astype(param.dtype)

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon}
