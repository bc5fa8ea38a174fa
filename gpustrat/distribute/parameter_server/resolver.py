"""Roles of the ranks of an MPI launch, as tf.distribute's cluster resolvers name them.

Rank 0 is the coordinator (task type ``"chief"``), ranks ``1..num_ps`` the parameter
servers (``"ps"``), the remaining ranks the workers (``"worker"``). A TensorFlow
``TF_CONFIG`` (a JSON string or dict with a ``"cluster"`` entry, or the ``TF_CONFIG``
environment variable) may be given instead of ``num_ps``: its ``ps`` and ``worker``
lists set how many of each there are (the addresses are kept for ``cluster_spec()``
only; MPI connects the ranks), and they must add up, with one chief, to the ranks
launched.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import time

#: The COMM_WORLD tag of the start (or exit) message from the coordinator.
TAG_START = 7700


class ClusterSpec:
    """``tf.train.ClusterSpec``: task type -> list of task addresses."""

    def __init__(self, cluster: dict):
        self._cluster = {str(k): list(v) for k, v in dict(cluster).items()}

    def as_dict(self) -> dict:
        return {k: list(v) for k, v in self._cluster.items()}

    @property
    def jobs(self) -> list:
        return list(self._cluster)

    def num_tasks(self, job_name: str) -> int:
        return len(self._cluster.get(job_name, ()))

    def task_address(self, job_name: str, task_index: int) -> str:
        return self._cluster[job_name][task_index]

    def __eq__(self, other) -> bool:
        return isinstance(other, ClusterSpec) and other._cluster == self._cluster

    def __repr__(self) -> str:
        return f"ClusterSpec({self._cluster!r})"


def _parse_tf_config(tf_config) -> dict:
    if isinstance(tf_config, str):
        try:
            tf_config = json.loads(tf_config)
        except json.JSONDecodeError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON ({e}): {tf_config[:200]!r}"
                             ) from None
    if not isinstance(tf_config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object or dict, got {tf_config!r}")
    cluster = tf_config.get("cluster", tf_config)
    if not isinstance(cluster, dict) or not cluster:
        raise ValueError("TF_CONFIG needs a 'cluster' entry such as {'chief': [...], "
                         f"'ps': [...], 'worker': [...]}}, got {tf_config!r}")
    unknown = sorted(set(cluster) - {"chief", "ps", "worker", "evaluator"})
    if unknown:
        raise ValueError(f"TF_CONFIG's cluster has task types {unknown} that a "
                         "parameter-server job does not have: use 'chief', 'ps', 'worker'")
    for k in ("ps", "worker"):
        if not cluster.get(k):
            raise ValueError(f"TF_CONFIG's cluster has no {k!r} tasks: a parameter-server "
                             "job needs at least one 'ps' and one 'worker'")
    if len(cluster.get("chief", [None])) != 1:
        raise ValueError(f"TF_CONFIG's cluster has {len(cluster['chief'])} 'chief' tasks: "
                         "there is exactly one coordinator (MPI rank 0)")
    return {k: list(v) for k, v in cluster.items()}


class MpiClusterResolver:
    """Roles from the ranks of ``mpiexec -n K``: chief (rank 0), ``num_ps`` servers,
    ``K - 1 - num_ps`` workers.

    Args:
        num_ps: how many parameter servers (default 1, or what ``tf_config`` says).
        tf_config: a TensorFlow ``TF_CONFIG`` (JSON string or dict); by default the
            ``TF_CONFIG`` environment variable when ``num_ps`` is not given.
        rpc_layer: accepted for TensorFlow compatibility; MPI carries everything.

    Raises:
        ValueError: fewer than 3 ranks, ``num_ps`` out of range, or a ``TF_CONFIG``
            whose task counts do not match the ranks launched.
    """

    def __init__(self, num_ps: int | None = None, tf_config=None, rpc_layer: str = "mpi"):
        from gpustrat.collectives.mpi import mpi_world  # noqa: PLC0415 - starts MPI
        world = mpi_world()
        self._rank = world.Get_rank()
        self._size = world.Get_size()
        # Before any check: a rank whose arguments are refused here tells the ranks that
        # wait for it, like one that fails later in its script.
        atexit.register(self._release_at_exit)
        self.rpc_layer = rpc_layer
        if tf_config is None and num_ps is None and os.environ.get("TF_CONFIG"):
            tf_config = os.environ["TF_CONFIG"]
        addresses = None
        if tf_config is not None:
            addresses = _parse_tf_config(tf_config)
            n_ps, n_workers = len(addresses["ps"]), len(addresses["worker"])
            if num_ps is not None and int(num_ps) != n_ps:
                raise ValueError(f"num_ps={num_ps} but TF_CONFIG lists {n_ps} 'ps' tasks: "
                                 "give one or the other")
            if 1 + n_ps + n_workers != self._size:
                raise ValueError(
                    f"TF_CONFIG describes 1 chief + {n_ps} ps + {n_workers} workers = "
                    f"{1 + n_ps + n_workers} tasks but mpiexec started {self._size} ranks: "
                    f"launch with mpiexec -n {1 + n_ps + n_workers}")
            num_ps = n_ps
        num_ps = 1 if num_ps is None else int(num_ps)
        if self._size < 3:
            raise ValueError(
                f"a parameter-server job needs at least 3 MPI ranks (a coordinator, a "
                f"server and a worker) but this one has {self._size}: launch it with "
                "mpiexec -n 3 or more")
        if not 1 <= num_ps <= self._size - 2:
            raise ValueError(
                f"num_ps={num_ps} does not fit {self._size} ranks: rank 0 coordinates and "
                f"at least one rank must be a worker, so 1 <= num_ps <= {self._size - 2}")
        self.num_ps = num_ps
        self.num_workers = self._size - 1 - num_ps
        if addresses is None:
            addresses = {"chief": ["mpi-rank-0"],
                         "ps": [f"mpi-rank-{r}" for r in range(1, 1 + num_ps)],
                         "worker": [f"mpi-rank-{r}" for r in range(1 + num_ps, self._size)]}
        addresses.setdefault("chief", ["mpi-rank-0"])
        self._spec = ClusterSpec({k: addresses[k] for k in ("chief", "ps", "worker")})
        self.task_type, self.task_id = role_of(self._rank, num_ps)

    def _start(self, chief: bool, timeout: float) -> None:
        """Meet the other ranks before the strategy starts, with point-to-point messages
        only, so that no rank is left inside a collective when another one is missing:
        the coordinator sends ``start`` to every rank, each answers ``ready`` (or, when
        its script ends first, ``exit`` at its exit), and once every rank is ready the
        coordinator sends ``go``. A rank that ends before making its strategy, or does
        not answer within ``timeout`` seconds (``GPUSTRAT_TIMEOUT``), makes the
        coordinator raise a RuntimeError naming it and tell the others, which exit with
        status 1 saying so."""
        from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
        world = mpi().COMM_WORLD
        _process["met"] = True
        if chief:
            self._started = True
            self._coordinator_process = (socket.gethostname(), os.getpid())
            start = ("start",) + self._coordinator_process
            for r in range(1, self._size):
                world.send(start, dest=r, tag=TAG_START)
            self._meet(world, timeout)
            for r in range(1, self._size):
                world.send(("go",), dest=r, tag=TAG_START)
            return
        self._phase = "waiting"
        got = _receive(world, 0, float("inf"))
        if got[0] == "start":
            self._coordinator_process = got[1:]
            world.send(("ready", self._rank), dest=0, tag=TAG_START)
            self._phase = "ready"
            got = _receive(world, 0, float("inf"))  # the coordinator has a deadline
        self._phase = "done"
        if got[0] == "go":
            return
        if got[0] == "exit":
            why = "the coordinator (rank 0) ended before making its ParameterServerStrategy"
        else:  # ("abandon", text): another rank is missing
            why = got[1]
        print(f"gpustrat: {why}; {self.task_type} {self.task_id} (rank {self._rank}) exits "
              "too", file=sys.stderr, flush=True)
        sys.exit(1)

    def _meet(self, world, timeout: float) -> None:
        """On the coordinator: wait until every other rank is ready (see _start)."""
        from gpustrat.collectives.mpi import mpi  # noqa: PLC0415
        MPI = mpi()
        waiting = set(range(1, self._size))
        gone = set()
        deadline = time.monotonic() + timeout
        problem = None
        while waiting and problem is None:
            got = _receive(world, MPI.ANY_SOURCE, deadline - time.monotonic())
            if got is None:
                names = ", ".join(self._describe(r) for r in sorted(waiting))
                problem = (f"{names} did not reach ParameterServerStrategy within "
                           f"{timeout:g} s (GPUSTRAT_TIMEOUT) of the coordinator: every "
                           "rank runs the same script and makes the strategy; see those "
                           "ranks' output, or raise GPUSTRAT_TIMEOUT if they legitimately "
                           "take longer to get there")
            elif got[0] == "ready":
                waiting.discard(got[1])
            elif got[0] == "exit":
                waiting.discard(got[1])
                gone.add(got[1])
                problem = (f"{self._describe(got[1])} ended before making its "
                           "ParameterServerStrategy (its script raised an exception, "
                           "returned or called sys.exit there): every rank runs the same "
                           "script and makes the strategy; see that rank's output")
        if problem is None:
            return
        # Those waiting for "go" take this instead (one that did not answer may still
        # come: the message waits for it).
        for r in sorted(set(range(1, self._size)) - gone):
            world.send(("abandon", problem), dest=r, tag=TAG_START)
        raise RuntimeError(problem)

    def _describe(self, rank: int) -> str:
        kind, index = role_of(rank, self.num_ps)
        return f"{'parameter server' if kind == 'ps' else kind} {index} (rank {rank})"

    def coordinator_gone(self) -> bool:
        """Whether the coordinator's process has ended (known when it runs on this
        machine; a rank that dies of a signal ends the whole job anyway). A coordinator
        that leaves with ``os._exit`` stops nothing, so the other ranks check this while
        idle."""
        host, pid = getattr(self, "_coordinator_process", (None, None))
        if host != socket.gethostname():
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:  # an exited process not yet reaped by the launcher is a zombie
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        except OSError:
            return False

    def _release_at_exit(self) -> None:
        """At this process's exit: a rank whose script ends (or fails) before it makes
        its strategy tells the ranks that wait for it there (see _start)."""
        from gpustrat.collectives.mpi import waits  # noqa: PLC0415
        MPI = waits._MPI
        if MPI is None or MPI.Is_finalized():
            return
        # Once per process, and only where no resolver met the others: another resolver
        # of the script (one not given to the strategy) has nobody waiting for it.
        if _process["met"] or _process["released"]:
            return
        _process["released"] = True
        world = MPI.COMM_WORLD
        if self._rank == 0:
            if getattr(self, "_started", False):
                return
            self._started = True
            for r in range(1, self._size):
                world.send(("exit",), dest=r, tag=TAG_START)
        elif getattr(self, "_phase", None) in (None, "waiting"):
            self._phase = "done"
            world.send(("exit", self._rank), dest=0, tag=TAG_START)

    @property
    def rank(self) -> int:
        """This process's MPI rank."""
        return self._rank

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        return {}

    @property
    def environment(self) -> str:
        return "mpi"

    def rank_of(self, task_type: str, task_id: int) -> int:
        """The MPI rank of task ``task_id`` of ``task_type``."""
        if task_type == "chief":
            return 0
        if task_type == "ps":
            return 1 + task_id
        if task_type == "worker":
            return 1 + self.num_ps + task_id
        raise ValueError(f"unknown task type {task_type!r}: use 'chief', 'ps' or 'worker'")

    def __repr__(self) -> str:
        return (f"MpiClusterResolver(rank={self._rank}, task_type={self.task_type!r}, "
                f"task_id={self.task_id}, num_ps={self.num_ps}, "
                f"num_workers={self.num_workers})")


#: This process's start: whether a resolver met the other ranks (made its strategy), or
#: told them at exit that it never will.
_process = {"met": False, "released": False}


def _receive(world, source: int, timeout: float):
    """The next message on TAG_START from ``source`` (MPI.ANY_SOURCE for any), or None
    after ``timeout`` seconds; polls with a backoff (MPI's blocking receive spins)."""
    from gpustrat.distribute.parameter_server.channel import Backoff  # noqa: PLC0415
    backoff = Backoff()
    deadline = time.monotonic() + timeout
    while True:
        msg = world.improbe(source=source, tag=TAG_START)
        if msg is not None:
            return msg.recv()
        if time.monotonic() > deadline:
            return None
        backoff()


def role_of(rank: int, num_ps: int) -> tuple[str, int]:
    if rank == 0:
        return "chief", 0
    if rank <= num_ps:
        return "ps", rank - 1
    return "worker", rank - 1 - num_ps
