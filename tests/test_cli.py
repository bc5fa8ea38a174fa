"""``python -m gpustrat``: info, demo and bench run as a user runs them (subprocesses
with timeouts) and print well-formed output; every benchmark suite runs in quick mode."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

import gpustrat  # noqa: E402
from gpustrat import cli  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SUITES = cli.discover_suites(REPO / "benchmarks")
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss (\d+\.\d+)  ([\d,]+) samples/s$")


def gpustrat_cmd(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    child_env = dict(os.environ, **(env or {}))
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), child_env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "gpustrat", *args], capture_output=True,
                          text=True, timeout=timeout, env=child_env, cwd=REPO)


def epoch_lines(stdout: str) -> list[tuple]:
    return [tuple(float(g.replace(",", "")) for g in m.groups())
            for m in map(EPOCH_LINE.match, stdout.splitlines()) if m]


# --- the command itself -----------------------------------------------------------------

def test_importing_the_cli_and_demo_does_no_work():
    code = ("import sys, gpustrat.cli, gpustrat.demo, gpustrat.__main__; "
            "bad = [m for m in ('mpi4py', 'mpi4py.MPI', 'cupy', 'numba', 'gpustrat.data', "
            "'gpustrat.collectives.mpi') if m in sys.modules]; "
            "assert not bad, bad; print('clean')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == "clean", proc.stderr


def test_usage_and_unknown_command():
    proc = gpustrat_cmd("--help", timeout=60)
    assert proc.returncode == 0
    assert all(c in proc.stdout for c in ("demo", "info", "bench"))
    proc = gpustrat_cmd("train", timeout=60)
    assert proc.returncode == 2 and "unknown command 'train'" in proc.stderr


# --- info -------------------------------------------------------------------------------

INFO_KEYS = ("gpustrat", "python", "numpy", "cupy", "numba", "numba-cuda", "mpi4py",
             "mpi library", "nccl", "gpu count", "default devices", "cuda simulator")


def test_info_plain_text_is_key_value_lines():
    proc = gpustrat_cmd("info", timeout=60, env={"NUMBA_ENABLE_CUDASIM": "0"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    pairs = dict(line.split(": ", 1) for line in lines)
    assert len(pairs) == len(lines), "every line is one 'key: value'"
    for key in INFO_KEYS:
        assert key in pairs, (key, proc.stdout)
    assert pairs["gpustrat"] == gpustrat.__version__
    assert pairs["numpy"] == np.__version__
    assert pairs["python"].startswith(".".join(map(str, sys.version_info[:3])))
    assert pairs["cuda simulator"] == "off"
    assert int(pairs["gpu count"]) >= 0
    if pairs["gpu count"] == "0":
        assert pairs["default devices"] == "cpu:0"


def test_info_json_matches_and_reports_the_simulator():
    proc = gpustrat_cmd("info", "--json", timeout=60, env={"NUMBA_ENABLE_CUDASIM": "1"})
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert set(INFO_KEYS) <= set(info)
    assert info["gpustrat"] == gpustrat.__version__
    assert isinstance(info["gpu count"], int)
    assert info["cuda simulator"].startswith("on")
    try:
        import mpi4py
    except ImportError:
        assert info["mpi library"] == "not installed"
    else:
        assert info["mpi4py"] == mpi4py.__version__
        assert info["mpi library"] and not info["mpi library"].startswith("error")


# --- demo -------------------------------------------------------------------------------

def test_demo_quick_prints_epochs_with_falling_loss():
    proc = gpustrat_cmd("demo", "--quick", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "1 replica(s)" in proc.stdout
    epochs = epoch_lines(proc.stdout)
    assert [e[:2] for e in epochs] == [(1, 2), (2, 2)], proc.stdout
    assert epochs[1][2] < epochs[0][2] and all(e[3] > 0 for e in epochs)


def test_demo_two_replicas_same_loss_as_one():
    one = gpustrat_cmd("demo", "--quick", "--epochs", "1", timeout=120)
    two = gpustrat_cmd("demo", "--quick", "--epochs", "1", "--devices", "cpu:0", "cpu:1",
                       timeout=120)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "2 replica(s)" in two.stdout
    (e1,), (e2,) = epoch_lines(one.stdout), epoch_lines(two.stdout)
    assert e1[2] == pytest.approx(e2[2], rel=1e-6)


@pytest.mark.mpi
def test_demo_multi_worker_prints_on_rank_0_only():
    out = assert_mpi_ok(2, """
        import sys
        from gpustrat.cli import main
        sys.exit(main(["demo", "--multi-worker", "--quick", "--devices", "cpu:0", "cpu:1"]))
    """, timeout=120)
    assert out.count("training a ") == 1 and "4 replica(s) (2 worker(s) x 2" in out, out
    assert [e[:2] for e in epoch_lines(out)] == [(1, 2), (2, 2)], out


# --- bench ------------------------------------------------------------------------------

def test_bench_finds_the_suites_and_their_launchers():
    assert {"run", "input", "mpi", "sweep"} <= set(SUITES)
    assert cli.mpi_ranks(SUITES["mpi"]) == 2
    assert cli.mpi_ranks(SUITES["run"]) == 0 and cli.mpi_ranks(SUITES["sweep"]) == 0
    proc = gpustrat_cmd("bench", "--list", timeout=60)
    assert proc.returncode == 0
    assert {line.split(":")[0] for line in proc.stdout.splitlines()} == set(SUITES)


@pytest.mark.parametrize("name", sorted(SUITES))
def test_bench_suite_quick_writes_json(name, tmp_path):
    out = tmp_path / "bench.json"
    proc = gpustrat_cmd("bench", name, "--quick", "--json", str(out), timeout=150)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"== {name} (" in proc.stdout
    report = json.loads(out.read_text())
    assert report["quick"] is True and report["gpustrat"] == gpustrat.__version__
    assert list(report["suites"]) == [name]
    result = report["suites"][name]
    if "skipped" in result:
        pytest.skip(result["skipped"])
    assert isinstance(result, dict) and result and "error" not in result, result


def test_bench_sweep_rows_and_plot(tmp_path):
    png, out = tmp_path / "sweep.png", tmp_path / "sweep.json"
    proc = gpustrat_cmd("bench", "sweep", "--quick", "--json", str(out), "--plot", str(png),
                        timeout=150)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert proc.returncode == 2 and "pip install -e '.[plot]'" in proc.stderr, proc.stderr
        assert not png.exists()
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = json.loads(out.read_text())["suites"]["sweep"]["rows"]
    assert {(r["workload"], r["replicas"], r["batch"]) for r in rows} == {
        (w, n, b) for w in ("input", "train") for n in (1, 2) for b in (32, 256)}
    assert all(r["samples_per_s"] > 0 for r in rows)


def test_bench_errors_name_the_problem(tmp_path):
    proc = gpustrat_cmd("bench", "nosuch", timeout=60)
    assert proc.returncode == 2 and "no suite named nosuch" in proc.stderr
    assert "run" in proc.stderr.split("the suites are:")[1]
    proc = gpustrat_cmd("bench", timeout=60, env={"GPUSTRAT_BENCHMARKS": str(tmp_path / "x")})
    assert proc.returncode == 2 and "source checkout" in proc.stderr
