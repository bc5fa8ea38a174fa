"""Dynamic loss scaling for float16 training (``keras.optimizers.LossScaleOptimizer``).

Words:
- *scale*: the factor the loss is multiplied by (:meth:`LossScaleOptimizer.scale_loss`)
  so that small float16 gradients do not flush to zero; the gradients are divided by it
  again before the update.
- *skip*: a step whose summed gradients hold an inf or a NaN is not applied (no
  variable, slot or ``iterations`` changes) and halves the scale; after
  ``dynamic_growth_steps`` applied steps in a row the scale doubles.
- *the decision*: made on the gradients summed over every replica in sync, after the
  step's one fused reduction, so it is the same on every replica and worker without a
  collective of its own (the sum of an inf or a NaN is not finite; workers never
  diverge). Keras under tf.distribute checks the first replica's own gradients.
"""

from __future__ import annotations

import math

import numpy as np

from gpustrat.devices import array_module, on_device_of, to_host
from gpustrat.distribute import context
from gpustrat.distribute.distributed_variables import DistributedVariable, zeros
from gpustrat.distribute.variables import VariableAggregation
from gpustrat.optimizers.base import COMMON_SETTINGS, Optimizer


class LossScaleOptimizer:
    """An optimizer that scales the loss and unscales the gradients, skipping steps
    whose gradients overflow (see the module docstring).

    Args:
        inner_optimizer: the optimizer that applies the unscaled gradients (it belongs
            to this one from now on).
        initial_scale: the first scale (default ``2 ** 15``, as Keras).
        dynamic_growth_steps: applied steps in a row after which the scale doubles
            (default 2000).
        name: a name (default the inner optimizer's, prefixed "loss_scale_").

    Raises:
        ValueError: an argument Keras leaves to the inner optimizer (``clipnorm``, ...),
            ``dynamic=False``, an inner optimizer with ``gradient_accumulation_steps``,
            or a scale or growth steps that are not positive.
    """

    _checkpoint_per_worker = False
    _checkpoint_by_variable_keys = True

    def __init__(self, inner_optimizer, initial_scale=2.0 ** 15, dynamic_growth_steps=2000,
                 name=None, **kwargs):
        if not kwargs.pop("dynamic", True):
            raise ValueError("LossScaleOptimizer no longer supports `dynamic=False` (as "
                             "Keras 3): for a fixed scale, multiply the loss by it and "
                             "divide the gradients by it before apply_gradients")
        for arg, default in COMMON_SETTINGS.items():
            if arg in kwargs and kwargs.pop(arg) != default:
                raise ValueError(f"LossScaleOptimizer does not support `{arg}`. Instead, "
                                 f"set `{arg}` on the `inner_optimizer`.")
        if kwargs:
            raise ValueError("LossScaleOptimizer does not support arguments: "
                             f"`{'`, `'.join(kwargs)}`.")
        if not isinstance(inner_optimizer, Optimizer):
            raise TypeError(f"LossScaleOptimizer wraps a gs.optimizers optimizer, got "
                            f"{inner_optimizer!r}")
        if inner_optimizer.gradient_accumulation_steps:
            raise ValueError("LossScaleOptimizer over an optimizer with "
                             "gradient_accumulation_steps is not supported: the scale may "
                             "change between the accumulated steps")
        if inner_optimizer._summed_gate is not None:
            raise ValueError(f"{inner_optimizer!r} already belongs to a LossScaleOptimizer")
        if not float(initial_scale) > 0 or not np.isfinite(float(initial_scale)):
            raise ValueError(f"initial_scale must be a positive finite number, got "
                             f"{initial_scale!r}")
        if isinstance(dynamic_growth_steps, bool) or int(dynamic_growth_steps) < 1 or \
                int(dynamic_growth_steps) != dynamic_growth_steps:
            raise ValueError(f"dynamic_growth_steps must be an integer >= 1, got "
                             f"{dynamic_growth_steps!r}")
        self.inner_optimizer = inner_optimizer
        self.initial_scale = float(initial_scale)
        self.dynamic_growth_steps = int(dynamic_growth_steps)
        self.name = name or f"loss_scale_{inner_optimizer.name}"
        strategy, replica_ctx = context.current()
        if replica_ctx is not None and strategy is not None:
            raise RuntimeError("make the optimizer in cross-replica context (inside "
                               "strategy.scope(), outside strategy.run)")
        agg = VariableAggregation.ONLY_FIRST_REPLICA
        self.step_counter = zeros(strategy, (), np.int64, f"{self.name}/step_counter",
                                  agg=agg)
        self.dynamic_scale = zeros(strategy, (), np.float32, f"{self.name}/dynamic_scale",
                                   agg=agg)
        self._held = None
        self._set(self.initial_scale, 0)    # held on the host too: no read back
        inner_optimizer._summed_gate = self._gate

    # --- what Keras's LossScaleOptimizer shows --------------------------------------------
    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self) -> float:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        self.inner_optimizer.learning_rate = value

    @property
    def variables(self) -> list:
        return [self.step_counter, self.dynamic_scale] + self.inner_optimizer.variables

    def scale_loss(self, loss):
        """``loss * scale`` (the scale now)."""
        return loss * self._state()[0]

    def apply_gradients(self, grads_and_vars, name=None,
                        skip_gradients_aggregation: bool = False):
        """The inner optimizer's step on the gradients divided by the scale, or no step
        when their sum holds an inf or a NaN; returns ``iterations``."""
        return self.inner_optimizer.apply_gradients(grads_and_vars, name,
                                                    skip_gradients_aggregation)

    def gradient_buffers(self, variables) -> list:
        return self.inner_optimizer.gradient_buffers(variables)

    def get_slot(self, var, name: str):
        return self.inner_optimizer.get_slot(var, name)

    def finalize_variable_values(self, var_list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

    def get_config(self) -> dict:
        inner = self.inner_optimizer
        return {"name": self.name,
                "inner_optimizer": {"class_name": type(inner).__name__,
                                    "config": inner.get_config()},
                "initial_scale": self.initial_scale,
                "dynamic_growth_steps": self.dynamic_growth_steps}

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None):
        from gpustrat import optimizers  # noqa: PLC0415
        config = dict(config)
        inner = config.pop("inner_optimizer")
        known = {**{n: getattr(optimizers, n) for n in optimizers.__all__
                    if isinstance(getattr(optimizers, n), type)}, **(custom_objects or {})}
        kind = known.get(inner["class_name"])
        if kind is None:
            raise ValueError(f"unknown optimizer {inner['class_name']!r}: pass "
                             "custom_objects={name: class} for one of your own")
        return cls(kind.from_config(inner["config"], custom_objects), **config)

    def __repr__(self) -> str:
        return (f"LossScaleOptimizer({self.inner_optimizer!r}, scale="
                f"{self._state()[0]:g})")

    # --- the decision, in the step's merge ---------------------------------------------------
    def _gate(self, sums: list, flat: bool):
        """The unscaled sums to apply, or None (a skipped step): ``sums`` are the
        step's summed gradients, ``[(indices, [flat sum per replica])]`` when ``flat``,
        else ``out[j][i]``; every replica's sums are equal, so the first replica's
        decide."""
        scale, count = self._state()
        firsts = [grads[0] for _, grads in sums] if flat else [row[0] for row in sums]
        if not _all_finite(firsts):
            self._set(scale * 0.5, 0)
            return None
        inv = 1.0 / scale
        if flat:
            for k, (indices, grads) in enumerate(sums):
                done: dict = {}
                for g in grads:     # a sum the replicas share is unscaled once
                    if id(g) not in done:
                        done[id(g)] = _unscale_in_place(g, inv)
                sums[k] = (indices, [done[id(g)] for g in grads])
        else:
            sums = [[_scaled(t, inv) for t in row] for row in sums]
        if count == self.dynamic_growth_steps - 1:
            self._set(scale * 2.0, 0)
        else:
            self._set(scale, count + 1)
        return sums

    def _state(self) -> tuple:
        """``(scale, step counter)`` on the host: kept with the write counts of the
        variables' first components, read again after a write from outside (an assign,
        a restore)."""
        s, c = _first(self.dynamic_scale), _first(self.step_counter)
        held = self._held
        if held is None or held[2] != s._writes or held[3] != c._writes:
            held = self._held = (float(to_host(s.read_value())),
                                 int(to_host(c.read_value())), s._writes, c._writes)
        return held[0], held[1]

    def _set(self, scale: float, count: int) -> None:
        held = self._held
        scale = float(np.float32(scale))
        if held is None or held[0] != scale:    # the scale changes rarely
            self._write(self.dynamic_scale, scale)
        self._write(self.step_counter, count)
        s, c = _first(self.dynamic_scale), _first(self.step_counter)
        self._held = (scale, int(count), s._writes, c._writes)

    @staticmethod
    def _write(var, value) -> None:
        arr = np.asarray(value, var.dtype)
        for comp in (var.values if isinstance(var, DistributedVariable) else (var,)):
            comp._write("assign", arr)

    # --- checkpointing -------------------------------------------------------------------------
    def _checkpoint_state(self, keys=None) -> dict:
        inner = self.inner_optimizer
        return {"inner": inner._checkpoint_state(keys), "dynamic_scale": self.dynamic_scale,
                "step_counter": self.step_counter}

    def _restore_checkpoint_state(self, state: dict, keys=None) -> None:
        self._prepare_checkpoint_restore(state, keys)()

    def _prepare_checkpoint_restore(self, state: dict, keys=None):
        for k in ("inner", "dynamic_scale", "step_counter"):
            if k not in state:
                raise ValueError(f"LossScaleOptimizer {self.name!r}: the checkpoint holds "
                                 f"no {k!r} (it was not saved from a LossScaleOptimizer)")
        inner = self.inner_optimizer._prepare_checkpoint_restore(state["inner"], keys)
        scale = np.asarray(state["dynamic_scale"])
        count = np.asarray(state["step_counter"])
        if scale.shape != () or count.shape != () or not np.isfinite(scale) or \
                not scale > 0 or count.dtype.kind not in "iu":
            raise ValueError(f"LossScaleOptimizer {self.name!r}: the checkpoint's scale "
                             f"{scale!r} and step counter {count!r} are not a positive "
                             "scale and an integer count")

        def write() -> None:
            inner()
            self._set(float(scale), int(count))
        return write


def _first(var):
    return var.values[0] if isinstance(var, DistributedVariable) else var


def _all_finite(arrays: list) -> bool:
    """Whether every element of every array (one replica's, on one device) is finite,
    with one number read back to the host: a reduction per array whose result is finite
    only if each element is, added up on the arrays' device. On the host it is the dot
    product of a contiguous float32 or float64 array with itself (one BLAS pass, three
    times faster than NumPy's sum); on a GPU, the sum (one reduction kernel, no cuBLAS),
    in float32 for narrower floats. Only when the total is not finite (an inf or a NaN,
    or large finite values overflowing it) are the elements checked one by one."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = None
        for x in arrays:
            if type(x) is np.ndarray and x.dtype.itemsize >= 4 and x.flags.c_contiguous:
                flat = x.reshape(-1)
                probe = np.dot(flat, flat)
            else:
                with on_device_of(x):
                    probe = x.sum(dtype=np.float32 if x.dtype.itemsize < 4 else x.dtype)
            total = probe if total is None else total + probe
        if math.isfinite(float(to_host(total))):
            return True
        for x in arrays:
            with on_device_of(x):
                if not bool(to_host(array_module(x).isfinite(x).all())):
                    return False
        return True


def _unscale_in_place(g, inv: float):
    """``g * inv`` written into ``g`` (the step's own summed buffer: one that the local
    replicas share is read-only to the update, and writable again here), or a new
    array where ``g`` cannot be written."""
    if type(g) is np.ndarray and not g.flags.writeable:
        try:
            g.flags.writeable = True
        except ValueError:
            return _scaled(g, inv)
        np.multiply(g, g.dtype.type(inv), out=g)
        g.flags.writeable = False
        return g
    with on_device_of(g):
        g *= g.dtype.type(inv)
    return g


def _scaled(t, inv: float):
    with on_device_of(t):
        return t * t.dtype.type(inv)
