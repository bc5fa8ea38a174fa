"""An optimizer's checkpoint state, and the checks a restore makes before it writes.

Words:
    state tree: what an optimizer saves: ``iterations``; ``learning_rate``, the
        current rate when it is a number (set between steps, it is not the
        constructor's), as Keras 3 saves its learning-rate variable, or
        ``learning_rate_schedule``, a schedule's ``serialize()`` (its rate follows from
        ``iterations``; a restore keeps the restoring optimizer's own schedule); ``config``, its
        settings (:meth:`Optimizer.get_config` without the name and learning rate), so
        that a restore that cannot take the slots can say which setting differs; and
        each trained variable's slots (by slot name), under ``variable_slots`` keyed by
        the variable's checkpoint key (its path in the Checkpoint,
        ``"model/layers/0/kernel"``) or, for a variable the Checkpoint does not hold,
        under ``named_slots`` keyed by
        the variable's name. Names are not unique (every unnamed ``gs.Variable`` is
        "Variable", a model has several "kernel"), keys are: a slot belongs to the
        variable the restoring Checkpoint reaches by the same path, as in TensorFlow's
        object graph. Trees written before keys were used have ``slots`` keyed by name.
    all or nothing: a restore first checks everything it was given (every slot's name,
        shape and dtype against this optimizer and its variables, ``iterations``, which
        variable each slot belongs to), and only then writes; a check that fails
        restores nothing.
    pending slots: restored slots of variables this optimizer has not trained yet:
        assigned when the first step that trains the variable makes its slots (as
        TensorFlow defers a restore to the slot's creation), and saved again as they
        were read until then.

Both the local optimizer (:mod:`gpustrat.optimizers.base`) and one whose state lives on
parameter servers (:mod:`gpustrat.distribute.parameter_server.optimizers`) use these.
"""

from __future__ import annotations

import numpy as np

from gpustrat.optimizers import schedules, training_state


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


def learning_rate_of(optimizer) -> dict:
    """``{"learning_rate": rate}`` for the state tree when the rate is a number;
    ``{"learning_rate_schedule": serialize(schedule)}`` for a schedule that has a
    config (a restore leaves the restoring optimizer's rate or schedule as it is:
    ``iterations`` carries the schedule on); else an empty dict."""
    lr = optimizer._learning_rate
    if isinstance(lr, schedules.LearningRateSchedule):
        try:
            return {"learning_rate_schedule": schedules.serialize(lr)}
        except NotImplementedError:   # a schedule without get_config: not described
            return {}
    return {} if callable(lr) else {"learning_rate": float(lr)}


def saved_learning_rate(optimizer, state: dict):
    """The saved rate to set, or None: none saved (a schedule, an older checkpoint), or
    this optimizer has a schedule (which keeps its own rates, as in Keras 3)."""
    lr = state.get("learning_rate")
    if lr is None or callable(optimizer._learning_rate):
        return None
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise ValueError(f"{_who(optimizer)}: the checkpoint's learning_rate {lr!r} is not "
                         "a positive finite number")
    return float(lr)


def saved_iterations(optimizer, state: dict) -> np.ndarray:
    """The saved step count as an int64 0-d array; a ValueError unless it is one."""
    value = np.asarray(state["iterations"])
    if value.shape != () or value.dtype.kind not in "iu":
        raise ValueError(f"{_who(optimizer)}: the checkpoint's iterations is "
                         f"{value.dtype} of shape {value.shape}, not an integer count")
    return value.astype(np.int64)


def kept(optimizer) -> tuple:
    """The slots ``optimizer`` keeps: its algorithm's and those of accumulation and EMA."""
    names = getattr(optimizer, "kept_slot_names", None)
    return tuple(optimizer.slot_names if names is None else names)


def _slot_shape(optimizer, name: str, var) -> tuple:
    shape = getattr(optimizer, "slot_shape", None)
    return tuple(var.shape) if shape is None else tuple(shape(name, tuple(var.shape)))


def renamed(optimizer, saved: dict) -> dict:
    """``saved`` (one variable's slots by name) with each former slot name of the
    optimizer (``former_slot_names``, such as Adam's ``"m"``) replaced by its name now."""
    former = getattr(optimizer, "former_slot_names", None)
    if not former or not any(s in former for s in saved):
        return saved
    return {former.get(s, s): value for s, value in saved.items()}


def check_slot_names(optimizer, state: dict, what: str, saved: dict) -> None:
    """Raise unless every slot in ``saved`` (the slots of ``what``, a variable) is one
    this optimizer keeps. A slot this optimizer keeps that the checkpoint lacks starts
    afresh, as made by a first step."""
    extra = [s for s in saved if s not in kept(optimizer)]
    if not extra:
        return
    raise ValueError(
        f"{_who(optimizer)} keeps slots {list(kept(optimizer))}, but the checkpoint "
        f"holds slot{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))} for "
        f"{what}{_settings_hint(optimizer, state)}; nothing was restored")


def check_slot_values(optimizer, what: str, var, saved: dict) -> None:
    """Raise unless every saved slot value has ``var``'s shape and dtype (a slot is
    never cast: the checkpoint and the variable must agree)."""
    for s, value in saved.items():
        shape, dtype = tuple(np.shape(value)), np.asarray(value).dtype
        want = _slot_shape(optimizer, s, var)
        if shape != want or dtype != var.dtype:
            raise ValueError(
                f"{_who(optimizer)}: the checkpoint's slot {s!r} of {what} is {dtype} of "
                f"shape {shape}, but the variable is {var.dtype} of shape "
                f"{tuple(var.shape)}{'' if want == tuple(var.shape) else f' (slot {want})'}"
                "; nothing was restored: restore into variables of the saved dtypes and "
                "shapes")


def zeros_for(saved: dict, optimizer, var) -> dict:
    """``saved`` with a fresh value (the optimizer's initial one, mostly zero) for each
    of its slots it lacks (a slot the checkpoint did not keep starts afresh, also in an
    optimizer that has stepped)."""
    out = dict(saved)
    for s in kept(optimizer):
        if s not in out:
            start = 0.0 if s in training_state.SLOTS else optimizer.slot_initial_value(s)
            out[s] = np.full(_slot_shape(optimizer, s, var), start, var.dtype)
    return out


class Pending:
    """Restored slots that wait for their variable's first step (see the module
    docstring): ``by_var`` for a variable of the restoring Checkpoint, ``by_key`` for a
    key the restoring Checkpoint does not hold (saved again only), ``by_name`` for a
    variable the saving Checkpoint did not hold; ``claimed`` the names a variable took
    slots by."""

    def __init__(self):
        self.by_var: dict = {}
        self.by_key: dict = {}
        self.by_name: dict = {}
        self.claimed: dict = {}

    def take(self, optimizer, variables: list) -> dict:
        """The pending slots of ``variables`` (about to get their slots) by variable,
        checked, then taken out of this; raises before anything is taken when a slot
        does not fit its variable or when slots kept by name could go to several
        variables."""
        out, by_name = {}, {}
        for v in variables:
            saved = self.by_var.get(v)
            if saved is None and (v.name in self.by_name or v.name in self.claimed):
                other = by_name.get(v.name) or self.claimed.get(v.name)
                if other is not None and other is not v:
                    raise ValueError(_ambiguous(optimizer, v.name, 2))
                by_name[v.name] = v
                saved = self.by_name.get(v.name)
            if saved is not None:
                what = f"variable {v.name!r}"
                check_slot_names(optimizer, {}, what, saved)
                check_slot_values(optimizer, what, v, saved)
                out[v] = saved
        for v in out:
            self.by_var.pop(v, None)
        for name, v in by_name.items():
            self.by_name.pop(name, None)
            self.claimed[name] = v
        return out

    def __bool__(self) -> bool:
        return bool(self.by_var or self.by_key or self.by_name or self.claimed)


def saved_slots(optimizer, trained: list, keys, pending: "Pending | None") -> dict:
    """The ``variable_slots`` and ``named_slots`` of the state tree, from ``trained``
    (``[(variable, {slot name: value})]``, the optimizer's variables in order) and the
    pending slots (saved again as they were read). ``keys``: the saving Checkpoint's
    :class:`~gpustrat.train.graph.VariableKeys`, or None (every variable by name).

    Raises:
        ValueError: two variables the Checkpoint does not hold have the same name (their
            slots could not be told apart on restore).
    """
    by_key, by_name, untracked = {}, {}, {}
    pending = pending or Pending()
    rows = list(trained) + [(v, s) for v, s in pending.by_var.items()]
    for var, slots in rows:
        key = keys.key_of(var) if keys is not None else None
        if key is not None:
            by_key.setdefault(key, dict(slots))
            continue
        untracked.setdefault(var.name, []).append(var)
        by_name.setdefault(var.name, dict(slots))
    twice = {n: vs for n, vs in untracked.items() if len({id(v) for v in vs}) > 1}
    if twice:
        name, vs = next(iter(twice.items()))
        raise ValueError(
            f"{_who(optimizer)} has slots for {len(vs)} variables named {name!r} that "
            "this Checkpoint does not hold, so a restore could not tell their slots "
            "apart; nothing was saved: put the variables in the Checkpoint too (e.g. "
            "Checkpoint(model=model, optimizer=optimizer)): their slots are then saved "
            "by the variables' keys; or give the variables distinct names")
    for key, slots in pending.by_key.items():
        by_key.setdefault(key, slots)
    for name, slots in pending.by_name.items():
        by_name.setdefault(name, slots)
    return {"variable_slots": by_key, "named_slots": by_name}


def match(optimizer, state: dict, keys, known: list) -> tuple:
    """Which variable each saved slot set belongs to, checked: ``(writes, pending)``
    where ``writes`` is ``[(variable, {slot name: value})]`` for variables in ``known``
    (those whose slots exist, or can be made now), with every slot of this optimizer
    (a zero for one the checkpoint lacks), and ``pending`` the rest. ``keys``: the
    restoring Checkpoint's :class:`~gpustrat.train.graph.VariableKeys`, or None.

    Raises (ValueError, before anything is written): a slot this optimizer does not
    keep, a slot of another shape or dtype than its variable, or slots kept by a name
    that several variables here have.
    """
    if "slots" in state:          # written before slots were keyed by variable keys
        by_key, by_name = {}, dict(state["slots"])
    else:
        by_key, by_name = dict(state["variable_slots"]), dict(state["named_slots"])
    by_key = {k: renamed(optimizer, saved) for k, saved in by_key.items()}
    by_name = {k: renamed(optimizer, saved) for k, saved in by_name.items()}
    known_ids = {id(v) for v in known}
    writes, pending = [], Pending()
    taken = set()

    def place(var, what: str, saved: dict) -> None:
        check_slot_values(optimizer, what, var, saved)
        taken.add(id(var))
        if id(var) in known_ids:
            writes.append((var, zeros_for(saved, optimizer, var)))
        else:
            pending.by_var[var] = dict(saved)

    for key, saved in by_key.items():
        var = keys.variable_at(key) if keys is not None else None
        what = f"the variable at checkpoint key {key!r}" if var is None else \
            f"variable {var.name!r} (checkpoint key {key!r})"
        check_slot_names(optimizer, state, what, saved)
        if var is None:
            pending.by_key[key] = dict(saved)
        else:
            place(var, what, saved)
    for name, saved in by_name.items():
        what = f"variable {name!r}"
        check_slot_names(optimizer, state, what, saved)
        found = {id(v): v for v in known if v.name == name}
        if keys is not None:
            found.update((id(v), v) for _, v in keys.named(name))
        found = [v for i, v in found.items() if i not in taken]
        if len(found) > 1:
            raise ValueError(_ambiguous(optimizer, name, len(found)))
        if found:
            place(found[0], what, saved)
            pending.claimed[name] = found[0]
        else:
            pending.by_name[name] = dict(saved)
    return writes, pending


def _ambiguous(optimizer, name: str, count: int) -> str:
    return (f"{_who(optimizer)}: the checkpoint keeps slots for a variable named {name!r} "
            f"by its name (the saving Checkpoint did not hold that variable, or was "
            f"written before slots were keyed by the variables' paths), and "
            f"{'several' if count > 2 else count} variables here are called {name!r}: "
            "which one they belong to cannot be told; nothing was restored. Save the "
            "checkpoint again with the variables in the Checkpoint beside the optimizer, "
            "or give the variables distinct names")


def _who(optimizer) -> str:
    return f"{type(optimizer).__name__} {optimizer.name!r}"


def _settings_hint(optimizer, state: dict) -> str:
    saved = state.get("config")
    if not isinstance(saved, dict):
        return (": make the optimizer with the settings that keep those slots (such as "
                "Adam's amsgrad=True for 'velocity_hat', SGD's momentum > 0 for "
                "'momentum')")
    here = config_of(optimizer)
    differ = [k for k in saved if k in here and here[k] != saved[k]]
    if not differ:
        return ""
    return (f" (it was saved with {', '.join(f'{k}={saved[k]!r}' for k in differ)}; this "
            f"optimizer has {', '.join(f'{k}={here[k]!r}' for k in differ)}): make the "
            "optimizer with the saved settings")
