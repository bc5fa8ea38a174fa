"""Adagrad (Duchi, Hazan and Singer), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer


class Adagrad(Optimizer):
    """``keras.optimizers.Adagrad``: ``accumulator += g**2``, then
    ``w -= lr * g / sqrt(accumulator + epsilon)``.

    Slot: ``accumulator``, starting at ``initial_accumulator_value`` (not zero).

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        initial_accumulator_value: the accumulator's starting value (non-negative).
        epsilon: added inside the square root (positive).
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("initial_accumulator_value", "epsilon")
    slot_names = ("accumulator",)

    def __init__(self, learning_rate=0.001, initial_accumulator_value: float = 0.1,
                 epsilon: float = 1e-7, name: str = "Adagrad", compression=None, **common):
        self.initial_accumulator_value = hyper.non_negative("initial_accumulator_value",
                                                            initial_accumulator_value)
        self.epsilon = hyper.positive("epsilon", epsilon)
        super().__init__(learning_rate, name, compression, **common)

    def slot_initial_value(self, name: str) -> float:
        return self.initial_accumulator_value if name == "accumulator" else 0.0

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        accumulator = slots["accumulator"]
        accumulator += xp.square(grad)
        param -= (lr * grad) / xp.sqrt(accumulator + self.epsilon)

    def get_config(self) -> dict:
        return {**super().get_config(),
                "initial_accumulator_value": self.initial_accumulator_value,
                "epsilon": self.epsilon}
