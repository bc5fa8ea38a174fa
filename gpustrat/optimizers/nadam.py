"""Nadam: Adam with Nesterov momentum (Dozat), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer

#: Past this step the momentum schedule's factor ``1 - 0.5 * 0.96**t`` is 1 to within
#: float64's precision: later products multiply by ``beta_1`` alone.
_SCHEDULE_STEPS = 1000


class Nadam(Optimizer):
    """``keras.optimizers.Nadam``: with ``t`` the step (from 1), the momentum schedule
    ``u_t = beta_1 * (1 - 0.5 * 0.96**t)`` and its running product
    ``P_t = u_1 * ... * u_t``: ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``,
    ``m_hat = u_{t+1} * m / (1 - P_t * u_{t+1}) + (1 - u_t) * g / (1 - P_t)``,
    ``v_hat = v / (1 - beta_2**t)``, ``w -= lr * m_hat / (sqrt(v_hat) + epsilon)``.

    Keras keeps ``P_t`` in a variable; here it is a function of the step, worked out
    on the host (a restored or parameter-server step needs no extra state).

    Slots: ``momentum`` (m) and ``velocity`` (v), starting at zero.

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        beta_1, beta_2: decay rates in [0, 1).
        epsilon: added to the root of ``v_hat`` (positive).
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("beta_1", "beta_2", "epsilon")
    slot_names = ("momentum", "velocity")

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, name: str = "Nadam", compression=None, **common):
        self.beta_1 = hyper.fraction("beta_1", beta_1)
        self.beta_2 = hyper.fraction("beta_2", beta_2)
        self.epsilon = hyper.positive("epsilon", epsilon)
        self._products = (None, [1.0])   # (beta_1, [P_0, P_1, ...])
        super().__init__(learning_rate, name, compression, **common)

    def _u(self, t: int) -> float:
        return self.beta_1 * (1.0 - 0.5 * 0.96 ** t)

    def _product(self, t: int) -> float:
        """``P_t``, multiplied in Keras's order (``P_{t-1} * beta_1 * (...)``)."""
        beta_1, held = self._products
        if beta_1 != self.beta_1:
            held = [1.0]
            self._products = (self.beta_1, held)
        for i in range(len(held), min(t, _SCHEDULE_STEPS) + 1):
            held.append(held[-1] * self.beta_1 * (1.0 - 0.5 * 0.96 ** i))
        if t <= _SCHEDULE_STEPS:
            return held[t]
        return held[_SCHEDULE_STEPS] * self.beta_1 ** (t - _SCHEDULE_STEPS)

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        u_t, u_next = self._u(step), self._u(step + 1)
        product = self._product(step)
        product_next = product * u_next
        m, v = slots["momentum"], slots["velocity"]
        m += (grad - m) * (1 - self.beta_1)
        v += (xp.square(grad) - v) * (1 - self.beta_2)
        m_hat = (u_next * m) / (1 - product_next) + ((1 - u_t) * grad) / (1 - product)
        v_hat = v / (1 - self.beta_2 ** step)
        param -= (m_hat * lr) / (xp.sqrt(v_hat) + self.epsilon)

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon}
