"""Lion (Chen et al., "Symbolic Discovery of Optimization Algorithms"), as Keras writes
it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers.base import Optimizer


class Lion(Optimizer):
    """``keras.optimizers.Lion``: ``w -= lr * sign(beta_1 * m + (1 - beta_1) * g)``,
    then ``m = beta_2 * m + (1 - beta_2) * g``.

    Slot: ``momentum``.

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        beta_1: in (0, 1] (0 would make it SignSGD), default 0.9.
        beta_2: the momentum's decay, default 0.99.
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("beta_1", "beta_2")
    slot_names = ("momentum",)

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.99,
                 name: str = "Lion", compression=None, **common):
        if not 0 < float(beta_1) <= 1:
            raise ValueError("Argument `beta_1` must be in the [0, 1] range. Otherwise, the "
                             f"optimizer degenerates to SignSGD. Received: beta_1={beta_1}.")
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        super().__init__(learning_rate, name, compression, **common)

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        m = slots["momentum"]
        param -= lr * xp.sign(m * self.beta_1 + grad * (1.0 - self.beta_1))
        m *= self.beta_2
        m += grad * (1.0 - self.beta_2)

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2}
