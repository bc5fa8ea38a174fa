"""TFRecord files: reading (``TFRecordDataset``), writing (``TFRecordWriter``), CRC32C.

Words:
    record: one byte string. A TFRecord file is a sequence of records, each framed as
        ``length`` (uint64, little-endian), ``masked_crc32c(length bytes)`` (uint32),
        ``data`` (length bytes), ``masked_crc32c(data)`` (uint32) -- TensorFlow's format,
        so files written by either side read on the other.
    CRC32C: the Castagnoli CRC-32 (polynomial 0x82F63B78, reflected), as in iSCSI.
    masked CRC: ``((crc >> 15) | (crc << 17)) + 0xa282ead8`` modulo 2**32; TensorFlow
        masks stored CRCs so that a CRC of data that itself contains CRCs stays strong.
    byte offset: the position in the (decompressed) file where a bad record starts;
        :class:`DataLossError` names it with the file.

The CRC runs in C through ``google-crc32c`` (a dependency of gpustrat, about 1 GB/s) or
the ``crc32c`` package. Where neither is importable (or google-crc32c was built without
its C extension), a pure-Python CRC (about 10 MB/s) takes over and a RuntimeWarning says
so once per process.
"""

from __future__ import annotations

import struct
import warnings
from typing import BinaryIO

from gpustrat.data.files import CompressedFileSource, check_compression

_POLY = 0x82F63B78
_MASK_DELTA = 0xA282EAD8


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        table.append(c)
    return table


_table: list[int] | None = None
# The C CRC function, when a package provides one (probed on first use).
_fast = None
_probed = False

SLOW_CRC_WARNING = (
    "TFRecord CRC32C checks run in pure Python (about 10 MB/s) because google-crc32c's C "
    "extension is not importable; reading and writing TFRecord files will be slow. "
    "Install it with: pip install google-crc32c")


def _crc32c_python(data: bytes) -> int:
    global _table
    if _table is None:
        _table = _make_table()
    t = _table
    crc = 0xFFFFFFFF
    for b in data:
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _c_crc32c():
    """The CRC function of google-crc32c (its C build) or of crc32c, else None."""
    try:
        import google_crc32c  # noqa: PLC0415 - probed on first use, not at import
        if getattr(google_crc32c, "implementation", "c") == "c":
            return google_crc32c.value
    except ImportError:
        pass
    try:
        import crc32c as _c  # noqa: PLC0415
        return _c.crc32c
    except ImportError:
        return None


def crc32c(data: bytes) -> int:
    """The CRC32C of ``data`` (``crc32c(b"123456789") == 0xE3069283``)."""
    global _fast, _probed
    if not _probed:
        _probed = True
        _fast = _c_crc32c()
        if _fast is None:
            warnings.warn(SLOW_CRC_WARNING, RuntimeWarning, stacklevel=3)
    if _fast is not None:
        return int(_fast(bytes(data)))
    return _crc32c_python(data)


def masked_crc32c(data: bytes) -> int:
    """TensorFlow's masked CRC32C of ``data``."""
    crc = crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


class DataLossError(IOError):
    """A TFRecord file is corrupt or truncated (``tf.errors.DataLossError``)."""


def _compressor(compression: str):
    import gzip
    import zlib
    if compression == "GZIP":
        return lambda f: gzip.GzipFile(fileobj=f, mode="wb")
    if compression == "ZLIB":
        return lambda f: _ZlibWriter(f, zlib.compressobj())
    return lambda f: f


class _ZlibWriter:
    def __init__(self, f, z):
        self._f, self._z = f, z

    def write(self, data: bytes) -> None:
        self._f.write(self._z.compress(data))

    def flush(self) -> None:
        self._f.flush()

    def close(self) -> None:
        self._f.write(self._z.flush())
        self._f.close()


class TFRecordWriter:
    """Writes records to a TFRecord file, as ``tf.io.TFRecordWriter``.

    Args:
        path: the file to create (overwritten if it exists).
        options: compression: None, "", "GZIP" or "ZLIB".

    Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path, options: str | None = None):
        from gpustrat.data.files import as_path
        compression = check_compression(options, "TFRecordWriter")
        self._path = as_path(path)
        self._file = _compressor(compression)(open(self._path, "wb"))

    def write(self, record) -> None:
        """Append one record (bytes, or a str encoded as UTF-8)."""
        if isinstance(record, str):
            record = record.encode()
        record = bytes(record)
        header = struct.pack("<Q", len(record))
        self._file.write(header + struct.pack("<I", masked_crc32c(header)) + record
                         + struct.pack("<I", masked_crc32c(record)))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TFRecordWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_records(f: BinaryIO, path: str):
    """Generator over the records of an open TFRecord stream, checking both CRCs.

    Raises:
        DataLossError: a truncated header or record, or a CRC mismatch; the message names
            ``path`` and the byte offset where the bad record starts.
    """
    offset = 0
    while True:
        header = f.read(12)
        if not header:
            return
        if len(header) < 12:
            raise DataLossError(f"TFRecord file {path!r}: truncated record header at byte "
                                f"offset {offset} ({len(header)} of 12 bytes)")
        length_bytes = header[:8]
        (length,) = struct.unpack("<Q", length_bytes)
        (length_crc,) = struct.unpack("<I", header[8:])
        if masked_crc32c(length_bytes) != length_crc:
            raise DataLossError(f"TFRecord file {path!r}: corrupted record at byte offset "
                                f"{offset}: the length's CRC does not match")
        body = f.read(length + 4)
        if len(body) < length + 4:
            raise DataLossError(f"TFRecord file {path!r}: truncated record at byte offset "
                                f"{offset}: {length} data bytes announced, "
                                f"{max(0, len(body) - 4)} present")
        data = body[:length]
        (data_crc,) = struct.unpack("<I", body[length:])
        if masked_crc32c(data) != data_crc:
            raise DataLossError(f"TFRecord file {path!r}: corrupted record at byte offset "
                                f"{offset}: the data's CRC does not match")
        yield data
        offset += 16 + length


class TFRecordDataset(CompressedFileSource):
    """The records of TFRecord files, as bytes scalars; both CRCs are checked.
    Arguments as :class:`~gpustrat.data.files.CompressedFileSource`."""

    _what = "TFRecordDataset"

    def _parse(self, f, path):
        return read_records(f, path)

