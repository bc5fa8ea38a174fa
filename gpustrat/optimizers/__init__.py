"""Optimizers that train variables under a strategy with one fused gradient reduction
per step (see :mod:`gpustrat.optimizers.base`)."""

from gpustrat.optimizers.adam import Adam
from gpustrat.optimizers.adamw import AdamW
from gpustrat.optimizers.base import Optimizer
from gpustrat.optimizers.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
