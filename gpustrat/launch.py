"""How this process was launched: by an MPI launcher, and as which rank, read from the
launcher's environment variables alone (no MPI call, so nothing is initialised); and
the command that starts a job on this machine (:func:`mpiexec_command`).

Words:
    launch: the job a launcher started: ``size`` processes, this one ``rank``, and
        ``local_rank`` among the processes of its node (None where the launcher does not
        say).

Launchers and the variables they set (each names all three where it can):
    MPICH / Hydra, Intel MPI: ``PMI_SIZE``, ``PMI_RANK``, ``MPI_LOCALRANKID`` (Intel's
        ``mpiexec.hydra`` is told apart by the ``I_MPI_HYDRA_UUID`` it sets)
    Open MPI: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``,
        ``OMPI_COMM_WORLD_LOCAL_RANK``
    MVAPICH: ``MV2_COMM_WORLD_SIZE``, ``MV2_COMM_WORLD_RANK``, ``MV2_COMM_WORLD_LOCAL_RANK``
    PMIx launchers (``prterun``, Slurm with ``--mpi=pmix``): ``PMIX_SIZE`` is not always
        set, so PMIx is recognised through the variables above or Slurm's
    Slurm ``srun``: ``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``. Only
        a job step (``srun``) sets ``SLURM_STEP_NUM_TASKS``; the batch script itself, which
        has ``SLURM_NTASKS`` but is one process, is not taken for a launch.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping


@dataclass(frozen=True)
class Launch:
    """One process of a launched job."""

    launcher: str
    size: int
    rank: int
    local_rank: int | None


# (launcher, size variable, rank variable, node-local rank variable), in the order they
# are tried: an MPI launcher run inside a Slurm allocation wins over the allocation.
_LAUNCHERS = (
    ("Open MPI", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH/Hydra", "PMI_SIZE", "PMI_RANK", "MPI_LOCALRANKID"),
    ("MVAPICH", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK"),
    ("Slurm srun", "SLURM_STEP_NUM_TASKS", "SLURM_PROCID", "SLURM_LOCALID"),
)


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


def detect_launch(env: Mapping[str, str] | None = None) -> Launch | None:
    """The launch this process belongs to, or None when no launcher's variables are set.

    Args:
        env: the environment to read (default ``os.environ``).
    """
    env = os.environ if env is None else env
    for launcher, size_var, rank_var, local_var in _LAUNCHERS:
        size, rank = _int(env, size_var), _int(env, rank_var)
        if size is not None and rank is not None and 0 <= rank < size:
            if size_var == "PMI_SIZE" and "I_MPI_HYDRA_UUID" in env:
                launcher = "Intel MPI (mpiexec.hydra)"
            return Launch(launcher, size, rank, _int(env, local_var))
    return None


# --- starting a job from a program (the benchmarks that launch themselves) ------------

def find_mpiexec() -> str | None:
    """The ``mpiexec`` beside the running Python (a virtual environment's MPICH or Open MPI
    wheel), else ``mpiexec`` or ``mpirun`` on ``PATH``; None when there is none."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("mpiexec") or shutil.which("mpirun")


@functools.lru_cache(maxsize=None)
def mpiexec_flavour(exe: str) -> str:
    """``"openmpi"``, ``"mpich"``, ``"intel"`` or ``"unknown"``: the launcher ``exe``
    is, from its ``--version``."""
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True,
                             timeout=30).stdout.lower()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if "open mpi" in out or "open-mpi" in out or "openrte" in out:
        return "openmpi"
    if "intel(r) mpi" in out or "intel mpi" in out:
        return "intel"
    if "hydra" in out or "mpich" in out:
        return "mpich"
    return "unknown"


def mpiexec_command(nprocs: int, exe: str | None = None) -> list:
    """The start of a command that runs ``nprocs`` processes on this machine:
    ``[mpiexec, "-n", nprocs]``, with ``--oversubscribe`` for Open MPI, which otherwise
    refuses more processes than the machine has cores (MPICH's Hydra runs them).

    Args:
        nprocs: the number of processes.
        exe: the launcher (default :func:`find_mpiexec`).
    Raises:
        FileNotFoundError: no launcher was found.
    """
    exe = exe or find_mpiexec()
    if exe is None:
        raise FileNotFoundError(
            f"no mpiexec beside {sys.executable} or on PATH: install the mpi extra "
            "(pip install -e '.[mpi]'), or load your site's MPI")
    cmd = [exe]
    if mpiexec_flavour(exe) == "openmpi":
        cmd.append("--oversubscribe")
    return cmd + ["-n", str(int(nprocs))]
