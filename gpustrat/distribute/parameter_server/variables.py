"""Variables that live on parameter servers, and optimizer steps applied there.

A :class:`RemoteVariable` is a handle: its value is held by one server rank, and every
read (``read_value``, ``numpy``, arithmetic) and update (``assign``, ``assign_add``,
``assign_sub``) is one request to that server, from the coordinator or from a function
running on a worker. Handles travel by value (a few numbers), so a scheduled function
that uses a variable reaches the same server array.

A :class:`ShardedVariable` is a variable split along axis 0 into remote shards on
several servers (``variable_partitioner``); reads concatenate, updates split.

Optimizers reach their steps, slots and checkpoint state on the servers through the
variables' methods below (see :mod:`.optimizers`).
"""

from __future__ import annotations

import numpy as np

from gpustrat.devices import to_device, to_host
from gpustrat.distribute import context
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
    (``value()`` read-only, as a variable's value is). Inside ``strategy.run`` on a GPU
    replica, ``value()`` and ``read_value()`` give it on the replica's device, as
    TensorFlow copies a parameter server's variable to the worker's device that reads
    it; ``numpy()`` is always on the host."""

    def value(self):
        a = self._fetch()
        a.flags.writeable = False
        return _on_replica_device(a)

    def read_value(self):
        return _on_replica_device(self._fetch())

    def numpy(self) -> np.ndarray:
        return self._fetch()

    def _read_for_array(self):
        return self._fetch()


def _on_replica_device(a: np.ndarray):
    """``a``, copied to the device of the replica whose ``strategy.run`` reads it when
    that is a GPU."""
    strategy, ctx = context.current()
    if ctx is None or strategy is None:
        return a
    device = strategy.local_devices[ctx.local_index]
    return to_device(a, device) if device.is_gpu else a


class _HeldElsewhere:
    """What an optimizer or a metric asks of a variable held on the servers."""

    #: Updates are applied one at a time at the server: replicas may update it at once.
    _atomic_updates = True

    def _apply_gradients(self, optimizer, grads: list, variables: list):
        from gpustrat.distribute.parameter_server import optimizers  # noqa: PLC0415
        return optimizers.apply_gradients(optimizer, grads, variables)

    def _get_slot(self, optimizer, name: str):
        from gpustrat.distribute.parameter_server import optimizers  # noqa: PLC0415
        return optimizers.get_slot(optimizer, self, name)

    # An optimizer whose ``iterations`` is held here keeps its state on the servers.
    def _optimizer_slot_variables(self, optimizer) -> list:
        from gpustrat.distribute.parameter_server import optimizers  # noqa: PLC0415
        return optimizers.slot_variables(optimizer)

    def _optimizer_checkpoint_state(self, optimizer, keys) -> dict:
        from gpustrat.distribute.parameter_server import optimizers  # noqa: PLC0415
        return optimizers.checkpoint_state(optimizer, keys)

    def _prepare_optimizer_restore(self, optimizer, state: dict, keys):
        from gpustrat.distribute.parameter_server import optimizers  # noqa: PLC0415
        return optimizers.prepare_restore(optimizer, state, keys)


class RemoteVariable(_HeldElsewhere, _FetchedReads, Variable):
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
        v._described = wire.describe_dtype(v._dtype)
        v._name = name
        v._trainable = trainable
        v._sync = sync
        v._agg = agg
        v._parent = None
        return v

    def __reduce__(self):
        return (_remote_variable, (self._vid, self._server, self._shape, self._described,
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
        _, (arr,) = request(self._server, "read", (self._vid, self._shape, self._described))
        return arr

    def _update(self, op: str, value) -> "RemoteVariable":
        if type(value) is np.ndarray and value.dtype == self._dtype and \
                value.shape == self._shape and value.flags.c_contiguous:
            arr = value  # sent from its own memory, as it is
        else:
            arr = wire.contiguous(to_host(self._coerce(value, op)))
        request(self._server, op, (self._vid,), [arr])
        return self

    def _write(self, op: str, value) -> None:
        request(self._server, op, (self._vid,), [wire.contiguous(to_host(value))])

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


class ShardedVariable(_HeldElsewhere, _FetchedReads, Variable):
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
        parts = [s._fetch() for s in self._shards]
        # In the shards' own dtype (concatenate would give a big-endian one native order).
        return np.concatenate(parts, axis=0, dtype=parts[0].dtype)

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

    def __reduce__(self):
        return (_sharded_variable, (self._shards, self._name))

    def __repr__(self) -> str:
        return (f"<gs.{self._kind} {self._name!r} shape={self._shape} dtype={self._dtype} "
                f"shards={len(self._shards)}>")


def _sharded_variable(shards, name):
    return ShardedVariable._from_shards(shards, name)
