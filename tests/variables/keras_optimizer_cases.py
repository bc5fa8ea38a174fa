"""The optimizer cases recorded from Keras 3 (``record_keras_optimizers.py``) and
checked against gpustrat (``test_optimizers_keras_parity.py``): a linear least-squares
model (kernel 3x2, bias 2) trained for 6 steps on 23 rows in global batches of 8 (the
last has 7), in float32 and float64. Plain NumPy: imported by both sides.

Every number given is exact in float32 (a power of two, or a sum of a few): Keras
converts Python numbers to float32 on the way to a float64 variable (the learning rate
is a float32 variable; ``beta_2=0.999`` becomes 0.99900001287, ``epsilon=1e-7``
1.00000001e-7), and gpustrat keeps them as float64. Nadam's schedule constant 0.96 is
such a number too, so float64 Nadam agrees to about 1e-8 only. Keras's defaults are
checked in float32 (the ``*_defaults`` cases).
"""

from __future__ import annotations

import numpy as np

N, D, K, BATCH, EPOCHS = 23, 3, 2, 8, 2
DTYPES = ("float32", "float64")

#: Hyperparameters exact in float32 (see the module docstring).
RHO, BETA_1, BETA_2, EPSILON = 0.875, 0.875, 1 - 2.0 ** -10, 2.0 ** -20

#: name -> (class name, keyword arguments); the same arguments in Keras and gpustrat,
#: but for ``exclude_from_weight_decay``, a method in Keras (``var_names=``).
CASES = {
    "rmsprop": ("RMSprop", {"learning_rate": 0.0625, "rho": RHO, "epsilon": EPSILON}),
    "rmsprop_centered_momentum": ("RMSprop", {"learning_rate": 0.0625, "rho": 0.75,
                                              "momentum": 0.5, "centered": True,
                                              "epsilon": EPSILON}),
    "rmsprop_clipnorm_active": ("RMSprop", {"learning_rate": 0.0625, "rho": RHO,
                                            "epsilon": EPSILON, "clipnorm": 0.25}),
    "rmsprop_clipnorm_inactive": ("RMSprop", {"learning_rate": 0.0625, "rho": RHO,
                                              "epsilon": EPSILON, "clipnorm": 1024.0}),
    # Keras starts a float64 accumulator at the float32 rounding of the initial value
    # (0.10000000149 for its default 0.1); gpustrat at the float64 value: 0.125 is both.
    "adagrad": ("Adagrad", {"learning_rate": 0.25, "initial_accumulator_value": 0.125,
                            "epsilon": EPSILON}),
    "adagrad_initial_decay": ("Adagrad", {"learning_rate": 0.25,
                                          "initial_accumulator_value": 0.5,
                                          "epsilon": 2.0 ** -10, "weight_decay": 0.25}),
    "adagrad_clipvalue_active": ("Adagrad", {"learning_rate": 0.25,
                                             "initial_accumulator_value": 0.125,
                                             "epsilon": EPSILON, "clipvalue": 0.125}),
    "nadam": ("Nadam", {"learning_rate": 0.0625, "beta_1": BETA_1, "beta_2": BETA_2,
                        "epsilon": EPSILON}),
    "nadam_global_clipnorm_active": ("Nadam", {"learning_rate": 0.0625, "beta_1": BETA_1,
                                               "beta_2": BETA_2, "epsilon": EPSILON,
                                               "global_clipnorm": 0.5}),
    "nadam_global_clipnorm_inactive": ("Nadam", {"learning_rate": 0.0625,
                                                 "beta_1": BETA_1, "beta_2": BETA_2,
                                                 "epsilon": EPSILON,
                                                 "global_clipnorm": 1024.0}),
    "adamax": ("Adamax", {"learning_rate": 0.0625, "beta_1": BETA_1, "beta_2": 0.875,
                          "epsilon": EPSILON}),
    "adadelta": ("Adadelta", {"learning_rate": 1.0, "rho": RHO, "epsilon": EPSILON}),
    "sgd_weight_decay": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                                 "weight_decay": 0.25}),
    "sgd_clipvalue_active": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                                     "clipvalue": 0.125}),
    "sgd_clipvalue_inactive": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                                       "clipvalue": 1024.0}),
    "adam_weight_decay_global_clipnorm": ("Adam", {"learning_rate": 0.0625,
                                                   "beta_1": BETA_1, "beta_2": BETA_2,
                                                   "epsilon": EPSILON,
                                                   "weight_decay": 0.25,
                                                   "global_clipnorm": 0.5}),
    "adamw_clipnorm": ("AdamW", {"learning_rate": 0.0625, "beta_1": BETA_1,
                                 "beta_2": BETA_2, "epsilon": EPSILON,
                                 "weight_decay": 0.25, "clipnorm": 0.25}),
    # Excluding a variable from the decay updates each variable in turn (no flat arena).
    "rmsprop_decay_excluding_bias_clipnorm": ("RMSprop", {
        "learning_rate": 0.0625, "rho": RHO, "epsilon": EPSILON, "weight_decay": 0.25,
        "clipnorm": 0.25, "exclude_from_weight_decay": ["bias"]}),
    # Keras's defaults (float32 only: they are not exact in float32).
    "rmsprop_defaults": ("RMSprop", {"learning_rate": 0.0625}),
    "adagrad_defaults": ("Adagrad", {"learning_rate": 0.25}),
    "nadam_defaults": ("Nadam", {"learning_rate": 0.0625}),
    "adamax_defaults": ("Adamax", {"learning_rate": 0.0625}),
    "adadelta_defaults": ("Adadelta", {"learning_rate": 1.0}),
    # Optimizers added with Keras 3.
    "lion": ("Lion", {"learning_rate": 0.0625, "beta_1": BETA_1, "beta_2": 0.984375}),
    "ftrl": ("Ftrl", {"learning_rate": 0.25, "initial_accumulator_value": 0.125,
                      "l1_regularization_strength": 0.0625,
                      "l2_regularization_strength": 0.125,
                      "l2_shrinkage_regularization_strength": 0.03125, "beta": 0.25}),
    "lamb": ("Lamb", {"learning_rate": 0.0625, "beta_1": BETA_1, "beta_2": BETA_2,
                      "epsilon": EPSILON}),
    "adafactor": ("Adafactor", {"learning_rate": 0.25, "beta_2_decay": -0.75,
                                "epsilon_1": 2.0 ** -60, "epsilon_2": 2.0 ** -10,
                                "clip_threshold": 1.0}),
    # Learning-rate schedules: (schedule class, its arguments), made on each side.
    "sgd_exponential_decay": ("SGD", {"learning_rate": ("ExponentialDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 2, "decay_rate": 0.5}),
        "momentum": 0.5}),
    "sgd_exponential_decay_staircase": ("SGD", {"learning_rate": ("ExponentialDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 2, "decay_rate": 0.5,
        "staircase": True})}),
    "rmsprop_piecewise_constant": ("RMSprop", {"learning_rate": (
        "PiecewiseConstantDecay", {"boundaries": [2, 4],
                                   "values": [0.125, 0.0625, 0.03125]}),
        "rho": RHO, "epsilon": EPSILON}),
    "sgd_polynomial_decay": ("SGD", {"learning_rate": ("PolynomialDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 4,
        "end_learning_rate": 0.015625, "power": 2.0})}),
    "sgd_polynomial_decay_cycle": ("SGD", {"learning_rate": ("PolynomialDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 2,
        "end_learning_rate": 0.015625, "power": 0.5, "cycle": True})}),
    "sgd_inverse_time_decay": ("SGD", {"learning_rate": ("InverseTimeDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 2, "decay_rate": 0.5})}),
    "adam_cosine_decay_warmup": ("Adam", {"learning_rate": ("CosineDecay", {
        "initial_learning_rate": 0.0, "decay_steps": 4, "alpha": 0.25,
        "warmup_target": 0.125, "warmup_steps": 3}),
        "beta_1": BETA_1, "beta_2": BETA_2, "epsilon": EPSILON}),
    "sgd_cosine_decay_restarts": ("SGD", {"learning_rate": ("CosineDecayRestarts", {
        "initial_learning_rate": 0.125, "first_decay_steps": 2, "t_mul": 2.0,
        "m_mul": 0.5, "alpha": 0.25}), "momentum": 0.5}),
    # Gradient accumulation and the moving average of the weights.
    "sgd_accumulation": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                                 "gradient_accumulation_steps": 2}),
    "adam_accumulation_schedule": ("Adam", {"learning_rate": ("ExponentialDecay", {
        "initial_learning_rate": 0.125, "decay_steps": 2, "decay_rate": 0.5}),
        "beta_1": BETA_1, "beta_2": BETA_2, "epsilon": EPSILON,
        "gradient_accumulation_steps": 3}),
    "adam_ema": ("Adam", {"learning_rate": 0.0625, "beta_1": BETA_1, "beta_2": BETA_2,
                          "epsilon": EPSILON, "use_ema": True, "ema_momentum": 0.75}),
    "sgd_ema_overwrite": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                                  "use_ema": True, "ema_momentum": 0.75,
                                  "ema_overwrite_frequency": 3}),
    # Dynamic loss scaling: the gradients are multiplied by the scale; those of step
    # INF_STEP (from 0) hold an inf, so that step is skipped and the scale halves.
    "sgd_loss_scale": ("SGD", {"learning_rate": 0.0625, "momentum": 0.5,
                               "loss_scale": {"initial_scale": 64.0,
                                              "dynamic_growth_steps": 2}}),
    "adam_loss_scale": ("Adam", {"learning_rate": 0.0625, "beta_1": BETA_1,
                                 "beta_2": BETA_2, "epsilon": EPSILON,
                                 "loss_scale": {"initial_scale": 1024.0,
                                                "dynamic_growth_steps": 3}}),
}

#: The step (from 0) whose gradients hold an inf in the loss-scaled cases.
INF_STEP = 2


def make_optimizer(optimizers, cls: str, kwargs: dict, keras: bool):
    """Case ``(cls, kwargs)`` as an optimizer of ``optimizers`` (``keras.optimizers`` or
    ``gpustrat.optimizers``): a schedule given as ``(name, arguments)`` is made from
    its ``schedules``, ``loss_scale`` wraps the optimizer in a LossScaleOptimizer, and
    ``exclude_from_weight_decay`` is a method call in Keras."""
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("learning_rate"), tuple):
        name, args = kwargs["learning_rate"]
        kwargs["learning_rate"] = getattr(optimizers.schedules, name)(**args)
    scaled = kwargs.pop("loss_scale", None)
    exclude = kwargs.pop("exclude_from_weight_decay", None) if keras else None
    opt = getattr(optimizers, cls)(**kwargs)
    if exclude:
        opt.exclude_from_weight_decay(var_names=exclude)
    if scaled is not None:
        opt = optimizers.LossScaleOptimizer(opt, **scaled)
    return opt


def dtypes_of(name: str) -> tuple:
    """The dtypes case ``name`` is recorded in."""
    return ("float32",) if name.endswith("_defaults") else DTYPES


#: gpustrat slot name -> the Keras optimizer's attribute holding that slot per variable.
KERAS_SLOTS = {
    "SGD": {"momentum": "momentums"},
    "Adam": {"momentum": "_momentums", "velocity": "_velocities"},
    "AdamW": {"momentum": "_momentums", "velocity": "_velocities"},
    "RMSprop": {"velocity": "_velocities", "momentum": "_momentums",
                "average_gradient": "_average_gradients"},
    "Adagrad": {"accumulator": "_accumulators"},
    "Nadam": {"momentum": "_momentums", "velocity": "_velocities"},
    "Adamax": {"momentum": "_m", "norm": "_u"},
    "Adadelta": {"accumulated_grad": "_accumulated_grads",
                 "accumulated_delta_var": "_accumulated_delta_vars"},
    "Lion": {"momentum": "_momentums"},
    "Ftrl": {"accumulator": "_accumulators", "linear": "_linears"},
    "Lamb": {"momentum": "_momentums", "velocity": "_velocities"},
    "Adafactor": {"r": "_r", "c": "_c", "velocity": "_v"},
}
#: gpustrat's slot of the weights' moving average (``use_ema``) and of the accumulated
#: gradients (``gradient_accumulation_steps``), as Keras holds them.
KERAS_EMA_SLOT = {"average": "_model_variables_moving_average"}
KERAS_ACCUMULATOR_SLOT = {"gradient_accumulator": "_accumulated_gradients"}


def data(dtype: str):
    """(x, y, initial kernel, initial bias) in ``dtype``."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, D))
    y = x @ rng.standard_normal((D, K)) + 0.5
    w0 = rng.standard_normal((D, K))
    return (x.astype(dtype), y.astype(dtype), w0.astype(dtype),
            np.zeros(K, dtype))


def batches(dtype: str):
    """The global batches, in order, over every epoch."""
    x, y, _, _ = data(dtype)
    for _ in range(EPOCHS):
        for start in range(0, N, BATCH):
            yield x[start:start + BATCH], y[start:start + BATCH]


def gradients(w, b, xb, yb, count):
    """The mean squared error's gradients (up to a factor 2) over ``count`` rows."""
    err = xb @ w + b - yb
    return xb.T @ err / count, err.sum(axis=0) / count
