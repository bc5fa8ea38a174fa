"""File-level sharding support for distributed input (gpustrat.data.autoshard)."""

import numpy as np
import pytest

from gpustrat.data import (AutoShardPolicy, Dataset, NpyDataset, Options, TextLineDataset,
                           TFRecordDataset, TFRecordWriter)
from gpustrat.data.autoshard import file_sources, reads_files, shard_files


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
