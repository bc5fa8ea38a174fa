"""The optimizer base: one fused gradient reduction per step, then the same update on
every replica.

Words:
- *slot*: per-variable optimizer state (SGD's momentum, Adam's moments): a variable of
  the trained variable's shape, mirrored when the trained variable is, made on first
  use.
- *step*: one ``apply_gradients`` call. Inside ``strategy.run`` every replica calls it
  with its own gradients (it is a collective, like ``all_reduce``); the replicas meet
  once, in a ``merge_call``, where the gradients of all variables are summed over every
  replica in sync in ONE fused reduction (one collective per fusion bucket, see
  :mod:`gpustrat.collectives.fusion`) and each replica's components are updated with
  the summed gradient. The sum (not the mean) is what tf.distribute does: scale each
  replica's loss with :func:`gpustrat.nn.compute_average_loss`.

An algorithm is a subclass that names its slots and writes :meth:`Optimizer.update_step`
on plain arrays (NumPy, or CuPy on a GPU replica), in place.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import numpy as np

from gpustrat.devices import to_host
from gpustrat.distribute import context
from gpustrat.distribute.collective_ops import as_array
from gpustrat.distribute.distributed_variables import DistributedVariable, strategy_of, zeros
from gpustrat.distribute.extended import agree_tensors, describe_layouts, fused_reduce
from gpustrat.distribute.variables import Variable, VariableAggregation
from gpustrat.reduce_util import ReduceOp
from gpustrat.values import DistributedValues

#: Wire types for ``compression``.
COMPRESSIONS = {"float16": np.dtype(np.float16)}


def compression_dtype(compression) -> np.dtype | None:
    """``None``, or the dtype gradients travel in ("float16")."""
    if compression is None:
        return None
    key = str(np.dtype(compression)) if not isinstance(compression, str) else compression
    key = key.strip().lower()
    if key == "bfloat16":
        from gpustrat.optimizers import bfloat16  # noqa: PLC0415
        return bfloat16.BFLOAT16
    if key not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is not supported: use None, "
                         "'float16' or 'bfloat16'")
    return COMPRESSIONS[key]


class Optimizer:
    """Base of the optimizers (``keras.optimizers.Optimizer``'s shape).

    Args:
        learning_rate: a positive float, or a callable ``schedule(step) -> float``
            called with the number of steps applied so far (``iterations``).
        name: a name for slots and messages.
        compression: ``None``, ``"float16"`` or ``"bfloat16"``: the dtype gradients are
            reduced in (halving the bytes moved; values are rounded to it).
    """

    #: Names of the slots each variable gets.
    slot_names: tuple = ()

    def __init__(self, learning_rate, name: str, compression=None):
        if not callable(learning_rate):
            _check_positive("learning_rate", learning_rate)
        self._learning_rate = learning_rate
        self.name = name
        self.compression = compression_dtype(compression)
        strategy, replica_ctx = context.current()
        if replica_ctx is not None and strategy is not None:
            raise RuntimeError("make the optimizer in cross-replica context (inside "
                               "strategy.scope(), outside strategy.run)")
        self._iterations = zeros(strategy, (), np.int64, f"{name}/iterations",
                                 agg=VariableAggregation.ONLY_FIRST_REPLICA)
        self._slots: dict = {}
        self._slot_list: list = []
        self._plans: dict = {}

    # --- state ----------------------------------------------------------------------
    @property
    def iterations(self) -> Variable:
        """The number of steps applied (an int64 variable)."""
        return self._iterations

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next step (a schedule is evaluated)."""
        lr = self._learning_rate
        if callable(lr):
            lr = lr(self._step_count())
            lr = float(to_host(lr)) if not isinstance(lr, (int, float)) else float(lr)
        return float(lr)

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        if not callable(value):
            _check_positive("learning_rate", value)
        self._learning_rate = value

    @property
    def variables(self) -> list:
        """``iterations`` and every slot, in the order they were made."""
        return [self._iterations] + list(self._slot_list)

    def get_slot(self, var: Variable, name: str) -> Variable:
        """Slot ``name`` of ``var`` (made on the first step that trained ``var``)."""
        try:
            return self._slots[var][name]
        except KeyError:
            raise KeyError(f"{type(self).__name__} has no slot {name!r} for variable "
                           f"{var.name!r}: slots are {list(self.slot_names)}, made on the "
                           "first apply_gradients that trains the variable") from None

    def _step_count(self) -> int:
        return int(to_host(self._iterations._array))

    def _build(self, variables) -> None:
        for v in variables:
            if v in self._slots:
                continue
            made = {}
            for s in self.slot_names:
                made[s] = zeros(strategy_of(v), v.shape, v.dtype, f"{v.name}/{s}")
                self._slot_list.append(made[s])
            self._slots[v] = made

    # --- the step -------------------------------------------------------------------
    def apply_gradients(self, grads_and_vars: Iterable, name=None,
                        skip_gradients_aggregation: bool = False) -> Variable:
        """Sum the gradients over every replica in sync (one fused reduction) and update
        the variables; returns ``iterations``.

        Inside ``strategy.run`` every replica must call it, with its own gradients for
        the same variables. In cross-replica context (or without a strategy) the
        gradients are taken as already summed and applied to every component.

        Raises:
            ValueError: no gradients, a gradient whose shape differs from its
                variable's, a variable of another strategy, or workers training
                different variables (on every worker).
            TypeError: a non-variable, or a gradient that is not floating point.
        """
        grads, variables = _check_pairs(grads_and_vars)
        remote = getattr(variables[0], "_apply_gradients", None)
        if remote is not None:  # variables on parameter servers: the step runs there
            return remote(self, grads, variables)
        strategy, replica_ctx = context.current()
        if replica_ctx is not None and strategy is not None:
            replica_ctx.merge_call(self._apply_merged,
                                   args=(grads, variables, not skip_gradients_aggregation))
        else:
            self._apply_merged(strategy, grads, variables, False)
        return self._iterations

    def _apply_merged(self, strategy, grads: list, variables: list, reduce: bool) -> None:
        plan = self._plan(variables)
        if strategy is not None and plan.owner is not None and plan.owner is not strategy:
            raise ValueError(
                f"{type(self).__name__}.apply_gradients: the variables belong to "
                f"{plan.owner!r} but the step runs under {strategy!r}: train the variables "
                "of one strategy, under that strategy")
        if plan.owner is None and strategy is not None and strategy.num_replicas_in_sync > 1:
            raise ValueError(
                f"{type(self).__name__}.apply_gradients under {strategy!r}: variable "
                f"{plan.names[0]!r} was made outside strategy.scope(), so it has one copy "
                "for all replicas; make the variables inside strategy.scope()")
        tensors = plan.gradients(grads)
        if reduce and plan.owner is not None and plan.owner.num_replicas_in_sync > 1:
            tensors = self._reduce(plan, tensors)
        lr = self.learning_rate
        step = self._step_count() + 1
        update = self.update_step
        names = plan.names
        for i, (params, slots) in enumerate(zip(plan.params, plan.slots)):
            devs = plan.devices[i]
            with devs[0].activate() if plan.gpu else _NO_CONTEXT:
                for j, (param, slot) in enumerate(zip(params, slots)):
                    if plan.gpu and devs[j] != devs[0]:
                        with devs[j].activate():
                            update(param, tensors[j][i], slot, lr, step, names[j])
                    else:
                        update(param, tensors[j][i], slot, lr, step, names[j])
        one = np.ones((), np.int64)
        for c in (self._iterations.values if isinstance(self._iterations, DistributedVariable)
                  else (self._iterations,)):
            c._write("assign_add", one)

    def _plan(self, variables: list) -> "_Plan":
        # Training loops pass the same variables every step: the bookkeeping is done once.
        key = tuple(map(id, variables))
        plan = self._plans.get(key)
        if plan is None:
            self._build(variables)
            plan = _Plan(self, variables)
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = plan
        return plan

    def _reduce(self, plan: "_Plan", tensors: list) -> list:
        strategy = plan.owner
        if plan.layouts is None:
            plan.layouts = describe_layouts(tensors, plan.keys)
        agree_tensors(strategy, tensors, f"{type(self).__name__}.apply_gradients",
                      layouts=plan.layouts)
        wire = self.compression
        if wire is None:
            return fused_reduce(strategy.communicator, tensors, ReduceOp.SUM)
        from gpustrat.optimizers import bfloat16  # noqa: PLC0415
        if wire is bfloat16.BFLOAT16:
            return bfloat16.reduce_sum(strategy.communicator, tensors)
        packed = [[t.astype(wire) for t in row] for row in tensors]
        reduced = fused_reduce(strategy.communicator, packed, ReduceOp.SUM)
        return [[r.astype(tensors[j][0].dtype) for r in row] for j, row in enumerate(reduced)]

    def update_step(self, param, grad, slots: dict, lr: float, step: int, name: str
                    ) -> None:
        """Update ``param`` (of the variable called ``name``) in place from the summed
        ``grad``; ``slots`` maps slot names to this replica's slot arrays (updated in
        place too); ``step`` counts from 1."""
        raise NotImplementedError

    def get_config(self) -> dict:
        return {"name": self.name, "learning_rate": self._learning_rate,
                "compression": None if self.compression is None else str(self.compression)}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "name")
        return f"{type(self).__name__}({args})"


_NO_CONTEXT = contextlib.nullcontext()


class _Plan:
    """What one list of variables needs each step, worked out on its first step: their
    owner, devices, component and slot arrays per replica, names and shapes."""

    def __init__(self, optimizer: Optimizer, variables: list):
        owners = {id(strategy_of(v)) for v in variables}
        if len(owners) > 1:
            bad = next(v for v in variables if strategy_of(v) is not strategy_of(variables[0]))
            raise ValueError(
                f"{type(optimizer).__name__}.apply_gradients: variable {bad.name!r} belongs "
                f"to {strategy_of(bad)!r} but {variables[0].name!r} to "
                f"{strategy_of(variables[0])!r}: train the variables of one strategy, "
                "under that strategy")
        self.owner = strategy_of(variables[0])
        comps = [v.values if isinstance(v, DistributedVariable) else (v,) for v in variables]
        self.n_local = len(comps[0])
        #: devices[i][j], params[i][j], slots[i][j]: replica i, variable j.
        self.devices = [[c[i]._device for c in comps] for i in range(self.n_local)]
        self.params = [[c[i]._array for c in comps] for i in range(self.n_local)]
        self.slots = [[{s: _component(slot, i) for s, slot in optimizer._slots[v].items()}
                       for v in variables] for i in range(self.n_local)]
        self.gpu = any(d.is_gpu for row in self.devices for d in row)
        self.names = [v.name for v in variables]
        self.keys = [v._key if isinstance(v, DistributedVariable) else v.name
                     for v in variables]
        self.shapes = [v.shape for v in variables]
        self.dtypes = [v.dtype for v in variables]
        #: What the workers agree on each step (made on the first reduction).
        self.layouts = None

    def gradients(self, grads: list) -> list:
        """``out[j][i]``: gradient j on local replica i's device, in variable j's dtype."""
        n = self.n_local
        out = []
        for j, g in enumerate(grads):
            if isinstance(g, DistributedValues):
                parts = g.values
                if len(parts) != n:
                    raise ValueError(f"the gradient of {self.names[j]!r} has {len(parts)} "
                                     f"components for {n} local replicas")
            else:
                # The same gradient on every replica (each replica passed this value).
                parts = (g,) * n
            row = list(parts)
            shape, dtype = self.shapes[j], self.dtypes[j]
            for i, a in enumerate(row):
                if type(a) is not np.ndarray or self.gpu:
                    a = row[i] = as_array(a, self.devices[i][j])
                if a.shape != shape:
                    raise ValueError(f"the gradient of variable {self.names[j]!r} has shape "
                                     f"{tuple(a.shape)} but the variable has {shape}")
                if a.dtype != dtype:
                    if a.dtype.kind not in "fc":
                        raise TypeError(f"the gradient of variable {self.names[j]!r} has "
                                        f"dtype {a.dtype}: gradients must be floating point")
                    row[i] = a.astype(dtype)
            out.append(row)
        return out


def _component(v: Variable, i: int):
    return (v.values[i] if isinstance(v, DistributedVariable) else v)._array


def _check_positive(what: str, value) -> None:
    try:
        ok = float(value) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{what} must be a positive number or a callable schedule, "
                         f"got {value!r}")


def _check_pairs(grads_and_vars) -> tuple[list, list]:
    pairs = list(grads_and_vars)
    for p in pairs:
        if not (isinstance(p, (tuple, list)) and len(p) == 2):
            raise TypeError("apply_gradients takes (gradient, variable) pairs, e.g. "
                            f"zip(grads, variables); got an item {p!r}")
    kept = [(g, v) for g, v in pairs if g is not None]
    for _, v in pairs:
        if not isinstance(v, Variable):
            raise TypeError(f"apply_gradients: {v!r} is not a gs.Variable; optimizers "
                            "train variables (make them with gs.Variable in the scope)")
    if not kept:
        names = [v.name for _, v in pairs]
        raise ValueError(f"apply_gradients: no gradients provided for any variable "
                         f"({names})")
    variables = [v for _, v in kept]
    if len({id(v) for v in variables}) != len(variables):
        raise ValueError("apply_gradients: a variable appears twice; sum its gradients "
                         "first")
    return [g for g, _ in kept], variables

