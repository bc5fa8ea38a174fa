"""Adam (Kingma and Ba), as Keras writes it."""

from __future__ import annotations

import math

import numpy as np

from gpustrat import devices as _devices
from gpustrat.devices import array_module
from gpustrat.optimizers.base import Optimizer


class Adam(Optimizer):
    """``keras.optimizers.Adam``: with ``t`` the step (from 1),
    ``m += (g - m) * (1 - beta_1)``, ``v += (g**2 - v) * (1 - beta_2)``,
    ``w -= lr * sqrt(1 - beta_2**t) / (1 - beta_1**t) * m / (sqrt(v) + epsilon)``
    (AMSGrad: ``v`` replaced by its running maximum). Slots, as Keras 3 names them:
    ``"momentum"`` (m), ``"velocity"`` (v) and, with AMSGrad, ``"velocity_hat"``; the
    names of TensorFlow's Keras 2 (``"m"``, ``"v"``, ``"vhat"``) are read as these by
    :meth:`get_slot` and by a checkpoint restore.

    Keyword arguments of every optimizer (``weight_decay``, the clips,
    ``exclude_from_weight_decay``): see :class:`Optimizer`.
    """

    agreed_settings = ("beta_1", "beta_2", "epsilon", "amsgrad")
    #: The slot names of earlier checkpoints (and of TensorFlow's Keras 2), by the name
    #: each stands for now.
    former_slot_names = {"m": "momentum", "v": "velocity", "vhat": "velocity_hat"}

    def __init__(self, learning_rate=0.001, beta_1: float = 0.9, beta_2: float = 0.999,
                 epsilon: float = 1e-7, amsgrad: bool = False, name: str = "Adam",
                 compression=None, **common):
        for what, b in (("beta_1", beta_1), ("beta_2", beta_2)):
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"{what} must be in [0, 1), got {b}")
        if not float(epsilon) > 0:
            raise ValueError(f"epsilon must be positive, got {epsilon}")
        self.beta_1, self.beta_2 = float(beta_1), float(beta_2)
        self.epsilon = float(epsilon)
        self.amsgrad = bool(amsgrad)
        self.slot_names = ("momentum", "velocity", "velocity_hat") if self.amsgrad else \
            ("momentum", "velocity")
        super().__init__(learning_rate, name, compression, **common)

    def step_size(self, lr: float, step: int) -> float:
        """``lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``: what step ``t`` scales ``m`` by."""
        return lr * math.sqrt(1.0 - self.beta_2 ** step) / (1.0 - self.beta_1 ** step)

    def update_step(self, param, grad, slots, lr, step, name):
        xp = array_module(param)
        capture = _devices.capture_state
        if capture is not None and xp is not np:
            # Captured by gs.function: the step size is a device scalar of the
            # graph, set to this formula's value before each replay.
            alpha = capture.step_scalar(self, param, self.step_size)
        else:
            alpha = self.step_size(lr, step)
        m, v = slots["momentum"], slots["velocity"]
        m += (grad - m) * (1.0 - self.beta_1)
        v += (grad * grad - v) * (1.0 - self.beta_2)
        if self.amsgrad:
            vhat = slots["velocity_hat"]
            xp.maximum(vhat, v, out=vhat)
            v = vhat
        param -= (m * alpha) / (xp.sqrt(v) + self.epsilon)

    def get_config(self) -> dict:
        return {**super().get_config(), "beta_1": self.beta_1, "beta_2": self.beta_2,
                "epsilon": self.epsilon, "amsgrad": self.amsgrad}
