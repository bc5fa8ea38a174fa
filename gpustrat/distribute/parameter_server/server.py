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

import os
import pickle
import threading
import time
import traceback

import numpy as np

from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.channel import (ERR_OFFSET, FAST_OPS, TAG_FAST,
                                                           Channel, transfer_spin)


#: How long a server polls for the next request before it sleeps: after a request that
#: came within ``LINGER_S`` of the one before, and after others.
LINGER_S, POLL_S = 300e-6, 50e-6


class _Applier:
    """A thread that adds received updates into their variables while the server's
    loop takes the next request's bytes.

    At most one addition is pending; :meth:`join` waits for it. The loop joins before
    it handles any request other than a fast update (whose bytes land in a buffer the
    pending addition does not use) and before it starts the next addition, so every
    later request still sees each update, and updates apply in arrival order.
    NumPy releases the interpreter lock for the arithmetic, so it runs beside MPI.
    """

    def __init__(self):
        self._go = threading.Lock()
        self._go.acquire()
        self._idle = threading.Lock()
        self._job = None
        #: the buffer that the pending addition reads (None: none pending)
        self.pending = None
        self._failed = None
        threading.Thread(target=self._run, name="gpustrat-ps-apply", daemon=True).start()

    def apply(self, var, delta, subtract: bool, buffer) -> None:
        """Start ``var.array += delta`` (``-=`` when ``subtract``) after the pending
        one; ``buffer`` holds ``delta``'s bytes until :meth:`join`."""
        self._idle.acquire()
        self.pending = buffer
        self._job = (var, delta, subtract)
        self._go.release()

    def join(self) -> str | None:
        """Wait for the pending addition; what went wrong with it, None if nothing."""
        if self.pending is None:
            return None
        with self._idle:
            self.pending = None
            failed, self._failed = self._failed, None
        return failed

    def _run(self) -> None:
        go, idle = self._go, self._idle
        while True:
            go.acquire()
            var, delta, subtract = self._job
            self._job = None
            try:
                _add(var.array, delta, subtract)
            except Exception as e:  # noqa: BLE001 - reported by the next request
                self._failed = (f"an earlier update of variable {var.name!r} could not "
                                f"be applied: {type(e).__name__}: {e}")
            finally:
                idle.release()


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
        self.optimizers: dict = {}
        #: (optimizer key, variable id) -> {slot name: the slot's variable id}
        self.slots: dict = {}
        #: (optimizer key, variable id) -> {slot name: the slot's array}, for steps
        self.slot_arrays: dict = {}
        self._next_slot_id = -1
        self._scratch: dict = {}
        self._header = np.empty(4, np.int64)
        #: Adds updates in a thread of its own (see _Applier) when this machine has a
        #: core for it beside one per rank; else in the loop, right after the answer.
        self._threaded = spare_core(ch)
        self._applier: _Applier | None = None

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
            failed = self._settle()
            arrays = self._receive(source, tag, ms, op, args) if ms else []
            if op == "stop":
                self.ch.send(source, tag, ("ok", None))
                return
            try:
                if failed is not None:
                    raise RuntimeError(failed)
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
        code, tag, vid, nbytes = (int(x) for x in header)
        var = self.vars.get(vid)
        fits = nbytes and var is not None and var.array.nbytes == nbytes
        value = None
        if code in (2, 3) and fits:
            # Acknowledged on arrival and applied by the applier thread while this loop
            # takes the next request: the caller need not wait for the arithmetic, and
            # every later request (of any process) waits for it (see _Applier).
            value = self._update_buffer(nbytes)
            self.ch.recv_into(source, tag, [value])
            failed = self._settle()
            if failed is None:
                comm.Send(_ACK, dest=source, tag=tag)
                self.ch.ring(source)
                a = var.array
                delta = value.view(a.dtype).reshape(a.shape)
                if not self._threaded:
                    _add(a, delta, code == 3)
                    return
                if self._applier is None:
                    self._applier = _Applier()
                self._applier.apply(var, delta, code == 3, value)
                return
        else:
            failed = self._settle()
            if code == 1 and fits and failed is None:
                self.ch.recv_into(source, tag, [var.array])  # in place
                comm.Send(_ACK, dest=source, tag=tag)
                self.ch.ring(source)
                return
            if nbytes:  # taken before the answer, whatever it is (the caller waits)
                value = self._update_buffer(nbytes)
                self.ch.recv_into(source, tag, [value])
        try:
            if failed is not None:
                raise RuntimeError(failed)
            var = self._var(vid)
            if code == 0:
                sent = comm.Isend(wire.raw(var.array), dest=source, tag=tag)
                self.ch.ring(source)
                # Until the reader has the bytes, no update may change them. Polled
                # about as long as the bytes take to move (the reader is receiving).
                self.ch.wait([sent], source, f"sending variable {var.name!r} to it",
                             spin_s=transfer_spin(var.array.nbytes))
                return
            if nbytes != var.array.nbytes:
                raise ValueError(f"{FAST_OPS[code]} of variable {var.name!r} got "
                                 f"{nbytes} bytes for its {var.array.nbytes}")
            # Left here: an update of a variable without elements, nothing to apply.
            comm.Send(_ACK, dest=source, tag=tag)
            self.ch.ring(source)
        except Exception as e:  # noqa: BLE001 - the caller raises it
            self.ch.send(source, tag + ERR_OFFSET, ("error", (
                type(e).__name__, f"parameter server {self.index} (rank {self.ch.rank}): "
                f"{e}")))

    def _settle(self) -> str | None:
        """Wait for the pending addition (see _Applier); what went wrong with it."""
        return self._applier.join() if self._applier is not None else None

    def _update_buffer(self, nbytes: int) -> np.ndarray:
        """A buffer of ``nbytes`` for an update's bytes, kept from one request to the
        next, that the pending addition does not read (two per size, the second made
        when first needed)."""
        bufs = self._scratch.get(("fast", nbytes))
        if bufs is None:
            bufs = self._scratch[("fast", nbytes)] = [np.empty(nbytes, np.uint8)]
        pending = self._applier.pending if self._applier is not None else None
        if bufs[0] is not pending:
            return bufs[0]
        if len(bufs) == 1:
            bufs.append(np.empty(nbytes, np.uint8))
        return bufs[1]

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

    def op_optimizer(self, key, blob: bytes, arrays):
        if key not in self.optimizers:
            self.optimizers[key] = pickle.loads(blob)
        return None, []

    def op_apply(self, key, lr: float, step, vids: list, arrays):
        """One optimizer step on variables ``vids``; ``step`` None: this server holds
        the optimizer's ``iterations`` (variable ``key``) and counts the step first.
        Returns the step."""
        opt = self.optimizers.get(key)
        if opt is None:
            return "need optimizer", []
        if step is None:
            count = self._var(key).array
            count += 1
            step = int(count)
        for vid, grad in zip(vids, arrays):
            var = self._var(vid)
            slots = self.slot_arrays.get((key, vid))
            if slots is None or len(slots) != len(opt.slot_names):
                self._make_slots(key, vid, opt.slot_names)
                slots = self.slot_arrays[(key, vid)]
            if grad.shape != var.array.shape:
                raise ValueError(f"the gradient of variable {var.name!r} has shape "
                                 f"{grad.shape} but the variable has {var.array.shape}")
            opt.update_step(var.array, grad.astype(var.array.dtype, copy=False), slots,
                            lr, step, var.name)
        return step, []

    def _make_slots(self, key, vid: int, names) -> dict:
        """The slots ``names`` of variable ``vid`` for optimizer ``key``, made (zeros)
        where missing; ``{name: slot variable id}``."""
        var = self._var(vid)
        ids = self.slots.setdefault((key, vid), {})
        arrays = self.slot_arrays.setdefault((key, vid), {})
        for name in names:
            if name not in ids:
                sid = self._next_slot_id
                self._next_slot_id -= 1
                self.vars[sid] = _Var(np.zeros_like(var.array), f"{var.name}/{name}")
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


_ACK = np.zeros(1, np.int64)


def _add(array, delta, subtract: bool) -> None:
    """``array += delta`` (``-=`` when ``subtract``), in place."""
    if subtract:
        np.subtract(array, delta, out=array)
    else:
        np.add(array, delta, out=array)


def spare_core(ch: Channel) -> bool:
    """Whether this rank may use more cores than the job has ranks on its machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return cores > ch.local_ranks


def _any_tag() -> int:
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().ANY_TAG


def _any_source() -> int:
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().ANY_SOURCE


def _status():
    from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
    return mpi().Status()
