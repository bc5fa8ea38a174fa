"""gs.distribute and gs.data.experimental: the names a port from TensorFlow looks for,
loaded lazily, listed by dir(), and enums that print as their names."""

from __future__ import annotations

import enum
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import gpustrat
import gpustrat as gs
from gpustrat.data import experimental_ops

REPO = Path(__file__).resolve().parents[1]
PORTING = (REPO / "docs" / "porting.md").read_text()

# dir(tf.distribute), dir(tf.distribute.experimental), dir(tf.data), dir(tf.data.experimental),
# public names, recorded from TensorFlow 2.21.
TF_DISTRIBUTE = {
    "CrossDeviceOps", "DistributedDataset", "DistributedIterator", "DistributedValues",
    "HierarchicalCopyAllReduce", "InputContext", "InputOptions", "InputReplicationMode",
    "MirroredStrategy", "MultiWorkerMirroredStrategy", "NcclAllReduce", "OneDeviceStrategy",
    "ParameterServerStrategy", "ReduceOp", "ReductionToOneDevice", "ReplicaContext",
    "RunOptions", "Server", "Strategy", "StrategyExtended", "TPUStrategy", "cluster_resolver",
    "coordinator", "experimental", "experimental_set_strategy", "get_replica_context",
    "get_strategy", "has_strategy", "in_cross_replica_context"}
TF_DISTRIBUTE_EXPERIMENTAL = {
    "CentralStorageStrategy", "CollectiveCommunication", "CollectiveHints",
    "CommunicationImplementation", "CommunicationOptions", "MultiWorkerMirroredStrategy",
    "ParameterServerStrategy", "PreemptionCheckpointHandler", "PreemptionWatcher",
    "TPUStrategy", "TerminationConfig", "ValueContext", "coordinator", "partitioners", "rpc"}
TF_DATA = {
    "AUTOTUNE", "Dataset", "DatasetSpec", "FixedLengthRecordDataset", "INFINITE_CARDINALITY",
    "Iterator", "IteratorSpec", "NumpyIterator", "Options", "TFRecordDataset",
    "TextLineDataset", "ThreadingOptions", "UNKNOWN_CARDINALITY", "experimental"}
TF_DATA_EXPERIMENTAL = {
    "AUTOTUNE", "AutoShardPolicy", "AutotuneAlgorithm", "AutotuneOptions", "Counter",
    "CsvDataset", "DatasetInitializer", "DistributeOptions", "ExternalStatePolicy",
    "INFINITE_CARDINALITY", "OptimizationOptions", "Optional", "RandomDataset", "Reducer",
    "SHARD_HINT", "ServiceOptions", "SqlDataset", "TFRecordWriter", "ThreadingOptions",
    "UNKNOWN_CARDINALITY", "assert_cardinality", "at", "bucket_by_sequence_length",
    "cardinality", "choose_from_datasets", "copy_to_device", "dense_to_ragged_batch",
    "dense_to_sparse_batch", "distributed_save", "enable_debug_mode", "enumerate_dataset",
    "from_list", "from_variant", "get_model_proto", "get_next_as_optional",
    "get_single_element", "get_structure", "group_by_reducer", "group_by_window",
    "ignore_errors", "index_table_from_dataset", "load", "make_batched_features_dataset",
    "make_csv_dataset", "make_saveable_from_iterator", "map_and_batch", "pad_to_cardinality",
    "parallel_interleave", "parse_example_dataset", "prefetch_to_device",
    "rejection_resample", "sample_from_datasets", "save", "scan", "service",
    "shuffle_and_repeat", "snapshot", "table_from_dataset", "take_while", "to_variant",
    "unbatch", "unique"}


def public(module) -> set[str]:
    return {n for n in dir(module) if not n.startswith("_")}


def run_python(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize("module, tf_names", [
    ("gpustrat.distribute", TF_DISTRIBUTE),
    ("gpustrat.distribute.experimental", TF_DISTRIBUTE_EXPERIMENTAL),
    ("gpustrat.data", TF_DATA),
    ("gpustrat.data.experimental", TF_DATA_EXPERIMENTAL),
], ids=["distribute", "distribute.experimental", "data", "data.experimental"])
def test_every_tensorflow_name_is_there_or_listed_as_missing(module, tf_names):
    mod = importlib.import_module(module)
    missing = sorted(n for n in tf_names - public(mod)
                     if not re.search(rf"`(tf\.[\w.]*\.)?{re.escape(n)}`", PORTING))
    assert not missing, f"{module}: neither provided nor listed in docs/porting.md: {missing}"
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


def test_namespaces_resolve_to_the_classes_users_already_have():
    assert gs.distribute.MirroredStrategy is gs.MirroredStrategy
    assert gs.distribute.ReduceOp is gs.ReduceOp
    assert gs.distribute.InputContext is gs.InputContext
    assert gs.distribute.get_replica_context is gs.get_replica_context
    assert (gs.distribute.experimental.MultiWorkerMirroredStrategy
            is gs.distribute.MultiWorkerMirroredStrategy is gs.MultiWorkerMirroredStrategy)
    assert gs.distribute.experimental.ValueContext is gs.ValueContext
    assert gs.data.experimental.AutoShardPolicy is gs.data.AutoShardPolicy
    assert gs.data.experimental.AUTOTUNE == gs.data.AUTOTUNE == -1
    assert gs.data.experimental.INFINITE_CARDINALITY == -1
    assert gs.data.experimental.UNKNOWN_CARDINALITY == -2


def test_unknown_names_raise_attribute_error_naming_the_module():
    with pytest.raises(AttributeError, match="'gpustrat.distribute' has no attribute 'TPUStrategy'"):
        gs.distribute.TPUStrategy  # noqa: B018
    with pytest.raises(AttributeError, match="gpustrat.data.experimental"):
        gs.data.experimental.snapshot  # noqa: B018


def test_lazy_names_are_listed_before_they_load_and_load_no_mpi():
    out = run_python(
        "import sys, gpustrat as gs\n"
        "listed = 'MultiWorkerMirroredStrategy' in dir(gs.distribute) and "
        "'distribute' in dir(gs) and 'data' in dir(gs)\n"
        "before = 'gpustrat.distribute.multi_worker' in sys.modules\n"
        "cls = gs.distribute.MultiWorkerMirroredStrategy\n"
        "gs.distribute.experimental.MultiWorkerMirroredStrategy\n"
        "print(listed, before, 'gpustrat.distribute.multi_worker' in sys.modules, "
        "'mpi4py' in sys.modules, 'mpi4py.MPI' in sys.modules, 'gpustrat.data' in sys.modules)")
    assert out == "True False True False False False"


def test_experimental_namespace_lists_lazy_names_and_loads_nothing_extra():
    out = run_python(
        "import sys, gpustrat.distribute.experimental as e\n"
        "print(sorted(n for n in dir(e) if not n.startswith('_')), "
        "'gpustrat.distribute.multi_worker' in sys.modules, 'mpi4py' in sys.modules)")
    assert out == ("['MultiWorkerMirroredStrategy', 'ParameterServerStrategy', 'ValueContext', "
                   "'coordinator', 'partitioners'] False False")


def all_enums():
    found = {}
    for info in pkgutil.walk_packages(gpustrat.__path__, "gpustrat."):
        if info.name.startswith(("gpustrat.collectives.nccl", "gpustrat.__main__")):
            continue
        mod = importlib.import_module(info.name)
        for value in vars(mod).values():
            if (isinstance(value, type) and issubclass(value, enum.Enum)
                    and value.__module__.startswith("gpustrat")):
                found[f"{value.__module__}.{value.__qualname__}"] = value
    return found


def test_every_enum_of_the_package_prints_as_its_name():
    enums = all_enums()
    assert {"AutoShardPolicy", "ReduceOp", "InputReplicationMode"} <= {
        e.__name__ for e in enums.values()}
    for cls in enums.values():
        for member in cls:
            want = f"{cls.__name__}.{member.name}"
            assert str(member) == want and f"{member}" == want and "%s" % member == want
            assert f"{member:>30}" == want.rjust(30)
            assert repr(member).startswith(f"<{want}:")


def test_auto_shard_policy_keeps_its_tensorflow_numbers():
    # Values recorded from TensorFlow 2.21 (an IntEnum there too).
    policy = gs.data.experimental.AutoShardPolicy
    assert [int(p) for p in (policy.OFF, policy.AUTO, policy.FILE, policy.DATA)] == [-1, 0, 1, 2]
    assert policy(1) is policy.FILE and policy.FILE == 1
    opts = gs.data.Options()
    opts.experimental_distribute.auto_shard_policy = 2
    assert str(opts.experimental_distribute.auto_shard_policy) == "AutoShardPolicy.DATA"


# --- gs.data.experimental's transformations --------------------------------------------

def as_lists(ds):
    return [np.asarray(e).tolist() if not isinstance(e, tuple)
            else tuple(np.asarray(c).tolist() for c in e) for e in ds]


def test_method_transformations_apply_the_dataset_method():
    E, Dataset = gs.data.experimental, gs.data.Dataset
    ds = Dataset.range(6).batch(4)
    assert as_lists(ds.apply(E.unbatch())) == list(range(6))
    assert as_lists(Dataset.range(3).apply(E.enumerate_dataset(start=10))) == [
        (10, 0), (11, 1), (12, 2)]
    assert E.unbatch.__name__ == "unbatch" and "ds.unbatch(" in E.unbatch.__doc__


def test_shuffle_and_repeat_map_and_batch_parallel_interleave():
    E, Dataset = gs.data.experimental, gs.data.Dataset
    got = as_lists(Dataset.range(5).apply(E.shuffle_and_repeat(5, count=2, seed=3)))
    assert got == as_lists(Dataset.range(5).shuffle(5, seed=3).repeat(2))
    assert sorted(got) == sorted(list(range(5)) * 2)
    got = as_lists(Dataset.range(7).apply(E.map_and_batch(lambda x: x * 3, 3,
                                                          num_parallel_batches=2)))
    assert got == [[0, 3, 6], [9, 12, 15], [18]]
    got = as_lists(Dataset.range(7).apply(E.map_and_batch(lambda x: x, 3, drop_remainder=True)))
    assert got == [[0, 1, 2], [3, 4, 5]]
    inter = Dataset.range(3).apply(E.parallel_interleave(
        lambda i: Dataset.range(2).map(lambda x: x + 10 * i), cycle_length=3))
    # TensorFlow 2.21 order for this pipeline (deterministic, block_length 1).
    assert as_lists(inter) == [0, 10, 20, 1, 11, 21]


def test_dataset_helpers():
    E, Dataset = gs.data.experimental, gs.data.Dataset
    assert E.cardinality(Dataset.range(10).batch(3)) == 4
    assert E.cardinality(Dataset.range(3).repeat()) == E.INFINITE_CARDINALITY
    assert E.cardinality(Dataset.range(3).filter(lambda x: x > 0)) == E.UNKNOWN_CARDINALITY
    assert int(E.get_single_element(Dataset.range(5).skip(4))) == 4
    spec = E.get_structure(Dataset.range(3).batch(2))
    assert spec == Dataset.range(3).batch(2).element_spec


def test_a_method_transformation_appears_when_the_dataset_method_exists(monkeypatch):
    Dataset = gs.data.Dataset
    assert "scan" in experimental_ops.METHOD_TRANSFORMATIONS
    if hasattr(Dataset, "scan"):
        assert "scan" in dir(gs.data.experimental)
        return
    assert "scan" not in experimental_ops.available()
    monkeypatch.setattr(Dataset, "scan", lambda self, state, fn: ("scan", self, state, fn),
                        raising=False)
    scan = experimental_ops.available()["scan"]
    ds = Dataset.range(2)
    f = lambda s, x: (s, x)  # noqa: E731
    assert ds.apply(scan(0, f)) == ("scan", ds, 0, f)


def test_static_functions_use_tensorflow_experimental_defaults(monkeypatch):
    Dataset = gs.data.Dataset
    calls = []
    monkeypatch.setattr(Dataset, "choose_from_datasets",
                        staticmethod(lambda *a, **k: calls.append((a, k)) or "chosen"),
                        raising=False)
    fn = experimental_ops.available()["choose_from_datasets"]
    assert fn(["a"], "c") == "chosen"
    # tf.data.experimental.choose_from_datasets defaults stop_on_empty_dataset to False
    # (Dataset.choose_from_datasets to True), recorded from TensorFlow 2.21.
    assert calls == [((["a"], "c"), {"stop_on_empty_dataset": False})]
    fn(["a"], "c", stop_on_empty_dataset=True)
    assert calls[-1][1] == {"stop_on_empty_dataset": True}
