"""``python -m gpustrat``: info, demo and bench run as a user runs them (subprocesses
with timeouts) and print well-formed output; every benchmark suite runs in quick mode."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, repo_env, run_mpi  # noqa: E402

import gpustrat  # noqa: E402
from gpustrat import cli, devices, launch  # noqa: E402
from gpustrat.launch import Launch, detect_launch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SUITES = cli.discover_suites(REPO / "benchmarks")
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+)  loss (\d+\.\d+)  ([\d,]+) samples/s$")


def gpustrat_cmd(*args, timeout=120, env=None) -> subprocess.CompletedProcess:
    child_env = repo_env(**(env or {}))
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

def test_demo_quick_prints_topology_and_epochs_with_falling_loss():
    proc = gpustrat_cmd("demo", "--quick", timeout=120)
    assert proc.returncode == 0, proc.stderr
    if devices.gpu_count() == 0:
        # Without a GPU the demo still shows distribution: two logical CPU replicas.
        assert ("topology: 1 worker(s) x 2 replica(s) = 2 replica(s) in sync; worker 0 "
                "devices: cpu:0, cpu:1; collectives: HostCommunicator") in proc.stdout
        assert "2 replica(s) (1 worker(s) x 2: cpu:0, cpu:1)" in proc.stdout
    epochs = epoch_lines(proc.stdout)
    assert [e[:2] for e in epochs] == [(1, 2), (2, 2)], proc.stdout
    assert epochs[1][2] < epochs[0][2] and all(e[3] > 0 for e in epochs)


def test_demo_two_replicas_same_loss_as_one():
    one = gpustrat_cmd("demo", "--quick", "--epochs", "1", "--devices", "cpu:0", timeout=120)
    two = gpustrat_cmd("demo", "--quick", "--epochs", "1", "--devices", "cpu:0", "cpu:1",
                       timeout=120)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert "2 replica(s)" in two.stdout and "1 replica(s)" in one.stdout
    (e1,), (e2,) = epoch_lines(one.stdout), epoch_lines(two.stdout)
    assert e1[2] == pytest.approx(e2[2], rel=1e-6)


def test_demo_hides_numbas_low_occupancy_warning_only(capsys):
    # On a GPU the demo's small launches make Numba warn (text as numba-cuda 0.30
    # prints it, colours included); the demo hides that warning and no other.
    import warnings  # noqa: PLC0415
    from gpustrat import demo  # noqa: PLC0415
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        demo.main(["--quick", "--epochs", "1", "--samples", "256", "--devices", "cpu:0"])
        warnings.warn("\x1b[1mGrid size 1 will likely result in GPU under-utilization due "
                      "to low occupancy.\x1b[0m", UserWarning)
        warnings.warn("Grid sizes are fine, this one is not about occupancy", UserWarning)
    assert [str(w.message) for w in caught] == [
        "Grid sizes are fine, this one is not about occupancy"]
    assert "epoch 1/1" in capsys.readouterr().out


@pytest.mark.mpi
def test_demo_multi_worker_prints_on_rank_0_only():
    out = assert_mpi_ok(2, """
        import sys
        from gpustrat.cli import main
        sys.exit(main(["demo", "--multi-worker", "--quick", "--devices", "cpu:0", "cpu:1"]))
    """, timeout=120)
    assert out.count("training a ") == 1 and "4 replica(s) (2 worker(s) x 2" in out, out
    assert [e[:2] for e in epoch_lines(out)] == [(1, 2), (2, 2)], out


def assert_one_line_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("python -m gpustrat demo: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "epoch" not in proc.stdout, "misuse is reported before training"


@pytest.mark.parametrize("args, fragments", [
    (["--batch", "0"], ["argument --batch", "at least 1", "got 0"]),
    (["--epochs", "-2"], ["argument --epochs", "at least 1", "got -2"]),
    (["--samples", "x"], ["argument --samples", "expected int", "'x'"]),
    (["--lr", "0"], ["argument --lr", "must be a positive finite number, got 0"]),
    (["--lr", "-1"], ["argument --lr", "must be a positive finite number, got -1"]),
    (["--lr", "nan"], ["argument --lr", "must be a positive finite number, got nan"]),
    (["--lr", "inf"], ["argument --lr", "must be a positive finite number, got inf"]),
    (["--devices", "cpu:0", "cpu:0"], ["argument --devices", "listed twice"]),
    (["--devices", "tpu:0"], ["argument --devices", "tpu:0"]),
    (["--save", "w.txt"], ["argument --save", "w.txt does not end in .npz"]),
], ids=["batch", "epochs", "samples", "lr", "lr-negative", "lr-nan", "lr-inf", "twice",
        "tpu", "save-suffix"])
def test_demo_misuse_is_one_line(args, fragments):
    assert_one_line_error(gpustrat_cmd("demo", "--quick", *args, timeout=60), *fragments)


def test_demo_gpu_without_a_gpu_is_one_line():
    if devices.gpu_count():
        pytest.skip("a GPU is visible")
    assert_one_line_error(gpustrat_cmd("demo", "--quick", "--devices", "gpu:0", timeout=60),
                          "argument --devices", "gpu:0", "no GPU is visible", "cpu:0")


def test_demo_save_checks_the_folder_before_training(tmp_path):
    missing = tmp_path / "no" / "such" / "w.npz"
    assert_one_line_error(gpustrat_cmd("demo", "--quick", "--save", str(missing), timeout=60),
                          "argument --save", str(missing.parent), "does not exist")
    assert not missing.parent.exists()
    good = tmp_path / "w.npz"
    proc = gpustrat_cmd("demo", "--quick", "--epochs", "1", "--save", str(good), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"weights w1, b1, w2, b2 written to {good}" in proc.stdout
    with np.load(good) as saved:
        assert sorted(saved.files) == ["b1", "b2", "w1", "w2"]


@pytest.mark.parametrize("command", [("demo",), ("bench",), ("info",)])
def test_help_shows_every_default(command):
    proc = gpustrat_cmd(*command, "--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    options = proc.stdout.split("options:", 1)[1]
    # One entry per option: its flag line and the indented help lines under it.
    entries = re.split(r"\n  (?=-)", "\n" + options.strip("\n"))
    entries = [" ".join(e.split()) for e in entries if e.strip()]
    assert len(entries) >= 2
    for entry in entries:
        if entry.startswith("-h, --help"):
            continue
        assert "default" in entry, f"{command[0]} --help: no default for: {entry}"


# --- MPI launch detection -----------------------------------------------------------------

@pytest.mark.parametrize("env, want", [
    ({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1"}, Launch("MPICH/Hydra", 4, 1, 1)),
    ({"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "2",
      "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, Launch("Open MPI", 3, 2, 0)),
    ({"MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_RANK": "0"}, Launch("MVAPICH", 2, 0, None)),
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
      "SLURM_NTASKS": "8"}, Launch("Slurm srun", 8, 5, 1)),
    # mpiexec inside a Slurm allocation: the MPI launcher's variables win.
    ({"SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0", "PMI_SIZE": "2", "PMI_RANK": "1"},
     Launch("MPICH/Hydra", 2, 1, None)),
    # A Slurm batch script is one process, though its allocation has several tasks.
    ({"SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}, None),
    ({"PMI_SIZE": "two", "PMI_RANK": "0"}, None),
    ({"PMI_SIZE": "2", "PMI_RANK": "2"}, None),
    ({}, None),
], ids=["mpich", "openmpi", "mvapich", "srun", "mpiexec-in-slurm", "sbatch", "garbage",
        "rank-out-of-range", "none"])
def test_detect_launch(env, want):
    assert detect_launch(env) == want


def test_importing_launch_reads_no_mpi():
    code = ("import sys, gpustrat.launch as l; print(l.detect_launch({}), "
            "'mpi4py' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.stdout.strip() == "None False", proc.stderr


@pytest.mark.parametrize("version_text,oversubscribe", [
    ("mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/",
     True),
    ("mpiexec (OpenRTE) 4.1.5", True),
    ("HYDRA build details:\n    Version:                                 5.0.2", False),
    ("", False),
], ids=["open-mpi-5", "open-mpi-4", "mpich", "unknown"])
def test_mpiexec_command_oversubscribes_under_open_mpi_only(tmp_path, version_text,
                                                           oversubscribe):
    # The benchmarks that launch themselves ask for 3-4 processes; Open MPI refuses more
    # processes than cores unless told to oversubscribe, MPICH's Hydra runs them.
    exe = tmp_path / "mpiexec"
    exe.write_text(f"#!/bin/sh\ncat <<'END'\n{version_text}\nEND\n")
    exe.chmod(0o755)
    assert launch.mpiexec_command(4, str(exe)) == (
        [str(exe)] + ["--oversubscribe"] * oversubscribe + ["-n", "4"])


def test_mpiexec_command_without_a_launcher_says_what_to_install(monkeypatch):
    monkeypatch.setattr(launch, "find_mpiexec", lambda: None)
    with pytest.raises(FileNotFoundError,
                       match=r"no mpiexec beside .* or on PATH: install the mpi extra"):
        launch.mpiexec_command(3)


@pytest.mark.mpi
def test_demo_under_mpiexec_goes_multi_worker_without_the_flag():
    out = assert_mpi_ok(2, """
        import sys
        from gpustrat.cli import main
        sys.exit(main(["demo", "--quick", "--devices", "cpu:0"]))
    """, timeout=120)
    assert out.count("training a ") == 1, out
    assert "started 2 processes: training over all of them" in out
    assert "topology: 2 worker(s) x 1 replica(s) = 2 replica(s) in sync" in out
    assert [e[:2] for e in epoch_lines(out)] == [(1, 2), (2, 2)], out


@pytest.mark.mpi
def test_demo_under_mpiexec_with_no_multi_worker_runs_independent_jobs():
    out = assert_mpi_ok(2, """
        import sys
        from gpustrat.cli import main
        sys.exit(main(["demo", "--quick", "--epochs", "1", "--devices", "cpu:0",
                       "--no-multi-worker"]))
    """, timeout=120)
    assert out.count("training a ") == 2 and "started 2 processes" not in out, out
    assert out.count("1 worker(s) x 1 replica(s)") == 2, out


@pytest.mark.mpi
def test_demo_misuse_under_mpiexec_fails_every_rank_and_says_it_once():
    if devices.gpu_count():
        pytest.skip("a GPU is visible")
    rc, out, err = run_mpi(2, """
        import sys
        from gpustrat.cli import main
        sys.exit(main(["demo", "--quick", "--devices", "gpu:0"]))
    """, timeout=120)
    assert rc == 2, (rc, out, err)
    assert err.count("error: argument --devices") == 1 and "Traceback" not in err, err


# --- bench ------------------------------------------------------------------------------

def test_bench_finds_the_suites_and_their_launchers():
    assert {"run", "input", "mpi", "sweep"} <= set(SUITES)
    assert cli.mpi_ranks(SUITES["mpi"]) == 2
    assert cli.mpi_ranks(SUITES["run"]) == 0 and cli.mpi_ranks(SUITES["sweep"]) == 0
    proc = gpustrat_cmd("bench", "--list", timeout=60)
    assert proc.returncode == 0
    assert {line.split(":")[0] for line in proc.stdout.splitlines()} == set(SUITES)
    # Each line says what the suite measures, from its docstring's first sentence.
    for line in proc.stdout.splitlines():
        name, _, rest = line.partition(": ")
        assert rest.endswith(")") and f"(bench_{name}.py" in rest, line
        assert len(rest.split(f" (bench_{name}.py")[0].split()) >= 3, line
    assert "stall: The stall inspector's cost: a training step's time with it on " \
           "against off, same run (bench_stall.py, mpiexec -n 2)" in proc.stdout


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
    if name != "sweep":
        # Every target has a verdict, printed beside it and listed at the end.
        assert result["verdicts"], result
        assert "== targets ==" in proc.stdout
        for v in result["verdicts"]:
            line = cli.format_verdict(v)
            assert f"target {line}" in proc.stdout and line in proc.stdout.split("== targets ==")[1]
            # A quick run judges no target: its figure, then "not judged (quick)".
            assert line.endswith(": not judged (quick)") or "not measured (" in line, line
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


FAKE_SUITE = """
import time
from benchmarks import targets

def main(argv):
    time.sleep(2.5)
    print("measured", flush=True)
    return {"verdicts": [targets.check("fast enough", 7.0, 5.0, "x"),
                         targets.check("small enough", 7.0, 5.0, "us", higher_is_better=False),
                         targets.not_measured("on a GPU", 85, "no GPU here", "%")]}
"""


def test_bench_prints_progress_and_a_verdict_beside_every_target(tmp_path):
    (tmp_path / "bench_fake.py").write_text(FAKE_SUITE)
    proc = gpustrat_cmd("bench", "fake", "--heartbeat", "1", timeout=60,
                        env={"GPUSTRAT_BENCHMARKS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # Silent for 2.5 s: the runner says the suite still runs, before its first line.
    assert re.search(r"\[fake\] still running: \d+ s so far \(timeout 1200 s\)", out), out
    assert out.index("still running") < out.index("measured")
    assert "target fast enough: 7 x (goal >= 5 x): met" in out
    assert "target small enough: 7 us (goal <= 5 us): NOT met" in out
    assert "target on a GPU (goal >= 85 %): not measured (no GPU here)" in out
    assert "-- fake: " in out and ", 1 target(s) met, 1 not met, 1 not measured" in out
    summary = out.split("== targets ==")[1].splitlines()
    assert [line.split()[0] for line in summary[1:4]] == ["fake"] * 3
    assert summary[4] == "1 target(s) met, 1 not met, 1 not measured"


def test_bench_quick_judges_no_target_and_says_so(tmp_path):
    (tmp_path / "bench_fake.py").write_text(FAKE_SUITE.replace("time.sleep(2.5)", "")
                                            .replace("no GPU here", "--quick is too short"))
    proc = gpustrat_cmd("bench", "fake", "--quick", timeout=60,
                        env={"GPUSTRAT_BENCHMARKS": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "target fast enough: 7 x (goal >= 5 x): not judged (quick)" in out
    assert "target small enough: 7 us (goal <= 5 us): not judged (quick)" in out
    assert "target on a GPU (goal >= 85 %): not judged (quick)" in out
    assert "NOT met" not in out and ": met" not in out
    assert out.split("== targets ==")[1].splitlines()[4] == \
        "0 target(s) met, 3 not judged (quick)"


def test_bench_output_files_and_times_are_checked_before_any_suite_runs(tmp_path):
    # --json into a folder that did not exist used to fail after every suite had run,
    # losing the results.
    (tmp_path / "bench_fake.py").write_text(FAKE_SUITE.replace("time.sleep(2.5)", ""))
    env = {"GPUSTRAT_BENCHMARKS": str(tmp_path)}
    out = tmp_path / "results" / "today" / "fake.json"
    proc = gpustrat_cmd("bench", "fake", "--json", str(out), timeout=60, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(out.read_text())["suites"]["fake"]["verdicts"]
    (tmp_path / "plain").write_text("")
    for args, words in (
            (["--json", str(tmp_path)], f"--json {tmp_path}: is a folder"),
            (["--json", str(tmp_path / "plain" / "x.json")],
             f"--json {tmp_path / 'plain' / 'x.json'}: its folder cannot be made"),
            (["--timeout", "-1"], "--timeout -1 must be a positive number of seconds"),
            (["--heartbeat", "0"], "--heartbeat 0 must be a positive number of seconds")):
        proc = gpustrat_cmd("bench", "fake", *args, timeout=60, env=env)
        assert proc.returncode == 2 and words in proc.stderr, (args, proc.stderr)
        assert "measured" not in proc.stdout, args  # nothing ran


# --- defaults that agree, and what the demo says while it trains --------------------------

def test_info_names_the_demos_devices_beside_the_strategies_default():
    proc = gpustrat_cmd("info", timeout=60)
    assert proc.returncode == 0, proc.stderr
    pairs = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    from gpustrat.demo import default_devices  # noqa: PLC0415
    assert pairs["demo devices"] == ", ".join(default_devices())
    if pairs["gpu count"] == "0":
        assert pairs["default devices"] == "cpu:0" and pairs["demo devices"] == "cpu:0, cpu:1"


def test_demo_says_when_its_options_do_not_do_what_they_seem_to():
    proc = gpustrat_cmd("demo", "--samples", "10", "--batch", "256", "--epochs", "1",
                        timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("note: --samples 10 is less than --batch 256: each epoch is one partial batch "
            "of 10 examples") in proc.stdout
    proc = gpustrat_cmd("demo", "--samples", "512", "--batch", "256", "--epochs", "1",
                        timeout=120)
    assert "note:" not in proc.stdout
    proc = gpustrat_cmd("demo", "--multi-worker", "--quick", "--epochs", "1", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--multi-worker without an MPI launcher: one worker, on cpu:0 (launch W workers " \
           "with mpiexec -n W python -m gpustrat demo" in proc.stdout, proc.stdout
    assert "1 worker(s) x 1 replica(s)" in proc.stdout


def test_demo_says_what_loss_to_expect_and_it_falls_between_those_bounds():
    proc = gpustrat_cmd("demo", "--quick", timeout=120)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"predicting the mean scores (\d\.\d+) and the noise alone (\d\.\d+)",
                  proc.stdout)
    assert m, proc.stdout
    top, floor = float(m.group(1)), float(m.group(2))
    losses = [e[2] for e in epoch_lines(proc.stdout)]
    assert floor < losses[-1] < losses[0] < top, (losses, top, floor)


def test_demo_shows_progress_within_a_long_epoch():
    from gpustrat import demo  # noqa: PLC0415
    import gpustrat as gs  # noqa: PLC0415
    lines = []
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    demo.train(strategy, epochs=1, n_samples=1000, global_batch=256, log=lines.append,
               progress_every=1e-9)  # every step counts as "a few seconds" here
    notes = [line for line in lines if line.startswith("  epoch 1/1: ")]
    assert [n.split(": ")[1].split(" examples")[0] for n in notes] == \
        ["256/1,000", "512/1,000", "768/1,000", "1,000/1,000"], lines
    lines.clear()
    demo.train(strategy, epochs=1, n_samples=1000, global_batch=256, log=lines.append)
    assert not [line for line in lines if line.startswith("  epoch")], lines  # a short epoch
