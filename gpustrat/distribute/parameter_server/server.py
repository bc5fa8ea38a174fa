"""A parameter server: holds variables and applies updates, one request at a time.

Requests (see :mod:`.channel`) are handled in arrival order, so each update is atomic
on its variable; updates from different workers interleave (asynchronous training).
Optimizer steps run here: a worker sends the gradients, the server runs the
optimizer's ``update_step`` on its arrays and keeps the optimizer's slots (momentum,
Adam's moments) beside the variables. Each slot is a variable of this server, under a
negative id of its own (the coordinator numbers the others from 0), so that it is read
and assigned as any variable is.
"""

from __future__ import annotations

import pickle
import re
import time
import traceback

import numpy as np

from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.channel import (ERR_OFFSET, FAST_OPS, TAG_FAST,
                                                           Channel, transfer_spin)
from gpustrat.distribute.parameter_server.staging import STAGED


#: How long a server polls for the next request before it sleeps: after a request that
#: came within ``LINGER_S`` of the one before, and after others.
LINGER_S, POLL_S = 300e-6, 50e-6


class _Var:
    __slots__ = ("array", "name")

    def __init__(self, array, name):
        self.array = array
        self.name = name


class Server:
    """The loop of one server rank; :meth:`serve` returns when the coordinator stops it."""

    def __init__(self, ch: Channel, index: int, memory_limit: int | None):
        self.ch = ch
        self.index = index
        self.memory_limit = memory_limit
        self.vars: dict = {}
        self.nbytes = 0
        #: optimizer key -> (the optimizer, the settings it came with: see op_apply)
        self.optimizers: dict = {}
        #: (optimizer key, variable id) -> {slot name: the slot's variable id}
        self.slots: dict = {}
        #: (optimizer key, variable id) -> {slot name: the slot's array}, for steps
        self.slot_arrays: dict = {}
        self._next_slot_id = -1
        self._scratch: dict = {}
        self._header = np.empty(4, np.int64)

    def serve(self, watch=None) -> None:
        comm = self.ch.comm
        # After a request that came within LINGER_S of the one before, poll that long
        # before sleeping: its caller reads or updates in a loop, and waking a sleeping
        # rank costs more than the transfer of a MiB. Requests further apart (training
        # steps) get the short poll: lingering would take processor time from the
        # processes that compute (the polls yield a busy core, but still cost).
        backoff = self.ch.backoff()
        sleep = self.ch.sleeper()  # every request rings this rank's doorbell
        any_source, any_tag = _any_source(), _any_tag()
        if sleep is not None and self.ch.staging is not None:
            # Counted while asleep: a caller on this machine rings only then.
            sleep = self.ch.staging.counted(
                sleep, lambda: comm.Iprobe(source=any_source, tag=any_tag))
        status = _status()
        idle_from = None
        while True:
            # Any tag: per source, a request's header always comes before its data.
            msg = comm.improbe(source=any_source, tag=any_tag, status=status)
            if msg is None:
                if idle_from is None:
                    idle_from = time.perf_counter()
                backoff(sleep)
                if watch is not None and backoff.delay >= 1e-3:
                    watch()
                continue
            if idle_from is not None:
                backoff.spin_s = LINGER_S if time.perf_counter() - idle_from < LINGER_S \
                    else POLL_S
                idle_from = None
            backoff.reset()
            source = status.Get_source()
            if status.Get_tag() == TAG_FAST:
                self._fast(msg, source)
                continue
            (op, tag, args), ms = msg.recv()
            arrays = self._receive(source, tag, ms, op, args) if ms else []
            if op == "stop":
                self.ch.send(source, tag, ("ok", None))
                return
            try:
                payload, out = getattr(self, "op_" + op)(*args, arrays=arrays)
                reply = ("ok", payload)
            except Exception as e:  # noqa: BLE001 - every error goes back to the caller
                reply = ("error", (type(e).__name__, f"parameter server {self.index} "
                                   f"(rank {self.ch.rank}): {e}"))
                out = []
                if not isinstance(e, (ValueError, TypeError, KeyError, MemoryError)):
                    reply = ("error", ("RuntimeError", reply[1][1] + "\n" +
                                       traceback.format_exc()))
            self.ch.send(source, tag, reply, out, data_tag=tag)

    def _fast(self, msg, source: int) -> None:
        """A read or update (see channel.FAST_CODES)."""
        comm = self.ch.comm
        header = self._header
        msg.Recv(header)
        code, tag, vid, nbytes = header.tolist()
        if code & STAGED:
            self._staged(source, code, tag, vid, nbytes)
            return
        var = self.vars.get(vid)
        fits = nbytes and var is not None and var.array.nbytes == nbytes
        if code == 1 and fits:
            self.ch.recv_into(source, tag, [var.array])  # in place
            comm.Send(_ACK, dest=source, tag=tag)
            self.ch.ring_waiter(source)
            return
        value = None
        if nbytes:  # taken before the answer, whatever it is (the caller waits)
            value = self._scratch.get(("fast", nbytes))
            if value is None:
                value = self._scratch[("fast", nbytes)] = np.empty(nbytes, np.uint8)
            self.ch.recv_into(source, tag, [value])
        try:
            var = self._var(vid)
            a = var.array
            if code == 0:
                sent = comm.Isend(wire.raw(a), dest=source, tag=tag)
                self.ch.ring(source)
                # Until the reader has the bytes, no update may change them. Polled
                # about as long as the bytes take to move (the reader is receiving).
                self.ch.wait([sent], source, f"sending variable {var.name!r} to it",
                             spin_s=transfer_spin(a.nbytes))
                return
            self._check_size(var, code, nbytes)
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self._fast_error(source, tag, e)
            return
        # Acknowledged on arrival, applied right after: the caller need not wait for
        # the arithmetic, and every later request (of any process) is handled after
        # it, so each still sees the update.
        comm.Send(_ACK, dest=source, tag=tag)
        self.ch.ring_waiter(source)
        if nbytes:
            _add(a, value.view(a.dtype).reshape(a.shape), code == 3)

    def _staged(self, source: int, code: int, tag: int, vid: int, nbytes: int) -> None:
        """An update whose value waits in the caller's slot (see :mod:`.staging`)."""
        staging = self.ch.staging
        try:
            var = self._var(vid)
            self._check_size(var, code & 7, nbytes)
        except Exception as e:  # noqa: BLE001 - the caller raises it
            staging.release(source, code)
            self._fast_error(source, tag, e)
            return
        # Acknowledged first, as above; the caller writes this slot again only after
        # the release below.
        self.ch.comm.Send(_ACK, dest=source, tag=tag)
        self.ch.ring_waiter(source)
        a = var.array
        _add(a, staging.incoming(source, code, nbytes).view(a.dtype).reshape(a.shape),
             code & 7 == 3)
        staging.release(source, code)

    @staticmethod
    def _check_size(var: _Var, code: int, nbytes: int) -> None:
        """An update the server can apply, checked before it is acknowledged (after
        that, an error could reach no caller)."""
        if nbytes != var.array.nbytes:
            raise ValueError(f"{FAST_OPS[code]} of variable {var.name!r} got "
                             f"{nbytes} bytes for its {var.array.nbytes}")
        if var.array.dtype.kind not in _UPDATABLE[code]:
            raise TypeError(f"{FAST_OPS[code]} of variable {var.name!r} of dtype "
                            f"{var.array.dtype}: NumPy has no such arithmetic for it "
                            "(assign a new value instead)")

    def _fast_error(self, source: int, tag: int, e: Exception) -> None:
        self.ch.send(source, tag + ERR_OFFSET, ("error", (
            type(e).__name__, f"parameter server {self.index} (rank {self.ch.rank}): "
            f"{e}")))

    def _receive(self, source: int, tag: int, ms: list, op: str, args: tuple) -> list:
        """The request's arrays: an assign lands in the variable itself; other updates
        and gradients in buffers kept from one request to the next (fresh pages cost
        more than the copy)."""
        var = self.vars.get(args[0]) if op == "assign" and args else None
        if var is not None and len(ms) == 1 and np.dtype(ms[0][0]) == var.array.dtype \
                and tuple(ms[0][1]) == var.array.shape:
            self.ch.recv_into(source, tag, [var.array])
            return [var.array]
        out = []
        for dt, shape in ms:
            key = (dt, tuple(shape), len(out))
            buf = self._scratch.get(key)
            if buf is None:
                buf = self._scratch[key] = np.empty(shape, np.dtype(dt))
            out.append(buf)
        self.ch.recv_into(source, tag, out)
        return out

    # --- operations: (args..., arrays) -> (payload, arrays) ---------------------------
    def _var(self, vid: int) -> _Var:
        try:
            return self.vars[vid]
        except KeyError:
            raise KeyError(f"no variable #{vid} here (was it made in this job's "
                           "strategy.scope()?)") from None

    def op_create(self, vid: int, name: str, dtype: str, shape: tuple, arrays):
        """Make the variable (zeros); its value follows in an ``assign``."""
        if vid in self.vars:
            raise ValueError(f"variable #{vid} ({name!r}) exists already")
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if self.memory_limit is not None and self.nbytes + nbytes > self.memory_limit:
            raise MemoryError(
                f"variable {name!r} of shape {tuple(shape)} {dtype} needs {nbytes} bytes "
                f"but this server holds {self.nbytes} of its {self.memory_limit} bytes "
                "(server_memory_limit): shard it over the servers with "
                "variable_partitioner (e.g. MaxSizePartitioner) or use more servers")
        try:
            held = np.zeros(shape, dtype)
        except MemoryError:
            raise MemoryError(f"variable {name!r} of {nbytes} bytes does not fit in this "
                              "server's memory: shard it with variable_partitioner or use "
                              "more servers") from None
        self.vars[vid] = _Var(held, name)
        self.nbytes += held.nbytes
        return None, []

    def op_delete(self, vid: int, arrays):
        """Forget variable ``vid`` (a shard of a variable whose other shards could not
        be made), freeing its bytes for later variables."""
        var = self.vars.pop(vid, None)
        if var is not None:
            self.nbytes -= var.array.nbytes
        return None, []

    def op_read(self, vid: int, *described, arrays):
        return None, [self._var(vid).array]

    def op_assign(self, vid: int, arrays):
        self._var(vid).array[...] = arrays[0]
        return None, []

    def op_assign_add(self, vid: int, arrays):
        self._var(vid).array += arrays[0]
        return None, []

    def op_assign_sub(self, vid: int, arrays):
        self._var(vid).array -= arrays[0]
        return None, []

    def op_assign_read(self, vid: int, update: str, arrays):
        getattr(self, "op_" + update)(vid, arrays=arrays)
        return None, [self._var(vid).array]

    def op_apply(self, key, lr: float, step, vids: list, settings: tuple,
                 blob: bytes | None = None, *, arrays):
        """One optimizer step on variables ``vids``; ``step`` None: this server holds
        the optimizer's ``iterations`` (variable ``key``) and counts the step first.
        Returns the step, or ``"need optimizer"`` (nothing done) when this server does
        not hold the optimizer with the caller's ``settings`` (its hyperparameters):
        the caller sends the step again with the optimizer (``blob``), which replaces
        the one held."""
        if blob is not None:
            self.optimizers[key] = (pickle.loads(blob), settings)
        held = self.optimizers.get(key)
        if held is None or held[1] != settings:
            return "need optimizer", []
        opt = held[0]
        if step is None:
            count = self._var(key).array
            count += 1
            step = int(count)
        for vid, grad in zip(vids, arrays):
            var = self._var(vid)
            slots = self.slot_arrays.get((key, vid))
            if slots is None or len(slots) != len(opt.slot_names):
                self._make_slots(key, vid, opt.slot_names, opt)
                slots = self.slot_arrays[(key, vid)]
            if grad.shape != var.array.shape:
                raise ValueError(f"the gradient of variable {var.name!r} has shape "
                                 f"{grad.shape} but the variable has {var.array.shape}")
            if opt.weight_decay:
                # A shard ("w/part_0") decays as its whole variable ("w") does.
                opt.decay(var.array, lr, _SHARD_SUFFIX.sub("", var.name))
            opt.update_step(var.array, grad.astype(var.array.dtype, copy=False), slots,
                            lr, step, var.name)
        return step, []

    def _make_slots(self, key, vid: int, names, opt=None) -> dict:
        """The slots ``names`` of variable ``vid`` for optimizer ``key``, made where
        missing (at ``opt``'s initial slot values; zeros without ``opt``: a restore
        writes them next); ``{name: slot variable id}``."""
        var = self._var(vid)
        ids = self.slots.setdefault((key, vid), {})
        arrays = self.slot_arrays.setdefault((key, vid), {})
        for name in names:
            if name not in ids:
                sid = self._next_slot_id
                self._next_slot_id -= 1
                start = 0.0 if opt is None else opt.slot_initial_value(name)
                self.vars[sid] = _Var(np.full_like(var.array, start), f"{var.name}/{name}")
                ids[name] = sid
                arrays[name] = self.vars[sid].array
        return dict(ids)

    def op_slot(self, key, vid: int, name: str, arrays):
        """The id of a slot variable, None before the first step made it."""
        self._var(vid)
        return self.slots.get((key, vid), {}).get(name), []

    def op_make_slots(self, key, vid: int, names: tuple, arrays):
        return self._make_slots(key, vid, names), []

    def op_slots(self, key, arrays):
        """``{variable id: {slot name: slot variable id}}`` of optimizer ``key``."""
        return {vid: dict(ids) for (k, vid), ids in self.slots.items() if k == key}, []

    def op_stats(self, arrays):
        return {"variables": len(self.vars), "nbytes": self.nbytes}, []


#: The suffix ParameterServerStrategy gives a sharded variable's parts.
_SHARD_SUFFIX = re.compile(r"/part_\d+$")
_ACK = np.zeros(1, np.int64)
#: Fast request code -> dtype kinds it applies to (booleans add as a logical or, as
#: NumPy does; nothing subtracts them).
_UPDATABLE = {1: "biufcSUVMmO", 2: "biufc", 3: "iufc"}


def _add(array, delta, subtract: bool) -> None:
    """``array += delta`` (``-=`` when ``subtract``), in place."""
    if subtract:
        np.subtract(array, delta, out=array)
    else:
        np.add(array, delta, out=array)


def _any_tag() -> int:
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().ANY_TAG


def _any_source() -> int:
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().ANY_SOURCE


def _status():
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().Status()
