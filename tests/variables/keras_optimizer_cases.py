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
}


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
}


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
