"""Pipeline rewriting for distributed input (gpustrat.data.autoshard): file-level
sharding, and the same order on every worker under DATA."""

import numpy as np
import pytest

from gpustrat.data import (AutoShardPolicy, Dataset, NpyDataset, Options, TextLineDataset,
                           TFRecordDataset, TFRecordWriter)
from gpustrat.data.autoshard import (file_sources, reads_files, same_order_everywhere,
                                     shard_files, unseeded_shuffles)


def _files(tmp_path, n, per_file):
    paths = []
    for i in range(n):
        p = tmp_path / f"part{i}.txt"
        p.write_text("".join(f"{i * per_file + j}\n" for j in range(per_file)))
        paths.append(str(p))
    return paths


def test_reads_files():
    assert not reads_files(Dataset.range(5).map(lambda x: x).batch(2))
    assert not reads_files(Dataset.from_tensor_slices(["a.txt"]).interleave(TextLineDataset))


def test_seed_example_two_files_two_workers(tmp_path):
    # SPEC FILE example: file 1 holds 0..5, file 2 holds 6..11, 2 workers.
    paths = _files(tmp_path, 2, 6)
    opts = Options()
    opts.experimental_distribute.auto_shard_policy = AutoShardPolicy.FILE
    ds = TextLineDataset(paths).map(lambda s: np.int64(int(s))).batch(4).with_options(opts)
    assert reads_files(ds) and len(file_sources(ds)) == 1
    w0 = [list(map(int, b)) for b in shard_files(ds, 2, 0)]
    w1 = [list(map(int, b)) for b in shard_files(ds, 2, 1)]
    assert w0 == [[0, 1, 2, 3], [4, 5]] and w1 == [[6, 7, 8, 9], [10, 11]]
    # the rebuilt pipeline keeps its options; the original is untouched
    assert shard_files(ds, 2, 0).options().experimental_distribute.auto_shard_policy == \
        AutoShardPolicy.FILE
    assert sum(len(b) for b in ds) == 12


def test_interleave_over_list_files_shards_the_file_list(tmp_path):
    _files(tmp_path, 5, 2)
    ds = (Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
          .interleave(TextLineDataset, cycle_length=2).map(lambda s: np.int64(int(s))))
    assert reads_files(ds)
    got = [sorted(int(v) for v in shard_files(ds, 3, i)) for i in range(3)]
    # files 0,3 / 1,4 / 2 in sorted order; every element exactly once
    assert got == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5]]
    shuffled = Dataset.list_files(str(tmp_path / "*.txt"), seed=5)
    names = [sorted(shard_files(shuffled, 2, i)) for i in range(2)]
    assert len(names[0]) == 3 and len(names[1]) == 2 and not set(names[0]) & set(names[1])


def test_too_few_files_names_both_counts(tmp_path):
    (path,) = _files(tmp_path, 1, 3)
    ds = TextLineDataset(path).batch(2)
    with pytest.raises(ValueError, match=r"reads 1 file\(s\) but is sharded over 2 workers"
                                         r".*AutoShardPolicy.DATA or OFF"):
        shard_files(ds, 2, 0)
    with pytest.raises(ValueError, match="reads no files"):
        shard_files(Dataset.range(4), 2, 0)
    with pytest.raises(ValueError, match="index 2 is out of range for 2"):
        shard_files(ds, 2, 2)


def test_zip_and_concatenate_of_file_sources_and_npy(tmp_path):
    rec = []
    for i in range(2):
        p = tmp_path / f"r{i}.tfrecord"
        with TFRecordWriter(p) as w:
            w.write(f"rec{i}".encode())
        rec.append(str(p))
    for i in range(2):
        np.save(tmp_path / f"n{i}.npy", np.full((3, 2), i))
    npy = NpyDataset([str(tmp_path / f"n{i}.npy") for i in range(2)]).batch(2)
    ds = Dataset.zip(TFRecordDataset(rec), npy)
    assert len(file_sources(ds)) == 2
    s1 = list(shard_files(ds, 2, 1))
    assert s1[0][0] == b"rec1" and int(s1[0][1][0, 0]) == 1
    cat = TFRecordDataset(rec).concatenate(TFRecordDataset(rec[::-1]))
    assert list(shard_files(cat, 2, 0)) == [b"rec0", b"rec1"]
    assert shard_files(npy, 2, 0).cardinality() == 2


class _Workers:
    """Worker ``rank`` of a group whose allgather answers with the given lists (what
    each worker would send), recording what this one sent."""

    def __init__(self, rank, others):
        self.rank, self._others, self.sent = rank, others, []

    def allgather(self, obj):
        self.sent.append(obj)
        return [obj if w == self.rank else o for w, o in enumerate(self._others)]


def _pipeline():
    # Each call builds the pipeline anew, as each worker does: new random seeds.
    return (Dataset.range(40).shuffle(40).map(lambda x: x * 2).shuffle(8).batch(4)
            .shuffle(3, reshuffle_each_iteration=True))


def _epochs(ds, n=2):
    return [[b.tolist() for b in ds] for _ in range(n)]


def test_unseeded_shuffles_take_worker_zeros_seeds():
    mine, theirs = _pipeline(), _pipeline()
    # Built apart, unseeded shuffles differ: the behaviour outside distribution.
    assert _epochs(mine, 1) != _epochs(theirs, 1)
    seeds0, seeds1 = ([n._seed for n in unseeded_shuffles(d)] for d in (mine, theirs))
    assert len(seeds0) == 3 and seeds0 != seeds1
    g0 = _Workers(0, [None, seeds1])
    agreed0 = same_order_everywhere(mine, g0)
    assert g0.sent == [seeds0]
    agreed1 = same_order_everywhere(theirs, _Workers(1, [seeds0, None]))
    first, second = _epochs(agreed0), _epochs(agreed1)
    assert first == second and first[0] != first[1]  # alike, and reshuffled per epoch
    assert sorted(v for b in first[0] for v in b) == [2 * v for v in range(40)]
    # The datasets passed in keep their own seeds and epochs.
    assert _epochs(mine, 1) != _epochs(theirs, 1)


def test_shuffles_inside_interleave_functions_are_seeded_alike():
    def build():
        return Dataset.range(6).interleave(
            lambda x: Dataset.range(10 * x, 10 * x + 10).shuffle(10), cycle_length=2)
    mine, theirs = build(), build()
    assert [int(v) for v in mine] != [int(v) for v in theirs]  # outside distribution
    seeds0, seeds1 = ([n._seed for n in unseeded_shuffles(d)] for d in (mine, theirs))
    assert len(seeds0) == 1                                    # the interleave node
    agreed0 = same_order_everywhere(mine, _Workers(0, [None, seeds1]))
    agreed1 = same_order_everywhere(theirs, _Workers(1, [seeds0, None]))
    first = [[int(v) for v in agreed0] for _ in range(2)]
    assert first == [[int(v) for v in agreed1] for _ in range(2)]
    assert first[0] != first[1] and sorted(first[0]) == list(range(60))


def test_different_numbers_of_unseeded_shuffles_name_each_workers_count():
    with pytest.raises(ValueError, match=r"unseeded shuffles \(worker 0: 3, worker 1: 1\)"):
        same_order_everywhere(_pipeline(), _Workers(0, [None, [5]]))


def test_seeded_pipelines_and_unordered_maps():
    seeded = Dataset.range(10).shuffle(10, seed=3).batch(2)
    g = _Workers(0, [None])
    assert same_order_everywhere(seeded, g) is seeded and g.sent == [[]]
    files = Dataset.list_files(__file__)
    assert same_order_everywhere(files, _Workers(0, [None])) is not files
    assert same_order_everywhere(Dataset.list_files(__file__, shuffle=False),
                                 _Workers(0, [None]))._seeded
    racy = Dataset.range(30).map(lambda x: x, num_parallel_calls=3, deterministic=False)
    ordered = same_order_everywhere(racy, _Workers(0, [None]))
    assert ordered is not racy and [int(v) for v in ordered] == list(range(30))
    plain = Dataset.range(30).map(lambda x: x, num_parallel_calls=3)
    assert same_order_everywhere(plain, _Workers(0, [None])) is plain
