"""The stand-in backend (gpustrat.testing.stand_in): counting stand-ins over real CuPy
arrays, on a machine without a GPU.

Each check of ``standin_checks.py`` runs in a child process whose ``PYTHONPATH``
selects the real CuPy 14 and NCCL wheels that ``python tests/conformance/install_cupy.py``
installs (``.ci/run`` runs it), so this process never imports CuPy. Without the wheels
these tests skip, and fail when ``GPUSTRAT_TEST_CONFORMANCE=1`` says they must be there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from standin_checks import CHECKS  # noqa: E402

TIMEOUT_S = 180
NO_CUPY = "without_cupy_the_error_says_how_to_install_it"


def _conformance_dir() -> Path:
    return Path(os.environ.get("GPUSTRAT_CONFORMANCE_DIR") or REPO / ".conformance")


def _child_path() -> str:
    dirs = [_conformance_dir() / "cupy14", _conformance_dir() / "nccl"]
    if not all(d.is_dir() for d in dirs):
        reason = (f"CuPy 14 and NCCL are not installed under {_conformance_dir()}: run "
                  "python tests/conformance/install_cupy.py")
        if os.environ.get("GPUSTRAT_TEST_CONFORMANCE", "").strip() == "1":
            pytest.fail(f"GPUSTRAT_TEST_CONFORMANCE=1 says the real wheels must be there, "
                        f"but {reason}", pytrace=False)
        pytest.skip(reason)
    return os.pathsep.join([*(str(d) for d in dirs), str(REPO)])


def _run(name: str, env: dict) -> None:
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    proc = subprocess.run([sys.executable, str(HERE / "standin_checks.py"), name],
                          capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), \
        f"{name} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.timeout(TIMEOUT_S + 30)
@pytest.mark.parametrize("name", sorted(n for n in CHECKS if n != NO_CUPY))
def test_stand_in(name):
    _run(name, dict(os.environ, PYTHONPATH=_child_path()))


@pytest.mark.timeout(TIMEOUT_S + 30)
def test_without_cupy_the_stand_in_says_how_to_install_it(tmp_path):
    # No CuPy on the path, and a conformance folder without the wheels.
    _run(NO_CUPY, dict(os.environ, PYTHONPATH=str(REPO),
                       GPUSTRAT_CONFORMANCE_DIR=str(tmp_path)))
