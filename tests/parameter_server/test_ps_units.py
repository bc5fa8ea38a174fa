"""Parameter-server pieces that need no MPI job: partitioners (TensorFlow 2.21's
arithmetic), TF_CONFIG parsing, and how functions and arrays travel."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.distribute.parameter_server import partitioners as P
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.resolver import _parse_tf_config, role_of
from gpustrat.distribute.parameter_server.variables import shard_rows

# Recorded from TensorFlow 2.21: tf.distribute.experimental.partitioners.* called with
# (tf.TensorShape(shape), dtype).
TF_PARTITIONS = json.loads("""
[{"shape": [10, 3], "dtype": "float32", "fixed3": [3, 1], "min_default": [1, 1], "min_16_4": [4, 1], "max_64": [2, 1], "max_64_3": [2, 1], "max_1000": [1, 1]},
 {"shape": [7], "dtype": "float64", "fixed3": [3], "min_default": [1], "min_16_4": [4], "max_64": [1], "max_64_3": [1], "max_1000": [1]},
 {"shape": [1000, 100], "dtype": "float32", "fixed3": [3, 1], "min_default": [1, 1], "min_16_4": [4, 1], "max_64": [1000, 1], "max_64_3": [3, 1], "max_1000": [500, 1]},
 {"shape": [3, 5], "dtype": "int32", "fixed3": [3, 1], "min_default": [1, 1], "min_16_4": [3, 1], "max_64": [1, 1], "max_64_3": [1, 1], "max_1000": [1, 1]},
 {"shape": [100, 2], "dtype": "string", "fixed3": [3, 1], "min_default": [1, 1], "min_16_4": [4, 1], "max_64": [50, 1], "max_64_3": [3, 1], "max_1000": [1, 1]},
 {"shape": [1, 8], "dtype": "float32", "fixed3": [1, 1], "min_default": [1, 1], "min_16_4": [1, 1], "max_64": [1, 1], "max_64_3": [1, 1], "max_1000": [1, 1]}]
""")
PARTITIONERS = {
    "fixed3": P.FixedShardsPartitioner(3),
    "min_default": P.MinSizePartitioner(),
    "min_16_4": P.MinSizePartitioner(min_shard_bytes=16, max_shards=4),
    "max_64": P.MaxSizePartitioner(max_shard_bytes=64),
    "max_64_3": P.MaxSizePartitioner(max_shard_bytes=64, max_shards=3),
    "max_1000": P.MaxSizePartitioner(max_shard_bytes=1000, bytes_per_string=4),
}


@pytest.mark.parametrize("case", TF_PARTITIONS, ids=lambda c: f"{c['shape']}-{c['dtype']}")
def test_partitioners_match_tensorflow(case):
    dtype = object if case["dtype"] == "string" else case["dtype"]
    for key, part in PARTITIONERS.items():
        assert part(tuple(case["shape"]), dtype) == case[key], key


def test_partitioners_are_reachable_and_refuse_bad_arguments():
    assert gs.distribute.experimental.partitioners.MaxSizePartitioner is P.MaxSizePartitioner
    with pytest.raises(ValueError, match="num_shards"):
        P.FixedShardsPartitioner(0)
    with pytest.raises(ValueError, match="max_shard_bytes"):
        P.MaxSizePartitioner(0)
    with pytest.raises(ValueError, match="axis 0"):
        P.FixedShardsPartitioner(2)((), np.float32)


def test_shards_split_rows_as_tensorflow():
    # TensorFlow's ShardedVariable gives the first rows % n shards one row more.
    assert shard_rows(10, 3) == [4, 3, 3]
    assert shard_rows(8, 2) == [4, 4]
    assert shard_rows(5, 4) == [2, 1, 1, 1]


def test_roles_of_ranks():
    assert [role_of(r, 2) for r in range(5)] == [
        ("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1)]


def test_tf_config_is_parsed_and_checked():
    cfg = {"cluster": {"chief": ["h:1"], "ps": ["h:2", "h:3"], "worker": ["h:4"]},
           "task": {"type": "worker", "index": 0}}
    assert _parse_tf_config(json.dumps(cfg))["ps"] == ["h:2", "h:3"]
    with pytest.raises(ValueError, match="no 'worker' tasks"):
        _parse_tf_config({"cluster": {"ps": ["a"]}})
    with pytest.raises(ValueError, match="'evaluator2'"):
        _parse_tf_config({"cluster": {"ps": ["a"], "worker": ["b"], "evaluator2": ["c"]}})
    with pytest.raises(ValueError, match="not valid JSON"):
        _parse_tf_config("{cluster")
    with pytest.raises(ValueError, match="2 'chief' tasks"):
        _parse_tf_config({"cluster": {"chief": ["a", "b"], "ps": ["a"], "worker": ["b"]}})


def test_importing_the_names_starts_no_mpi():
    code = ("import sys, gpustrat as gs\n"
            "gs.distribute.cluster_resolver.MpiClusterResolver\n"
            "gs.distribute.experimental.ParameterServerStrategy\n"
            "gs.distribute.coordinator.ClusterCoordinator, gs.distribute.coordinator.RemoteValue\n"
            "gs.distribute.experimental.coordinator.PerWorkerValues\n"
            "gs.distribute.coordinator.experimental_get_current_worker_index\n"
            "gs.distribute.experimental.partitioners.FixedShardsPartitioner\n"
            "gs.distribute.ShardedVariable\n"
            "assert gs.distribute.experimental.coordinator.ClusterCoordinator is "
            "gs.distribute.coordinator.ClusterCoordinator\n"
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI started at import'\n"
            "print('fine')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "fine", out.stderr


# --- functions and arrays on the wire ----------------------------------------------------

SCALE = 3


def module_level(x):
    return x * SCALE


def _roundtrip(obj):
    blob, arrays = wire.pack(obj)
    return wire.unpack(blob, [a.copy() for a in arrays]), blob, arrays


def test_arrays_travel_outside_the_pickle():
    big = np.arange(100000, dtype=np.float64)
    back, blob, arrays = _roundtrip({"a": big, "s": np.float32(2), "z": np.zeros(())})
    assert len(blob) < 1000 and len(arrays) == 2
    assert np.array_equal(back["a"], big) and back["z"].shape == ()


def test_importable_function_travels_by_reference():
    back, blob, _ = _roundtrip(module_level)
    assert back is module_level
    assert b"co_code" not in blob and len(blob) < 200


def test_script_functions_travel_by_value_with_closures_globals_and_recursion():
    offset = 10
    np_alias = np

    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def local(x, k=2):
        return np_alias.asarray(x) * k + offset + fact(3) + module_level(1)

    back, _, _ = _roundtrip(local)
    assert back is not local
    assert back(np.ones(2)).tolist() == [21.0, 21.0]  # 2 + 10 + 6 + 3
    lam, _, _ = _roundtrip(lambda y: y + offset)
    assert lam(1) == 11


# A global whose name is also an attribute a function reads (np.log): not the function's.
log = threading.Lock()


def test_a_global_named_like_an_attribute_the_function_reads_stays_behind():
    # Attribute names sit beside global names in the code object: np.log used to
    # bring the unpicklable global ``log`` along, and the schedule failed.
    back, _, _ = _roundtrip(lambda x: float(np.log(x)))
    assert back(1.0) == 0.0
    # A global the function does read still travels, and one that cannot is named.
    with pytest.raises(TypeError, match=r"_thread.lock"):
        wire.pack(lambda: log.locked(), "function 'f'")


def test_what_cannot_travel_is_a_type_error_naming_it():
    lock = threading.Lock()
    with pytest.raises(TypeError, match=r"cannot send function 'f'.*_thread.lock"):
        wire.pack(lambda: lock, "function 'f'")
    import __main__

    def uses_main():
        return __main__

    with pytest.raises(TypeError, match="__main__"):
        wire.pack(uses_main)


def test_variables_and_metrics_made_outside_the_scope_cannot_travel():
    from gpustrat.distribute.parameter_server.variables import (RemoteVariable,
                                                                ShardedVariable)
    from gpustrat.distribute.variables import VariableAggregation, VariableSynchronization
    counter = gs.Variable(np.zeros((), np.float32), name="counter")
    metric = gs.metrics.Sum(name="outside_metric")

    def step():
        counter.assign_add(np.float32(1))

    with pytest.raises(TypeError, match=r"cannot send function 'step' to another process: "
                       r"gs.Variable 'counter' was made outside strategy.scope\(\).*"
                       r"inside `with strategy.scope\(\):`") as info:
        wire.pack((step, (), {}), "function 'step'")
    assert "picklable" not in str(info.value)  # not the general advice
    with pytest.raises(TypeError, match=r"metric 'outside_metric' \(gs.metrics.Sum\) was "
                       r"made outside strategy.scope\(\)"):
        wire.pack((lambda: metric.update_state(1.0), (), {}), "function 'f'")
    with pytest.raises(TypeError, match="'counter' was made outside"):
        wire.pack({"args": [counter]}, "an argument")
    # Handles of variables on the servers travel, in a metric too.
    handle = RemoteVariable._handle(3, 1, (2,), np.float32, "w", True,
                                    VariableSynchronization.AUTO, VariableAggregation.NONE)
    sharded = ShardedVariable._from_shards([handle, handle], "s")
    held = gs.metrics.Sum(name="held")
    held._variables = [handle]
    held.total = handle
    back, _, _ = _roundtrip((lambda: (handle, sharded), held))
    w, s = back[0]()
    assert (w._vid, w._server, s.shape) == (3, 1, (4,))
    assert back[1].variables[0]._vid == 3


def test_a_remote_value_passed_on_says_whether_it_is_pending_or_failed():
    from gpustrat.distribute.parameter_server.values import RemoteValue
    rv = RemoteValue("function 'first'")
    with pytest.raises(TypeError, match=r"RemoteValue of function 'first' is not ready "
                       r"yet: pass remote_value.fetch\(\)"):
        wire.pack(rv)
    rv._fail(ValueError("bad row 3 (function 'first' failed on worker 0)"))
    with pytest.raises(TypeError, match=r"RemoteValue of function 'first' has no result: "
                       r"the function failed with ValueError: bad row 3"):
        wire.pack(rv)
    done = RemoteValue("function 'second'")
    done._set(np.arange(3))
    assert _roundtrip([done])[0][0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("raised, said", [
    (SystemExit(0), "called sys.exit(0)"), (SystemExit(), "called sys.exit()"),
    (SystemExit("bad input"), "called sys.exit('bad input')"),
    (KeyboardInterrupt(), "raised KeyboardInterrupt")])
def test_a_function_that_exits_is_an_ordinary_error_on_the_coordinator(raised, said):
    import pickle

    from gpustrat.distribute.parameter_server.coordinator import _remote_error
    err = _remote_error(pickle.dumps(raised), "Traceback ...\nSystemExit: 0\n",
                        "function 'step'", 1, 3)
    assert type(err) is RuntimeError, err
    assert str(err).startswith(f"function 'step' {said} on worker 1 (rank 3)"), err
    assert "Traceback ..." in "".join(err.__notes__)
    # An exception keeps its type, with the function and worker named.
    err = _remote_error(pickle.dumps(KeyError("k")), "tb", "function 'step'", 0, 2)
    assert type(err) is KeyError and "function 'step' failed on worker 0" in str(err)


def test_a_server_known_lost_fails_requests_at_once():
    from gpustrat.distribute.parameter_server.channel import Channel, ServerLostError

    class Comm:
        def Get_rank(self):
            return 3

        def Get_size(self):
            return 4

    class FullSlots:  # the server never took this rank's previous update
        def put(self, dest, code, value, timeout):
            raise TimeoutError

    ch = Channel(Comm(), timeout=4.0)
    ch.server_ranks = [1, 2]
    ch.staging = FullSlots()
    with pytest.raises(ServerLostError, match=r"^assign_add on parameter server 1 \(rank "
                       r"2\): it did not take this rank's previous update within 4 s "
                       r"\(GPUSTRAT_TIMEOUT\)"):
        ch.request(1, "assign_add", (7,), [np.ones(2, np.float32)])
    assert ch.lost == {2}
    # Known lost: every later request to it fails at once (no MPI is touched).
    for op, args, arrays in [("read", (7, (2,), "<f4"), []),
                             ("assign", (7,), [np.ones(2, np.float32)]),
                             ("create", (8, "w", "<f4", (2,)), [])]:
        with pytest.raises(ServerLostError, match=rf"^{op} on parameter server 1 \(rank "
                           r"2\): the server was lost earlier .*restore the variables "
                           r"from a checkpoint"):
            ch.request(1, op, args, arrays)


def test_a_gone_coordinator_is_noticed_on_its_machine():
    import os
    import socket

    from gpustrat.distribute.parameter_server.resolver import MpiClusterResolver
    r = object.__new__(MpiClusterResolver)
    r._coordinator_process = (socket.gethostname(), os.getpid())
    assert not r.coordinator_gone()
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    r._coordinator_process = (socket.gethostname(), done.pid)
    assert r.coordinator_gone()
    r._coordinator_process = ("another-host", done.pid)
    assert not r.coordinator_gone()  # another machine's process cannot be checked


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from gpustrat.distribute.parameter_server.variables import (  # noqa: E402
    RemoteVariable, ShardedVariable)
from gpustrat.distribute.variables import (  # noqa: E402
    VariableAggregation, VariableSynchronization)


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 500), cols=st.integers(1, 6), shards=st.integers(1, 40),
       max_bytes=st.integers(1, 4096))
def test_sharding_delivers_every_row_once(rows, cols, shards, max_bytes):
    for part in (P.FixedShardsPartitioner(shards),
                 P.MinSizePartitioner(min_shard_bytes=max_bytes, max_shards=shards),
                 P.MaxSizePartitioner(max_shard_bytes=max_bytes, max_shards=shards)):
        n = part((rows, cols), np.float32)[0]
        assert 1 <= n <= min(rows, shards), (part, n)
        sizes = shard_rows(rows, n)
        assert sum(sizes) == rows and min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
        handles = [RemoteVariable._handle(i, i % 2, (k, cols), np.float32, f"s{i}", True,
                                          VariableSynchronization.ON_WRITE,
                                          VariableAggregation.NONE)
                   for i, k in enumerate(sizes)]
        sharded = ShardedVariable._from_shards(handles, "x")
        value = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
        pieces = sharded._split(value)
        assert sharded.shape == (rows, cols)
        assert [p.shape[0] for p in pieces] == sizes
        assert np.array_equal(np.concatenate(pieces), value)


# --- per-worker values -------------------------------------------------------------------

def test_per_worker_values_are_found_in_arguments_and_need_a_coordinator():
    from gpustrat.distribute.parameter_server import values as V
    a, b = V.PerWorkerValues([1, 2]), V.PerWorkerValues((np.zeros(2), np.ones(2)))
    assert a.values == (1, 2) and len(b) == 2
    found = V.find_unplaced((a, [{"k": b}], a), {"x": (b,), "y": {3: 4, "z": a}})
    assert len(found) == 2 and {id(x) for x in found} == {id(a), id(b)}
    b._ident = 5  # placed: not found again
    assert V.find_unplaced(([b],), None) == []
    # A placed one travels as its number; one met before any coordinator exists is
    # a TypeError saying what to do.
    blob, _ = wire.pack(b)
    assert len(blob) < 200
    with pytest.raises(TypeError, match="make the coordinator first"):
        wire.pack({"v": a})
    with pytest.raises(TypeError, match="list or tuple"):
        V.PerWorkerValues(3)
    with pytest.raises(TypeError, match="lives on worker 1"):
        wire.pack(V.WorkerLocal(1, "resource"))
    with pytest.raises(RuntimeError, match="inside a scheduled function"):
        next(V.PerWorkerIterator(b))
    with pytest.raises(RuntimeError, match="not on the coordinator"):
        gs.distribute.coordinator.experimental_get_current_worker_index()


# --- waiting: doorbells and the function-process pipe ------------------------------------

def test_a_doorbell_wakes_its_sleeper_and_keeps_a_ring_nobody_waited_for():
    import time

    from gpustrat.distribute.parameter_server import doorbell
    job = doorbell.job_id("testhost", 12345)
    bell = doorbell.Doorbell(doorbell.address(job, 3, doorbell.REPLIES))
    ringer = doorbell.Ringer(job)
    try:
        assert bell.sock is not None, "Linux has the abstract socket namespace"
        t0 = time.perf_counter()
        assert bell.sleep(0.05) is False  # nobody rang: the whole timeout
        assert time.perf_counter() - t0 >= 0.04
        ringer.ring(3)  # before anybody sleeps: kept, so the next sleep ends at once
        t0 = time.perf_counter()
        assert bell.sleep(5.0) is True
        assert time.perf_counter() - t0 < 2.0
        assert bell.drain() is False  # the sleep took the ring
        # A ring from another thread ends a sleep in progress.
        threading.Timer(0.05, ringer.ring, args=(3,)).start()
        t0 = time.perf_counter()
        assert bell.sleep(5.0) is True and time.perf_counter() - t0 < 2.0
        ringer.ring(4)  # nobody there (another machine, or gone): dropped quietly
        # Many rings while nobody reads: the socket fills, rings are dropped, one wakes.
        for _ in range(5000):
            ringer.ring(3)
        assert bell.sleep(1.0) is True and bell.drain() is False
    finally:
        bell.close()
        ringer.close()


def test_a_checkpoint_refuses_per_worker_iterators_and_skips_them_when_held(tmp_path):
    # TensorFlow 2.21: tf.train.Checkpoint(it=<PerWorkerDistributedIterator>) raises
    # ("expecting a trackable object"), and a module attribute holding one is not saved.
    from gpustrat.distribute.parameter_server.values import (PerWorkerDataset,
                                                             PerWorkerIterator,
                                                             PerWorkerValues)
    it = PerWorkerIterator(PerWorkerValues([1, 2]))
    for name, value in (("it", it), ("values", PerWorkerValues([1, 2])),
                        ("ds", PerWorkerDataset(None, PerWorkerValues([1, 2])))):
        with pytest.raises(TypeError, match=rf"cannot save {name}={type(value).__name__}: "
                           r"per-worker values and iterators are not saved in checkpoints "
                           r"under ParameterServerStrategy.*starts from its beginning"):
            gs.train.Checkpoint(**{name: value})

    class Trainer:
        def __init__(self):
            self.w = gs.Variable(np.arange(3.0, dtype=np.float32), name="w")
            self.iterator = it

    trainer = Trainer()
    path = gs.train.Checkpoint(trainer=trainer).save(str(tmp_path / "c"))
    trainer.w.assign(np.zeros(3, np.float32))
    gs.train.Checkpoint(trainer=trainer).restore(path).assert_consumed()
    assert trainer.w.numpy().tolist() == [0.0, 1.0, 2.0] and trainer.iterator is it


def test_update_slots_leave_shared_memory_to_spare(monkeypatch):
    from types import SimpleNamespace

    from gpustrat.distribute.parameter_server import staging
    free = {"bytes": 1 << 40}
    monkeypatch.setattr(staging.os, "statvfs", lambda path: SimpleNamespace(
        f_bavail=free["bytes"] // 4096, f_frsize=4096))
    assert staging._slot_bytes(5, 2) == staging.SLOT_BYTES
    # 64 MiB free (a container's default /dev/shm), 9 ranks, 3 of them servers: every
    # rank filling both slots at every server takes at most half of it.
    free["bytes"] = 64 << 20
    slot = staging._slot_bytes(9, 3)
    assert slot % 64 == 0 and 9 * 3 * 2 * slot <= 32 << 20 < 9 * 3 * 2 * (slot + 64)
    free["bytes"] = 0
    assert staging._slot_bytes(9, 3) == 0

    def missing(path):
        raise FileNotFoundError(path)
    monkeypatch.setattr(staging.os, "statvfs", missing)
    assert staging._slot_bytes(9, 3) == staging.SLOT_BYTES


def test_a_worker_bound_to_one_cpu_is_told_how_to_give_it_two():
    from gpustrat.distribute.parameter_server.worker import one_cpu_warning
    text = one_cpu_warning(1, 3, cpus={5}, cpu_count=16)
    assert text.startswith("gpustrat: worker 1 (rank 3) may run on CPU 5 only")
    assert "srun -c 2" in text and "-bind-to none" in text
    assert "I_MPI_PIN=0" in text and "I_MPI_PIN_DOMAIN=2" in text  # Intel MPI pins by default
    assert one_cpu_warning(1, 3, cpus={4, 5}, cpu_count=16) is None
    assert one_cpu_warning(1, 3, cpus={0}, cpu_count=1) is None  # a one-CPU machine


def test_reads_inside_run_on_gpu_replicas_are_on_the_replicas_devices():
    # A server's variable read inside strategy.run on a GPU worker came back as a NumPy
    # array, which CuPy refuses to mix with the replica's CuPy arrays.
    from gpustrat import devices, testing
    from gpustrat.distribute.parameter_server.variables import _FetchedReads

    class Held(_FetchedReads):
        def _fetch(self):
            return np.arange(3, dtype=np.float32)

    v = Held()
    with testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            for read in (v.value, v.read_value):
                got = s.experimental_local_results(s.run(lambda: read() * 2))
                assert [type(g) for g in got] == [cp.ndarray] * 2
                assert [g.device.id for g in got] == [0, 1]
                assert [devices.to_host(g).tolist() for g in got] == [[0, 2, 4]] * 2
            assert type(v.numpy()) is np.ndarray          # on the host, always
        finally:
            s.close()
    assert not san.reports, san.reports
    cpu = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        got = cpu.experimental_local_results(cpu.run(v.value))
        assert all(type(g) is np.ndarray and not g.flags.writeable for g in got)
    finally:
        cpu.close()


def test_a_server_step_decays_a_shard_as_its_whole_variable_and_starts_slots_afresh():
    # Shards are "bias/part_0" on their server: an exclusion anchored at the end of the
    # name ("bias$") still excludes them, as it does the local variable "bias".
    from gpustrat.distribute.parameter_server.optimizers import _server_copy
    from gpustrat.distribute.parameter_server.server import Server
    server = Server(None, 0, None)
    server.op_create(0, "iterations", "int64", (), arrays=[])
    server.op_create(1, "bias/part_0", "float32", (2,), arrays=[])
    server.op_create(2, "kernel/part_1", "float32", (2,), arrays=[])
    server.op_assign(1, arrays=[np.ones(2, np.float32)])
    server.op_assign(2, arrays=[np.ones(2, np.float32)])
    opt = gs.optimizers.Adagrad(1.0, initial_accumulator_value=0.5, weight_decay=0.5,
                                exclude_from_weight_decay=["bias$"])
    step, _ = server.op_apply(0, 1.0, None, [1, 2], opt._settings(), _server_copy(opt),
                              arrays=[np.zeros(2, np.float32)] * 2)
    assert step == 1
    np.testing.assert_array_equal(server.vars[1].array, [1.0, 1.0])     # not decayed
    np.testing.assert_array_equal(server.vars[2].array, [0.5, 0.5])     # 1 - 1 * 0.5 * 1
    np.testing.assert_array_equal(server.slot_arrays[(0, 1)]["accumulator"], [0.5, 0.5])
