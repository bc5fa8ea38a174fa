"""Variables that live on parameter servers, and optimizer steps applied there.

A :class:`RemoteVariable` is a handle: its value is held by one server rank, and every
read (``read_value``, ``numpy``, arithmetic) and update (``assign``, ``assign_add``,
``assign_sub``) is one request to that server, from the coordinator or from a function
running on a worker. Handles travel by value (a few numbers), so a scheduled function
that uses a variable reaches the same server array.

A :class:`ShardedVariable` is a variable split along axis 0 into remote shards on
several servers (``variable_partitioner``); reads concatenate, updates split.

``optimizer.apply_gradients`` on remote variables sends each gradient to the server of
its variable, which runs the optimizer's ``update_step`` on its array and keeps the
slots; ``iterations`` is a remote variable too (incremented once per step).
"""

from __future__ import annotations

import copy
import pickle

import numpy as np

from gpustrat.devices import to_host
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.variables import (Variable, VariableAggregation,
                                           VariableSynchronization)

_requester = None


def set_requester(fn) -> None:
    """How this process reaches the servers: ``fn(server, op, args, arrays)``."""
    global _requester
    _requester = fn


def request(server: int, op: str, args: tuple = (), arrays=()):
    if _requester is None:
        raise RuntimeError(
            "this process cannot reach the parameter servers: remote variables are used "
            "on the coordinator (after ParameterServerStrategy(...)) or inside functions "
            "scheduled with ClusterCoordinator.schedule")
    return _requester(server, op, args, arrays)


class _FetchedReads:
    """Reads of a variable held elsewhere: each one is a fresh copy from ``_fetch``
    (``value()`` read-only, as a variable's value is)."""

    def value(self):
        a = self._fetch()
        a.flags.writeable = False
        return a

    def read_value(self):
        return self._fetch()

    def numpy(self) -> np.ndarray:
        return self._fetch()

    def _read_for_array(self):
        return self._fetch()


class RemoteVariable(_FetchedReads, Variable):
    """A variable held by parameter server ``server`` (see the module docstring)."""

    _kind = "RemoteVariable"

    @classmethod
    def _handle(cls, vid: int, server: int, shape, dtype, name: str, trainable: bool,
                sync, agg) -> "RemoteVariable":
        v = object.__new__(cls)
        v._vid = vid
        v._server = server
        v._shape = tuple(int(n) for n in shape)
        v._dtype = np.dtype(dtype)
        v._name = name
        v._trainable = trainable
        v._sync = sync
        v._agg = agg
        v._parent = None
        return v

    def __reduce__(self):
        return (_remote_variable, (self._vid, self._server, self._shape, self._dtype.str,
                                   self._name, self._trainable, self._sync.value,
                                   self._agg.value))

    # --- what it is -----------------------------------------------------------------
    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def device(self) -> str:
        """``/job:ps/replica:0/task:K/device:CPU:0`` for server K, as in TensorFlow."""
        return f"/job:ps/replica:0/task:{self._server}/device:CPU:0"

    @property
    def server(self) -> int:
        """The index of the server holding the value."""
        return self._server

    # --- reading and updating (one request each) --------------------------------------
    def _fetch(self) -> np.ndarray:
        _, (arr,) = request(self._server, "read", (self._vid, self._shape, self._dtype.str))
        return arr

    def _update(self, op: str, value) -> "RemoteVariable":
        arr = wire.contiguous(to_host(self._coerce(value, op)))
        request(self._server, op, (self._vid,), [arr])
        return self

    def _write(self, op: str, value) -> None:
        request(self._server, op, (self._vid,), [wire.contiguous(to_host(value))])

    def _apply_gradients(self, optimizer, grads: list, variables: list):
        return apply_gradients(optimizer, grads, variables)

    def __repr__(self) -> str:
        return (f"<gs.{self._kind} {self._name!r} shape={self._shape} dtype={self._dtype} "
                f"device={self.device}>")


def _remote_variable(vid, server, shape, dtype, name, trainable, sync, agg):
    return RemoteVariable._handle(vid, server, shape, dtype, name, trainable,
                                  VariableSynchronization(sync), VariableAggregation(agg))


def shard_rows(rows: int, num_shards: int) -> list:
    """Rows per shard along axis 0, as TensorFlow splits: the first ``rows % n`` shards
    get one row more."""
    base, extra = divmod(rows, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


class ShardedVariable(_FetchedReads, Variable):
    """A variable split along axis 0 over servers (``tf.distribute.ShardedVariable``).

    ``variables`` lists the shards (remote variables) in order; reading concatenates
    them, updates split the value along axis 0.
    """

    _kind = "ShardedVariable"

    @classmethod
    def _from_shards(cls, shards: list, name: str) -> "ShardedVariable":
        v = object.__new__(cls)
        v._shards = list(shards)
        first = shards[0]
        v._shape = (sum(s.shape[0] for s in shards),) + tuple(first.shape[1:])
        v._dtype = first.dtype
        v._name = name
        v._trainable = first.trainable
        v._sync = first.synchronization
        v._agg = first.aggregation
        v._parent = None
        return v

    @property
    def variables(self) -> list:
        """The shards, in order along axis 0."""
        return list(self._shards)

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def device(self) -> str:
        return self._shards[0].device

    def _fetch(self) -> np.ndarray:
        return np.concatenate([s._fetch() for s in self._shards], axis=0)

    def _split(self, arr) -> list:
        bounds = np.cumsum([s.shape[0] for s in self._shards])[:-1]
        return np.split(arr, bounds, axis=0)

    def _update(self, op: str, value) -> "ShardedVariable":
        arr = wire.contiguous(to_host(self._coerce(value, op)))
        for s, part in zip(self._shards, self._split(arr)):
            s._write(op, part)
        return self

    def _write(self, op: str, value) -> None:
        for s, part in zip(self._shards, self._split(np.asarray(to_host(value)))):
            s._write(op, part)

    def _apply_gradients(self, optimizer, grads: list, variables: list):
        return apply_gradients(optimizer, grads, variables)

    def __reduce__(self):
        return (_sharded_variable, (self._shards, self._name))

    def __repr__(self) -> str:
        return (f"<gs.{self._kind} {self._name!r} shape={self._shape} dtype={self._dtype} "
                f"shards={len(self._shards)}>")


def _sharded_variable(shards, name):
    return ShardedVariable._from_shards(shards, name)


# --- optimizer steps on the servers ------------------------------------------------

def _server_copy(optimizer) -> bytes:
    """The optimizer without its state, for a server to call ``update_step`` on."""
    clone = copy.copy(optimizer)
    state = dict(optimizer.__dict__)
    for k in ("_iterations", "_slots", "_slot_list", "_plans", "_last_plan"):
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
    iterations = optimizer._iterations
    if not isinstance(iterations, RemoteVariable):
        raise ValueError(
            f"{type(optimizer).__name__} trains variables on parameter servers but was "
            "made outside the ParameterServerStrategy's scope: make the optimizer inside "
            "strategy.scope(), like the variables")
    per_server: dict = {}
    for g, v in zip(grads, variables):
        if isinstance(v, ShardedVariable):
            g = _gradient(g, v)
            for s, part in zip(v._shards, v._split(g)):
                per_server.setdefault(s._server, ([], []))
                per_server[s._server][0].append(s._vid)
                per_server[s._server][1].append(wire.contiguous(part))
        elif isinstance(v, RemoteVariable):
            per_server.setdefault(v._server, ([], []))
            per_server[v._server][0].append(v._vid)
            per_server[v._server][1].append(_gradient(g, v))
        else:
            raise ValueError(
                f"{type(optimizer).__name__}.apply_gradients: variable {v.name!r} is not "
                "on the parameter servers (it was made outside the ParameterServerStrategy's "
                "scope); train the strategy's variables together, or separately")
    # Counting the step first gives each concurrent step its own step number.
    _, (count,) = request(iterations._server, "assign_read",
                          (iterations._vid, "assign_add"), [np.ones((), np.int64)])
    step = int(count)
    lr = optimizer._learning_rate
    if callable(lr):
        lr = lr(step - 1)
    lr = float(to_host(lr)) if not isinstance(lr, (int, float)) else float(lr)
    key = iterations._vid
    blob = None
    for server, (vids, arrays) in per_server.items():
        reply, _ = request(server, "apply", (key, lr, step, vids), arrays)
        if reply == "need optimizer":
            blob = blob or _server_copy(optimizer)
            request(server, "optimizer", (key, blob))
            request(server, "apply", (key, lr, step, vids), arrays)
    return iterations


def _gradient(g, v) -> np.ndarray:
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


def slot(optimizer, var: RemoteVariable, name: str) -> np.ndarray:
    """The value of slot ``name`` of ``var`` (read from its server)."""
    _, (arr,) = request(var._server, "slot", (optimizer._iterations._vid, var._vid, name))
    return arr
