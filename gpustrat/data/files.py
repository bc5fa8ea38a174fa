"""File sources: ``list_files``, ``TextLineDataset`` and their common base.

Words:
    file names: a path (``str``, ``bytes``, ``os.PathLike``), a list or 1-d array of
        paths, or a Dataset whose elements are paths (as ``list_files`` yields).
    file source: a dataset built on a static list of file names (``_files``). FILE
        auto-sharding rebuilds it over a sub-list with ``_with_files``. A dataset that
        reads its file names from another dataset is not a file source itself; its
        input (typically ``list_files``) is.
    compression: ``None`` or ``""`` (plain files), ``"GZIP"`` or ``"ZLIB"``, as in
        ``tf.data``.
    parallel reads: ``num_parallel_reads=k`` (> 1) reads k files at once, interleaving
        their elements one at a time, each file read ahead by a background thread.
"""

from __future__ import annotations

import abc
import copy
import glob
import gzip
import io
import itertools
import os
import zlib
from typing import Any, BinaryIO, Iterator

import numpy as np

from gpustrat.data.dataset import (AUTOTUNE, Dataset, _IterContext, autotune_parallelism)
from gpustrat.data.iterator_state import FunctionIterator, IndexedIterator, StateIterator
from gpustrat.data.spec import STRING, TensorSpec
from gpustrat.data.unary import _close


def as_path(name: Any) -> str:
    """One file name (str, bytes, PathLike, NumPy string scalar or 0-d array) as str."""
    if isinstance(name, np.ndarray):
        if name.ndim != 0:
            raise ValueError(f"expected one file name, got an array of shape {name.shape}")
        name = name[()]
    if isinstance(name, (bytes, np.bytes_)):
        return os.fsdecode(bytes(name))
    if isinstance(name, (str, os.PathLike)):
        return os.fspath(name)
    raise TypeError(f"a file name must be str, bytes or os.PathLike, got "
                    f"{type(name).__name__} {name!r}")


def as_path_list(names: Any) -> list[str]:
    """File names (one, a list, or a 1-d array) as a list of str."""
    if isinstance(names, np.ndarray) and names.ndim == 1:
        return [as_path(n) for n in names]
    if isinstance(names, (list, tuple)):
        return [as_path(n) for n in names]
    return [as_path(names)]


def open_file(path: str, compression: str | None, what: str,
              buffer_size: int = -1) -> BinaryIO:
    """Open ``path`` for binary reading, decompressing as asked.

    Raises:
        FileNotFoundError: ``path`` does not exist; the message names it.
    """
    try:
        raw = open(path, "rb", buffering=buffer_size)
    except FileNotFoundError:
        raise FileNotFoundError(f"{what}: file {path!r} does not exist") from None
    if not compression:
        return raw
    if compression == "GZIP":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "ZLIB":
        return io.BufferedReader(_ZlibReader(raw))
    raw.close()
    raise ValueError(f"{what}: compression_type must be None, '', 'GZIP' or 'ZLIB', "
                     f"got {compression!r}")


def check_compression(compression: str | None, what: str) -> str:
    compression = compression or ""
    if compression not in ("", "GZIP", "ZLIB"):
        raise ValueError(f"{what}: compression_type must be None, '', 'GZIP' or 'ZLIB', "
                         f"got {compression!r}")
    return compression


class _ZlibReader(io.RawIOBase):
    """A readable stream of the zlib-decompressed content of ``raw``."""

    def __init__(self, raw: BinaryIO):
        self._raw = raw
        self._z = zlib.decompressobj()
        self._pending = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._pending:
            chunk = self._raw.read(1 << 16)
            if not chunk:
                self._pending = self._z.flush()
                if not self._pending:
                    return 0
                break
            self._pending = self._z.decompress(chunk)
        n = min(len(b), len(self._pending))
        b[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n

    def close(self) -> None:
        self._raw.close()
        super().close()


class FileSourceDataset(Dataset):
    """Base of datasets that read the elements of a list of files, file after file.

    Subclasses define :meth:`_read_file` (a generator over one file's elements) and
    :meth:`_compute_spec`.
    """

    _what = "file source"

    def __init__(self, filenames: Any, num_parallel_reads: int | None = None):
        if isinstance(filenames, Dataset):
            self._names = filenames
            self._files = None
        else:
            self._names = None
            self._files = as_path_list(filenames)
        if num_parallel_reads == AUTOTUNE:
            num_parallel_reads = autotune_parallelism()
        if num_parallel_reads is not None and (
                isinstance(num_parallel_reads, bool) or int(num_parallel_reads) <= 0):
            raise ValueError(f"{self._what}: num_parallel_reads must be positive or AUTOTUNE, "
                             f"got {num_parallel_reads!r}")
        self._parallel_reads = int(num_parallel_reads or 1)

    def _inputs(self):
        return () if self._names is None else (self._names,)

    def _with_inputs(self, inputs):
        if self._names is None:
            return self
        new = copy.copy(self)
        new._names = inputs[0]
        new.__dict__.pop("_spec_cache", None)
        return new

    def _with_files(self, files: list[str]) -> "FileSourceDataset":
        """The same source over another static list of files."""
        new = copy.copy(self)
        new._files = list(files)
        new._names = None
        new.__dict__.pop("_spec_cache", None)
        return new

    @abc.abstractmethod
    def _read_file(self, path: str) -> Iterator:
        """A generator over one file's elements."""

    def _name_iter(self, ctx: _IterContext) -> Iterator[str]:
        if self._names is None:
            yield from self._files
            return
        it = self._names._iter(ctx)
        try:
            for name in it:
                yield as_path(name)
        finally:
            _close(it)

    def _parallel(self) -> Dataset:
        """Parallel reads: the files interleaved one element at a time (a cycle of
        ``num_parallel_reads``), each open file read ahead by a background thread."""
        from gpustrat.data.interleave import InterleaveDataset  # noqa: PLC0415
        return InterleaveDataset(_FileNames(self), self._one_file,
                                 cycle_length=self._parallel_reads, block_length=1,
                                 num_parallel_calls=self._parallel_reads)

    def _one_file(self, path) -> "FileSourceDataset":
        """This source over the one file ``path``, read sequentially."""
        new = self._with_files([as_path(path)])
        new._parallel_reads = 1
        return new

    def _iter(self, ctx):
        if self._parallel_reads > 1:
            return self._parallel()._iter(ctx)
        return self._sequential(ctx)

    def _sequential(self, ctx):
        names = self._name_iter(ctx)
        try:
            for path in names:
                reader = self._read_file(path)
                try:
                    yield from reader
                finally:
                    reader.close()
        finally:
            names.close()

    def _cardinality(self):
        return -2


class ListFilesDataset(Dataset):
    """``Dataset.list_files(pattern, shuffle, seed)``: matching file names as bytes.

    The names are sorted; with ``shuffle`` (the default when None) every epoch visits
    them in a new order drawn from ``(seed, epoch)``.
    """

    def __init__(self, file_pattern: Any, shuffle: bool | None = None, seed: int | None = None):
        patterns = as_path_list(file_pattern)
        files: set[str] = set()
        for p in patterns:
            files.update(glob.glob(p))
        if not files:
            raise FileNotFoundError(f"list_files: no files match the pattern(s) {patterns}")
        self._files = sorted(files)
        self._shuffle = True if shuffle is None else bool(shuffle)
        # Unseeded and shuffling: distributing under DATA agrees one seed across workers.
        self._seeded = seed is not None or not self._shuffle
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._seed = int(seed)
        # Counts the shuffled orders drawn, as every reshuffling node does: a saved
        # position records it and a restore sets it (iterator_state.epoch_counts).
        self._epochs = itertools.count()

    def _with_files(self, files: list[str]) -> "ListFilesDataset":
        new = copy.copy(self)
        new._files = list(files)
        new._epochs = itertools.count()
        return new

    def _with_seed(self, seed: int) -> "ListFilesDataset":
        """The same file list with another shuffle seed, counting its epochs from 0."""
        new = copy.copy(self)
        new._seed, new._seeded, new._epochs = int(seed), True, itertools.count()
        new._agreed = True
        return new

    def _iter(self, ctx):
        epoch = next(self._epochs) if self._shuffle and not ctx.peek else 0
        yield from self._order(epoch)

    def _state_iter(self, ctx):
        return _ListFilesIterator(self)

    def _order(self, epoch: int) -> list[bytes]:
        files = self._files
        if self._shuffle:
            order = np.random.default_rng([self._seed, epoch]).permutation(len(files))
            files = [files[i] for i in order]
        return [os.fsencode(f) for f in files]

    def _cardinality(self):
        return len(self._files)

    def _compute_spec(self):
        return TensorSpec((), STRING)


class _ListFilesIterator(StateIterator):
    """``list_files``: the state is the epoch and seed of the order and the next index."""

    def __init__(self, node: ListFilesDataset):
        self._node = node
        self._epoch = next(node._epochs) if node._shuffle else 0
        self._seed = node._seed
        self._start()

    def _start(self) -> None:
        names = self._node._order(self._epoch)
        self._it = IndexedIterator(len(names), names.__getitem__)

    def __next__(self):
        return next(self._it)

    def save(self):
        return {"epoch": self._epoch, "seed": self._seed, "pos": self._it.save()["pos"]}

    def restore(self, state):
        node = self._node
        self._epoch, self._seed = int(state["epoch"]), int(state["seed"])
        if node._shuffle:
            # Later iterations go on from the next epoch, with the saved seed.
            nxt = next(node._epochs)
            node._epochs, node._seed = itertools.count(max(nxt, self._epoch + 1)), self._seed
        self._start()
        self._it.restore({"pos": state["pos"]})


class CompressedFileSource(FileSourceDataset):
    """A file source whose files may be compressed; subclasses parse one opened file.

    Args:
        filenames: file names, or a Dataset of file names.
        compression_type: None, "", "GZIP" or "ZLIB".
        buffer_size: read buffer in bytes (default 256 KiB).
        num_parallel_reads: read this many files at once, interleaving their elements.
    """

    def __init__(self, filenames, compression_type: str | None = None,
                 buffer_size: int | None = None, num_parallel_reads: int | None = None):
        super().__init__(filenames, num_parallel_reads)
        self._compression = check_compression(compression_type, self._what)
        self._buffer_size = int(buffer_size or 256 * 1024)

    @abc.abstractmethod
    def _parse(self, f, path: str) -> Iterator:
        """The elements of one opened (decompressed) file."""

    def _state_iter(self, ctx):
        if self._parallel_reads > 1:
            return self._parallel()._state_iter(ctx)
        return _FileIterator(self, ctx)

    def _read_file(self, path):
        f = open_file(path, self._compression, self._what, self._buffer_size)
        try:
            yield from self._parse(f, path)
        finally:
            f.close()

    def _compute_spec(self):
        return TensorSpec((), STRING)


class TextLineDataset(CompressedFileSource):
    """The lines of text files, without their line ending (``\\n`` or ``\\r\\n``), as bytes.
    Arguments as :class:`CompressedFileSource`."""

    _what = "TextLineDataset"

    def _parse(self, f, path):
        for line in f:
            if line.endswith(b"\n"):
                line = line[:-2] if line.endswith(b"\r\n") else line[:-1]
            yield line


def _check_saved_file(node, i: int, path) -> None:
    """A saved position in file ``i`` named ``path`` fits ``node``'s static file list."""
    files = node._files
    if i > len(files) or (i < len(files) and files[i] != path):
        raise ValueError(f"{node._what}: the saved position is in file {path!r} (number "
                         f"{i}), but this dataset's file {i} is "
                         f"{files[i] if i < len(files) else 'missing'!r}: restore into a "
                         "dataset over the same files")


class _FileNames(Dataset):
    """The file names of a file source, as ``str`` (internal to parallel reads): its
    static list (the state saves the next index and its name), or its dataset of names."""

    def __init__(self, source: FileSourceDataset):
        self._source = source

    def _iter(self, ctx):
        return self._source._name_iter(ctx)

    def _state_iter(self, ctx):
        source = self._source
        if source._files is None:
            return FunctionIterator((source._names._state_iter(ctx),),
                                    lambda it: as_path(next(it._inputs[0])))
        return _NameListIterator(source)


class _NameListIterator(StateIterator):
    def __init__(self, node: FileSourceDataset):
        self._node, self._file = node, 0

    def __next__(self):
        files = self._node._files
        if self._file >= len(files):
            raise StopIteration
        self._file += 1
        return files[self._file - 1]

    def save(self):
        files = self._node._files
        return {"file": self._file, "path": files[self._file] if self._file < len(files)
                else None}

    def restore(self, state):
        _check_saved_file(self._node, int(state["file"]), state["path"])
        self._file = int(state["file"])


class _FileIterator(StateIterator):
    """A file source read file after file; the state is the file's index and name and
    the byte offset after the last element returned (for a compressed file, the number
    of elements read from it, which a restore reads past again), and, for file names
    read from a dataset, that dataset's position. The parsers read nothing ahead of the
    element they return."""

    def __init__(self, node: CompressedFileSource, ctx):
        self._node = node
        self._names = None if node._files is not None else node._names._state_iter(ctx)
        self._inputs = () if self._names is None else (self._names,)
        self._file, self._offset, self._count = 0, 0, 0
        self._path = None   # the file being read (None: the next name is to be taken)
        self._f = self._parser = None
        self._gen = self._elements()

    def _next_path(self) -> str:
        if self._names is not None:
            return as_path(next(self._names))
        files = self._node._files
        if self._file >= len(files):
            raise StopIteration
        return files[self._file]

    def _open(self) -> None:
        node = self._node
        self._f = open_file(self._path, node._compression, node._what, node._buffer_size)
        if not node._compression and self._offset:
            self._f.seek(self._offset)
        self._parser = node._parse(self._f, self._path)
        if node._compression:
            for _ in range(self._count):
                next(self._parser)

    def _close_file(self) -> None:
        if self._parser is not None:
            self._parser.close()
            self._f.close()
        self._f = self._parser = None

    def _elements(self):
        """The elements, file after file, recording the position of each before it is
        handed out (a generator, started after any restore)."""
        while True:
            if self._path is None:
                try:
                    self._path = self._next_path()
                except StopIteration:
                    return
            self._open()
            for element in self._parser:
                self._count += 1
                yield element
            self._close_file()
            self._path = None
            self._file, self._offset, self._count = self._file + 1, 0, 0

    def fast_iter(self):
        return self._gen

    def __next__(self):
        return next(self._gen)

    def save(self):
        offset = self._offset
        if self._f is not None and not self._node._compression:
            # Between two next calls the parser stands just after the last element it
            # returned (it reads nothing ahead), so the file's position is the offset
            # (asked here, not per element: tell() costs microseconds).
            offset = self._f.tell()
        state = {"file": self._file, "offset": offset, "count": self._count}
        if self._names is None:
            files = self._node._files
            state["path"] = files[self._file] if self._file < len(files) else None
        else:
            state["path"] = self._path
            state["names"] = self._names.save()
        return state

    def restore(self, state):
        if self._names is None:
            _check_saved_file(self._node, int(state["file"]), state["path"])
        else:
            self._names.restore(state["names"])
            self._path = state["path"]
        self._file, self._offset, self._count = int(state["file"]), int(state["offset"]), \
            int(state["count"])

    def close(self):
        self._gen.close()
        self._close_file()
        super().close()
