"""Positions of cache (memory and file), file sources over a dataset of names or with
parallel reads, and from_generator over a class that saves its position."""

import gzip
import logging
import os
import sys

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_util import canon, resume_everywhere, roundtrip, state_bytes  # noqa: E402


class Calls:
    """A map function that counts its calls."""

    def __init__(self):
        self.n = 0

    def __call__(self, x):
        self.n += 1
        return x * 3


def test_memory_cache_resumes_while_filling_and_while_replaying():
    # A fresh pipeline for every restore (a restarted job): the cache is rebuilt.
    def build():
        return Dataset.range(10).shuffle(6, seed=1).cache().repeat(3)
    full, states = resume_everywhere(build)
    modes = [s["position"]["input"]["mode"] for s in states if s["position"]["input"]]
    assert modes[:10] == ["fill"] * 10 and modes[11:] == ["memory"] * (len(modes) - 11)
    assert full[:10] == full[10:20] == full[20:]


def test_memory_cache_state_holds_a_position_not_the_elements():
    ds = Dataset.range(10 ** 5).map(lambda x: x * 2).cache().repeat(2)
    it = iter(ds)
    for _ in range(10 ** 5 + 10):   # into the second pass, which replays the cache
        next(it)
    state = it.get_state()
    assert state["position"]["input"] == {"mode": "memory", "pos": 10,
                                          "start": {"fields": {}, "inputs": [{"pos": 0}]}}
    assert state_bytes(state) < 2048


def test_memory_cache_restored_in_the_same_process_is_not_read_again():
    calls = Calls()
    ds = Dataset.range(20).map(calls).cache()
    assert [int(x) for x in ds] == [3 * x for x in range(20)]
    assert calls.n == 20
    it = iter(ds)                      # replays the cache
    head = [int(next(it)) for _ in range(7)]
    restored = iter(ds)
    restored.set_state(roundtrip(it.get_state()))
    assert head + [int(x) for x in restored] == [3 * x for x in range(20)]
    assert calls.n == 20               # same dataset, same filling pass: no rebuild


def test_memory_cache_rebuilds_with_the_saved_unseeded_shuffle():
    # An unseeded shuffle draws another seed in a restarted job; the cache is rebuilt
    # from the saved start position, so it holds what the saved job's cache held.
    def build():
        return Dataset.range(50).shuffle(50).cache().repeat(2)
    it = iter(build())
    head = [int(next(it)) for _ in range(70)]
    state = roundtrip(it.get_state())
    rest = [int(x) for x in it]
    restored = iter(build())
    restored.set_state(state)
    assert [int(x) for x in restored] == rest
    assert head[50:] + rest == head[:50]


def test_a_restored_filling_pass_completes_the_cache(caplog):
    calls = Calls()
    ds = Dataset.range(12).map(calls).cache().repeat(2)
    it = iter(ds)
    head = [int(next(it)) for _ in range(5)]
    state = roundtrip(it.get_state())
    it.close()
    fresh_calls = Calls()
    restored_ds = Dataset.range(12).map(fresh_calls).cache().repeat(2)
    restored = iter(restored_ds)
    restored.set_state(state)
    rest = [int(x) for x in restored]
    assert head + rest == [3 * x for x in range(12)] * 2
    # The first 5 read again to fill the cache, the other 7 read once, the second pass
    # replayed: a complete cache, also for the next epoch.
    assert fresh_calls.n == 12
    assert [int(x) for x in restored_ds.take(3)] == [0, 3, 6] and fresh_calls.n == 12


def test_a_partial_cache_is_never_kept(caplog):
    calls = Calls()
    ds = Dataset.range(12).map(calls).cache()
    it = iter(ds)
    head = [int(next(it)) for _ in range(4)]
    state = roundtrip(it.get_state())
    restored = iter(ds)
    restored.set_state(state)
    assert [int(next(restored)) for _ in range(3)] == [12, 15, 18]
    with caplog.at_level(logging.WARNING, logger="gpustrat"):
        restored.close()   # stops before the end: nothing is kept
        it.close()
    assert "memory cache was discarded" in caplog.text
    before = calls.n
    assert [int(x) for x in ds] == [3 * x for x in range(12)] and calls.n == before + 12
    assert head == [0, 3, 6, 9]


def test_file_cache_resumes_while_writing_and_while_reading(tmp_path):
    name = str(tmp_path / "c")

    def build():
        return Dataset.range(9).shuffle(4, seed=2).map(lambda x: (x, str(int(x)))).cache(
            name).repeat(2)
    full = [canon(e) for e in build()]
    for k in range(len(full) + 1):
        os.remove(name + ".gpustrat-cache")
        it = iter(build())
        head = [canon(next(it)) for _ in range(k)]
        state = roundtrip(it.get_state())
        it.close()
        restored = iter(build())
        restored.set_state(state)
        assert head + [canon(e) for e in restored] == full, k
        mode = state["position"]["input"] and state["position"]["input"]["mode"]
        assert mode == ("fill" if 0 < k < 10 else "file" if k >= 10 else None), (k, mode)
        assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache"]   # no lock, no temp


def test_file_cache_position_is_a_byte_offset_checked_against_the_file(tmp_path):
    name = str(tmp_path / "c")
    ds = Dataset.range(20).cache(name)
    list(ds)
    it = iter(ds)
    for _ in range(5):
        next(it)
    state = roundtrip(it.get_state())
    assert state["position"]["mode"] == "file" and state["position"]["count"] == 5
    size = os.path.getsize(name + ".gpustrat-cache")
    assert 0 < state["position"]["offset"] < size == state["position"]["size"]
    restored = iter(Dataset.range(20).cache(name))
    restored.set_state(state)
    assert [int(x) for x in restored] == list(range(5, 20))
    os.remove(name + ".gpustrat-cache")
    list(Dataset.range(30).cache(name))   # another cache file of that name
    with pytest.raises(ValueError, match=r"reads the cache file .* of \d+ bytes, but it now"):
        iter(Dataset.range(20).cache(name)).set_state(state)
    os.remove(name + ".gpustrat-cache")
    with pytest.raises(ValueError, match="which does not exist"):
        iter(Dataset.range(20).cache(name)).set_state(state)


def int_text_files(tmp_path, count=4, compress=False):
    paths = []
    for f in range(count):
        data = "".join(f"{f * 100 + i}\n" for i in range(2 + 2 * f)).encode()
        path = tmp_path / f"part-{f}.txt"
        path.write_bytes(gzip.compress(data) if compress else data)
        paths.append(str(path))
    return paths


@pytest.mark.parametrize("reads", [None, 3])
@pytest.mark.parametrize("compress", [False, True])
def test_text_lines_over_a_dataset_of_names_resume(tmp_path, reads, compress):
    int_text_files(tmp_path, compress=compress)

    def build():
        names = Dataset.list_files(str(tmp_path / "part-*.txt"), seed=4)
        return gs.data.TextLineDataset(names, compression_type="GZIP" if compress else None,
                                       num_parallel_reads=reads).repeat(2)
    full, states = resume_everywhere(build)
    assert len(full) == 2 * sum(2 + 2 * f for f in range(4))
    # Two passes of list_files: two orders of the files.
    firsts = [int(x) // 100 for x in build()]
    assert firsts[:20] != firsts[20:] or reads


def test_parallel_reads_save_each_open_file_and_its_read_ahead(tmp_path):
    paths = int_text_files(tmp_path)

    def build():
        return gs.data.TextLineDataset(paths, num_parallel_reads=3).map(
            lambda line: np.int64(int(line)))
    full, states = resume_everywhere(build)
    # Lines of three files one at a time, as the parallel interleave reads them.
    assert [int(f[0][0][1]) for f in full[:6]] == [0, 100, 200, 1, 101, 201]
    slots = states[4]["position"]["inputs"][0]["slots"]
    assert [s["element"] for s in slots] == paths[:3]
    assert [s["state"]["input"]["offset"] for s in slots] != [0, 0, 0]


def test_tfrecords_of_a_dataset_of_names_with_parallel_reads_resume(tmp_path):
    paths = []
    for f in range(3):
        path = str(tmp_path / f"r{f}.tfrecord")
        with gs.data.TFRecordWriter(path) as w:
            for i in range(3 + f):
                w.write(f"record {f} {i}".encode() * (i + 1))
        paths.append(path)

    def build():
        return gs.data.TFRecordDataset(Dataset.from_tensor_slices(paths),
                                       num_parallel_reads=2)
    full, _ = resume_everywhere(build)
    assert len(full) == 12


def test_batched_strings_in_a_prefetch_buffer_are_saved(tmp_path):
    paths = int_text_files(tmp_path)
    ds = gs.data.TextLineDataset(paths).batch(3).prefetch(4)
    it = iter(ds)
    head = [next(it).tolist() for _ in range(2)]
    import time
    time.sleep(0.1)   # the prefetcher reads ahead batches of strings
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    rest = [b.tolist() for b in it]
    restored = iter(ds)
    gs.train.Checkpoint(input=restored).restore(path)
    assert [b.tolist() for b in restored] == rest
    assert sum(len(b) for b in head + rest) == 20


class Counter:
    """An iterator whose objects save their position."""

    made = 0

    def __init__(self, n, step=1):
        Counter.made += 1
        self.i, self.n, self.step = 0, n, step

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += self.step
        return (np.int64(self.i), str(self.i))

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = int(state["i"])


def test_from_generator_saves_through_get_state_and_set_state():
    sig = (gs.data.TensorSpec((), np.int64), gs.data.TensorSpec((), gs.data.STRING))

    def build():
        return Dataset.from_generator(Counter, args=(12, 2), output_signature=sig).batch(4)
    full, states = resume_everywhere(build)
    assert states[0]["position"]["inputs"][0] == {"started": False}
    assert states[1]["position"]["inputs"][0] == {"started": True, "index": 4,
                                                  "state": {"i": 8}}
    made = Counter.made
    restored = iter(build())
    restored.set_state(roundtrip(states[1]))   # a new object, set_state before next
    assert Counter.made == made + 1
    assert canon(next(restored)) == full[1]


def test_from_generator_whose_objects_lack_the_methods_is_a_clear_error():
    class Declares(Counter):
        def __new__(cls, n):
            return iter(range(n))   # not an object of the class
    it = iter(Dataset.from_generator(Declares, args=(3,)))
    with pytest.raises(TypeError, match=r"from_generator\(Declares\): the object it "
                                        r"returned, a range_iterator, has no get_state"):
        next(it)
