"""The README's test command says what it costs and what it skips, and how to run what
it skips: the time, the skip reasons (``-rs``) and the conformance wheels' install."""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _tests_section() -> str:
    return README[README.index("Run the tests"):README.index("## Status")]


def test_the_readme_says_how_long_the_tests_take_and_what_they_skip():
    text = _tests_section()
    assert re.search(r"takes about \d+ minutes \([\d,]+ passed, \d+ skipped\)", text), text
    assert "python tests/conformance/install_cupy.py" in text
    assert "GPUSTRAT_TEST_CONFORMANCE=1 python -m pytest -q tests/conformance" in text
    assert "GPUSTRAT_TEST_GPU=1" in text and "-rs" in text
    assert (REPO / "tests" / "conformance" / "install_cupy.py").is_file()


def test_pytest_names_the_reason_of_every_skip():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    assert "-rs" in cfg["tool:pytest"]["addopts"].split()
    # Without the wheels, a conformance test's skip reason says what to run.
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/conformance/test_real_cupy.py", "-k", "13"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "GPUSTRAT_CONFORMANCE_DIR": str(REPO / "no-such"),
             "GPUSTRAT_TEST_CONFORMANCE": "0"})
    assert "SKIPPED" in proc.stdout and \
        "run python tests/conformance/install_cupy.py" in proc.stdout, proc.stdout[-3000:]
