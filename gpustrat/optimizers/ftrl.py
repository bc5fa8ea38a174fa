"""FTRL-Proximal (McMahan et al., "Ad Click Prediction"), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers.base import Optimizer


class Ftrl(Optimizer):
    """``keras.optimizers.Ftrl``: with ``p = -learning_rate_power``,
    ``n' = n + g**2``, ``z += g + 2 * l2_shrinkage * w - (n'**p - n**p) / lr * w``,
    ``w = (clip(z, -l1, l1) - z) / (n'**p / lr + 2 * (l2 + beta / (2 * lr)))``,
    ``n = n'``.

    Slots: ``accumulator`` (n, starting at ``initial_accumulator_value``) and
    ``linear`` (z).

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        learning_rate_power: <= 0 (default -0.5).
        initial_accumulator_value, l1_regularization_strength,
        l2_regularization_strength, l2_shrinkage_regularization_strength: >= 0.
        beta: default 0.
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("learning_rate_power", "initial_accumulator_value",
                       "l1_regularization_strength", "l2_regularization_strength",
                       "l2_shrinkage_regularization_strength", "beta")
    slot_names = ("accumulator", "linear")

    def __init__(self, learning_rate=0.001, learning_rate_power=-0.5,
                 initial_accumulator_value=0.1, l1_regularization_strength=0.0,
                 l2_regularization_strength=0.0, l2_shrinkage_regularization_strength=0.0,
                 beta=0.0, name: str = "Ftrl", compression=None, **common):
        if initial_accumulator_value < 0.0:
            raise ValueError("`initial_accumulator_value` needs to be positive or zero. "
                             f"Received: initial_accumulator_value={initial_accumulator_value}.")
        if learning_rate_power > 0.0:
            raise ValueError("`learning_rate_power` needs to be negative or zero. Received: "
                             f"learning_rate_power={learning_rate_power}.")
        for what, value in (("l1_regularization_strength", l1_regularization_strength),
                            ("l2_regularization_strength", l2_regularization_strength),
                            ("l2_shrinkage_regularization_strength",
                             l2_shrinkage_regularization_strength)):
            if value < 0.0:
                raise ValueError(f"`{what}` needs to be positive or zero. Received: "
                                 f"{what}={value}.")
        self.learning_rate_power = float(learning_rate_power)
        self.initial_accumulator_value = float(initial_accumulator_value)
        self.l1_regularization_strength = float(l1_regularization_strength)
        self.l2_regularization_strength = float(l2_regularization_strength)
        self.l2_shrinkage_regularization_strength = float(l2_shrinkage_regularization_strength)
        self.beta = float(beta)
        super().__init__(learning_rate, name, compression, **common)

    def slot_initial_value(self, name: str) -> float:
        return self.initial_accumulator_value if name == "accumulator" else 0.0

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        accum, linear = slots["accumulator"], slots["linear"]
        power = -self.learning_rate_power
        l2 = self.l2_regularization_strength + self.beta / (2.0 * lr)
        new_accum = accum + grad * grad
        grown = new_accum ** power
        linear += grad + 2 * self.l2_shrinkage_regularization_strength * param - \
            (grown - accum ** power) / lr * param
        quadratic = grown / lr + 2 * l2
        l1 = self.l1_regularization_strength
        param[...] = (xp.clip(linear, -l1, l1) - linear) / quadratic
        accum[...] = new_accum

    def get_config(self) -> dict:
        return {**super().get_config(), "learning_rate_power": self.learning_rate_power,
                "initial_accumulator_value": self.initial_accumulator_value,
                "l1_regularization_strength": self.l1_regularization_strength,
                "l2_regularization_strength": self.l2_regularization_strength,
                "l2_shrinkage_regularization_strength":
                    self.l2_shrinkage_regularization_strength,
                "beta": self.beta}
