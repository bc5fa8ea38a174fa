"""An optimizer's checkpoint state, and the checks a restore makes before it writes.

Words:
    state tree: what an optimizer saves: ``iterations``; ``config``, its settings
        (:meth:`Optimizer.get_config` without the name and learning rate), so that a
        restore that cannot take the slots can say which setting differs; and
        ``slots``, each trained variable's slots by slot name.
    all or nothing: a restore first checks everything it was given (every slot's name,
        shape and dtype against this optimizer and its variables, ``iterations``), and
        only then writes; a check that fails restores nothing.

Both the local optimizer (:mod:`gpustrat.optimizers.base`) and one whose state lives on
parameter servers (:mod:`gpustrat.distribute.parameter_server.optimizers`) use these.
"""

from __future__ import annotations

import numpy as np


def config_of(optimizer) -> dict:
    """The settings a checkpoint records: JSON numbers, strings, bools and lists of
    them from ``get_config()``, without the name and the learning rate."""
    out = {}
    for k, v in optimizer.get_config().items():
        if k in ("name", "learning_rate"):
            continue
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, (bool, int, float, str)) or (
                isinstance(v, list) and all(isinstance(x, (bool, int, float, str))
                                            for x in v)):
            out[k] = v
    return out


def saved_iterations(optimizer, state: dict) -> np.ndarray:
    """The saved step count as an int64 0-d array; a ValueError unless it is one."""
    value = np.asarray(state["iterations"])
    if value.shape != () or value.dtype.kind not in "iu":
        raise ValueError(f"{_who(optimizer)}: the checkpoint's iterations is "
                         f"{value.dtype} of shape {value.shape}, not an integer count")
    return value.astype(np.int64)


def check_slot_names(optimizer, state: dict, what: str, saved: dict) -> None:
    """Raise unless every slot in ``saved`` (the slots of ``what``, a variable) is one
    this optimizer keeps. A slot this optimizer keeps that the checkpoint lacks starts
    at zero, as made by a first step."""
    extra = [s for s in saved if s not in optimizer.slot_names]
    if not extra:
        return
    raise ValueError(
        f"{_who(optimizer)} keeps slots {list(optimizer.slot_names)}, but the checkpoint "
        f"holds slot{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} for "
        f"{what}{_settings_hint(optimizer, state)}; nothing was restored")


def check_slot_values(optimizer, what: str, var, saved: dict) -> None:
    """Raise unless every saved slot value has ``var``'s shape and dtype (a slot is
    never cast: the checkpoint and the variable must agree)."""
    for s, value in saved.items():
        shape, dtype = tuple(np.shape(value)), np.asarray(value).dtype
        if shape != tuple(var.shape) or dtype != var.dtype:
            raise ValueError(
                f"{_who(optimizer)}: the checkpoint's slot {s!r} of {what} is {dtype} of "
                f"shape {shape}, but the variable is {var.dtype} of shape "
                f"{tuple(var.shape)}; nothing was restored: restore into variables of the "
                "saved dtypes and shapes")


def zeros_for(saved: dict, slot_names, var) -> dict:
    """``saved`` with a zero value for each slot of ``slot_names`` it lacks (a slot the
    checkpoint did not keep starts afresh, also in an optimizer that has stepped)."""
    out = dict(saved)
    for s in slot_names:
        if s not in out:
            out[s] = np.zeros(var.shape, var.dtype)
    return out


def _who(optimizer) -> str:
    return f"{type(optimizer).__name__} {optimizer.name!r}"


def _settings_hint(optimizer, state: dict) -> str:
    saved = state.get("config")
    if not isinstance(saved, dict):
        return (": make the optimizer with the settings that keep those slots (such as "
                "Adam's amsgrad=True for 'vhat', SGD's momentum > 0 for 'momentum')")
    here = config_of(optimizer)
    differ = [k for k in saved if k in here and here[k] != saved[k]]
    if not differ:
        return ""
    return (f" (it was saved with {', '.join(f'{k}={saved[k]!r}' for k in differ)}; this "
            f"optimizer has {', '.join(f'{k}={here[k]!r}' for k in differ)}): make the "
            "optimizer with the saved settings")
