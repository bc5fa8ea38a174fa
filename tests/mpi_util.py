"""Launching ``mpiexec`` jobs from pytest: find the launcher, run a script, report.

Tests write the child program as a string; :func:`run_mpi` puts it in a temporary file,
runs ``mpiexec -n N python file`` with a timeout and returns what the ranks printed.
Open MPI needs ``--oversubscribe`` (more ranks than cores) and permission to run as
root; MPICH's Hydra needs nothing. Children run with ``OMP_NUM_THREADS=1`` and the
repository on ``PYTHONPATH``, so they import this checkout of gpustrat. Ranks share one
stdout pipe: print whole lines with ``flush=True`` (one write each) so that lines from
different ranks never interleave.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from gpustrat.launch import find_mpiexec, mpiexec_command, mpiexec_flavour

REPO = Path(__file__).resolve().parents[1]


def repo_env(base: dict | None = None, **extra) -> dict:
    """``base`` (the environment by default) with the repository first on PYTHONPATH,
    keeping what PYTHONPATH held (where a launch put its packages), plus ``extra``."""
    env = dict(os.environ if base is None else base, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


@functools.lru_cache(maxsize=None)
def mpiexec_path() -> str | None:
    """The ``mpiexec`` beside ``sys.executable`` (the venv's MPICH wheel), else on PATH."""
    return find_mpiexec()


def mpi_flavour() -> str:
    """``"openmpi"``, ``"mpich"`` or ``"unknown"``, from ``mpiexec --version``."""
    exe = mpiexec_path()
    return "unknown" if exe is None else mpiexec_flavour(exe)


def require_mpi() -> str:
    """The mpiexec path, or skip the calling test with what to install."""
    exe = mpiexec_path()
    if exe is None:
        pytest.skip("no mpiexec found beside the Python executable or on PATH: "
                    "install the MPI extra (pip install -e '.[mpi]')")
    try:
        import mpi4py  # noqa: F401, PLC0415
    except ImportError:
        pytest.skip("mpi4py is not installed: pip install -e '.[mpi]'")
    return exe


def run_mpi(n: int, script: str, timeout: float = 120, env: dict | None = None,
            args=(), launcher_args=()) -> tuple[int, str, str]:
    """Run ``script`` (Python source) on ``n`` ranks; return (returncode, stdout, stderr).

    ``args`` go to the script, ``launcher_args`` to mpiexec (before ``-n``).

    A launch that outlives ``timeout`` seconds is killed and reported as returncode
    -9 with ``[run_mpi] timed out`` appended to stderr.
    """
    exe = require_mpi()
    cmd = mpiexec_command(n, exe)
    child_env = dict(os.environ)
    if mpi_flavour() == "openmpi":
        child_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    child_env["OMP_NUM_THREADS"] = "1"
    # Unbuffered output writes a print's pieces separately, interleaving the ranks.
    child_env.pop("PYTHONUNBUFFERED", None)
    child_env = repo_env(child_env, **(env or {}))
    with tempfile.TemporaryDirectory(prefix="gpustrat-mpi-") as tmp:
        path = Path(tmp) / "child.py"
        path.write_text(textwrap.dedent(script))
        cmd[1:1] = launcher_args
        cmd += [sys.executable, str(path), *map(str, args)]
        # A new session lets a timeout kill the launcher and every rank it started.
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=child_env, cwd=tmp, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=timeout)
            return proc.returncode, out, err
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, err = proc.communicate()
            return -9, out, err + f"\n[run_mpi] timed out after {timeout:g} s"


def format_result(rc: int, out: str, err: str) -> str:
    return (f"mpiexec exited with status {rc}\n--- stdout ---\n{out}"
            f"\n--- stderr ---\n{err}")


def assert_mpi_ok(n: int, script: str, timeout: float = 120, env: dict | None = None,
                  args=(), expect_lines: int | None = None, marker: str = "OK"
                  ) -> str:
    """Run ``script`` on ``n`` ranks; fail with the children's output unless it exits 0
    and (when ``expect_lines`` is given) exactly that many stdout lines start with
    ``marker``. Returns stdout."""
    rc, out, err = run_mpi(n, script, timeout=timeout, env=env, args=args)
    if rc != 0:
        raise AssertionError(format_result(rc, out, err))
    if expect_lines is not None:
        got = sum(1 for line in out.splitlines() if line.startswith(marker))
        if got != expect_lines:
            raise AssertionError(f"expected {expect_lines} lines starting with {marker!r}, "
                                 f"got {got}\n" + format_result(rc, out, err))
    return out


def killed_by_signal_9(text: str) -> bool:
    """Whether a launcher's report says a rank was killed by SIGKILL: MPICH and Open MPI
    write ``signal 9``, Intel MPI ``KILLED BY SIGNAL: 9``."""
    return re.search(r"signal:? 9\b", text, re.IGNORECASE) is not None
