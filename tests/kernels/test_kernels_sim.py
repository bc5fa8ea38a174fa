"""Run the kernel cases (``sim_cases.py``) under the Numba CUDA simulator.

``NUMBA_ENABLE_CUDASIM`` is read when ``numba.cuda`` is first imported and stays for
the life of the process, so the cases run in a child pytest with the variable set;
this process, and every other test in it, never sees the simulator.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TIMEOUT_S = 900

pytest.importorskip("numba", reason="the kernels need Numba: pip install -e '.[kernels]'")


@pytest.mark.timeout(TIMEOUT_S + 60)
@pytest.mark.parametrize("kernel", ["split or simulator", "pack"])
def test_kernels_under_simulator(kernel):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           "-k", kernel, str(HERE / "sim_cases.py")]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"simulator cases for {kernel!r} ran past {TIMEOUT_S} s:\n{e.stdout}")
    assert proc.returncode == 0, (
        f"simulator cases for {kernel!r} failed (exit {proc.returncode}):\n"
        f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.timeout(300)
def test_fake_cupy_logic_tests_also_pass_under_the_simulator():
    # A user (or CI) running the whole suite with NUMBA_ENABLE_CUDASIM=1 gets the
    # simulator's numba.cuda in every test: the fake-cupy tests of the launch logic
    # must not depend on names only the real numba.cuda has.
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", str(REPO / "tests" / "test_gpu_logic_fakes.py")],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=240)
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-4000:]
    assert " error" not in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
