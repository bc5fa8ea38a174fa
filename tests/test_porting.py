"""docs/porting.md: TensorFlow's documented tf.distribute / tf.data examples beside their
gpustrat ports. Every port runs and prints what TensorFlow's documentation records, and
every line that uses tf.distribute or tf.data ports by the namespace change alone."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, repo_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "porting.md").read_text()

# The tensor-library spellings a port changes besides the namespaces (the table at the
# top of docs/porting.md).
TENSOR_LIBRARY = {"tf.float32": "np.float32", "tf.uint8": "np.uint8",
                  "tf.TensorShape([4])": "(4,)"}


def ported_pairs() -> dict[str, tuple[str, str]]:
    """``{name: (tensorflow program, gpustrat program)}`` of the ``<!-- port: name -->``
    tables."""
    pairs = {}
    for m in re.finditer(r"<!-- port: ([\w-]+) -->(.*?)</table>", DOC, re.S):
        blocks = re.findall(r"```python\n(.*?)\n```", m.group(2), re.S)
        assert len(blocks) == 2, f"port {m.group(1)}: expected two python blocks"
        pairs[m.group(1)] = tuple(blocks)
    return pairs


PAIRS = ported_pairs()


def port_line(line: str) -> str:
    line = line.replace("tf.distribute.", "gs.distribute.").replace("tf.data.", "gs.data.")
    for tf_name, ours in TENSOR_LIBRARY.items():
        line = line.replace(tf_name, ours)
    # Device lists name GPUs in TensorFlow's examples; the ports run on CPU devices.
    return re.sub(r'"(GPU|CPU):\d"', '"DEVICE"', line)


def run_port(source: str, epilogue: str = "") -> list[str]:
    env = repo_env(CUDA_VISIBLE_DEVICES="")
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run([sys.executable, "-c", source + "\n" + epilogue],
                          capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_the_doc_has_every_port():
    assert set(PAIRS) == {
        "distribute-dataset", "run", "dataset-loop", "optional", "options", "predict-order",
        "inputs-without-datasets", "parallel-generator", "file-pipeline", "multi-worker",
        "custom-training-loop"}


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_distribute_and_data_lines_port_by_the_namespace_alone(name):
    tf_program, gs_program = PAIRS[name]
    ours = {port_line(line).strip() for line in gs_program.splitlines()}
    uses = [line for line in tf_program.splitlines()
            if "tf.distribute." in line or "tf.data." in line]
    assert uses, name
    changed = [line for line in uses if port_line(line).strip() not in ours]
    assert not changed, f"{name}: these lines needed more than the namespace change: {changed}"
    assert "import tensorflow" not in gs_program and not re.search(r"\btf\.", gs_program)


# What each port prints; the values are those TensorFlow's documentation records for the
# TensorFlow program on the left (written here as gpustrat prints NumPy values).

def test_distribute_dataset():
    assert run_port(PAIRS["distribute-dataset"][1]) == [
        "[PerReplica:{0: array([0]), 1: array([2])}, PerReplica:{0: array([4]), 1: array([6])}]"]


def test_run_constant_values_from_function_and_all_reduce():
    assert run_port(PAIRS["run"][1]) == ["PerReplica:{0: 6.0, 1: 6.0}", "PerReplica:{0: 4, 1: 4}",
                                         "PerReplica:{0: 1, 1: 1}"]


def test_dataset_loop_and_distributed_loop():
    epilogue = "print('EPOCH-END', epoch, step, type(loss).__name__, loss.shape)"
    out = run_port(PAIRS["dataset-loop"][1], epilogue)
    text = "\n".join(out)
    # Seven batches (six of 16 rows, one of 4) of 0.7, twice: plain and distributed.
    assert text.count("[[0.7]") == 14 and text.count("[0.7]") == 200
    assert len(re.findall(r"^Loss is  \[\[0\.7\]", text, re.M)) == 7
    assert text.count("[[1.]") == 2 and text.count("[1.]") == 32   # the first global batch
    assert out[-1] == "EPOCH-END 9 4 ndarray (16, 1)"


def test_get_next_as_optional_stops_after_the_partial_step():
    assert run_port(PAIRS["optional"][1]) == [
        "(array([0, 1]), array([2, 3]))", "(array([4, 5]), array([6, 7]))",
        "(array([8]), array([], dtype=int64))"]


def test_options_and_datasets_from_function():
    epilogue = ("print(dataset.options().experimental_distribute.auto_shard_policy)\n"
                "print([tuple(x[0].shape) for x in dist_dataset])")
    assert run_port(PAIRS["options"][1], epilogue) == [
        "AutoShardPolicy.DATA", "[(4, 16, 1)]"]


def test_predictions_come_back_in_order():
    assert run_port(PAIRS["predict-order"][1]) == [str({i: 2 * i for i in range(24)})]


def test_values_from_function_and_generator_input():
    epilogue = "x = next(iterator); print(x.shape, x.dtype)"
    out = run_port(PAIRS["inputs-without-datasets"][1], epilogue)
    assert out == ["1.0"] * 4 + ["(4,) float32"]


def test_parallel_generator_keeps_order():
    assert run_port(PAIRS["parallel-generator"][1]) == [
        str([[4.0 * i for i in range(k, min(k + 8, 20))] for k in (0, 8, 16)])]


def test_file_pipeline_reads_its_shard_of_files_each_epoch():
    assert run_port(PAIRS["file-pipeline"][1]) == [
        str(sorted(f"{f}-{r}" for f in (1, 3) for r in range(5) for _ in range(2)))]


def test_custom_training_loop_matches_tensorflow():
    # Printed by the TensorFlow column under TensorFlow 2.21 on two logical CPU devices.
    assert run_port(PAIRS["custom-training-loop"][1]) == [
        "epoch 1  loss 5.932413", "epoch 2  loss 0.323531", "epoch 3  loss 0.019261",
        "w [0.9958 1.987  2.9469]"]


@pytest.mark.mpi
def test_multi_worker_data_sharding_under_mpiexec():
    out = assert_mpi_ok(2, PAIRS["multi-worker"][1], timeout=120,
                        env={"CUDA_VISIBLE_DEVICES": ""})
    assert sorted(out.splitlines()) == ["worker 0 [[0, 1], [4, 5], [8, 9]]",
                                        "worker 1 [[2, 3], [6, 7], [10, 11]]"]
