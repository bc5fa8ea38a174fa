"""A worker rank: keeps one function process alive and relays between it, the
coordinator and the servers.

MPI launchers end the whole job when a rank dies of a signal, so user code never runs
in the rank itself: it runs in a child process (:mod:`.executor`), started once and
reused. When that process dies (a crash, a kill, ``os._exit``), the rank tells the
coordinator what it was doing (the coordinator runs a function again elsewhere),
starts a replacement and makes this worker's datasets, iterators and other per-worker
values in it again. A value whose making ends the process more than ``max_retries``
times is not made again: the coordinator gets its error if it waits for it, and the
functions that use it on this worker fail with it.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import subprocess
import sys

from gpustrat.distribute.parameter_server import doorbell
from gpustrat.distribute.parameter_server.channel import (TAG_RESULT, TAG_RESULT_DATA,
                                                           TAG_TASK, TAG_TASK_DATA,
                                                           Channel, ServerLostError)
from gpustrat.distribute.parameter_server.pipe import Pipe

# The launcher's variables would make a child that imports mpi4py join the MPI job.
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "MPIR_", "HYDRA_", "HYDI_", "OMPI_", "MPICH_")


def _child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    # The script's folder, so that functions of modules beside it import by reference.
    here = sys.path[0] if sys.path and sys.path[0] else os.getcwd()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


def one_cpu_warning(index: int, rank: int, cpus=None, cpu_count=None) -> str | None:
    """What to tell a user whose launcher bound worker ``index`` (rank ``rank``) to a
    single CPU of a machine with more (``cpus``: its affinity, default this process's):
    its function process inherits that CPU, and the rank's relaying then takes time
    from the functions. None when the rank may use more than one CPU."""
    try:
        cpus = os.sched_getaffinity(0) if cpus is None else cpus
    except (AttributeError, OSError):  # no affinity on this platform
        return None
    cpu_count = os.cpu_count() if cpu_count is None else cpu_count
    if len(cpus) != 1 or (cpu_count or 1) < 2:
        return None
    return (f"gpustrat: worker {index} (rank {rank}) may run on CPU {min(cpus)} only, and "
            "its function process, where the scheduled functions run, shares that CPU "
            "with it. Give each worker rank two CPUs (srun -c 2; MPICH: mpiexec -bind-to "
            "core:2; Open MPI: mpirun --map-by slot:PE=2; Intel MPI: I_MPI_PIN_DOMAIN=2), "
            "or launch without binding (srun --cpu-bind=none; mpiexec -bind-to none; "
            "Intel MPI, which pins every rank by default: I_MPI_PIN=0)")


class FunctionProcess:
    """The child process running this worker's functions."""

    def __init__(self, info: dict):
        self.info = info
        self.proc = None
        self.conn = None

    def start(self) -> None:
        parent, child = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpustrat.distribute.parameter_server.executor",
             str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),), env=_child_env(), stdin=subprocess.DEVNULL)
        child.close()
        self.conn = Pipe(parent)
        self.conn.send(("init", self.info))

    def exit_code(self):
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.conn.close()


class WorkerRank:
    def __init__(self, ch: Channel, index: int, num_workers: int, devices: list):
        self.ch = ch
        self.index = index
        self.info = {"worker": index, "num_workers": num_workers, "devices": devices}
        #: (kind, id, payload, arrays, what, max_retries) of every per-worker value made
        #: here (datasets, iterators, resources, sent values), in order.
        self.setups: list = []
        #: Exit codes of the processes that died making each value (by id).
        self.deaths: dict = {}
        #: Why each value no longer made here is missing (by id).
        self.broken: dict = {}
        self.unanswered: set = set()  # setups the coordinator waits for
        #: Messages for the process, sent one at a time: while it runs a function it
        #: reads only the answers to its variable requests from the pipe.
        self.outbox: collections.deque = collections.deque()
        #: What the process is doing: None, ("run", task id) or ("setup", id).
        self.inflight = None
        #: Messages to the coordinator not yet taken (Channel.send's pending sends).
        self.sending: list = []
        self.fp = None

    def _start(self) -> None:
        self.fp = FunctionProcess(dict(self.info, broken=dict(self.broken)))
        self.fp.start()
        self.inflight = None
        for kind, ident, payload, arrays, _, _ in self.setups:
            if ident in self.broken:
                continue
            # The coordinator still waits for those the lost process had not answered.
            notify = ident in self.unanswered
            self.outbox.append((("setup", kind, ident, payload, notify), arrays,
                                ("setup", ident)))
        self._pump()

    def _pump(self) -> None:
        if self.inflight is not None or not self.outbox:
            return
        header, arrays, what = self.outbox.popleft()
        self.inflight = what
        try:
            self.fp.conn.send(header, arrays)
        except OSError:
            pass  # the process is gone: found by the loop

    def _to_coordinator(self, header, arrays=()) -> None:
        # Not waited for: the coordinator may be sending this rank a task meanwhile.
        self.sending.append(self.ch.send(0, TAG_RESULT, header, arrays,
                                         data_tag=TAG_RESULT_DATA, slot=doorbell.RESULTS,
                                         wait=False))

    def _lost(self) -> None:
        code = self.fp.proc.wait()
        try:
            self.fp.conn.close()
        except OSError:
            pass
        doing = self.inflight or (None, None)
        running = doing[1] if doing[0] == "run" else None
        queued = [what[1] for _, _, what in self.outbox if what[0] == "run"]
        self.outbox.clear()  # setups are made again by _start
        setup, failed = self._setup_lost(doing[1], code) if doing[0] == "setup" else \
            (None, None)
        self._to_coordinator(("lost", running, queued, code, setup))
        if failed is not None:
            self._to_coordinator(failed)
        self._start()

    def _setup_lost(self, ident: int, code):
        """Count a process that died making value ``ident``: a scheduled function's
        rule (it fails after more than ``max_retries`` lost processes). Returns what the
        coordinator is told: ``(what, ident, attempts, gave_up)``, and the failed
        ``setup_done`` when it waits for that value and it is given up."""
        what, retries = next((w, r) for _, i, _, _, w, r in self.setups if i == ident)
        codes = self.deaths.setdefault(ident, [])
        codes.append(code)
        gave_up = len(codes) > retries
        failed = None
        if gave_up:
            died = (f"its function process died {len(codes)} times while making it (exit "
                    f"codes {', '.join(map(str, codes))}; max_retries={retries}): the "
                    "function that makes it probably ends the process itself (os._exit, "
                    "a signal, memory exhaustion)")
            self.broken[ident] = (f"worker {self.index} has no per-worker {what} #{ident}: "
                                  f"{died}. Functions that use it there fail")
            if ident in self.unanswered:
                self.unanswered.discard(ident)
                failed = ("setup_done", ident, ("RuntimeError", died))
        return (what, ident, len(codes), gave_up), failed

    def serve(self, watch=None) -> None:
        try:
            self._serve(watch)
        except BaseException:
            if self.fp is not None and self.fp.proc is not None:
                self.fp.proc.kill()
            raise

    def _serve(self, watch) -> None:
        comm = self.ch.comm
        warning = one_cpu_warning(self.index, self.ch.rank)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        self._start()
        backoff = self.ch.backoff()
        while True:
            busy = False
            msg = comm.improbe(source=0, tag=TAG_TASK)
            if msg is not None:
                busy = True
                header, ms = msg.recv()
                arrays = self.ch.recv_arrays(0, TAG_TASK_DATA, ms) if ms else []
                kind = header[0]
                if kind == "stop":
                    self.fp.stop()
                    self._to_coordinator(("stopped",))
                    for requests, _ in self.sending:
                        self.ch.wait(requests, 0, "sending to the coordinator")
                    return
                if kind == "ping":  # the coordinator asks whether this rank is there
                    self._to_coordinator(("pong",))
                elif kind == "server_lost":  # requests to it now fail at once
                    self.ch.lost.add(header[1])
                elif kind == "run":
                    self.outbox.append((header, arrays, ("run", header[1])))
                elif kind == "setup":
                    _, how, ident, payload, what, retries = header
                    self.setups.append((how, ident, payload, arrays, what, retries))
                    self.unanswered.add(ident)
                    self.outbox.append((("setup", how, ident, payload, True), arrays,
                                        ("setup", ident)))
                self._pump()
            conn = self.fp.conn
            try:
                ready = bool(select.select([conn.fileno()], [], [], 0)[0])
            except (OSError, ValueError):
                ready = True
            if ready:
                busy = True
                try:
                    # Views of the process's arena: a variable request's arrays go to
                    # the server from there (see _from_process).
                    header, arrays = conn.recv(views=True)
                except (EOFError, OSError):
                    self._lost()
                    continue
                self._from_process(header, arrays)
            elif self.fp.exit_code() is not None:
                self._lost()
                continue
            if self.sending:
                self.sending = self.ch.done(self.sending)
            if busy:
                backoff.reset()
            else:
                # Asleep on the doorbell and the pipe: a task of the coordinator or a
                # message of the function process wakes this rank at once.
                backoff(self._sleep)
                if watch is not None and backoff.delay >= 1e-3:
                    watch()

    def _sleep(self, seconds: float) -> bool:
        bell = self.ch.bells.get(doorbell.REPLIES)
        try:
            pipe = self.fp.conn.fileno()
        except OSError:
            return True  # the process is gone: found by the loop
        if bell is None:
            return bool(select.select([pipe], [], [], seconds)[0])
        return bell.sleep(seconds, also=pipe)

    def _from_process(self, header, arrays) -> None:
        kind = header[0]
        if kind == "var":
            _, server, op, args = header
            # A read lands where the answer to the process carries it (no copy here).
            into = self.fp.conn.placed([(args[2], args[1])]) \
                if op == "read" and len(args) == 3 and not arrays else None
            try:
                payload, out = self.ch.request(server, op, args, arrays,
                                               into=into[0] if into else None)
                reply = ("var_reply", "ok", payload)
            except Exception as e:  # noqa: BLE001 - the function gets the error
                reply, out = ("var_reply", "error", (type(e).__name__, str(e))), []
                if isinstance(e, ServerLostError):
                    self._to_coordinator(("server_lost", self.ch.server_ranks[server],
                                          str(e)))
            try:
                self.fp.conn.send(reply, out)
            except OSError:
                pass
            return
        # Other arrays outlive the next message to the process: copies of the views.
        arrays = [a.copy() for a in arrays]
        if kind in ("done", "error"):
            self.inflight = None
            self._to_coordinator(header, arrays)
        elif kind == "setup_done":
            self.inflight = None
            _, ident, notify, err = header
            self.unanswered.discard(ident)
            if notify:
                self._to_coordinator(("setup_done", ident, err))
        self._pump()
