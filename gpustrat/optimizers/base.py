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
- *clipping* (``clipnorm``, ``clipvalue``, ``global_clipnorm``; see
  :mod:`gpustrat.optimizers.clipping`): applied to the summed gradients, so a step
  clips what one process would on the whole global batch, at any replica count.
  (Keras 3 under tf.distribute clips each replica's own gradients before the sum.)
- *weight decay*: before its update, each variable that is not excluded becomes
  ``w - w * weight_decay * lr`` (Keras 3's decoupled decay, on every optimizer).

An algorithm is a subclass that names its slots and writes :meth:`Optimizer.update_step`
on plain arrays (NumPy, or CuPy on a GPU replica), in place.
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
import zlib
from itertools import repeat
from typing import Iterable

import numpy as np

from gpustrat import timeline as _tl
from gpustrat import devices as _devices
from gpustrat.devices import on_device_of, to_host
from gpustrat.distribute import context
from gpustrat.distribute.distributed_variables import DistributedVariable, strategy_of, zeros
from gpustrat.collectives.fusion import (all_reduce_arenas, copy_into, fused_all_reduce_flat,
                                         layout_of)
from gpustrat.distribute.extended import agreement, fused_reduce
from gpustrat.distribute.variables import Variable, VariableAggregation
from gpustrat.reduce_util import ReduceOp
from gpustrat.values import PerReplica
from gpustrat.optimizers import bfloat16, checkpointing, clipping, schedules, training_state
from gpustrat.optimizers.plan import StepPlan, check_trainable, fresh_arrays, replica_devices

_NO_CONTEXT = contextlib.nullcontext()
#: What each step adds to ``iterations`` (read-only: shared by every step).
_ONE = np.ones((), np.int64)
_ONE.flags.writeable = False

#: Wire types for ``compression``.
COMPRESSIONS = {"float16": np.dtype(np.float16)}


def compression_dtype(compression) -> np.dtype | None:
    """``None``, or the dtype gradients travel in ("float16")."""
    if compression is None:
        return None
    key = str(np.dtype(compression)) if not isinstance(compression, str) else compression
    key = key.strip().lower()
    if key == "bfloat16":
        return bfloat16.BFLOAT16
    if key not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is not supported: use None, "
                         "'float16' or 'bfloat16'")
    return COMPRESSIONS[key]


class Optimizer:
    """Base of the optimizers (``keras.optimizers.Optimizer``'s shape).

    Args:
        learning_rate: a positive float; a
            :class:`~gpustrat.optimizers.schedules.LearningRateSchedule`, called before
            each step with the number of steps applied so far (``iterations``); or a
            callable of no arguments, called before each step (as Keras 3).
        name: a name for slots and messages.
        compression: ``None``, ``"float16"`` or ``"bfloat16"``: the dtype gradients are
            reduced in (halving the bytes moved; values are rounded to it).
        weight_decay: None (no decay) or a non-negative float: each step first sets
            ``w -= w * weight_decay * lr`` for every variable not excluded.
        clipnorm: None or a positive float: each variable's summed gradient is scaled
            down to this L2 norm when it is longer.
        clipvalue: None or a positive float: each summed gradient's elements are
            clipped to ``[-clipvalue, clipvalue]``.
        global_clipnorm: None or a positive float: all summed gradients together are
            scaled down to this L2 norm when longer. At most one of the three clips.
        exclude_from_weight_decay: regular expressions (``re`` syntax); a variable
            whose name any of them matches somewhere (``re.search``, as Keras) is not
            decayed: ``["bias"]`` excludes every name containing "bias", ``["bias$"]``
            only names ending in it.
        gradient_accumulation_steps: None, or an integer >= 2: the gradients of that
            many steps are summed and applied (divided by it) on the last of them (see
            :mod:`gpustrat.optimizers.training_state`).
        use_ema, ema_momentum, ema_overwrite_frequency: keep an exponential moving
            average of the weights (momentum in [0, 1], default 0.99), and set the
            weights to it every ``ema_overwrite_frequency`` steps (None: only at
            :meth:`finalize_variable_values`).

    Raises:
        ValueError: a learning rate, weight decay or clip that is not a positive (decay:
            non-negative) finite number, or more than one clip.
    """

    #: Names of the slots each variable gets.
    slot_names: tuple = ()
    #: Former names of slots (``{old: new}``): a checkpoint's slots and
    #: :meth:`get_slot` take them as the new names.
    former_slot_names: dict = {}
    #: Attributes (hyperparameters) that every worker must set alike, beside the
    #: learning rate and ``iterations``.
    agreed_settings: tuple = ()
    #: The settings of every optimizer that workers agree on (before ``agreed_settings``).
    base_settings: tuple = ("weight_decay", "exclude_from_weight_decay") + clipping.NAMES \
        + ("gradient_accumulation_steps", "_ema_settings")
    #: A wrapper's check of the summed gradients before the update (see
    #: :class:`~gpustrat.optimizers.LossScaleOptimizer`): ``gate(sums, flat)`` returns
    #: the sums to apply, or None to skip the step. None: every step applies.
    _summed_gate = None

    def __init__(self, learning_rate, name: str, compression=None, *, weight_decay=None,
                 clipnorm=None, clipvalue=None, global_clipnorm=None,
                 exclude_from_weight_decay=None, gradient_accumulation_steps=None,
                 use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None,
                 loss_scale_factor=None):
        if loss_scale_factor is not None:
            raise ValueError(
                f"loss_scale_factor={loss_scale_factor!r} is not supported: multiply the "
                "loss by the factor and divide the gradients by it before "
                "apply_gradients, or wrap the optimizer in "
                "gs.optimizers.LossScaleOptimizer for dynamic loss scaling")
        (self.gradient_accumulation_steps, self.use_ema, self.ema_momentum,
         self.ema_overwrite_frequency) = training_state.check(
            gradient_accumulation_steps, use_ema, ema_momentum, ema_overwrite_frequency)
        schedules.check_learning_rate(learning_rate)
        self._learning_rate = learning_rate
        self.name = name
        self.compression = compression_dtype(compression)
        clipping.check(clipnorm, clipvalue, global_clipnorm)
        self.clipnorm = clipping.check_one("clipnorm", clipnorm)
        self.clipvalue = clipping.check_one("clipvalue", clipvalue)
        self.global_clipnorm = clipping.check_one("global_clipnorm", global_clipnorm)
        if weight_decay is not None:
            bad = isinstance(weight_decay, (str, bytes, bool))
            try:
                number = float(weight_decay)
            except (TypeError, ValueError):
                bad = True
            if bad or not 0 <= number < math.inf:
                raise ValueError(f"weight_decay must be a non-negative finite number or "
                                 f"None (no decay), got {weight_decay!r}")
            weight_decay = number
        self.weight_decay = weight_decay
        self._decayed: dict = {}
        self._exclude = ()
        self.exclude_from_weight_decay = exclude_from_weight_decay
        strategy, replica_ctx = context.current()
        if replica_ctx is not None and strategy is not None:
            raise RuntimeError("make the optimizer in cross-replica context (inside "
                               "strategy.scope(), outside strategy.run)")
        self._iterations = zeros(strategy, (), np.int64, f"{name}/iterations",
                                 agg=VariableAggregation.ONLY_FIRST_REPLICA)
        self._slots: dict = {}
        self._slot_list: list = []
        self._plans: dict = {}
        self._last_plan: StepPlan | None = None
        self._remember_step(0)
        # (learning rate, settings, their checksum) of the last step, and its step.
        self._agreed = (None, None, 0)
        self._agreed_step = 0

    # --- state ----------------------------------------------------------------------
    @property
    def iterations(self):
        """The number of steps applied (an int64 variable). With
        ``gradient_accumulation_steps`` n, as Keras: the number of updates, the calls
        of ``apply_gradients`` divided by n (a read-only 0-d int64 array which, as
        Keras's tensor, also has ``numpy()``; the variable counting every call is
        saved in checkpoints)."""
        n = self.gradient_accumulation_steps
        if n:
            count = np.asarray(self._step_count() // n, np.int64).view(_UpdateCount)
            count.flags.writeable = False
            return count
        return self._iterations

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next step (a schedule is evaluated)."""
        lr = self._learning_rate
        if callable(lr):
            if not isinstance(lr, schedules.LearningRateSchedule):
                return schedules.rate_at(lr, None)
            # As Keras: the schedule sees every call of apply_gradients counted (with
            # gradient_accumulation_steps too, where ``iterations`` counts updates).
            return schedules.rate_at(lr, self._step_count())
        return float(lr)

    @learning_rate.setter
    def learning_rate(self, value) -> None:
        schedules.check_learning_rate(value)
        self._learning_rate = value

    @property
    def variables(self) -> list:
        """``iterations`` and every slot, in the order they were made (on parameter
        servers: in the order their variables were made)."""
        held = getattr(self._iterations, "_optimizer_slot_variables", None)
        if held is not None:  # the optimizer's state is on parameter servers
            return [self._iterations] + held(self)
        return [self._iterations] + list(self._slot_list)

    def get_slot(self, var: Variable, name: str) -> Variable:
        """Slot ``name`` of ``var`` (made on the first step that trained ``var``): a
        variable like ``var`` (mirrored, or on ``var``'s parameter server)."""
        name = self.former_slot_names.get(name, name)
        held = getattr(var, "_get_slot", None)
        if held is not None:
            return held(self, name)
        try:
            return self._slots[var][name]
        except KeyError:
            kind = type(self).__name__
            if name not in self.slot_names:
                raise KeyError(f"{kind} keeps no slot {name!r}: its slots are "
                               f"{list(self.slot_names)}") from None
            raise KeyError(f"{kind} has no slot {name!r} for variable {var.name!r} yet: "
                           "slots are made on the first apply_gradients that trains the "
                           "variable (a restored slot takes its saved value then)") from None

    @property
    def exclude_from_weight_decay(self) -> tuple:
        """The regular expressions of the variable names that are not decayed."""
        return self._exclude

    @exclude_from_weight_decay.setter
    def exclude_from_weight_decay(self, names) -> None:
        if isinstance(names, str):
            names = (names,)
        names = tuple(names or ())
        bad = [n for n in names if not isinstance(n, str)]
        if bad:
            raise TypeError(f"exclude_from_weight_decay takes regular expressions (strings) "
                            f"matched against variable names, got {bad!r}")
        try:
            # Keras joins the patterns into one alternation and searches each name.
            pattern = re.compile("|".join(names)) if names else None
        except re.error as e:
            raise ValueError(f"exclude_from_weight_decay {list(names)}: not a regular "
                             f"expression ({e}); escape special characters with "
                             "re.escape to match them literally") from None
        if self._decayed and names != self._exclude:
            # Which variables decay is settled by the first step (a fused step decays
            # every variable of its arena).
            raise ValueError(
                f"exclude_from_weight_decay {list(self._exclude)} -> {list(names)}: this "
                f"{type(self).__name__} has taken steps, and which variables decay is "
                f"fixed by the first one; make the {type(self).__name__} with the "
                "exclusions it should keep")
        self._exclude = names
        self._exclude_pattern = pattern

    def _decays(self, name: str) -> bool:
        """Whether weight decay applies to the variable called ``name``."""
        hit = self._decayed.get(name)
        if hit is None:
            pattern = self._exclude_pattern
            hit = self._decayed[name] = pattern is None or pattern.search(name) is None
        return hit

    def decay(self, param, lr: float, name: str | None) -> None:
        """Keras's weight decay of ``param`` (the variable called ``name``; None: the
        flattened values of variables that all decay), in place, before its update:
        ``w -= w * weight_decay * lr``."""
        if self.weight_decay and (name is None or self._decays(name)):
            param -= param * self.weight_decay * lr

    @property
    def kept_slot_names(self) -> tuple:
        """:attr:`slot_names` and the slots of gradient accumulation and EMA
        (``"gradient_accumulator"``, ``"average"``) when they are on."""
        return tuple(self.slot_names) + training_state.extra_slots(self)

    @property
    def _ema_settings(self):
        """What workers agree on of the EMA (None when it is off)."""
        return (self.ema_momentum, self.ema_overwrite_frequency) if self.use_ema else None

    def finalize_variable_values(self, var_list) -> None:
        """With ``use_ema``: set each variable of ``var_list`` to its moving average
        (the end of training, as Keras's ``fit`` does); else nothing."""
        if self.use_ema:
            training_state.finalize(self, list(var_list))

    def slot_shape(self, name: str, shape: tuple) -> tuple:
        """The shape of slot ``name`` of a variable of ``shape`` (the variable's unless an
        algorithm keeps a smaller state, as Adafactor's factored moments)."""
        return shape

    def slot_initial_value(self, name: str) -> float:
        """The value every element of slot ``name`` starts at (0 unless an algorithm
        says otherwise)."""
        return 0.0

    def _first_iteration(self) -> Variable:
        it = self._iterations
        return it.values[0] if isinstance(it, DistributedVariable) else it

    def _remember_step(self, count: int) -> None:
        # The step count on the host, with the write count of iterations' first
        # component it belongs to: a step reads no device value unless iterations was
        # written from outside (an assign, a restore). A variable held elsewhere (no
        # local array whose writes are counted) is read each time.
        first = self._first_iteration()
        self._host_step = (count, first._writes if "_array" in first.__dict__ else None)

    def _step_count(self) -> int:
        count, writes = self._host_step
        first = self._first_iteration()
        if writes is None or first._writes != writes:
            local = "_array" in first.__dict__
            count = int(to_host(first._array if local else first.read_value()))
            self._remember_step(count)
        return count

    def _build(self, variables) -> None:
        new = [v for v in variables if v not in self._slots]
        pending = self.__dict__.get("_restored_slots")
        # Restored slots waiting for these variables are checked (and taken) before any
        # slot is made: a mismatch makes and writes nothing.
        restored = pending.take(self, new) if pending else {}
        for v in new:
            made = {}
            for s in self.kept_slot_names:
                sync_agg = training_state.SLOT_KINDS.get(s, ())
                shape = self.slot_shape(s, tuple(v.shape))
                made[s] = zeros(strategy_of(v), shape, v.dtype, f"{v.name}/{s}", *sync_agg)
                start = 0.0 if s in training_state.SLOTS else self.slot_initial_value(s)
                if start:
                    made[s].assign(np.full(shape, start, v.dtype))
                self._slot_list.append(made[s])
            self._slots[v] = made
            for s, value in restored.get(v, {}).items():
                made[s].assign(value)

    # --- checkpointing ----------------------------------------------------------------
    #: The optimizer's state is the same on every worker: a checkpoint writes it once.
    _checkpoint_per_worker = False
    #: Slots are saved by their variables' checkpoint keys.
    _checkpoint_by_variable_keys = True

    def _checkpoint_state(self, keys=None) -> dict:
        """``iterations``, the learning rate (a number, not a schedule), the settings and
        every slot, keyed by its variable's key in
        the saving Checkpoint (``keys``, a :class:`~gpustrat.train.graph.VariableKeys`)
        or, for a variable the Checkpoint does not hold, by its name (see
        :mod:`~gpustrat.optimizers.checkpointing`); slots as the variables themselves:
        the checkpoint reads them when it writes (without a copy where it can, or into
        its own copy for an asynchronous save).

        Slots restored before the optimizer made them (a checkpoint read before the
        first step) and not yet claimed are saved again as they were read.

        Raises:
            ValueError: slots of two variables of one name that the Checkpoint does not
                hold (a restore could not tell them apart).
        """
        held = getattr(self._iterations, "_optimizer_checkpoint_state", None)
        if held is not None:  # read from the parameter servers
            return held(self, keys)
        slots = checkpointing.saved_slots(self, list(self._slots.items()), keys,
                                          self.__dict__.get("_restored_slots"))
        return {"iterations": self._iterations, **checkpointing.learning_rate_of(self),
                "config": checkpointing.config_of(self), **slots}

    def _restore_checkpoint_state(self, state: dict, keys=None) -> None:
        """Set ``iterations`` and the slots from :meth:`_checkpoint_state`'s output
        (everything checked first: see :meth:`_prepare_checkpoint_restore`)."""
        self._prepare_checkpoint_restore(state, keys)()

    def _prepare_checkpoint_restore(self, state: dict, keys=None):
        """Check :meth:`_checkpoint_state`'s output against this optimizer and the
        restoring Checkpoint's variables (``keys``), and return the function that writes
        it; raises (ValueError) before anything is written.

        Each saved slot set goes to the variable at the same key in the restoring
        Checkpoint (slots saved by name: to the one variable of that name). Slots of
        variables this optimizer has not trained yet are assigned when the first step
        makes them, as TensorFlow defers a restore to the slot's creation. A slot this
        optimizer keeps that the checkpoint lacks starts afresh. A saved learning rate
        replaces this optimizer's unless this one has a schedule.
        """
        held = getattr(self._iterations, "_prepare_optimizer_restore", None)
        if held is not None:  # written to the parameter servers
            return held(self, state, keys)
        iterations = checkpointing.saved_iterations(self, state)
        lr = checkpointing.saved_learning_rate(self, state)
        writes, pending = checkpointing.match(self, state, keys, list(self._slots))

        def write() -> None:
            self._iterations.assign(iterations)
            if lr is not None:
                self._learning_rate = lr
            for var, saved in writes:
                made = self._slots[var]
                for s, slot in made.items():
                    slot.assign(saved[s])
            self._restored_slots = pending
        return write

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
        last = self._last_plan
        grads, variables = _check_pairs(grads_and_vars,
                                        None if last is None else last.variables)
        remote = getattr(variables[0], "_apply_gradients", None)
        if remote is not None:  # variables on parameter servers: the step runs there
            if training_state.extra_slots(self) or self._summed_gate is not None or \
                    type(self).slot_shape is not Optimizer.slot_shape:
                raise ValueError(
                    f"{type(self).__name__}: gradient_accumulation_steps, use_ema, loss "
                    "scaling and slots of their own shapes (Adafactor's) are not supported "
                    "for variables on parameter servers (each "
                    "worker's step is applied there as it comes); train without them, or "
                    "under MirroredStrategy or MultiWorkerMirroredStrategy")
            return remote(self, grads, variables)
        strategy, replica_ctx = context.current()
        if replica_ctx is not None and strategy is not None:
            merge = self._apply_recorded if _tl.ON else self._apply_merged
            plan = self._known_plan(variables)
            i = replica_ctx.local_index
            if plan is not None and plan.packs and not self.gradient_accumulation_steps \
                    and self.compression is None and not plan.is_buffers(i, grads):
                # The replica's gradients, packed now into one buffer (one launch), are
                # all the step needs of them: the replica goes on at once, the last to
                # call runs the step, and the caller may reuse its arrays at once. A
                # replica reading the variables (or iterations, or slots) before the
                # step ran waits for it then.
                replica_ctx.merge_call_later(
                    merge, args=(_StepArgs(plan.packed(i, grads), variables, True),
                                 not skip_gradients_aggregation))
                return self._iterations
            # One leaf per replica: the merge hands over the replicas' lists as they are
            # (a PerReplica of them), without walking a hundred gradients.
            replica_ctx.merge_call(merge, args=(_StepArgs(grads, variables),
                                                not skip_gradients_aggregation))
        else:
            self._apply_merged(strategy, _StepArgs(grads, variables), False)
        return self._iterations

    def gradient_buffers(self, variables: Iterable) -> list:
        """Arrays to write this replica's gradients into, one per variable (of its
        shape and dtype, on the replica's device), for
        ``apply_gradients(zip(buffers, variables))`` with the same variables.

        They are views of one buffer per replica laid out as the fused reduction needs
        it, so the step reduces the gradients where they are: no copy into fusion
        buffers and no check per gradient (PyTorch DDP's ``gradient_as_bucket_view``).
        Their contents are undefined until written: write every element
        (``np.matmul(a, b, out=buf)``, ``buf[...] = g``). After ``apply_gradients`` each
        holds the gradient the update used (summed over every replica in sync). The
        next call hands out the same buffers unless something still refers to one of
        them (a gradient kept from an earlier step, or a view of it): then it hands out
        new ones, so a kept gradient is never overwritten.

        Before the first ``apply_gradients`` of these variables, and for variables of
        several dtypes, they are ordinary new arrays (the step copies them as any
        gradients). Call it inside ``strategy.run`` for this replica's buffers (outside,
        for the first local replica's).
        """
        variables = list(variables)
        strategy, ctx = context.current()
        index = ctx.local_index if ctx is not None and strategy is not None else 0
        plan = self._known_plan(variables)
        if plan is None:  # made by the first step, in cross-replica context
            bad = next((v for v in variables if not isinstance(v, Variable)), None)
            if bad is not None or not variables:
                raise TypeError(f"gradient_buffers takes a non-empty list of gs.Variable, "
                                f"got {bad!r}" if variables else
                                "gradient_buffers got no variables")
            return fresh_arrays([v.shape for v in variables], [v.dtype for v in variables],
                                replica_devices(variables, index))
        if strategy is not None and plan.owner is not None and plan.owner is not strategy:
            raise ValueError(
                f"{type(self).__name__}.gradient_buffers: the variables belong to "
                f"{plan.owner!r} but this runs under {strategy!r}: train the variables "
                "of one strategy, under that strategy")
        if index >= plan.n_local:
            raise ValueError(
                f"{type(self).__name__}.gradient_buffers under {strategy!r}: variable "
                f"{plan.names[0]!r} was made outside strategy.scope(), so it has one copy "
                "for all replicas; make the variables inside strategy.scope()")
        return plan.gradient_buffers(index)

    def _apply_merged(self, strategy, step_args, reduce: bool) -> None:
        per_replica = step_args.values if isinstance(step_args, PerReplica) else (step_args,)
        variables = per_replica[0].variables
        for i, other in enumerate(per_replica[1:], 1):
            if len(other.variables) != len(variables) or \
                    not all(map(operator.is_, other.variables, variables)):
                raise ValueError(
                    f"{type(self).__name__}.apply_gradients: replica {i} passed other "
                    f"variables ({[v.name for v in other.variables]}) than replica 0 "
                    f"({[v.name for v in variables]}); every replica must train the same "
                    "variables, in the same order")
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
        lr = self.learning_rate
        step = self._step_count() + 1
        if _devices.capture_state is not None:   # gs.function guards what a step read
            _devices.capture_state.note_optimizer(self, lr, step)
        accumulating = self.gradient_accumulation_steps
        # The update's step number (from 1): with accumulation, the applied steps'
        # (Keras's iterations), which bias corrections see; the learning rate's
        # schedule saw every call (``lr`` above, as Keras).
        update = step
        if accumulating:
            update = step // accumulating
            per_replica = training_state.accumulate(
                self, plan, per_replica, step % accumulating == 0, _StepArgs)
            if per_replica is None:     # only accumulated: no reduction, no update
                self._count_step(plan, step)
                return
        reduce = reduce and plan.owner is not None and plan.owner.num_replicas_in_sync > 1
        # Workers must train the same variables with gradients of the same shapes: that
        # agreement rides with the reduction's first collective.
        agree = None
        if reduce:
            agree = plan.agreement
            if agree is None:
                agree = plan.agreement = agreement(plan.owner, plan.described,
                                                   f"{type(self).__name__}.apply_gradients")
            if agree is not None:  # and the learning rate, settings and iterations
                agree = agree + (self._settings_agreement(lr, step),)
        clips = self.clipnorm is not None or self.clipvalue is not None or \
            self.global_clipnorm is not None
        gate = self._summed_gate
        # (Every replica's, or none: packed gradients come only in a deposit.)
        arenas = [a.grads for a in per_replica] if per_replica[0].packed else \
            plan.buffer_arenas([a.grads for a in per_replica])
        if arenas is not None:
            # The gradients were written into the plan's gradient buffers, or packed by
            # the replicas: reduced in place, with no per-gradient check or copy.
            buckets = self._reduce_arenas(plan, arenas, agree) if reduce else \
                [(plan.indices, arenas)]
            if gate is not None and gate(buckets, True) is None:
                return       # a skipped step: no update, iterations unchanged
            if plan.flat is not None:
                if clips:
                    buckets = clipping.clip_flat(self, buckets, plan.flat.offsets)
                plan.flat.step(self, buckets, lr, update)
            else:
                views = plan.buffer_views()
                plan.step_each(self, clipping.clip_tensors(self, views) if clips else views,
                               lr, update)
        else:
            try:
                if len(per_replica) == 1:
                    tensors = plan.gradients(per_replica[0].grads)
                else:
                    tensors = plan.gradients_by_replica([a.grads for a in per_replica])
            except (TypeError, ValueError) as e:
                if reduce and plan.owner.num_workers > 1:
                    # The other workers wait in the reduction's first collective: meet
                    # them there with this error, so that every worker raises, not this
                    # one alone.
                    plan.owner.communicator.agree(
                        (f"bad gradients: {e}",), f"{type(self).__name__}.apply_gradients",
                        "every worker must give gradients of its variables' shapes and a "
                        "floating-point dtype")
                raise
            if plan.flat is not None:
                buckets = self._flat_gradients(plan, tensors, reduce, agree)
                if gate is not None and gate(buckets, True) is None:
                    return
                if clips:
                    buckets = clipping.clip_flat(self, buckets, plan.flat.offsets)
                plan.flat.step(self, buckets, lr, update)
            else:
                if reduce:
                    tensors = self._reduce(plan, tensors, agree)
                if gate is not None:
                    tensors = gate(tensors, False)
                    if tensors is None:
                        return
                if clips:
                    tensors = clipping.clip_tensors(self, tensors)
                plan.step_each(self, tensors, lr, update)
        if accumulating:
            training_state.reset(plan)
        self._count_step(plan, step)

    def _apply_recorded(self, strategy, step_args, reduce: bool) -> None:
        """:meth:`_apply_merged`, recorded as the timeline's ``apply_gradients`` span."""
        _tl.timed("apply_gradients", self._apply_merged, strategy, step_args, reduce)

    # merge_call names its function by qualname in the replicas' signature: the same
    # whether the step is recorded or not.
    _apply_recorded.__qualname__ = _apply_merged.__qualname__

    def _count_step(self, plan: StepPlan, step: int) -> None:
        """The end of step ``step`` (from 1): the EMA, then ``iterations``."""
        if self.use_ema:
            n = self.gradient_accumulation_steps
            training_state.average(self, plan, (step - 1) // n if n else step - 1)
        for c in (self._iterations.values if isinstance(self._iterations, DistributedVariable)
                  else (self._iterations,)):
            c._write("assign_add", _ONE)
        self._remember_step(step)

    def _settings(self) -> tuple:
        """The values of :attr:`agreed_settings`, now (a getter made once per class)."""
        get = _SETTINGS.get(type(self))
        if get is None:
            get = _SETTINGS[type(self)] = _getter(self._agreed_names())
        return get(self)

    def _agreed_names(self) -> tuple:
        """:attr:`agreed_settings` and :attr:`base_settings`, each name once."""
        return tuple(dict.fromkeys(tuple(self.agreed_settings) + self.base_settings))

    def _settings_agreement(self, lr: float, step: int) -> tuple:
        """``(code, describe)`` for ``comm.agreeing``'s ``also``: every worker must take
        step ``step`` (from 1) with the same learning rate and :attr:`agreed_settings`.
        The checksum of the settings is kept until they change; the step is mixed into
        it with integer arithmetic."""
        settings = self._settings()
        held = self._agreed
        if held[0] != lr or held[1] != settings:
            code = zlib.crc32(repr((type(self).__name__, lr, settings)).encode())
            held = self._agreed = (lr, settings, code)
        self._agreed_step = step
        return (held[2] + step * 0x9E3779B1) & 0xFFFFFFFF, self._agreed_description

    def _agreed_description(self) -> tuple:
        """The ``(key, what, hint)`` of :meth:`_settings_agreement`'s last step."""
        lr, settings, _ = self._agreed
        # The common settings only where set: an optimizer without clips or decay
        # reads as its algorithm's settings.
        key = (f"learning_rate={lr!r}",) + tuple(
            f"{n}={v!r}" for n, v in zip(self._agreed_names(), settings)
            if n in self.agreed_settings or v not in (None, ())) + (
            f"iterations={self._agreed_step - 1}",)
        return (key, f"{type(self).__name__}.apply_gradients (learning rate, "
                "hyperparameters and iterations)",
                "every worker must take each step with the same learning rate, "
                "hyperparameters and iterations: make the optimizer alike on every worker "
                "(with a learning rate or schedule that does not depend on the worker) "
                "and restore every worker from the same checkpoint")

    def _plan(self, variables: list) -> StepPlan:
        # Training loops pass the same variables every step: the bookkeeping is done once.
        plan = self._known_plan(variables)
        if plan is None:
            check_trainable(self, variables)   # before slots are made
            self._build(variables)
            plan = self._last_plan = StepPlan(self, variables)
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[tuple(map(id, variables))] = plan
        return plan

    def _known_plan(self, variables: list) -> StepPlan | None:
        """The plan of exactly these variables, if one was made (the last one used is
        recognised by identity, without hashing a hundred ids)."""
        last = self._last_plan
        if last is not None and len(variables) == len(last.variables) and \
                all(map(operator.is_, variables, last.variables)):
            return last
        plan = self._plans.get(tuple(map(id, variables)))
        if plan is not None:
            self._last_plan = plan
        return plan

    def _reduce(self, plan: StepPlan, tensors: list, agree: tuple | None) -> list:
        """Per-tensor sums over every replica in sync (``out[j][i]``), on the wire in
        the compression dtype; ``agree`` rides with the first collective."""
        comm = plan.owner.communicator
        wire = self.compression
        with comm.agreeing(*agree) if agree else _NO_CONTEXT:
            if wire is None:
                return fused_reduce(comm, tensors, ReduceOp.SUM)
            if wire is bfloat16.BFLOAT16:
                return bfloat16.reduce_sum(comm, tensors)
            packed = [[_cast(t, wire) for t in row] for row in tensors]
            reduced = fused_reduce(comm, packed, ReduceOp.SUM)
        return [[_cast(r, tensors[j][0].dtype) for r in row] for j, row in enumerate(reduced)]

    def _reduce_arenas(self, plan: StepPlan, arenas: list, agree: tuple | None) -> list:
        """Sum the replicas' gradient buffers over every replica in sync, in place;
        returns ``[(tensor indices, [flat summed gradients per replica]), ...]``."""
        comm = plan.owner.communicator
        if self.compression is None:
            with comm.agreeing(*agree) if agree else _NO_CONTEXT:
                return all_reduce_arenas(comm, arenas, ReduceOp.SUM,
                                         layout_of(plan.shapes, plan.dtypes))
        # Compressed: the collectives gradient arrays make (cast per variable, the same
        # buckets), so that workers may mix both; then the sums go back into the buffers.
        views = plan.buffer_views()
        for row, summed in zip(views, self._reduce(plan, views, agree)):
            for view, value in zip(row, summed):
                copy_into(view, value)
        return [(plan.indices, arenas)]

    def _flat_gradients(self, plan: StepPlan, tensors: list, reduce: bool,
                        agree: tuple | None) -> list:
        """``[(tensor indices, [flat summed gradients per replica]), ...]`` per bucket:
        one fused reduction, straight from the fusion buffers."""
        if reduce and self.compression is not bfloat16.BFLOAT16:
            wire = self.compression
            packed = tensors if wire is None else [[_cast(t, wire) for t in row]
                                                   for row in tensors]
            comm = plan.owner.communicator
            with comm.agreeing(*agree) if agree else _NO_CONTEXT:
                # plan.gradients checked the shapes and dtypes: the fusion need not again.
                # Uncompressed, the update only reads the sums: host replicas may share
                # one (no copy per replica).
                buckets = fused_all_reduce_flat(comm, packed, ReduceOp.SUM,
                                                layout=None if wire is not None else
                                                layout_of(plan.shapes, plan.dtypes),
                                                shared=wire is None)
            if wire is not None:
                buckets = [(b, [_cast(x, plan.dtypes[0]) for x in bufs])
                           for b, bufs in buckets]
            return buckets
        if reduce:
            comm = plan.owner.communicator
            with comm.agreeing(*agree) if agree else _NO_CONTEXT:
                tensors = bfloat16.reduce_sum(comm, tensors)
        return [(plan.indices, plan.flat.concatenate(tensors))]

    def flat_ok(self, names: list) -> bool:
        """Whether one update of all these variables' flattened values at once is the
        same as updating each (True unless some are excluded from weight decay, or an
        algorithm treats variables by name)."""
        return not self.weight_decay or all(self._decays(n) for n in names)

    def update_step(self, param, grad, slots: dict, lr: float, step: int, name: str | None
                    ) -> None:
        """Update ``param`` (of the variable called ``name``) in place from the summed
        ``grad``; ``slots`` maps slot names to this replica's slot arrays (updated in
        place too); ``step`` counts from 1. ``param`` may be the flattened values of
        several variables at once (``name`` None; see :meth:`flat_ok`). ``grad`` is
        read-only: the local replicas may share it."""
        raise NotImplementedError

    def update_replicas(self, params: list, grad, slots: list, lr: float, step: int
                        ) -> None:
        """:meth:`update_step` of every local host replica's flattened values
        (``params[i]``, ``slots[i]``) from one summed ``grad`` they share (read-only).
        An algorithm may override it to compute what the replicas share once, giving
        the same values as one ``update_step`` per replica."""
        for param, s in zip(params, slots):
            self.update_step(param, grad, s, lr, step, None)

    def get_config(self) -> dict:
        """The constructor's arguments (a schedule as
        :func:`~gpustrat.optimizers.schedules.serialize` gives it), for
        :meth:`from_config`."""
        lr = self._learning_rate
        if isinstance(lr, schedules.LearningRateSchedule):
            try:
                lr = schedules.serialize(lr)
            except NotImplementedError:   # a schedule without get_config: as it is
                pass
        config = {"name": self.name, "learning_rate": lr,
                  "compression": None if self.compression is None else str(self.compression)}
        # Keras's common settings, always (as Keras's get_config has them).
        for k in ("weight_decay",) + clipping.NAMES:
            config[k] = getattr(self, k)
        if self._exclude:
            config["exclude_from_weight_decay"] = list(self._exclude)
        config.update(training_state.config(self), loss_scale_factor=None)
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None):
        """The optimizer :meth:`get_config` described (``custom_objects``: name -> class
        for schedules of your own)."""
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = schedules.deserialize(config["learning_rate"],
                                                            custom_objects)
        return cls(**config)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items()
                         if k != "name" and (k not in _UNSET or _UNSET[k] != v))
        return f"{type(self).__name__}({args})"


#: Keras's settings common to every optimizer, at the values that mean "not used" (a
#: LossScaleOptimizer leaves them to its inner optimizer).
COMMON_SETTINGS = {"weight_decay": None, "clipnorm": None, "global_clipnorm": None,
                   "clipvalue": None, "use_ema": False, "ema_momentum": 0.99,
                   "ema_overwrite_frequency": None, "loss_scale_factor": None,
                   "gradient_accumulation_steps": None}
#: What every config holds at those values: a repr leaves them out.
_UNSET = {"compression": None, **COMMON_SETTINGS}

#: Per optimizer class: a function giving the values of its ``agreed_settings``.
_SETTINGS: dict = {}


def _getter(names: tuple):
    """A function of an object giving the tuple of its attributes ``names`` (in C)."""
    if len(names) > 1:
        return operator.attrgetter(*names)
    if names:
        one = operator.attrgetter(names[0])
        return lambda obj: (one(obj),)
    return lambda obj: ()


class _StepArgs:
    """One replica's gradients and variables, passed to the merge as one value."""

    __slots__ = ("grads", "variables", "packed")

    def __init__(self, grads: list, variables: list, packed: bool = False):
        #: The gradients, one per variable; ``packed``: one flat array of them all
        #: (``StepPlan.packed``).
        self.grads = grads
        self.variables = variables
        self.packed = packed


def _cast(x, dtype):
    """``x.astype(dtype)`` on ``x``'s device (the merge runs with any device current;
    on a GPU replica the cast then runs on that device's current, replica, stream)."""
    if type(x) is np.ndarray:
        return x.astype(dtype)
    with on_device_of(x):
        return x.astype(dtype)


def _check_pairs(grads_and_vars, known: list | None = None) -> tuple[list, list]:
    """The gradients and variables of (gradient, variable) pairs, pairs without a
    gradient left out. ``known``: a list of distinct variables checked before (the last
    step's): the same variables again need no check of their own."""
    pairs = list(grads_and_vars)
    # The common case (pairs of a gradient and a variable, every gradient given) is
    # checked with whole-list operations in C; the loops below name what is wrong. (Any
    # other sized item of two passes here only to fail the variables' checks.)
    try:
        pairs_of_two = bool(pairs) and set(map(len, pairs)) == {2}
    except TypeError:  # an item without a length: named below
        pairs_of_two = False
    if pairs_of_two:
        grads, variables = map(list, zip(*pairs))
        if not any(map(operator.is_, grads, repeat(None, len(grads)))) and (
                (known is not None and len(known) == len(variables) and
                 all(map(operator.is_, variables, known))) or
                (all(map(isinstance, variables, repeat(Variable, len(variables)))) and
                 len(set(map(id, variables))) == len(variables))):
            return grads, variables
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


class _UpdateCount(np.ndarray):
    """``Optimizer.iterations`` under gradient accumulation: a read-only 0-d int64
    array with ``numpy()``, as the tensor Keras returns there."""

    def numpy(self) -> np.ndarray:
        return np.array(self.view(np.ndarray))
