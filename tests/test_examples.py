"""The examples run and do what they say."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_custom_training_loop_fits_and_ignores_topology(capsys):
    loop = load("custom_training_loop")
    w1, true_w = loop.main(["cpu:0"], epochs=20)
    w3, _ = loop.main(["cpu:0", "cpu:1", "cpu:2"], epochs=20)
    np.testing.assert_allclose(w1, true_w, atol=0.01)
    np.testing.assert_allclose(w3, w1, rtol=1e-12, atol=1e-12)
    out = capsys.readouterr().out
    assert "(array([8]), array([], dtype=int64), array([], dtype=int64))" in out


def test_mirrored_basics_prints_the_seed_results(capsys):
    load("mirrored_basics").main(["cpu:0", "cpu:1"])
    out = capsys.readouterr().out
    assert "PerReplica:{0: 6.0, 1: 6.0}" in out
    # Both replicas get 1 (TF 2.21 prints the same PerReplica of two 1s).
    assert "all_reduce(sum, replica ids): PerReplica:{0: 1, 1: 1}" in out
    assert "reduce(SUM, axis=0): 72.0" in out and "reduce(MEAN, axis=0): 8.0" in out


def run_example(*args):
    env = dict(os.environ, PYTHONPATH=str(EXAMPLES.parent), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=120, env=env, cwd=EXAMPLES.parent)


@pytest.mark.parametrize("name", ["mirrored_basics", "custom_training_loop", "train_mlp"])
def test_examples_take_devices_like_the_demo(name):
    proc = run_example(f"examples/{name}.py", "--help")
    assert proc.returncode == 0 and "--devices DEV [DEV ...]" in proc.stdout, proc.stderr
    assert "default: every GPU, else cpu:0 cpu:1" in " ".join(proc.stdout.split())


def test_mirrored_basics_on_three_devices_from_the_command_line():
    proc = run_example("examples/mirrored_basics.py", "--devices", "cpu:0", "cpu:1", "cpu:2")
    assert proc.returncode == 0, proc.stderr
    assert "PerReplica:{0: 6.0, 1: 6.0, 2: 6.0}" in proc.stdout
    assert "all_reduce(sum, replica ids): PerReplica:{0: 3, 1: 3, 2: 3}" in proc.stdout


def test_examples_default_to_two_cpu_replicas_without_a_gpu():
    proc = run_example("examples/mirrored_basics.py")
    assert proc.returncode == 0, proc.stderr
    assert "num_replicas_in_sync=2" in proc.stdout and "PerReplica:{0: 6.0, 1: 6.0}" in proc.stdout
    proc = run_example("examples/custom_training_loop.py", "--devices", "cpu:0", "cpu:1",
                       "--epochs", "5")
    assert proc.returncode == 0, proc.stderr
    assert "epoch   5  loss" in proc.stdout and "(array([8]), array([], dtype=int64))" in proc.stdout


def test_generator_processes_maps_an_index_generator_on_worker_processes():
    proc = run_example("examples/generator_processes.py", "--records", "48", "--batch", "8")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "threads  : 6 batches, x (8, 64, 64, 3) uint8, y (8, 10) float32" in out, out
    assert "processes: 6 batches, x (8, 64, 64, 3) uint8, y (8, 10) float32" in out, out
    assert "same batches: True" in out, out


def test_generator_processes_decodes_every_record():
    example = load("generator_processes")
    records = example.make_training_set(10)
    batches, _ = example.main(records=10, batch=4, compare=False)
    xs = np.concatenate([x for x, _ in batches])
    ys = np.concatenate([y for _, y in batches])
    assert xs.shape == (10, 64, 64, 3) and ys.shape == (10, 10)
    for i, record in enumerate(records):
        x, y = example.your_processing_function(record)
        np.testing.assert_array_equal(xs[i], x)
        assert ys[i].argmax() == record[0]
