"""Stochastic gradient descent, with optional (Nesterov) momentum."""

from __future__ import annotations

import numpy as np

from gpustrat import devices as _devices
from gpustrat.optimizers.base import Optimizer


class SGD(Optimizer):
    """``keras.optimizers.SGD``: with momentum ``m = momentum * m - lr * g`` and
    ``w += m`` (Nesterov: ``w += momentum * m - lr * g``); without, ``w -= lr * g``.

    Args:
        learning_rate: a float or a schedule (see :class:`Optimizer`).
        momentum: in [0, 1); 0 keeps no slot.
        nesterov: Nesterov momentum.
        compression: the dtype gradients are reduced in (None, "float16", "bfloat16").
        weight_decay, clipnorm, clipvalue, global_clipnorm, exclude_from_weight_decay:
            keyword arguments of every optimizer (see :class:`Optimizer`).
    """

    agreed_settings = ("momentum", "nesterov")

    def __init__(self, learning_rate=0.01, momentum: float = 0.0, nesterov: bool = False,
                 name: str = "SGD", compression=None, **common):
        self._momentum = None
        self.momentum = momentum
        self.nesterov = bool(nesterov)
        super().__init__(learning_rate, name, compression, **common)

    @property
    def momentum(self) -> float:
        return self._momentum

    @momentum.setter
    def momentum(self, value) -> None:
        value = float(value)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {value}")
        stepped = bool(getattr(self, "_slots", None))
        if value and stepped and not self.slot_names:
            raise ValueError(
                f"momentum {self._momentum:g} -> {value:g}: this SGD has taken steps "
                "without a momentum slot (momentum 0 keeps none), so it cannot start one "
                "now; make the SGD with a nonzero momentum (it may be set to 0 and back "
                "later), or make a new SGD")
        self._momentum = value
        if not stepped:  # the slots are fixed by the first step
            self.slot_names = ("momentum",) if value else ()

    def update_step(self, param, grad, slots, lr, step, name):
        capture = _devices.capture_state
        if capture is not None and not isinstance(param, np.ndarray):
            # Captured by gs.function: the learning rate is a device scalar of the
            # graph, set before each replay (a schedule's next value included).
            lr = capture.step_scalar(self, param, _learning_rate)
        self._descend(param, slots, lr * grad)

    def update_replicas(self, params, grad, slots, lr, step):
        if type(self).update_step is not SGD.update_step:   # a subclass's own update
            super().update_replicas(params, grad, slots, lr, step)
            return
        step_size = lr * grad   # the replicas' common term, computed once
        for param, s in zip(params, slots):
            self._descend(param, s, step_size)

    def _descend(self, param, slots, step_size) -> None:
        """The update given ``step_size = lr * grad``."""
        if not self.momentum:
            param -= step_size
            return
        m = slots["momentum"]
        m *= self.momentum
        m -= step_size
        if self.nesterov:
            param += self.momentum * m - step_size
        else:
            param += m

    def get_config(self) -> dict:
        return {**super().get_config(), "momentum": self.momentum, "nesterov": self.nesterov}


def _learning_rate(lr: float, step: int) -> float:
    return lr
