"""``map`` and ``interleave`` on worker processes (``use_processes=True``): results and
their order, errors and dead workers, no process left behind, checkpoint positions,
bounded memory, the options switch, and the same under mpiexec and the parameter
server. Every test that starts a process has a timeout."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import AUTOTUNE, Dataset, Options, WorkerDiedError
from gpustrat.data import processes

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, repo_env  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def worker_pids(parent: int) -> list[int]:
    """The live worker processes started by process ``parent`` (read from /proc: their
    command line ends with the parent's pid)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and any(b"_worker_main" in a for a in argv) and \
                len(argv) >= 2 and argv[-2] == str(parent).encode():
            out.append(int(entry))
    return out


def wait_gone(parent: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while True:
        left = worker_pids(parent)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def as_ints(ds) -> list[int]:
    return [int(x) for x in ds]


def test_results_in_input_order_with_nested_and_large_outputs():
    scale = np.arange(4.0)

    def f(x):   # a closure over an array, outputs nesting small and large arrays
        return {"x": x, "pair": (np.full((200, 200), x, np.float32), scale * x)}

    got = list(Dataset.range(30).map(f, num_parallel_calls=2, use_processes=True))
    want = list(Dataset.range(30).map(f))
    assert len(got) == 30
    for g, w in zip(got, want):
        assert int(g["x"]) == int(w["x"])
        np.testing.assert_array_equal(g["pair"][0], w["pair"][0])
        np.testing.assert_array_equal(g["pair"][1], w["pair"][1])
        assert g["pair"][0].dtype == np.float32 and g["pair"][0].flags.writeable


@pytest.mark.timeout(60)
def test_large_tasks_and_large_answers_cross_without_waiting_for_each_other():
    # Fast calls on 300 KB inputs with 24 KB outputs: a task carries many inputs (tens
    # of MB, more than a socket holds) and its answer many outputs in the message
    # itself. The consumer must not block writing a worker's next task while that
    # worker blocks writing its answer.
    src = Dataset.range(600).map(lambda i: np.full(300_000 // 8, i, np.int64))
    ds = src.map(lambda a: a[:3000].copy(), num_parallel_calls=2, use_processes=True)
    got = [int(x[0]) for x in ds]
    assert got == list(range(600))


def test_many_short_calls_travel_in_batches_and_keep_their_order():
    ds = Dataset.range(3000).map(lambda x: x * 2, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    got = [int(next(it)) for _ in range(2000)]
    run = it._state._run
    assert run._batch > 1, "short calls should be sent several per message"
    got += as_ints(it)
    assert got == [2 * i for i in range(3000)]


def test_calls_run_in_other_processes_and_the_generator_in_this_one():
    seen = []

    def gen():
        for i in range(12):
            seen.append(os.getpid())
            yield i

    ds = Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((), np.int64))
    pids = {int(p) for p in ds.map(lambda i: np.int64(os.getpid()), num_parallel_calls=2,
                                   use_processes=True)}
    assert set(seen) == {os.getpid()}
    assert os.getpid() not in pids and 1 <= len(pids) <= 2


def test_written_for_tensorflow_runs_on_threads_and_the_options_switch_moves_it():
    me = os.getpid()
    base = Dataset.range(6)
    threads = base.map(lambda x: np.int64(os.getpid()), num_parallel_calls=2)
    assert set(as_ints(threads)) == {me}
    o = Options()
    o.experimental_processing.use_processes = True
    switched = threads.with_options(o)
    assert me not in set(as_ints(switched))
    # A call that says use_processes=False, or has no num_parallel_calls, stays here.
    kept = base.map(lambda x: np.int64(os.getpid()), num_parallel_calls=2,
                    use_processes=False).with_options(o)
    assert set(as_ints(kept)) == {me}
    serial = base.map(lambda x: np.int64(os.getpid())).with_options(o)
    assert set(as_ints(serial)) == {me}
    # The switch reaches interleave too: the datasets are made in the workers.
    slots = Dataset.range(4).interleave(lambda x: Dataset.from_tensors(np.int64(os.getpid())),
                                        num_parallel_calls=2)
    assert set(as_ints(slots)) == {me}
    assert me not in set(as_ints(slots.with_options(o)))
    o2 = Options()
    o2.experimental_processing.max_processes = 1
    one = base.map(lambda x: np.int64(os.getpid()), num_parallel_calls=AUTOTUNE,
                   use_processes=True).with_options(o2)
    assert len(set(as_ints(one))) == 1 and me not in set(as_ints(one))


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="num_parallel_calls is None"):
        Dataset.range(3).map(lambda x: x, use_processes=True)
    with pytest.raises(TypeError, match="use_processes must be True, False or None"):
        Dataset.range(3).map(lambda x: x, num_parallel_calls=2, use_processes="yes")
    with pytest.raises(TypeError, match="use_processes must be True, False or None"):
        Options().experimental_processing.use_processes = 1
    with pytest.raises(ValueError, match="max_processes"):
        Options().experimental_processing.max_processes = 0
    import threading
    lock = threading.Lock()
    ds = Dataset.range(3).map(lambda x: (lock, x)[1], num_parallel_calls=2,
                              use_processes=True)
    with pytest.raises(TypeError, match="use_processes=True runs the function in worker"):
        list(ds)


def test_not_deterministic_yields_results_as_they_complete():
    def f(x):
        if x == 0:
            time.sleep(1.0)
        return x

    ds = Dataset.range(20).map(f, num_parallel_calls=2, deterministic=False,
                               use_processes=True)
    got = as_ints(ds)
    assert sorted(got) == list(range(20))
    assert got[0] != 0
    ordered = as_ints(Dataset.range(20).map(f, num_parallel_calls=2, use_processes=True))
    assert ordered == list(range(20))


def failing(x):
    if x == 5:
        raise ValueError(f"bad record {int(x)}")
    return x


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("no")


def test_an_error_is_raised_with_the_workers_traceback_and_the_element():
    ds = Dataset.range(10).map(failing, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    got = [int(next(it)) for _ in range(5)]
    assert got == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="bad record 5") as info:
        next(it)
    cause = info.value.__cause__
    assert isinstance(cause, processes.RemoteTraceback)
    assert "in failing" in cause.text and 'raise ValueError(f"bad record' in cause.text
    assert any("input element 5 of this epoch" in n for n in info.value.__notes__)
    with pytest.raises(StopIteration):
        next(it)

    def raise_unpicklable(x):
        raise Unpicklable("held a lock")
    with pytest.raises(RuntimeError, match="Unpicklable: held a lock") as info:
        list(Dataset.range(3).map(raise_unpicklable, num_parallel_calls=2,
                                  use_processes=True))
    assert "raise_unpicklable" in info.value.__cause__.text


def test_ignore_errors_drops_the_failed_elements():
    ds = Dataset.range(10).map(failing, num_parallel_calls=2,
                               use_processes=True).ignore_errors()
    assert as_ints(ds) == [0, 1, 2, 3, 4, 6, 7, 8, 9]


def kill_self(x):
    if x == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def exit_self(x):
    if x == 3:
        os._exit(7)
    return x


def segfault(x):
    if x == 3:
        import ctypes
        ctypes.string_at(0)
    return x


@pytest.mark.parametrize("fn, how", [(kill_self, "killed by signal SIGKILL"),
                                     (exit_self, "exited with status 7"),
                                     (segfault, "killed by signal SIGSEGV")])
def test_a_dead_worker_is_an_error_naming_the_element(fn, how):
    ds = Dataset.range(8).map(fn, num_parallel_calls=2, use_processes=True)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError) as info:
        list(ds)
    assert time.monotonic() - t0 < 30
    message = str(info.value)
    assert how in message and "input element 3 of this epoch" in message, message
    assert not wait_gone(os.getpid())


def test_no_worker_outlives_its_iterator_closed_or_collected():
    me = os.getpid()
    ds = Dataset.range(100).map(lambda x: x, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    next(it)
    assert len(worker_pids(me)) == 2
    it.close()
    assert worker_pids(me) == []
    it = iter(ds)
    next(it)
    assert len(worker_pids(me)) == 2
    del it
    gc.collect()
    assert worker_pids(me) == []
    # Read ahead by a prefetch thread, over two passes of a repeat.
    it = iter(ds.take(5).repeat(2).prefetch(2))
    assert as_ints(it) == [0, 1, 2, 3, 4] * 2
    assert wait_gone(me) == []
    it = iter(ds.prefetch(2))
    next(it)
    it.close()
    assert worker_pids(me) == []
    # A pipeline that cannot save its position (a Python generator's) runs the same.
    gen = Dataset.from_generator(lambda: iter(range(100)),
                                 output_signature=gs.data.TensorSpec((), np.int64))
    it = iter(gen.map(lambda x: x, num_parallel_calls=2, use_processes=True))
    assert it._state is None
    next(it)
    assert len(worker_pids(me)) == 2
    del it
    gc.collect()
    assert wait_gone(me) == []


CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import gpustrat as gs

    def slow(x):
        time.sleep(0.2)
        return np.full(1 << 15, x)   # 256 KiB: through shared memory

    ds = gs.data.Dataset.range(10**6).map(slow, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    next(it)
    print("RUNNING", flush=True)
    try:
        for x in it:
            pass
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
        raise
""")


BUSY_CHILD = textwrap.dedent("""
    import gpustrat as gs

    def busy(x):   # pure Python for a minute: the call holds its worker's GIL
        s = 0
        for k in range(3 * 10**9):
            s += k % 7
        return s

    it = iter(gs.data.Dataset.range(4).map(busy, num_parallel_calls=2, use_processes=True))
    print("RUNNING", flush=True)
    next(it)
""")


def start_child(code=CHILD):
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=repo_env())
    line = proc.stdout.readline()
    assert line.strip() == "RUNNING", proc.stderr.read() if proc.poll() is not None else line
    deadline = time.monotonic() + 10
    while len(worker_pids(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(worker_pids(proc.pid)) == 2
    return proc


def test_ctrl_c_ends_the_pipeline_and_its_workers():
    proc = start_child()
    try:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert "INTERRUPTED" in out and "KeyboardInterrupt" in err, err
        assert proc.returncode != 0
        assert wait_gone(proc.pid) == []
    finally:
        proc.kill()
        proc.wait()


def test_workers_exit_when_their_parent_is_killed():
    proc = start_child()
    try:
        workers = worker_pids(proc.pid)
        shm = processes._shm_dir()

        def segments():
            return [n for n in os.listdir(shm) if n.startswith(f"gpustrat-{proc.pid}-")]
        deadline = time.monotonic() + 10
        while not segments() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert segments()
        proc.kill()
        proc.wait()
        assert wait_gone(proc.pid, timeout=10) == [], workers
        assert segments() == []   # each worker removed its own as it left
    finally:
        proc.kill()
        proc.wait()


def test_workers_exit_when_their_parent_is_killed_in_the_middle_of_a_python_call():
    # The call holds the GIL and would run for a minute: the worker still leaves at
    # once when its parent dies (not when the call ends).
    proc = start_child(BUSY_CHILD)
    try:
        workers = worker_pids(proc.pid)
        time.sleep(1.5)   # both workers are in their call by now
        assert worker_pids(proc.pid) == workers
        proc.kill()
        proc.wait()
        assert wait_gone(proc.pid, timeout=5) == [], workers
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_checkpoint_keeps_the_exact_position_with_work_in_flight(deterministic):
    def f(x):
        time.sleep(0.002 * (x % 3))
        return np.int64(x) * 10

    ds = Dataset.range(200).map(f, num_parallel_calls=2, deterministic=deterministic,
                                use_processes=True).batch(3)
    it = iter(ds)
    before = [next(it).tolist() for _ in range(20)]
    assert it._state._inputs[0]._run._inputs, "elements should be in flight at the save"
    state = it.get_state()
    after = [x.tolist() for x in it]
    restored = iter(ds)
    restored.set_state(state)
    again = [x.tolist() for x in restored]
    flat = [v for b in before + again for v in b]
    if deterministic:
        assert again == after
        assert flat == [10 * i for i in range(200)]
    else:
        assert sorted(flat) == [10 * i for i in range(200)]  # none lost, none repeated


def test_a_checkpoint_of_short_batched_calls_resumes_exactly():
    ds = Dataset.range(5000).map(lambda x: x + 1, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    first = [int(next(it)) for _ in range(1500)]
    state = it.get_state()
    restored = iter(ds)
    restored.set_state(state)
    assert first + as_ints(restored) == list(range(1, 5001))


def test_memory_stays_bounded_with_large_outputs():
    me = os.getpid()
    mib = 1 << 20

    def big(x):
        return np.full(4 * mib // 8, x, np.int64)   # 4 MiB

    ds = Dataset.range(60).map(big, num_parallel_calls=2, use_processes=True)
    it = iter(ds)
    run = it._state._run
    most_in_flight = most_segments = 0

    def rss():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
    start = None
    for i, a in enumerate(it):
        assert a[0] == i and a[-1] == i
        if start is None:
            start = rss()
        time.sleep(0.01)  # a consumer slower than the workers
        most_in_flight = max(most_in_flight, len(run._inputs))
        prefix = run.pool.prefix
        most_segments = max(most_segments, sum(
            os.path.getsize(os.path.join(run.pool.shm_dir, n))
            for n in os.listdir(run.pool.shm_dir) if n.startswith(prefix)))
        del a
    grew = rss() - start
    assert most_in_flight <= 2 * 2, most_in_flight           # 2 tasks a worker, 1 each
    # Shared memory: the answers in flight or waiting (at most 4), the one held here
    # and each worker's segments kept for reuse (32 MiB), whatever went through.
    assert most_segments <= (5 * 4 + 2 * 32) * mib, most_segments / mib
    assert grew < 64 * mib, grew                               # 240 MiB went through
    assert not [n for n in os.listdir(run.pool.shm_dir) if n.startswith(prefix)]
    assert worker_pids(me) == []


def test_process_count_is_the_cores_of_this_rank(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    for name in processes._LOCAL_SIZE_VARS:
        monkeypatch.delenv(name, raising=False)
    assert processes.process_count() == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")   # two unbound ranks on this machine
    assert processes.process_count() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 4})  # a bound rank
    assert processes.process_count() == 3


def slot_dataset(x):
    return Dataset.range(x * 10, x * 10 + int(x) % 4 + 1).map(lambda v: v * 2)


def test_interleave_on_processes_gives_the_order_of_threads_and_resumes():
    kw = dict(cycle_length=3, block_length=2, num_parallel_calls=2)
    want = as_ints(Dataset.range(9).interleave(slot_dataset, **kw))
    ds = Dataset.range(9).interleave(slot_dataset, use_processes=True, **kw)
    assert as_ints(ds) == want
    it = iter(ds)
    first = [int(next(it)) for _ in range(7)]
    state = it.get_state()
    restored = iter(ds)
    restored.set_state(state)
    assert first + as_ints(restored) == want
    assert len(worker_pids(os.getpid())) == 2   # the saved iterator's pool, still open
    del it
    gc.collect()
    assert wait_gone(os.getpid()) == []


def test_interleave_on_processes_reports_the_slots_error():
    def bad(x):
        return Dataset.range(3).map(lambda v: 1 // (int(v) - 1))
    ds = Dataset.range(2).interleave(bad, num_parallel_calls=2, use_processes=True)
    with pytest.raises(ZeroDivisionError) as info:
        list(ds)
    assert "ZeroDivisionError" in info.value.__cause__.text


MPI_SCRIPT = r"""
import os
import numpy as np
import gpustrat as gs
from gpustrat.data import AUTOTUNE, Dataset, processes

s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
rank = s.cluster_resolver.task_id

def work(i):
    x = 0
    for k in range(2000):   # Python that holds the GIL
        x += (k * int(i)) % 7
    return np.int64(i), np.int64(x), np.int64(os.getpid())

ds = Dataset.range(64).map(work, num_parallel_calls=AUTOTUNE, use_processes=True).batch(8)
dist = s.experimental_distribute_dataset(ds)
seen, pids = [], set()
for batch in dist:
    for part in s.experimental_local_results(batch):
        seen += np.asarray(part[0]).tolist()
        pids |= set(np.asarray(part[2]).tolist())
assert os.getpid() not in pids
# Each global batch of 8 is split over the 2 workers: 4 rows each.
expect = [v for b in range(8) for v in range(8 * b + 4 * rank, 8 * b + 4 * rank + 4)]
assert seen == expect, (rank, seen)
print("OK", rank, len(pids), processes.process_count(), flush=True)
"""


@pytest.mark.mpi
def test_under_mpiexec_each_rank_has_its_own_pool():
    out = assert_mpi_ok(2, MPI_SCRIPT, timeout=120, expect_lines=2)
    for line in out.splitlines():
        if line.startswith("OK"):
            _, rank, used, count = line.split()
            assert 1 <= int(used) <= int(count), line


PS_SCRIPT = r"""
import os
import numpy as np
import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)

def dataset_fn():
    def work(i):
        return np.int64(i) * 3, np.int64(os.getpid())
    return (gs.data.Dataset.range(40)
            .map(work, num_parallel_calls=2, use_processes=True).batch(4))

it = iter(coord.create_per_worker_dataset(dataset_fn))
def step(iterator):
    x, pid = next(iterator)
    return x.tolist(), sorted(set(pid.tolist())), os.getpid()
got = coord.fetch([coord.schedule(step, args=(it,)) for _ in range(10)])
values = sorted(v for x, _, _ in got for v in x)
assert values == [3 * i for i in range(40)], values
for _, pids, here in got:
    assert here not in pids and 1 <= len(pids) <= 2, (here, pids)
print("OK", flush=True)
"""


@pytest.mark.mpi
def test_a_parameter_server_workers_dataset_maps_on_processes():
    assert_mpi_ok(3, PS_SCRIPT, timeout=120, expect_lines=1)


def test_a_function_that_cannot_load_in_a_worker_is_an_error_not_a_dead_worker(tmp_path):
    # A module importable here but not in a fresh interpreter (put on sys.path after
    # the workers' path was taken... here: removed before they start).
    (tmp_path / "only_here_mod.py").write_text("def f(x):\n    return x\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import only_here_mod
    finally:
        sys.path.remove(str(tmp_path))
    try:
        ds = Dataset.range(3).map(only_here_mod.f, num_parallel_calls=2, use_processes=True)
        with pytest.raises(RuntimeError, match="could not be loaded in the worker") as info:
            list(ds)
        assert "only_here_mod" in info.value.__cause__.text
    finally:
        sys.modules.pop("only_here_mod", None)


def test_a_dead_interleave_worker_is_an_error_naming_the_slots_element():
    def slot(x):
        def f(v):
            if int(x) == 2 and int(v) == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return v
        return Dataset.range(3).map(f)

    ds = Dataset.range(4).interleave(slot, cycle_length=2, num_parallel_calls=2,
                                     use_processes=True)
    with pytest.raises(WorkerDiedError, match="killed by signal SIGKILL") as info:
        list(ds)
    assert "input element 2" in str(info.value), str(info.value)
    assert gs.data.experimental.ProcessingOptions is gs.data.ProcessingOptions
    assert wait_gone(os.getpid()) == []
