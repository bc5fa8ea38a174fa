"""Saving and restoring the position of gs.data iterators: restore-and-continue yields
exactly what the uninterrupted iterator would have yielded, over random pipelines."""

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as hs

import gpustrat as gs
from gpustrat.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_util import canon, roundtrip, state_bytes  # noqa: E402


SCALAR_OPS = ["map", "pmap", "filter", "shuffle", "repeat", "take", "skip", "shard",
              "prefetch", "enumerate_first", "interleave", "pinterleave", "cache",
              "cache_file", "window", "scan", "group", "unique", "ignore_errors", "sample",
              "choose"]
SOURCES = ["range", "slices", "tuple_slices", "concat", "generator", "text_names",
           "text_parallel", "tfrecord_names_parallel"]
TAILS = ["none", "batch", "batch_drop", "batch_unbatch", "batch_prefetch", "enumerate", "zip",
         "padded", "padded_fused", "bucket", "rebatch"]


class Counter:
    """An iterator class whose objects save their position (for from_generator)."""

    def __init__(self, n):
        self.i, self.n = 0, n

    def __iter__(self):
        return self

    def __next__(self):
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return np.int64(self.i * 7 % 13 + 100 * self.i)

    def get_state(self):
        return {"i": self.i}

    def set_state(self, state):
        self.i = int(state["i"])


def int_files(root, n, kind):
    """Three files holding the lines (or records) 0..n-1 dealt out in turn."""
    paths = []
    for f in range(3):
        path = root / f"{kind}-{n}-{f}"
        if not path.exists():
            values = [str(i).encode() for i in range(f, n, 3)]
            if kind == "text":
                path.write_bytes(b"".join(v + b"\n" for v in values))
            else:
                with gs.data.TFRecordWriter(str(path)) as w:
                    for v in values:
                        w.write(v)
        paths.append(str(path))
    return paths


def fails_on_some(k):
    def f(x):
        if x % (k + 2) == 1:
            raise ValueError(f"{x} is 1 modulo {k + 2}")
        return x
    return f


_tags = iter(range(10 ** 9))


@hs.composite
def pipelines(draw):
    """``build(root)``: a random pipeline (files and file caches under ``root``);
    ``build.reset(root)`` deletes its file caches, so that the next pass fills them."""
    n = draw(hs.integers(0, 40))
    source = draw(hs.sampled_from(SOURCES))
    ops = draw(hs.lists(hs.tuples(hs.sampled_from(SCALAR_OPS), hs.integers(1, 9)),
                        max_size=5))
    tail = draw(hs.sampled_from(TAILS))
    b = draw(hs.integers(1, 5))
    seed = draw(hs.integers(0, 2 ** 32))
    tag = next(_tags)

    def build(root):
        if source == "range":
            ds = Dataset.range(n)
        elif source == "slices":
            ds = Dataset.from_tensor_slices(np.arange(n, dtype=np.int64) * 3)
        elif source == "tuple_slices":
            ds = Dataset.from_tensor_slices((np.arange(n), np.arange(n) * 10)).map(
                lambda a, c: a + c)
        elif source == "generator":
            ds = Dataset.from_generator(Counter, args=(n,),
                                        output_signature=gs.data.TensorSpec((), np.int64))
        elif source == "text_names":
            int_files(root, n, "text")
            ds = gs.data.TextLineDataset(Dataset.list_files(str(root / f"text-{n}-*"),
                                                            seed=seed))
        elif source == "text_parallel":
            ds = gs.data.TextLineDataset(int_files(root, n, "text"), num_parallel_reads=2)
        elif source == "tfrecord_names_parallel":
            ds = gs.data.TFRecordDataset(Dataset.from_tensor_slices(
                int_files(root, n, "tfrecord")), num_parallel_reads=3)
        else:
            ds = Dataset.range(n // 2).concatenate(Dataset.range(100, 100 + n - n // 2))
        if source.startswith(("text", "tfrecord")):
            ds = ds.map(lambda line: np.int64(int(line)))
        for i, (op, k) in enumerate(ops):
            if op == "map":
                ds = ds.map(lambda x: x * 2 + 1)
            elif op == "pmap":
                ds = ds.map(lambda x: x - 1, num_parallel_calls=k)
            elif op == "filter":
                ds = ds.filter(lambda x, k=k: x % (k + 1) != 0)
            elif op == "shuffle":
                ds = ds.shuffle(k, seed=seed + k)
            elif op == "repeat":
                ds = ds.repeat(k % 3 + 1)
            elif op == "take":
                ds = ds.take(k * 3)
            elif op == "skip":
                ds = ds.skip(k)
            elif op == "shard":
                ds = ds.shard(k % 3 + 1, k % (k % 3 + 1))
            elif op == "prefetch":
                ds = ds.prefetch(k)
            elif op in ("interleave", "pinterleave"):
                ds = ds.interleave(
                    lambda x: Dataset.range(int(x) % 4).map(lambda y, x=x: x * 10 + y),
                    cycle_length=k % 3 + 1, block_length=k % 2 + 1,
                    num_parallel_calls=min(2, k % 3 + 1) if op == "pinterleave" else None)
            elif op == "enumerate_first":
                ds = ds.enumerate(k).map(lambda i, x: i * 1000 + x)
            elif op == "cache":
                ds = ds.cache()
            elif op == "cache_file":
                ds = ds.cache(str(root / f"cache-{tag}-{i}"))
            elif op == "window":
                ds = ds.window(k % 4 + 1, shift=k % 3 + 1, stride=k % 2 + 1,
                               drop_remainder=k % 2 == 0).flat_map(
                    lambda w: w.batch(100).map(lambda v: v.sum() * 10 + len(v)))
            elif op == "scan":
                ds = ds.scan(np.int64(k), lambda s, x: (s + x, s * 3 + x))
            elif op == "group":
                ds = ds.group_by_window(
                    lambda x, k=k: x % (k % 3 + 2),
                    lambda key, w: w.batch(100).map(lambda v, key=key: v.sum() * 10 + key),
                    window_size=k % 3 + 1)
            elif op == "unique":
                ds = ds.map(lambda x, k=k: x % (k + 3)).unique()
            elif op == "ignore_errors":
                # A first element that does not fail (so that every pipeline has a spec).
                ds = Dataset.from_tensors(np.int64(0)).concatenate(ds).map(
                    fails_on_some(k)).ignore_errors()
            elif op == "sample":
                ds = Dataset.sample_from_datasets([ds, Dataset.range(500, 500 + k)],
                                                  weights=[0.7, 0.3], seed=seed)
            elif op == "choose":
                ds = Dataset.choose_from_datasets(
                    [ds, Dataset.range(900, 900 + 2 * k)],
                    Dataset.range(3 * n + 6).map(lambda i: np.int64(i % 3 == 0)),
                    stop_on_empty_dataset=bool(k % 2))
        if tail == "batch":
            ds = ds.batch(b)
        elif tail == "batch_drop":
            ds = ds.batch(b, drop_remainder=True)
        elif tail == "batch_unbatch":
            ds = ds.batch(b).unbatch()
        elif tail == "batch_prefetch":
            ds = ds.batch(b).prefetch(2)
        elif tail == "enumerate":
            ds = ds.enumerate()
        elif tail == "padded":
            ds = ds.map(lambda x: np.arange(int(x) % 5)).padded_batch(b, padded_shapes=[None],
                                                                      padding_values=-1)
        elif tail == "padded_fused":
            ds = ds.padded_batch(b) if source != "slices" or ops else \
                Dataset.from_tensor_slices(np.arange(n * 2).reshape(n, 2)).padded_batch(
                    b, padded_shapes=[3], padding_values=7)
        elif tail == "zip":
            ds = Dataset.zip((ds, Dataset.range(1000).map(lambda x: x * 7)))
        elif tail == "bucket":
            ds = ds.map(lambda x: np.arange(int(x) % 7)).bucket_by_sequence_length(
                lambda x: len(x), [2, 4], [b, 2, 3], padded_shapes=[None],
                padding_values=np.int64(-1))
        elif tail == "rebatch":
            ds = ds.batch(b).rebatch([2, 0, 3])
        return ds

    def reset(root):
        for f in root.glob(f"cache-{tag}-*"):
            f.unlink()
    build.reset = reset
    return build


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(pipelines(), hs.floats(0, 1), hs.integers(0, 3))
def test_restore_and_continue_yields_the_uninterrupted_sequence(tmp_path, build, where, again):
    full = [canon(e) for e in iter(build(tmp_path))]
    build.reset(tmp_path)  # the iterator below fills the file caches again
    k = int(where * len(full))
    it = iter(build(tmp_path))
    got = [canon(next(it)) for _ in range(k)]
    state = roundtrip(it.get_state())
    assert got == full[:k]
    # The saved iterator itself goes on unchanged by the save.
    assert [canon(e) for e in it] == full[k:]
    # A fresh pipeline (a restarted job) restored at k continues exactly.
    restored = iter(build(tmp_path))
    restored.set_state(state)
    rest = []
    for _ in range(again):  # save again mid-way through the restored iterator
        e = next(restored, None)
        if e is None:
            break
        rest.append(canon(e))
        s2 = roundtrip(restored.get_state())
        restored.close()
        restored = iter(build(tmp_path))
        restored.set_state(s2)
    rest += [canon(e) for e in restored]
    assert rest == full[k:]


def test_repeat_of_reshuffled_dataset_continues_with_later_epochs():
    def build():
        return Dataset.range(10).shuffle(10, seed=3).repeat(4)
    full = [int(x) for x in build()]
    it = iter(build())
    head = [int(next(it)) for _ in range(13)]
    restored = iter(build())
    restored.set_state(roundtrip(it.get_state()))
    assert head + [int(x) for x in restored] == full
    # Later epochs are still different orders of the same elements.
    assert full[:10] != full[10:20] and sorted(full[:10]) == sorted(full[10:20])


def test_prefetch_read_ahead_is_handed_back_not_lost():
    def slow_square(x):
        return x * x
    ds = Dataset.range(50).map(slow_square, num_parallel_calls=4).prefetch(16)
    it = iter(ds)
    first = [int(next(it)) for _ in range(5)]
    import time
    time.sleep(0.1)  # the prefetcher and map workers run ahead
    state = it.get_state()
    assert first == [0, 1, 4, 9, 16]
    restored = iter(ds)
    restored.set_state(state)
    assert [int(x) for x in restored] == [x * x for x in range(5, 50)]


def test_nondeterministic_parallel_map_delivers_each_element_once():
    ds = Dataset.range(60).map(lambda x: x + 1, num_parallel_calls=4, deterministic=False)
    it = iter(ds)
    head = [int(next(it)) for _ in range(17)]
    restored = iter(ds)
    restored.set_state(roundtrip(it.get_state()))
    assert sorted(head + [int(x) for x in restored]) == list(range(1, 61))


def test_unsupported_transformations_raise_naming_them():
    def gen():
        yield from range(3)
    it = iter(Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((), np.int64)))
    next(it)
    with pytest.raises(ValueError, match=r"from_generator\(gen\) cannot save its position"):
        it.get_state()
    # A class with only one of the two methods does not declare a saveable position.
    class HalfCounter(Counter):
        set_state = None
    it = iter(Dataset.from_generator(HalfCounter, args=(3,)).map(lambda x: x + 1))
    next(it)
    with pytest.raises(ValueError, match=r"from_generator\(HalfCounter\) cannot save its "
                                         r"position: .* get_state\(\) and set_state"):
        it.get_state()


def test_restore_into_another_dataset_is_an_error():
    it = iter(Dataset.range(10).batch(2))
    next(it)
    state = it.get_state()
    other = iter(Dataset.range(12).batch(2))
    with pytest.raises(ValueError, match="saved for another dataset"):
        other.set_state(state)
    with pytest.raises(ValueError, match="saved for another dataset"):
        iter(Dataset.range(10).map(lambda x: x).batch(2)).set_state(state)


def test_shuffle_state_grows_with_the_buffer_not_the_dataset():
    ds = Dataset.range(10 ** 6).shuffle(1000, seed=1).batch(32)
    it = iter(ds)
    for _ in range(100):
        next(it)
    size = state_bytes(it.get_state())
    buffer_bytes = 1000 * 8
    assert size - buffer_bytes < 64 * 1024, size


def test_checkpoint_of_a_dataset_iterator(tmp_path):
    ds = Dataset.from_tensor_slices({"x": np.arange(20.0), "y": np.arange(20)}).shuffle(
        5, seed=2).batch(3).prefetch(2)
    it = iter(ds)
    for _ in range(3):
        next(it)
    ck = gs.train.Checkpoint(iterator=it, step=3)
    path = ck.save(str(tmp_path / "ckpt"))
    rest = [canon(e) for e in it]
    assert len(rest) == 4
    it2 = iter(ds)   # the dataset's next epoch, until restored
    gs.train.Checkpoint(iterator=it2, step=0).restore(path)
    assert [canon(e) for e in it2] == rest


@pytest.mark.parametrize("kind", ["text", "tfrecord", "text_gzip", "npy", "npy_batch"])
def test_file_sources_resume_at_the_saved_element(tmp_path, kind):
    paths = []
    for f in range(3):
        if kind.startswith("text"):
            p = tmp_path / f"f{f}.txt"
            data = "".join(f"line {f}-{i}\n" for i in range(5 + f)).encode()
            if kind == "text_gzip":
                import gzip
                data = gzip.compress(data)
            p.write_bytes(data)
        elif kind == "tfrecord":
            p = tmp_path / f"f{f}.tfrecord"
            with gs.data.experimental.TFRecordWriter(str(p)) if hasattr(
                    gs.data.experimental, "TFRecordWriter") else __import__(
                    "gpustrat.data.tfrecord", fromlist=["x"]).TFRecordWriter(str(p)) as w:
                for i in range(4 + f):
                    w.write(f"rec {f}-{i}".encode() * (i + 1))
        else:
            p = tmp_path / f"f{f}.npy"
            np.save(p, np.arange((4 + f) * 3, dtype=np.float32).reshape(-1, 3) + 100 * f)
        paths.append(str(p))

    def build():
        if kind == "text":
            return gs.data.TextLineDataset(paths)
        if kind == "text_gzip":
            return gs.data.TextLineDataset(paths, compression_type="GZIP")
        if kind == "tfrecord":
            return gs.data.TFRecordDataset(paths)
        ds = Dataset.from_npy(paths)
        return ds.batch(2) if kind == "npy_batch" else ds
    full = [canon(e) for e in build()]
    assert len(full) >= 6
    for k in range(len(full) + 1):
        it = iter(build())
        head = [canon(next(it)) for _ in range(k)]
        state = roundtrip(it.get_state())
        restored = iter(build())
        restored.set_state(state)
        assert head + [canon(e) for e in restored] == full, k
    if kind in ("text", "tfrecord"):
        it = iter(build())
        next(it)
        assert it.get_state()["position"]["offset"] > 0  # a byte offset, not a count


def test_unseeded_shuffle_in_repeat_resumes_exactly_across_epochs():
    ds = Dataset.range(12).shuffle(12).repeat(3)      # a seed drawn per dataset object
    it = iter(ds)
    head = [int(next(it)) for _ in range(5)]
    state = roundtrip(it.get_state())
    rest = [int(x) for x in it]
    other = Dataset.range(12).shuffle(12).repeat(3)   # a restarted job: another seed
    restored = iter(other)
    restored.set_state(state)
    assert [int(x) for x in restored] == rest
    assert sorted(head + rest) == sorted(list(range(12)) * 3)


def test_interleave_over_unsaveable_datasets_iterates_but_refuses_to_save():
    def gen():
        yield from range(3)

    def inner(x):
        return Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((), np.int64))
    ds = Dataset.range(3).interleave(inner, cycle_length=2)
    assert sorted(int(v) for v in ds) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    it = iter(ds)
    next(it)
    with pytest.raises(ValueError, match=r"interleave: .*from_generator\(gen\) cannot save"):
        it.get_state()


@pytest.mark.parametrize("parallel", [None, 2])
def test_interleave_resumes_at_every_position(parallel):
    def build():
        return Dataset.range(1, 6).interleave(
            lambda x: Dataset.range(int(x) * 2).map(lambda y, x=x: x * 100 + y),
            cycle_length=2, block_length=3, num_parallel_calls=parallel)
    full = [int(v) for v in build()]
    assert len(full) == 30
    for k in range(len(full) + 1):
        it = iter(build())
        head = [int(next(it)) for _ in range(k)]
        restored = iter(build())
        restored.set_state(roundtrip(it.get_state()))
        assert head + [int(v) for v in restored] == full, k


@pytest.mark.parametrize("use_mmap", [True, False])
def test_npy_batches_hold_only_their_own_rows(tmp_path, use_mmap):
    # A batch that is a view of a larger read-ahead window keeps the whole window alive
    # (prefetch buffers several batches): peak memory grows with the window, not B.
    import mmap

    from gpustrat.data.npy import NpyDataset
    path = tmp_path / "a.npy"
    np.save(path, np.arange(3000 * 256, dtype=np.float32).reshape(3000, 256))
    it = iter(NpyDataset(str(path), mmap=use_mmap).batch(16))
    for k in range(3):
        batch = next(it)
        np.testing.assert_array_equal(batch[:, 0], np.arange(16 * k, 16 * k + 16) * 256)
        owner = batch
        while isinstance(owner, np.ndarray) and owner.base is not None:
            owner = owner.base
        held = owner.nbytes if isinstance(owner, np.ndarray) else len(memoryview(owner))
        assert held < batch.nbytes + mmap.ALLOCATIONGRANULARITY, (held, batch.nbytes)
    assert it.get_state()["position"] == {"file": 0, "row": 48, "path": str(path)}


@pytest.mark.parametrize("seed", [0, 2])
def test_a_shuffled_file_list_under_a_cache_keeps_its_order_after_a_restore(tmp_path, seed):
    # The cache reads the restored pass's first elements again from a second iterator
    # of its input: the file list's shuffle counter, moved by that iterator, is the
    # saved one again after the restore (the second pass used a third order).
    def build():
        files = Dataset.list_files(str(tmp_path / "text-2-*"), seed=seed)
        return gs.data.TextLineDataset(files).map(
            lambda line: np.int64(int(line))).repeat(2).cache()
    int_files(tmp_path, 2, "text")
    full = [int(x) for x in iter(build())]
    it = iter(build())
    it.set_state(roundtrip(iter(build()).get_state()))
    rest = [int(next(it))]
    state = roundtrip(it.get_state())
    it.close()
    it = iter(build())
    it.set_state(state)
    rest += [int(x) for x in it]
    assert rest == full
