"""Optimizers that train variables under a strategy with one fused gradient reduction
per step (see :mod:`gpustrat.optimizers.base`)."""

from gpustrat.optimizers import schedules
from gpustrat.optimizers.adadelta import Adadelta
from gpustrat.optimizers.adafactor import Adafactor
from gpustrat.optimizers.adagrad import Adagrad
from gpustrat.optimizers.adam import Adam
from gpustrat.optimizers.adamax import Adamax
from gpustrat.optimizers.adamw import AdamW
from gpustrat.optimizers.base import Optimizer
from gpustrat.optimizers.ftrl import Ftrl
from gpustrat.optimizers.lamb import Lamb
from gpustrat.optimizers.lion import Lion
from gpustrat.optimizers.loss_scale import LossScaleOptimizer
from gpustrat.optimizers.nadam import Nadam
from gpustrat.optimizers.rmsprop import RMSprop
from gpustrat.optimizers.sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adamax", "Nadam",
           "Adadelta", "Lion", "Ftrl", "Lamb", "Adafactor", "LossScaleOptimizer",
           "schedules"]
