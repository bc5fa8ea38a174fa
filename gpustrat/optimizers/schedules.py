"""Learning-rate schedules (``keras.optimizers.schedules``): a rate of the step.

An optimizer given a :class:`LearningRateSchedule` calls it with ``iterations`` (the
number of steps applied so far, from 0) before each step; a plain callable it calls with
no arguments, as Keras 3 does. The formulas, defaults and configs are Keras 3's. They
are evaluated on the host in float64 (Keras: in the initial rate's dtype, float32), so a
rate may differ from Keras's in the last float32 digit.

Every worker computes the rate from the same ``iterations`` and the step's agreement
checks that they used the same rate. A checkpoint keeps ``iterations`` and the
schedule's config (:func:`serialize`); a restore sets ``iterations``, so the restored
optimizer's schedule carries on where the saved one was.
"""

from __future__ import annotations

import inspect
import math

import numpy as np

from gpustrat.devices import to_host

__all__ = ["LearningRateSchedule", "ExponentialDecay", "PiecewiseConstantDecay",
           "PolynomialDecay", "InverseTimeDecay", "CosineDecay", "CosineDecayRestarts",
           "serialize", "deserialize"]


class LearningRateSchedule:
    """Base of the schedules: subclass it and write ``__call__(self, step)`` (the rate
    of a step, a number) and ``get_config`` (the constructor's arguments, for
    :meth:`from_config`)."""

    def __call__(self, step):
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must "
                                  "override `__call__(self, step)`.")

    def get_config(self) -> dict:
        raise NotImplementedError(f"Learning rate schedule '{type(self).__name__}' must "
                                  "override `get_config()` in order to be serializable.")

    @classmethod
    def from_config(cls, config: dict):
        """A schedule made from :meth:`get_config`'s output."""
        return cls(**config)

    def __repr__(self) -> str:
        try:
            args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        except NotImplementedError:
            args = ""
        return f"{type(self).__name__}({args})"


def _check_steps(what: str, value) -> None:
    if not value > 0:
        raise ValueError(f"Argument `{what}` must be > 0. Received: {what}={value}")


def _out(x):
    """A 0-d result as a Python float, an array as a float64 array."""
    x = np.asarray(x, np.float64)
    return float(x) if x.ndim == 0 else x


def _step(step):
    return np.asarray(step, np.float64)


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)``; with
    ``staircase`` the exponent is floored (the rate drops every ``decay_steps``)."""

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="ExponentialDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name
        _check_steps("decay_steps", decay_steps)

    def __call__(self, step):
        p = _step(step) / float(self.decay_steps)
        if self.staircase:
            p = np.floor(p)
        return _out(float(self.initial_learning_rate) * np.power(float(self.decay_rate), p))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "decay_rate": self.decay_rate,
                "staircase": self.staircase, "name": self.name}


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` for ``step <= boundaries[0]``, ``values[i]`` for
    ``boundaries[i-1] < step <= boundaries[i]``, ``values[-1]`` after the last."""

    def __init__(self, boundaries, values, name="PiecewiseConstant"):
        if len(boundaries) != len(values) - 1:
            raise ValueError(
                "The length of boundaries should be 1 less than the length of "
                f"values. Received: boundaries={boundaries} of length {len(boundaries)}, "
                f"and values={values} of length {len(values)}.")
        self.boundaries = boundaries
        self.values = values
        self.name = name

    def __call__(self, step):
        s = _step(step)
        b, v = [float(x) for x in self.boundaries], [float(x) for x in self.values]
        out = (s <= b[0]) * v[0] + (s > b[-1]) * v[-1]
        for low, high, value in zip(b[:-1], b[1:], v[1:-1]):
            out = out + ((s > low) & (s <= high)) * value
        return _out(out)

    def get_config(self) -> dict:
        return {"boundaries": self.boundaries, "values": self.values, "name": self.name}


class PolynomialDecay(LearningRateSchedule):
    """``(initial - end) * (1 - step / decay_steps) ** power + end`` with the step held
    at ``decay_steps``; with ``cycle``, ``decay_steps`` grows to the first multiple of
    itself at or past the step."""

    def __init__(self, initial_learning_rate, decay_steps, end_learning_rate=0.0001,
                 power=1.0, cycle=False, name="PolynomialDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.end_learning_rate = end_learning_rate
        self.power = power
        self.cycle = cycle
        self.name = name
        _check_steps("decay_steps", decay_steps)

    def __call__(self, step):
        s = _step(step)
        steps = float(self.decay_steps)
        if self.cycle:
            steps = steps * np.where(s == 0, 1.0, np.ceil(s / steps))
        else:
            s = np.minimum(s, steps)
        p = s / steps
        initial, end = float(self.initial_learning_rate), float(self.end_learning_rate)
        return _out((initial - end) * np.power(1 - p, float(self.power)) + end)

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "end_learning_rate": self.end_learning_rate,
                "power": self.power, "cycle": self.cycle, "name": self.name}


class InverseTimeDecay(LearningRateSchedule):
    """``initial_learning_rate / (1 + decay_rate * step / decay_steps)`` (the quotient
    floored with ``staircase``)."""

    def __init__(self, initial_learning_rate, decay_steps, decay_rate, staircase=False,
                 name="InverseTimeDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.decay_rate = decay_rate
        self.staircase = staircase
        self.name = name
        _check_steps("decay_steps", decay_steps)

    def __call__(self, step):
        p = _step(step) / float(self.decay_steps)
        if self.staircase:
            p = np.floor(p)
        return _out(float(self.initial_learning_rate) / (1.0 + float(self.decay_rate) * p))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "decay_rate": self.decay_rate,
                "staircase": self.staircase, "name": self.name}


class CosineDecay(LearningRateSchedule):
    """Cosine decay with an optional linear warm-up. Without ``warmup_target``:
    ``initial * ((1 - alpha) * 0.5 * (1 + cos(pi * min(step, decay_steps) /
    decay_steps)) + alpha)``. With it: for ``warmup_steps`` steps the rate rises
    linearly from ``initial_learning_rate`` to ``warmup_target``, then decays from
    ``warmup_target`` as above over ``decay_steps`` more steps."""

    def __init__(self, initial_learning_rate, decay_steps, alpha=0.0, name="CosineDecay",
                 warmup_target=None, warmup_steps=0):
        self.initial_learning_rate = initial_learning_rate
        self.decay_steps = decay_steps
        self.alpha = alpha
        self.name = name
        self.warmup_steps = warmup_steps
        self.warmup_target = warmup_target
        _check_steps("decay_steps", decay_steps)

    def _decay(self, s, steps, start):
        alpha = float(self.alpha)
        cosine = 0.5 * (1.0 + np.cos(math.pi * (s / steps)))
        return start * ((1 - alpha) * cosine + alpha)

    def __call__(self, step):
        s, steps = _step(step), float(self.decay_steps)
        initial = float(self.initial_learning_rate)
        if self.warmup_target is None:
            return _out(self._decay(np.minimum(s, steps), steps, initial))
        target, warm = float(self.warmup_target), float(self.warmup_steps)
        s = np.minimum(s, steps + warm)
        with np.errstate(divide="ignore", invalid="ignore"):
            warming = (target - initial) * (s / warm) + initial
        return _out(np.where(s < warm, warming, self._decay(s - warm, steps, target)))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "decay_steps": self.decay_steps, "alpha": self.alpha, "name": self.name,
                "warmup_target": self.warmup_target, "warmup_steps": self.warmup_steps}


class CosineDecayRestarts(LearningRateSchedule):
    """Cosine decay with warm restarts (SGDR): the multiplier decays from 1 to
    ``alpha`` over ``first_decay_steps`` steps, then restarts; each period is ``t_mul``
    times longer than the last and starts at ``m_mul`` times its rate."""

    def __init__(self, initial_learning_rate, first_decay_steps, t_mul=2.0, m_mul=1.0,
                 alpha=0.0, name="SGDRDecay"):
        self.initial_learning_rate = initial_learning_rate
        self.first_decay_steps = first_decay_steps
        self._t_mul = t_mul
        self._m_mul = m_mul
        self.alpha = alpha
        self.name = name
        _check_steps("first_decay_steps", first_decay_steps)

    def __call__(self, step):
        fraction = _step(step) / float(self.first_decay_steps)
        t_mul, m_mul, alpha = float(self._t_mul), float(self._m_mul), float(self.alpha)
        if t_mul == 1.0:
            restart = np.floor(fraction)
            fraction = fraction - restart
        else:
            restart = np.floor(np.log(1.0 - fraction * (1.0 - t_mul)) / math.log(t_mul))
            done = (1.0 - np.power(t_mul, restart)) / (1.0 - t_mul)
            fraction = (fraction - done) / np.power(t_mul, restart)
        cosine = 0.5 * np.power(m_mul, restart) * (1.0 + np.cos(math.pi * fraction))
        return _out(float(self.initial_learning_rate) * ((1 - alpha) * cosine + alpha))

    def get_config(self) -> dict:
        return {"initial_learning_rate": self.initial_learning_rate,
                "first_decay_steps": self.first_decay_steps, "t_mul": self._t_mul,
                "m_mul": self._m_mul, "alpha": self.alpha, "name": self.name}


# --- how optimizers call a learning rate -----------------------------------------------

def rate_at(lr, step) -> float:
    """The rate of ``lr`` (a number, a :class:`LearningRateSchedule` called with
    ``step``, or a plain callable called with no arguments, as Keras 3 calls them) as a
    float."""
    if isinstance(lr, LearningRateSchedule):
        lr = lr(step)
    elif callable(lr):
        lr = lr()
    return float(to_host(lr)) if not isinstance(lr, (int, float)) else float(lr)


def check_learning_rate(value) -> None:
    """Raise unless ``value`` is a positive finite number, a schedule, or a callable
    that takes no arguments."""
    if isinstance(value, LearningRateSchedule) or not callable(value):
        if not callable(value):
            _check_positive("learning_rate", value)
        return
    try:
        inspect.signature(value).bind()
    except TypeError:
        raise TypeError(
            f"learning_rate {value!r} needs arguments, but a callable learning rate is "
            "called with none (as in Keras 3); for a rate that depends on the step, "
            "subclass gs.optimizers.schedules.LearningRateSchedule (its __call__(step) is "
            "given iterations) or use one of its schedules") from None
    except ValueError:   # no signature to read (a builtin): it is called as it is
        pass


def _check_positive(what: str, value) -> None:
    ok = False
    if not isinstance(value, (str, bytes)):  # float("0.1") would take a string
        try:
            number = float(value)
        except (TypeError, ValueError):
            pass
        else:
            ok = 0 < number < math.inf
    if not ok:
        raise ValueError(f"{what} must be a positive finite number or a callable "
                         f"schedule, got {value!r}")


#: The schedules :func:`deserialize` knows by class name.
_BUILTIN = {c.__name__: c for c in (ExponentialDecay, PiecewiseConstantDecay,
                                    PolynomialDecay, InverseTimeDecay, CosineDecay,
                                    CosineDecayRestarts)}


def serialize(schedule: LearningRateSchedule) -> dict:
    """``{"class_name": ..., "config": ...}`` of a schedule (JSON-compatible when its
    config is)."""
    if not isinstance(schedule, LearningRateSchedule):
        raise TypeError(f"serialize takes a LearningRateSchedule, got {schedule!r}")
    return {"module": "gpustrat.optimizers.schedules",
            "class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(config: dict, custom_objects: dict | None = None) -> LearningRateSchedule:
    """The schedule :func:`serialize` described (``custom_objects``: name -> class for
    schedules of your own)."""
    known = {**_BUILTIN, **(custom_objects or {})}
    try:
        name, args = config["class_name"], config["config"]
    except (TypeError, KeyError):
        raise ValueError(f"deserialize takes {{'class_name': ..., 'config': ...}}, got "
                         f"{config!r}") from None
    cls = known.get(name)
    if cls is None:
        raise ValueError(f"unknown learning rate schedule {name!r}: the built-in ones are "
                         f"{sorted(_BUILTIN)}; pass custom_objects={{{name!r}: TheClass}} "
                         "for one of your own")
    return cls.from_config(args)
