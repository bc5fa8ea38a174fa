"""Adadelta (Zeiler), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer


class Adadelta(Optimizer):
    """``keras.optimizers.Adadelta``: ``acc_g = rho * acc_g + (1 - rho) * g**2``,
    ``delta = -sqrt(acc_d + epsilon) * g / sqrt(acc_g + epsilon)``,
    ``acc_d = rho * acc_d + (1 - rho) * delta**2``, ``w += lr * delta``.

    Slots: ``accumulated_grad`` (acc_g) and ``accumulated_delta_var`` (acc_d), starting
    at zero.

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`; Keras's default
            0.001, though the paper's Adadelta has no rate: pass 1.0 for it).
        rho: the accumulators' decay, in [0, 1).
        epsilon: added inside the square roots (positive).
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("rho", "epsilon")
    slot_names = ("accumulated_grad", "accumulated_delta_var")

    def __init__(self, learning_rate=0.001, rho: float = 0.95, epsilon: float = 1e-7,
                 name: str = "Adadelta", compression=None, **common):
        self.rho = hyper.fraction("rho", rho)
        self.epsilon = hyper.positive("epsilon", epsilon)
        super().__init__(learning_rate, name, compression, **common)

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        rho, eps = self.rho, self.epsilon
        acc_g, acc_d = slots["accumulated_grad"], slots["accumulated_delta_var"]
        acc_g *= rho
        acc_g += (1 - rho) * xp.square(grad)
        delta = -((xp.sqrt(acc_d + eps) * grad) / xp.sqrt(acc_g + eps))
        acc_d *= rho
        acc_d += (1 - rho) * xp.square(delta)
        param += lr * delta

    def get_config(self) -> dict:
        return {**super().get_config(), "rho": self.rho, "epsilon": self.epsilon}
