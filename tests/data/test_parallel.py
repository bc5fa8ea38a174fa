"""Parallel map, prefetch and parallel interleave: order, errors, and thread lifetime."""

import gc
import subprocess
import sys
import threading
import time
import traceback

import numpy as np
import pytest

from gpustrat.data import AUTOTUNE, Dataset, TensorSpec


def _pipeline_threads():
    return [t for t in threading.enumerate() if t.name.startswith("gpustrat-")]


def _wait_no_threads(timeout=5.0):
    end = time.monotonic() + timeout
    while _pipeline_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return _pipeline_threads()


def test_parallel_map_keeps_order_with_uneven_delays():
    def slow(x):
        time.sleep(0.002 * (int(x) % 4))
        return x * 10

    ds = Dataset.range(40).map(slow, num_parallel_calls=8)
    assert [int(v) for v in ds] == [10 * i for i in range(40)]
    assert ds.element_spec == TensorSpec((), np.int64)


def test_parallel_map_nondeterministic_delivers_every_element():
    def slow(x):
        time.sleep(0.05 if int(x) == 0 else 0.0)
        return x

    out = [int(v) for v in Dataset.range(30).map(slow, num_parallel_calls=4,
                                                  deterministic=False)]
    assert sorted(out) == list(range(30))
    assert out[0] != 0  # the slow first element did not hold the others back


def test_seed_004_pattern_index_dataset_plus_parallel_python_map():
    # Seed 004: a dataset of indices, then map of a slow Python function, AUTOTUNE.
    training_set = [np.full(3, i, np.float32) for i in range(64)]
    lock = threading.Lock()
    inside = [0]
    peak = [0]

    def process(i):
        with lock:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.002)  # the slow, non-vectorisable Python work
        with lock:
            inside[0] -= 1
        x = training_set[int(i)]
        return x * 2, np.float32(x.sum())

    ds = (Dataset.from_generator(lambda: range(len(training_set)),
                                 output_signature=TensorSpec((), np.int64))
          .map(process, num_parallel_calls=AUTOTUNE)
          .batch(8))
    batches = list(ds)
    assert len(batches) == 8
    np.testing.assert_array_equal(batches[1][0][0], np.full(3, 16, np.float32))
    np.testing.assert_array_equal(batches[7][1], [3 * i for i in range(56, 64)])
    assert peak[0] >= 2  # calls overlap: faster than serial where calls wait
    assert ds.element_spec == (TensorSpec((None, 3), np.float32),
                               TensorSpec((None,), np.float32))


def _boom(x):
    if int(x) == 5:
        raise KeyError(f"bad element {int(x)}")
    return x


@pytest.mark.parametrize("parallel", [None, 4])
def test_exception_in_map_is_reraised_with_its_traceback_then_stops(parallel):
    it = iter(Dataset.range(20).map(_boom, num_parallel_calls=parallel).prefetch(2))
    got = []
    with pytest.raises(KeyError, match="bad element 5") as info:
        for v in it:
            got.append(int(v))
    assert got == [0, 1, 2, 3, 4]
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_boom" in frames  # the worker's own frame is kept
    with pytest.raises(StopIteration):
        next(it)
    assert _wait_no_threads() == []


def test_close_stops_threads_midway():
    gate = threading.Event()

    def slow(x):
        gate.wait(0.01)
        return x

    ds = Dataset.range(10 ** 6).map(slow, num_parallel_calls=4).prefetch(8)
    it = iter(ds)
    assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
    assert _pipeline_threads()  # workers are running
    it.close()
    assert _pipeline_threads() == []  # close joined every thread
    with pytest.raises(StopIteration):
        next(it)


def test_abandoned_iterator_stops_its_threads():
    ds = Dataset.range(10 ** 6).prefetch(4).map(lambda x: x, num_parallel_calls=2).prefetch(2)
    it = iter(ds)
    next(it)
    assert _pipeline_threads()
    del it
    gc.collect()
    assert _wait_no_threads() == []


def test_parallel_interleave_reads_slots_concurrently():
    # Readers of different slots overlap: the peak number of readers inside a read at
    # once is counted (no wall-clock comparison, which a loaded machine can upset).
    lock = threading.Lock()
    inside = [0]
    peak = [0]

    def slow_source(x):
        def gen():
            for i in range(5):
                with lock:
                    inside[0] += 1
                    peak[0] = max(peak[0], inside[0])
                time.sleep(0.02)
                with lock:
                    inside[0] -= 1
                yield x * 100 + i
        return Dataset.from_generator(gen, output_signature=TensorSpec((), np.int64))

    serial = Dataset.range(4).interleave(slow_source, cycle_length=4, block_length=1)
    parallel = Dataset.range(4).interleave(slow_source, cycle_length=4, block_length=1,
                                           num_parallel_calls=4)
    want = [int(v) for v in serial]
    assert peak[0] == 1
    peak[0] = 0
    got = [int(v) for v in parallel]
    assert got == want
    assert want[:5] == [0, 100, 200, 300, 1]
    assert peak[0] >= 2, "the parallel interleave never read two slots at once"
    assert _wait_no_threads() == []


def test_every_epoch_restarts_threads_cleanly():
    ds = Dataset.range(50).map(lambda x: x + 1, num_parallel_calls=3).prefetch(2)
    for _ in range(3):
        assert [int(v) for v in ds] == list(range(1, 51))
    assert _wait_no_threads() == []


def test_bad_parallelism_is_rejected():
    with pytest.raises(ValueError, match="num_parallel_calls must be positive, got 0"):
        Dataset.range(3).map(lambda x: x, num_parallel_calls=0)


def test_import_starts_no_thread_and_touches_no_file(tmp_path):
    code = ("import threading, sys; import gpustrat.data as d;"
            "from gpustrat.data import Dataset;"
            "ds = Dataset.range(5).map(lambda x: x, num_parallel_calls=4).prefetch(2);"
            "it = iter(ds);"
            "print(threading.active_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60, cwd=tmp_path)
    assert out.stdout.strip() == "1"  # building and iter() start nothing before next()
    assert list(tmp_path.iterdir()) == []


def test_adaptive_prefetch_threads_only_slow_sources():
    import threading
    import time

    from gpustrat.data import parallel

    def slow():
        for i in range(20):
            time.sleep(0.001)
            yield i

    names = []

    def watch(gen):
        for x in gen:
            names.append({t.name for t in threading.enumerate()})
            yield x
    out = list(watch(parallel.adaptive_prefetch(slow(), 2)))
    assert out == list(range(20))
    assert any("gpustrat-prefetch" in n for n in names[parallel.ADAPTIVE_PROBE:])
    names.clear()
    assert list(watch(parallel.adaptive_prefetch(iter(range(50)), 2))) == list(range(50))
    assert not any("gpustrat-prefetch" in n for n in names)
    # Shorter than the probe, and errors, behave as the plain source.
    assert list(parallel.adaptive_prefetch(iter(range(3)), 2)) == [0, 1, 2]


def test_prefetch_autotune_is_adaptive_and_keeps_order():
    import threading
    import time

    from gpustrat.data import AUTOTUNE, Dataset, TensorSpec

    def prefetch_threads():
        return any("gpustrat-prefetch" in t.name for t in threading.enumerate())

    # A cheap source: AUTOTUNE keeps it inline, no thread (prefetch(2) would start one).
    seen = []
    for x in Dataset.range(30).prefetch(AUTOTUNE).as_numpy_iterator():
        seen.append(int(x))
        assert not prefetch_threads(), "prefetch(AUTOTUNE) threaded a cheap source"
    assert seen == list(range(30))

    # A slow source: past the probe, AUTOTUNE hands it to a prefetch thread.
    def slow():
        for i in range(30):
            time.sleep(0.002)
            yield np.int64(i)
    ds = Dataset.from_generator(slow, output_signature=TensorSpec((), np.int64))
    seen, threaded = [], []
    for x in ds.prefetch(AUTOTUNE).as_numpy_iterator():
        seen.append(int(x))
        threaded.append(prefetch_threads())
    assert seen == list(range(30))
    assert any(threaded), "prefetch(AUTOTUNE) never threaded a slow source"
