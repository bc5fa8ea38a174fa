"""File sources: list_files, TextLineDataset, TFRecord (reader, writer, CRCs), .npy."""

import gzip
import struct

import numpy as np
import pytest

from gpustrat.data import (STRING, DataLossError, Dataset, NpyDataset, TensorSpec,
                           TextLineDataset, TFRecordDataset, TFRecordWriter)
from gpustrat.data.tfrecord import crc32c, masked_crc32c


def test_crc32c_known_vectors():
    assert crc32c(b"123456789") == 0xE3069283
    assert crc32c(bytes(32)) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E


def test_tfrecord_framing_is_tensorflows(tmp_path):
    path = tmp_path / "one.tfrecord"
    with TFRecordWriter(path) as w:
        w.write(b"hello")
    raw = path.read_bytes()
    assert len(raw) == 8 + 4 + 5 + 4
    assert struct.unpack("<Q", raw[:8]) == (5,)
    assert struct.unpack("<I", raw[8:12]) == (masked_crc32c(raw[:8]),)
    assert raw[12:17] == b"hello"
    crc = crc32c(b"hello")
    masked = ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF
    assert struct.unpack("<I", raw[17:]) == (masked,)


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_tfrecord_roundtrip(tmp_path, compression):
    records = [b"", b"a", bytes(range(256)) * 3, b"tail\x00\x00"]
    path = tmp_path / "r.tfrecord"
    with TFRecordWriter(str(path), options=compression) as w:
        for r in records:
            w.write(r)
    ds = TFRecordDataset([str(path)], compression_type=compression)
    assert list(ds) == records  # trailing zero bytes survive
    assert ds.element_spec == TensorSpec((), STRING)
    batch = next(iter(ds.batch(4)))
    assert batch.dtype == object and list(batch) == records


def _write(path, records):
    with TFRecordWriter(path) as w:
        for r in records:
            w.write(r)


def test_tfrecord_corruption_names_file_and_offset(tmp_path):
    path = tmp_path / "bad.tfrecord"
    _write(path, [b"first", b"second"])
    raw = bytearray(path.read_bytes())
    second = 16 + 5  # byte offset of the second record
    raw[second + 12] ^= 0xFF  # flip a data byte of the second record
    path.write_bytes(bytes(raw))
    it = iter(TFRecordDataset(str(path)))
    assert next(it) == b"first"
    with pytest.raises(DataLossError, match=rf"bad.tfrecord.*byte offset {second}.*data's CRC"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    raw[second + 12] ^= 0xFF
    raw[second] ^= 0x01  # now the length field is corrupt
    path.write_bytes(bytes(raw))
    with pytest.raises(DataLossError, match=rf"offset {second}.*length's CRC"):
        list(TFRecordDataset(str(path)))
    path.write_bytes(bytes(raw[:second + 7]))  # truncated header
    with pytest.raises(DataLossError, match=rf"truncated record header at byte offset {second}"):
        list(TFRecordDataset(str(path)))


def test_textline_and_missing_file(tmp_path):
    a = tmp_path / "a.txt"
    a.write_bytes(b"one\ntwo\r\nthree")
    b = tmp_path / "b.txt.gz"
    with gzip.open(b, "wb") as f:
        f.write(b"x\ny\n")
    assert list(TextLineDataset(str(a))) == [b"one", b"two", b"three"]
    assert list(TextLineDataset([str(b)], compression_type="GZIP")) == [b"x", b"y"]
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        list(TextLineDataset([str(a), missing]))
    with pytest.raises(ValueError, match="compression_type"):
        TextLineDataset(str(a), compression_type="BZ2")


def _text_files(tmp_path, n, lines):
    paths = []
    for i in range(n):
        p = tmp_path / f"f{i}.txt"
        p.write_text("".join(f"{i}-{j}\n" for j in range(lines)))
        paths.append(str(p))
    return paths


def test_list_files_sorted_shuffled_and_errors(tmp_path):
    paths = _text_files(tmp_path, 5, 1)
    ds = Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
    assert list(ds) == [p.encode() for p in paths]
    assert ds.cardinality() == 5 and ds.element_spec == TensorSpec((), STRING)
    sh = Dataset.list_files(str(tmp_path / "*.txt"), seed=1)
    e1, e2 = list(sh), list(sh)
    assert sorted(e1) == sorted(e2) == [p.encode() for p in paths]
    assert e1 != e2 or e1 != list(sh)
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        Dataset.list_files(str(tmp_path / "nothing-here*"))


def test_interleave_over_list_files_with_parallel_reads(tmp_path):
    _text_files(tmp_path, 3, 4)
    files = Dataset.list_files(str(tmp_path / "*.txt"), shuffle=False)
    ds = files.interleave(TextLineDataset, cycle_length=3, block_length=2, num_parallel_calls=3)
    out = [v.decode() for v in ds]
    assert out[:6] == ["0-0", "0-1", "1-0", "1-1", "2-0", "2-1"] and len(out) == 12
    # a Dataset of names as input, and num_parallel_reads interleaving one line per file
    tl = TextLineDataset(files, num_parallel_reads=3)
    assert [v.decode() for v in tl][:4] == ["0-0", "1-0", "2-0", "0-1"]


def test_npy_rows_batches_and_views(tmp_path):
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    p = tmp_path / "x.npy"
    np.save(p, x)
    ds = Dataset.from_npy(str(p))
    rows = list(ds)
    assert len(rows) == 10 and ds.cardinality() == 10
    np.testing.assert_array_equal(np.stack(rows), x)
    assert ds.element_spec == TensorSpec((3,), np.float32)
    batches = list(ds.batch(4))
    assert [b.shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
    np.testing.assert_array_equal(np.concatenate(batches), x)
    assert not batches[0].flags.writeable  # a read-only view of the file
    copies = list(NpyDataset(str(p), mmap=False).batch(4, drop_remainder=True))
    assert len(copies) == 2 and copies[0].flags.writeable
    assert ds.batch(4, drop_remainder=True).element_spec == TensorSpec((4, 3), np.float32)


def test_npy_several_files_batch_across_boundaries(tmp_path):
    a, b = np.arange(5), np.arange(5, 12)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    ds = NpyDataset([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")])
    assert [list(map(int, v)) for v in ds.batch(4)] == [[0, 1, 2, 3], [4, 5, 6, 7],
                                                          [8, 9, 10, 11]]
    assert [int(v) for v in ds] == list(range(12))
    assert ds.batch(5).cardinality() == 3


def test_npy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        Dataset.from_npy(str(tmp_path / "missing.npy")).cardinality()
    np.save(tmp_path / "s.npy", np.float32(1))
    with pytest.raises(ValueError, match="scalar"):
        list(Dataset.from_npy(str(tmp_path / "s.npy")))
    np.save(tmp_path / "a.npy", np.zeros((2, 3)))
    np.save(tmp_path / "b.npy", np.zeros((2, 4)))
    with pytest.raises(ValueError, match=r"\(4,\).*\(3,\)"):
        NpyDataset([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]).cardinality()
    (tmp_path / "junk.npy").write_bytes(b"not an npy file at all")
    with pytest.raises(ValueError, match="junk.npy"):
        list(Dataset.from_npy(str(tmp_path / "junk.npy")))


def test_npy_fortran_order(tmp_path):
    x = np.asfortranarray(np.arange(12).reshape(4, 3))
    np.save(tmp_path / "f.npy", x)
    out = list(Dataset.from_npy(str(tmp_path / "f.npy")).batch(3))
    np.testing.assert_array_equal(np.concatenate(out), x)
