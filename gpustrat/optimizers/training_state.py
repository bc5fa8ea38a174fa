"""Gradient accumulation and the exponential moving average of the weights (EMA), on
every optimizer, as Keras 3 writes them (``gradient_accumulation_steps``, ``use_ema``,
``ema_momentum``, ``ema_overwrite_frequency``).

Words:
- *accumulation*: with ``gradient_accumulation_steps = n``, a step whose number (from
  1) is not a multiple of ``n`` only adds each replica's gradients to its accumulator;
  the n-th step applies ``(accumulated + gradient) / n`` (clipped and decayed then, as
  Keras clips and decays on the applying step only) and empties the accumulators.
  The updates, ``optimizer.iterations``, are the calls divided by n, as Keras counts
  them (a schedule and bias corrections see those); the step counter a checkpoint
  saves counts every call (Keras's ``_iterations``). The accumulator is the
  ``"gradient_accumulator"`` slot: a
  sync-on-read SUM variable, each replica holding the sum of its own gradients, so a
  step that does not apply needs no communication at all; its read (a checkpoint) is
  the sum over every replica, the accumulated gradient Keras keeps, and the applying
  step's one fused reduction sums the replicas' accumulators with their last
  gradients. Every worker agrees on the step (iterations) at the applying step's
  reduction.
- *EMA*: after every step (also one that only accumulates), the ``"average"`` slot of
  each variable becomes ``m * average + (1 - m) * w`` with ``m = ema_momentum`` (0
  while no update has been counted, so the average starts at the weights); when the
  updates so far plus one are a multiple of ``ema_overwrite_frequency`` the weights are
  set to their averages, and
  :meth:`~gpustrat.optimizers.Optimizer.finalize_variable_values` sets them at the end.
"""

from __future__ import annotations

import contextlib
import math

import numpy as np

from gpustrat.distribute.variables import VariableAggregation, VariableSynchronization

_NO_CONTEXT = contextlib.nullcontext()

ACCUMULATOR = "gradient_accumulator"
AVERAGE = "average"

#: The slots these features add (they start at zero).
SLOTS = (ACCUMULATOR, AVERAGE)
#: Extra slots' synchronization and aggregation (the accumulator is per replica).
SLOT_KINDS = {ACCUMULATOR: (VariableSynchronization.ON_READ, VariableAggregation.SUM)}


def check(gradient_accumulation_steps, use_ema, ema_momentum, ema_overwrite_frequency):
    """The checked settings, as Keras checks them (messages in Keras's words)."""
    steps = gradient_accumulation_steps
    if steps:
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or \
                not steps >= 2:
            raise ValueError("`gradient_accumulation_steps` must be an integer >= 2. "
                             f"Received: gradient_accumulation_steps={steps}")
        steps = int(steps)
    else:
        steps = None
    momentum = float(ema_momentum)
    freq = ema_overwrite_frequency
    if use_ema:
        if not 0 <= momentum <= 1 or math.isnan(momentum):
            raise ValueError("`ema_momentum` must be in the range [0, 1]. Received: "
                             f"ema_momentum={ema_momentum}")
        if freq and (isinstance(freq, bool) or not isinstance(freq, (int, np.integer))
                     or freq < 1):
            raise ValueError("`ema_overwrite_frequency` must be an integer >= 1 or None. "
                             f"Received: ema_overwrite_frequency={freq}")
    return steps, bool(use_ema), momentum, (int(freq) if freq else None)


def extra_slots(optimizer) -> tuple:
    """The slots these features keep (beside the algorithm's)."""
    out = ()
    if optimizer.gradient_accumulation_steps:
        out += (ACCUMULATOR,)
    if optimizer.use_ema:
        out += (AVERAGE,)
    return out


def _each(plan, name: str):
    """``(device, [(component array, slot array)])`` per local replica, flat arenas as
    one pair when the plan has them."""
    for i in range(plan.n_local):
        dev = plan.devices[i][0]
        if plan.flat is not None:
            yield dev, [(plan.flat.params[i], plan.flat.slots[i][name])]
        else:
            yield dev, [(c._array, s[name]._array)
                        for c, s in zip(plan.comps[i], plan.slot_comps[i])]


def _activate(dev):
    return dev.activate() if dev.is_gpu else _NO_CONTEXT


def accumulate(optimizer, plan, per_replica: list, applying: bool, step_args_type):
    """Before a step's reduction: add every replica's gradients to its accumulator
    (``applying`` False), or make them ``(accumulated + gradient) / steps`` (True: in
    place when they are the plan's gradient buffers). Returns the replicas' step
    arguments to go on with (None: the step ends here)."""
    steps = optimizer.gradient_accumulation_steps
    arenas = plan.buffer_arenas([a.grads for a in per_replica])
    if arenas is not None and plan.flat is not None:
        for i, arena in enumerate(arenas):
            acc = plan.flat.slots[i][ACCUMULATOR]
            with _activate(plan.devices[i][0]):
                if applying:
                    arena += acc
                    arena /= steps
                else:
                    acc += arena
        return per_replica if applying else None
    if len(per_replica) == 1:
        tensors = plan.gradients(per_replica[0].grads)
    else:
        tensors = plan.gradients_by_replica([a.grads for a in per_replica])
    if plan.flat is not None and not applying:
        # Each replica's gradients packed into one flat buffer (one call), added to its
        # flat accumulator at once.
        for i, flat in enumerate(plan.flat.concatenate(tensors)):
            with _activate(plan.devices[i][0]):
                plan.flat.slots[i][ACCUMULATOR] += flat
        return None
    out = []
    for i in range(plan.n_local):
        grads = []
        for j, slots in enumerate(plan.slot_comps[i]):
            acc = slots[ACCUMULATOR]._array
            with _activate(plan.devices[i][j]):
                if applying:
                    grads.append((acc + tensors[j][i]) / steps)
                else:
                    acc += tensors[j][i]
        out.append(step_args_type(grads, per_replica[0].variables))
    return out if applying else None


def reset(plan) -> None:
    """Empty every accumulator (after the applying step)."""
    for dev, pairs in _each(plan, ACCUMULATOR):
        with _activate(dev):
            for _, acc in pairs:
                acc[...] = 0


def average(optimizer, plan, iterations: int) -> None:
    """The EMA of a step taken with ``iterations`` (Keras's: updates so far, before this
    step's count), and the overwrite when ``iterations + 1`` is a multiple of the
    frequency (with accumulation, at every call while it is)."""
    m = optimizer.ema_momentum if iterations != 0 else 0.0
    freq = optimizer.ema_overwrite_frequency
    overwrite = bool(freq) and (iterations + 1) % freq == 0
    for dev, pairs in _each(plan, AVERAGE):
        with _activate(dev):
            for w, avg in pairs:
                if m:
                    avg *= m
                    avg += (1 - m) * w
                else:
                    avg[...] = w
                if overwrite:
                    w[...] = avg


def finalize(optimizer, variables) -> None:
    """Set each variable (that has an average) to its average."""
    for v in variables:
        slots = optimizer._slots.get(v)
        if slots is None or AVERAGE not in slots:
            continue
        v.assign(slots[AVERAGE].read_value())


def config(optimizer) -> dict:
    """The settings for ``get_config`` (always, as Keras's config has them)."""
    return {"use_ema": optimizer.use_ema, "ema_momentum": optimizer.ema_momentum,
            "ema_overwrite_frequency": optimizer.ema_overwrite_frequency,
            "gradient_accumulation_steps": optimizer.gradient_accumulation_steps}
