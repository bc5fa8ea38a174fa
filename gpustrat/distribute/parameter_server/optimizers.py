"""Optimizers whose variables live on parameter servers: steps, slots, checkpoint state.

An optimizer made in a ParameterServerStrategy's scope has a remote ``iterations``;
its number on the servers (``iterations``' variable id, the *key*) names the
optimizer there. ``apply_gradients`` on remote variables sends each gradient to the
server of its variable, which runs the optimizer's ``update_step`` on its array and
keeps the slots (momentum, Adam's moments) beside it. Weight decay is applied there too,
before each update; gradient clipping on the worker, to that worker's gradients of the
step (a server applies the workers' steps in turn, never their sum). Each slot is a variable of that
server (made on the first step that trains the variable, or by a restore), so
``optimizer.get_slot(var, name)`` is a remote variable like any other: reads and
assigns are one request each, from the coordinator or from a scheduled function.

Checkpoints are written on the coordinator: the optimizer's state (``iterations`` and
every slot, keyed by its variable's checkpoint key, a sharded variable's slots whole)
is read from the servers, and a restore writes it back to them, making the slots it needs.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np

from gpustrat.devices import to_host
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.variables import (RemoteVariable,
                                                            ShardedVariable, request)
from gpustrat.optimizers import checkpointing, clipping
from gpustrat.optimizers.schedules import rate_at
from gpustrat.optimizers.plan import check_trainable


def _key(optimizer) -> int:
    iterations = optimizer._iterations
    if not isinstance(iterations, RemoteVariable):
        raise ValueError(
            f"{type(optimizer).__name__} trains variables on parameter servers but was "
            "made outside the ParameterServerStrategy's scope: make the optimizer inside "
            "strategy.scope(), like the variables")
    return iterations._vid


def _parts(var) -> list:
    return list(var._shards) if isinstance(var, ShardedVariable) else [var]


# --- the step ---------------------------------------------------------------------------

def _server_copy(optimizer) -> bytes:
    """The optimizer without its state, for a server to call ``update_step`` on."""
    clone = copy.copy(optimizer)
    state = dict(optimizer.__dict__)
    for k in ("_iterations", "_slots", "_slot_list", "_plans", "_last_plan",
              "_restored_slots"):
        state.pop(k, None)
    state["_learning_rate"] = 1.0  # the caller sends each step's rate
    clone.__dict__ = state
    try:
        return pickle.dumps(clone, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001
        raise TypeError(f"{type(optimizer).__name__} cannot be sent to the parameter "
                        f"servers ({e}): its class must be importable from a module") from None


def apply_gradients(optimizer, grads: list, variables: list):
    """One optimizer step on remote variables: every gradient goes to its variable's
    server, which applies ``update_step`` there; returns ``iterations``.

    Inside ``strategy.run`` on a worker with several replicas, the replicas' gradients
    are summed first (one step per call of the worker, as in tf.distribute)."""
    from gpustrat.distribute import context  # noqa: PLC0415
    strategy, replica_ctx = context.current()
    if replica_ctx is not None and strategy is not None and \
            len(strategy.local_devices) > 1:
        return replica_ctx.merge_call(_apply_merged, args=(optimizer, grads, variables))
    return _apply(optimizer, grads, variables)


def _apply_merged(strategy, optimizer, grads, variables):
    return _apply(optimizer, list(grads), list(variables))


def _apply(optimizer, grads: list, variables: list):
    key = _key(optimizer)
    iterations = optimizer._iterations
    per_server: dict = {}
    # Everything is checked before the first request: a refused step changes nothing.
    for v in variables:
        if not isinstance(v, (RemoteVariable, ShardedVariable)):
            raise ValueError(
                f"{type(optimizer).__name__}.apply_gradients: variable {v.name!r} is not "
                "on the parameter servers (it was made outside the ParameterServerStrategy's "
                "scope); train the strategy's variables together, or separately")
    check_trainable(optimizer, variables)
    grads = [_gradient(g, v) for g, v in zip(grads, variables)]
    if optimizer.clipnorm is not None or optimizer.clipvalue is not None or \
            optimizer.global_clipnorm is not None:
        # Each worker's step is clipped as it comes (the servers apply steps of
        # several workers in turn, never their sum), as Keras under a
        # ParameterServerStrategy.
        grads = clipping.clip_list(optimizer, grads)
    for g, v in zip(grads, variables):
        pieces = v._split(g) if isinstance(v, ShardedVariable) else [g]
        for part, piece in zip(_parts(v), pieces):
            vids, arrays = per_server.setdefault(part._server, ([], []))
            vids.append(part._vid)
            arrays.append(wire.contiguous(piece))
    # Counting the step first gives each concurrent step its own step number. With a
    # fixed learning rate, the server holding ``iterations`` counts it in the same
    # request as its part of the step (one round trip less).
    lr = optimizer._learning_rate
    home = iterations._server
    step = None
    if callable(lr) or home not in per_server:
        _, (count,) = request(home, "assign_read", (iterations._vid, "assign_add"),
                              [np.ones((), np.int64)])
        step = int(count)
    lr = rate_at(lr, None if step is None else step - 1)
    # The hyperparameters go with every step: a server holding the optimizer with
    # other values asks for it again, so a change between steps takes effect at once.
    settings = optimizer._settings()
    blob = [None]
    if step is None:
        step = _apply_on(optimizer, home, key, lr, None, per_server.pop(home), settings,
                         blob)
    for server, work in per_server.items():
        _apply_on(optimizer, server, key, lr, step, work, settings, blob)
    return iterations


def _apply_on(optimizer, server: int, key: int, lr: float, step, work, settings: tuple,
              blob: list) -> int:
    """Server ``server``'s part of a step; when the server does not hold the optimizer
    with these ``settings``, the step is sent again with the optimizer. Returns the
    step number."""
    vids, arrays = work
    reply, _ = request(server, "apply", (key, lr, step, vids, settings), arrays)
    if reply == "need optimizer":
        blob[0] = blob[0] or _server_copy(optimizer)
        reply, _ = request(server, "apply", (key, lr, step, vids, settings, blob[0]),
                           arrays)
    return reply


def _gradient(g, v) -> np.ndarray:
    from gpustrat.distribute.variables import Variable  # noqa: PLC0415
    from gpustrat.values import DistributedValues  # noqa: PLC0415
    if isinstance(g, DistributedValues):
        parts = [np.asarray(to_host(p)) for p in g.values]
        g = parts[0] if len(parts) == 1 else np.sum(parts, axis=0)
    if isinstance(g, Variable):
        g = g.read_value()
    a = np.asarray(to_host(g))
    if a.shape != v.shape:
        raise ValueError(f"the gradient of variable {v.name!r} has shape {a.shape} but the "
                         f"variable has {v.shape}")
    if a.dtype.kind not in "fc":
        raise TypeError(f"the gradient of variable {v.name!r} has dtype {a.dtype}: "
                        "gradients must be floating point")
    return wire.contiguous(a, dtype=v.dtype)


# --- slots ------------------------------------------------------------------------------

def _slot_handle(part: RemoteVariable, sid: int, name: str) -> RemoteVariable:
    return RemoteVariable._handle(sid, part._server, part._shape, part._dtype,
                                  f"{part._name}/{name}", False, part._sync, part._agg)


def _handles(var, name: str, sids: list):
    parts = _parts(var)
    handles = [_slot_handle(p, sid, name) for p, sid in zip(parts, sids)]
    if isinstance(var, ShardedVariable):
        return ShardedVariable._from_shards(handles, f"{var.name}/{name}")
    return handles[0]


def get_slot(optimizer, var, name: str):
    """Slot ``name`` of ``var``: a remote variable on ``var``'s server (a sharded one
    for a sharded ``var``)."""
    key = _key(optimizer)
    sids = None
    if name in optimizer.slot_names:
        sids = [request(p._server, "slot", (key, p._vid, name))[0] for p in _parts(var)]
    if sids is None or any(s is None for s in sids):
        raise KeyError(f"{type(optimizer).__name__} has no slot {name!r} for variable "
                       f"{var.name!r}: slots are {list(optimizer.slot_names)}, made on the "
                       "first apply_gradients that trains the variable")
    return _handles(var, name, sids)


def _made_slots(optimizer) -> list:
    """``[(variable, {slot name: handle})]`` for every variable of the strategy that
    this optimizer has slots for, in the order the variables were made."""
    from gpustrat.distribute.parameter_server.strategy import coordinator_strategy  # noqa
    strategy = coordinator_strategy("the optimizer's slots")
    key = _key(optimizer)
    held: dict = {}
    for server in range(strategy.num_ps):
        for vid, sids in request(server, "slots", (key,))[0].items():
            held[(server, vid)] = sids
    out = []
    for var in strategy._variables:
        got = [held.get((p._server, p._vid)) for p in _parts(var)]
        if any(g is None for g in got):
            continue
        out.append((var, {name: _handles(var, name, [g[name] for g in got])
                          for name in got[0] if all(name in g for g in got)}))
    return out


def slot_variables(optimizer) -> list:
    """Every slot of the optimizer, as remote (or sharded) variables."""
    return [slot for _, made in _made_slots(optimizer) for slot in made.values()]


def checkpoint_state(optimizer, keys=None) -> dict:
    """``iterations``, the settings and every slot (keyed by its variable's checkpoint
    key, or name; see :mod:`gpustrat.optimizers.checkpointing`), read from the servers;
    the same tree as a local optimizer's."""
    trained = [(var, {s: h.numpy() for s, h in made.items()})
               for var, made in _made_slots(optimizer)]
    slots = checkpointing.saved_slots(optimizer, trained, keys,
                                      optimizer.__dict__.get("_restored_slots"))
    return {"iterations": optimizer._iterations.numpy(),
            **checkpointing.learning_rate_of(optimizer),
            "config": checkpointing.config_of(optimizer), **slots}


def prepare_restore(optimizer, state: dict, keys=None):
    """Check :func:`checkpoint_state`'s tree against the optimizer and the restoring
    Checkpoint's variables; return the function that writes ``iterations`` and the
    slots to the servers (making the slots there). Raises before anything is written.
    Slots of variables this job does not have are kept and saved again."""
    from gpustrat.distribute.parameter_server.strategy import coordinator_strategy  # noqa
    strategy = coordinator_strategy("the optimizer's slots")
    key = _key(optimizer)
    iterations = checkpointing.saved_iterations(optimizer, state)
    lr = checkpointing.saved_learning_rate(optimizer, state)
    writes, pending = checkpointing.match(optimizer, state, keys, list(strategy._variables))

    def write() -> None:
        names = tuple(optimizer.slot_names)
        for var, saved in writes:
            made = [request(p._server, "make_slots", (key, p._vid, names))[0]
                    for p in _parts(var)]
            for s in names:
                _handles(var, s, [m[s] for m in made]).assign(np.asarray(saved[s]))
        optimizer._iterations.assign(iterations)
        if lr is not None:
            optimizer._learning_rate = lr
        optimizer._restored_slots = pending
    return write
