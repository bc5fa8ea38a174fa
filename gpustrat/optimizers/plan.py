"""What an optimizer works out once per list of variables, so that a step is cheap.

Words:
- *plan*: for one list of variables (a training loop passes the same list every step):
  their owner strategy, devices, component variables and slots per replica, names,
  shapes and dtypes.
- *flat arena*: one 1-D array per replica (on its device) holding the plan's variables'
  values back to back, in the plan's order; each component's array becomes a view of
  its slice, and likewise one arena per slot. The fused reduction's buffers hold the
  summed gradients in the same order, so a step updates all the variables with a few
  large array operations instead of a few per variable (Apex's and optax's
  "multi-tensor" updates do the same). A variable is moved into an arena once, by the
  first plan that trains it; arrays read from it before (``value()`` views) keep the old
  memory. Plans that cannot use arenas (mixed dtypes, variables already in another
  arena, an algorithm that treats variables by name) update each variable in turn.
- *gradient buffers*: one 1-D array per replica (on its device) laid out as the fusion
  reduction lays out the gradients, handed out as one view per variable
  (``Optimizer.gradient_buffers``). Gradients written into them are reduced where they
  are, in place: no packing, no per-gradient checks (PyTorch DDP's
  ``gradient_as_bucket_view``). Buffers are handed out again each step unless
  something outside the plan still refers to them (a gradient kept from an earlier
  step, or a view of one): then a new buffer is made, so that a kept gradient is never
  overwritten. Plans of several dtypes, or of variables on several devices per
  replica, hand out fresh arrays instead.
"""

from __future__ import annotations

import contextlib
import operator
import sys

import numpy as np

from gpustrat.collectives.fusion import pack_gpu, pack_host
from gpustrat.devices import gpu_array_type, on_device_of
from gpustrat.distribute.collective_ops import as_array
from gpustrat.distribute.distributed_variables import DistributedVariable, strategy_of
from gpustrat.distribute.extended import describe_shapes
from gpustrat.values import DistributedValues, PerReplica

_NO_CONTEXT = contextlib.nullcontext()
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_DEVICE_ID = operator.attrgetter("data.device_id")   # (no Device object made)
_ITEM = [operator.itemgetter(i) for i in range(64)]


def _components(v) -> tuple:
    return v.values if isinstance(v, DistributedVariable) else (v,)


class StepPlan:
    """See the module docstring. ``comps[i][j]``: replica i's component of variable j
    (a plain variable); ``slot_comps[i][j]``: its slots' components by name."""

    def __init__(self, optimizer, variables: list):
        self.owner = strategy_of(variables[0])   # check_trainable checked the rest
        self.variables = list(variables)
        comps = [_components(v) for v in variables]
        self.n_local = len(comps[0])
        self.comps = [[c[i] for c in comps] for i in range(self.n_local)]
        self.slot_comps = [[{s: _components(slot)[i]
                             for s, slot in optimizer._slots[v].items()}
                            for v in variables] for i in range(self.n_local)]
        self.devices = [[c._device for c in row] for row in self.comps]
        self.gpu = any(d.is_gpu for row in self.devices for d in row)
        self.names = [v.name for v in variables]
        self.keys = [v._key if isinstance(v, DistributedVariable) else v.name
                     for v in variables]
        self.shapes = [v.shape for v in variables]
        self.dtypes = [v.dtype for v in variables]
        #: What the workers agree on each step: every variable's key, shape and dtype.
        self.described = describe_shapes(self.shapes, self.dtypes, self.keys)
        #: ``agreement(...)`` of the step's reduction, made on the first one.
        self.agreement = None
        #: The gradients' layout for the fused reduction (what gradients() checks).
        self._host_types = [np.ndarray] * len(variables)
        #: Per local replica: its device index when all its variables are on that one
        #: GPU (then a column of CuPy arrays there is checked in C), else None.
        self._gpu_index = [row[0].index if row[0].is_gpu and len(set(row)) == 1 else None
                           for row in self.devices]
        self.flat = FlatArenas.adopt(self, optimizer)
        self.indices = list(range(len(variables)))
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self._offsets = [0]
        for n in sizes:
            self._offsets.append(self._offsets[-1] + n)
        # Gradient buffers: one dtype, and each replica's variables on one device.
        self._buffered = len(set(self.dtypes)) == 1 and \
            all(len(set(row)) == 1 for row in self.devices)
        self._buffers: list = [None] * self.n_local   # (arena, views) per replica
        self._refs: list = [None] * self.n_local

    def gradient_buffers(self, i: int) -> list:
        """Local replica ``i``'s gradient buffers (module docstring): one array per
        variable, of its shape and dtype, on the replica's device."""
        if not self._buffered:
            return fresh_arrays(self.shapes, self.dtypes, self.devices[i])
        held = self._buffers[i]
        if held is None or _refs(held) != self._refs[i]:
            # First use, or the last buffers are still held outside: new ones.
            held = self._buffers[i] = self._new_buffers(i)
            self._refs[i] = _refs(held)
        return list(held[1])

    def _new_buffers(self, i: int) -> tuple:
        dev = self.devices[i][0]
        off = self._offsets
        with dev.activate():
            arena = dev.xp.empty(off[-1], self.dtypes[0])
            views = tuple(arena[off[j]:off[j + 1]].reshape(shape)
                          for j, shape in enumerate(self.shapes))
        return arena, views

    def buffer_arenas(self, grads_per_replica: list) -> list | None:
        """The replicas' gradient arenas when ``grads_per_replica[i]`` (replica i's
        gradients, in the plan's order) are exactly replica i's gradient buffers for
        every local replica; else None."""
        if len(grads_per_replica) != self.n_local:
            return None
        arenas = []
        for held, grads in zip(self._buffers, grads_per_replica):
            if held is None or len(grads) != len(held[1]) or \
                    not all(map(operator.is_, grads, held[1])):
                return None
            arenas.append(held[0])
        return arenas

    def buffer_views(self) -> list:
        """``out[j][i]``: gradient buffer j of replica i (after :meth:`buffer_arenas`)."""
        return list(map(list, zip(*[held[1] for held in self._buffers])))

    def _host_column_ok(self, column: list) -> bool:
        """Whether one replica's gradients are NumPy arrays of the variables' shapes and
        dtypes (whole-list compares, in C)."""
        return (list(map(type, column)) == self._host_types
                and list(map(_SHAPE, column)) == self.shapes
                and list(map(_DTYPE, column)) == self.dtypes)

    def _gpu_column_ok(self, column: list, i: int) -> bool:
        """Whether replica i's gradients are CuPy arrays of the variables' shapes and
        dtypes on the replica's one GPU (whole-list compares, in C)."""
        index = self._gpu_index[i]
        return (index is not None and len(column) == len(self.shapes)
                and set(map(type, column)) == {gpu_array_type()}
                and list(map(_SHAPE, column)) == self.shapes
                and list(map(_DTYPE, column)) == self.dtypes
                and set(map(_DEVICE_ID, column)) == {index})

    def gradients_by_replica(self, columns: list) -> list:
        """:meth:`gradients` of ``columns[i]``, replica i's list of gradients (one per
        variable), as every replica passes them inside ``strategy.run``."""
        if len(columns) == self.n_local and (
                all(map(self._gpu_column_ok, columns, range(self.n_local))) if self.gpu
                else all(map(self._host_column_ok, columns))):
            return list(zip(*columns))
        return self.gradients(list(zip(*columns)), per_replica=True)

    def gradients(self, grads: list, per_replica: bool = False) -> list:
        """``out[j][i]``: gradient j on local replica i's device, in variable j's dtype.

        ``grads[j]`` is variable j's gradient: a per-replica value, or one value for
        every replica; with ``per_replica``, a sequence of one value per replica."""
        n = self.n_local
        if n == 1 and not per_replica and (self._gpu_column_ok(grads, 0) if self.gpu
                                           else self._host_column_ok(grads)):
            return list(zip(grads))   # one replica's arrays (no PerReplica among them)
        if not self.gpu and n <= len(_ITEM):
            # The common step: host arrays of the right shapes and dtypes, checked with
            # whole-list compares (in C) instead of one by one.
            rows = grads if per_replica else \
                [g.values if type(g) is PerReplica else (g,) * n for g in grads]
            if set(map(len, rows)) == {n} and \
                    all(self._host_column_ok(list(map(_ITEM[i], rows))) for i in range(n)):
                return rows
        out = []
        for j, g in enumerate(grads):
            if per_replica or isinstance(g, DistributedValues):
                parts = g if per_replica else g.values
                if len(parts) != n:
                    raise ValueError(f"the gradient of {self.names[j]!r} has {len(parts)} "
                                     f"components for {n} local replicas")
            else:
                # The same gradient on every replica (each replica passed this value).
                parts = (g,) * n
            out.append([self._checked(a, i, j) for i, a in enumerate(parts)])
        return out

    def _checked(self, a, i: int, j: int):
        """Replica i's gradient ``a`` of variable j as an array of the variable's dtype
        on its component's device; raises if its shape differs or it is not floating
        point."""
        if type(a) is not np.ndarray or self.gpu:
            a = as_array(a, self.devices[i][j])
        shape, dtype = self.shapes[j], self.dtypes[j]
        if a.shape != shape:
            raise ValueError(f"the gradient of variable {self.names[j]!r} has shape "
                             f"{tuple(a.shape)} but the variable has {shape}")
        if a.dtype != dtype:
            if a.dtype.kind not in "fc":
                raise TypeError(f"the gradient of variable {self.names[j]!r} has "
                                f"dtype {a.dtype}: gradients must be floating point")
            with on_device_of(a):        # cast on the gradient's device
                a = a.astype(dtype)
        return a

    @property
    def packs(self) -> bool:
        """Whether a replica's step can give its gradients packed (:meth:`packed`):
        several local replicas whose variables live in flat arenas, one per replica."""
        return self.flat is not None and self._buffered and self.n_local > 1

    def is_buffers(self, i: int, grads: list) -> bool:
        """Whether ``grads`` are exactly local replica i's gradient buffers."""
        held = self._buffers[i]
        return held is not None and len(grads) == len(held[1]) and \
            all(map(operator.is_, grads, held[1]))

    def packed(self, i: int, grads: list):
        """Local replica i's gradients (one per variable, in the plan's order), checked
        as :meth:`gradients` does, flattened back to back into one new array on its
        device (written on its current stream; on a host, a pooled buffer): the layout of
        its gradient buffers."""
        dev = self.devices[i][0]
        if not (self._gpu_column_ok(grads, i) if self.gpu else self._host_column_ok(grads)):
            if len(grads) != len(self.shapes):
                raise ValueError(f"{len(grads)} gradients for {len(self.shapes)} variables")
            grads = [self._checked(a, i, j) for j, a in enumerate(grads)]
        if dev.is_gpu:
            return pack_gpu(grads)      # one launch, no view per tensor
        return pack_host(grads, i)      # a pooled buffer, reused once the step let go

    def step_each(self, optimizer, tensors: list, lr: float, step: int) -> None:
        """Update each variable's components in turn (``tensors[j][i]`` summed)."""
        update = optimizer.update_step
        decay = optimizer.weight_decay
        names = self.names
        for i in range(self.n_local):
            for j, (comp, slots) in enumerate(zip(self.comps[i], self.slot_comps[i])):
                dev = comp._device
                with dev.activate() if dev.is_gpu else _NO_CONTEXT:
                    if decay:
                        optimizer.decay(comp._array, lr, names[j])
                    update(comp._array, tensors[j][i], {s: c._array for s, c in slots.items()},
                           lr, step, names[j])


def check_trainable(optimizer, variables: list) -> None:
    """Raise unless an optimizer can train every one of ``variables`` together: all of
    one strategy, all floating point. Called before the step makes or writes anything,
    so that a refused step changes no variable, slot or ``iterations``."""
    where = f"{type(optimizer).__name__}.apply_gradients"
    owner = strategy_of(variables[0])
    bad = next((v for v in variables if strategy_of(v) is not owner), None)
    if bad is not None:
        raise ValueError(
            f"{where}: variable {bad.name!r} belongs to {strategy_of(bad)!r} but "
            f"{variables[0].name!r} to {owner!r}: train the variables of one strategy, "
            "under that strategy")
    bad = next((v for v in variables if v.dtype.kind not in "fc"), None)
    if bad is not None:
        raise TypeError(
            f"{where}: variable {bad.name!r} has dtype {bad.dtype}, and an optimizer "
            "trains floating-point variables only; nothing was updated. Leave it out of "
            "the (gradient, variable) pairs (or pass None as its gradient), or make it a "
            "float variable")


def fresh_arrays(shapes: list, dtypes: list, devices: list) -> list:
    """One new (uninitialised) array per shape and dtype, on its device."""
    out = []
    for shape, dtype, dev in zip(shapes, dtypes, devices):
        with dev.activate():
            out.append(dev.xp.empty(shape, dtype))
    return out


def replica_devices(variables: list, i: int) -> list:
    """The device of local replica ``i``'s component of each variable (a variable with
    one component: that one's)."""
    out = []
    for v in variables:
        comps = _components(v)
        out.append(comps[i if i < len(comps) else 0]._device)
    return out


def _refs(held: tuple) -> tuple:
    """References to a replica's gradient arena and the most to one of its views: equal
    to the count taken when they were made unless something else holds them."""
    return sys.getrefcount(held[0]), max(map(sys.getrefcount, held[1]), default=0)


class FlatArenas:
    """A plan's variables and slots in one flat arena per replica (module docstring)."""

    def __init__(self, plan: StepPlan, sizes: list):
        self.plan = plan
        self.offsets = [0]
        for n in sizes:
            self.offsets.append(self.offsets[-1] + n)
        self.params: list = []             # params[i]: replica i's arena
        self.slots: list = []              # slots[i][name]: replica i's slot arena

    @classmethod
    def adopt(cls, plan: StepPlan, optimizer) -> "FlatArenas | None":
        """Move the plan's variables and slots into arenas, or None when it cannot."""
        dtype = plan.dtypes[0]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in plan.shapes]
        if (any(d != dtype for d in plan.dtypes) or dtype.kind != "f" or not sum(sizes)
                or not optimizer.flat_ok(plan.names)):
            return None
        for i in range(plan.n_local):
            row = plan.comps[i] + [c for slots in plan.slot_comps[i] for c in slots.values()]
            if any(getattr(c, "_in_arena", False) for c in row) or \
                    any(d != plan.devices[i][0] for d in plan.devices[i]):
                return None
        flat = cls(plan, sizes)
        for i in range(plan.n_local):
            dev = plan.devices[i][0]
            with dev.activate():
                flat.params.append(flat._move(dev, plan.comps[i], dtype))
                names = plan.slot_comps[i][0].keys() if plan.slot_comps[i] else ()
                flat.slots.append({s: flat._move(dev, [sl[s] for sl in plan.slot_comps[i]],
                                                 dtype) for s in names})
        for row in plan.comps:
            for c in row:
                parent = c._parent
                if parent is not None:
                    parent._array = parent._values[0]._array
        return flat

    def _move(self, device, comps: list, dtype):
        arena = device.xp.empty(self.offsets[-1], dtype)
        for j, c in enumerate(comps):
            lo, hi = self.offsets[j], self.offsets[j + 1]
            arena[lo:hi] = c._array.reshape(-1)
            c._array = arena[lo:hi].reshape(c._array.shape)
            c._in_arena = True
        return arena

    def concatenate(self, tensors: list) -> list:
        """One flat array per replica of ``tensors[j][i]``, in the plan's order (host
        replicas: in a pooled fusion buffer, reused once the step lets go of it)."""
        out = []
        array = gpu_array_type()
        for i, dev in enumerate(row[0] for row in self.plan.devices):
            column = list(map(_ITEM[i], tensors)) if i < len(_ITEM) else \
                [t[i] for t in tensors]
            if not dev.is_gpu and all(type(t) is np.ndarray for t in column):
                out.append(pack_host(column, i))
            elif dev.is_gpu and set(map(type, column)) == {array} and \
                    set(map(_DTYPE, column)) == {self.plan.dtypes[0]} and \
                    set(map(_DEVICE_ID, column)) == {dev.index}:
                out.append(pack_gpu(column))    # one launch, no view per tensor
            else:
                with dev.activate():
                    out.append(dev.xp.concatenate([t.reshape(-1) for t in column]))
        return out

    def step(self, optimizer, buckets: list, lr: float, step: int) -> None:
        """Update from ``[(tensor indices, flat summed gradients per replica)]``."""
        update = optimizer.update_step
        decay = optimizer.weight_decay
        for indices, grads in buckets:
            lo, hi = self.offsets[indices[0]], self.offsets[indices[-1] + 1]
            if decay:   # every variable of a flat plan decays (Optimizer.flat_ok)
                for i, p in enumerate(self.params):
                    dev = self.plan.devices[i][0]
                    with dev.activate() if dev.is_gpu else _NO_CONTEXT:
                        optimizer.decay(p[lo:hi], lr, None)
            if len(grads) > 1 and not self.plan.gpu and \
                    all(g is grads[0] for g in grads):
                # One summed gradient for every local replica (a host reduction's).
                optimizer.update_replicas(
                    [p[lo:hi] for p in self.params], grads[0],
                    [{s: a[lo:hi] for s, a in slots.items()} for slots in self.slots],
                    lr, step)
                continue
            for i, grad in enumerate(grads):
                dev = self.plan.devices[i][0]
                with dev.activate() if dev.is_gpu else _NO_CONTEXT:
                    update(self.params[i][lo:hi], grad,
                           {s: a[lo:hi] for s, a in self.slots[i].items()}, lr, step, None)
