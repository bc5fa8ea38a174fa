"""RMSprop (Tieleman and Hinton), as Keras writes it."""

from __future__ import annotations

from gpustrat.devices import array_module
from gpustrat.optimizers import hyper
from gpustrat.optimizers.base import Optimizer


class RMSprop(Optimizer):
    """``keras.optimizers.RMSprop``: ``velocity = rho * velocity + (1 - rho) * g**2``;
    the step ``lr * g / sqrt(velocity + epsilon)`` (centered: ``average_gradient =
    rho * average_gradient + (1 - rho) * g`` and
    ``lr * g / sqrt(velocity - average_gradient**2 + epsilon)``); with momentum,
    ``m = momentum * m + step`` and ``w -= m``, else ``w -= step``.

    Slots: ``velocity``, plus ``momentum`` when momentum > 0 and ``average_gradient``
    when centered (all start at zero). ``momentum`` and ``centered`` are fixed when the
    optimizer is made (they decide its slots).

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        rho: the velocity's decay, in [0, 1).
        momentum: in [0, 1); 0 keeps no momentum slot.
        epsilon: added inside the square root (positive).
        centered: divide by the gradient's estimated variance instead of its second
            moment.
        Keyword arguments of every optimizer: see :class:`Optimizer`.
    """

    agreed_settings = ("rho", "momentum", "epsilon", "centered")

    def __init__(self, learning_rate=0.001, rho: float = 0.9, momentum: float = 0.0,
                 epsilon: float = 1e-7, centered: bool = False, name: str = "RMSprop",
                 compression=None, **common):
        self.rho = hyper.fraction("rho", rho)
        self._momentum = hyper.fraction("momentum", momentum)
        self.epsilon = hyper.positive("epsilon", epsilon)
        self._centered = bool(centered)
        self.slot_names = ("velocity",) + (("momentum",) if self._momentum else ()) + \
            (("average_gradient",) if self._centered else ())
        super().__init__(learning_rate, name, compression, **common)

    @property
    def momentum(self) -> float:
        return self._momentum

    @property
    def centered(self) -> bool:
        return self._centered

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        rho = self.rho
        velocity = slots["velocity"]
        velocity *= rho
        velocity += (1 - rho) * xp.square(grad)
        if self._centered:
            average = slots["average_gradient"]
            average *= rho
            average += (1 - rho) * grad
            denominator = velocity - xp.square(average) + self.epsilon
        else:
            denominator = velocity + self.epsilon
        increment = (lr * grad) / xp.sqrt(denominator)
        if self._momentum:
            m = slots["momentum"]
            m *= self._momentum
            m += increment
            param -= m
        else:
            param -= increment

    def get_config(self) -> dict:
        return {**super().get_config(), "rho": self.rho, "momentum": self.momentum,
                "epsilon": self.epsilon, "centered": self.centered}
