"""``.npy`` files as a dataset of rows, read through short-lived memory maps.

Words:
    row: ``array[i]`` of a stored array: element i of the dataset. Several files are read
        one after the other as if concatenated along their first axis; they must agree
        on dtype and on the shape after the first axis.
    window: a range of consecutive rows mapped with its own ``mmap``. Every batch is one
        window (so a batch is a zero-copy, read-only view of the file), and unbatched
        iteration walks windows of about 4 MiB. A window is unmapped as soon as the last
        array viewing it is dropped, so however large the file, only the windows still
        referenced (the batches in flight and the prefetch buffers) stay resident. One
        mapping of the whole file would instead keep every page read so far in the
        process's resident set.
    mmap=False: the same windows are read with ``readinto`` into fresh arrays (a copy,
        writable), for file systems where mapping is slow or impossible.
"""

from __future__ import annotations

import copy
import math
import mmap
import os
from typing import Any

import numpy as np

from gpustrat.data.dataset import Dataset
from gpustrat.data.files import as_path_list
from gpustrat.data.iterator_state import StateIterator
from gpustrat.data.spec import TensorSpec

# Rows per window for unbatched iteration: about this many bytes.
_WINDOW_BYTES = 4 << 20


class _NpyFile:
    """Header facts of one ``.npy`` file."""

    __slots__ = ("path", "shape", "dtype", "fortran", "offset")

    def __init__(self, path: str):
        self.path = path
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"NpyDataset: file {path!r} does not exist") from None
        with f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    shape, fortran, dtype = np.lib.format._read_array_header(f, version)
            except ValueError as e:
                raise ValueError(f"NpyDataset: {path!r} is not a valid .npy file ({e})") from None
            self.offset = f.tell()
        if dtype.hasobject:
            raise ValueError(f"NpyDataset: {path!r} holds Python objects (dtype {dtype}); "
                             "only plain dtypes can be memory-mapped")
        if len(shape) == 0:
            raise ValueError(f"NpyDataset: {path!r} holds a scalar; a dataset of rows needs "
                             "an array of rank >= 1")
        self.shape, self.fortran, self.dtype = tuple(shape), bool(fortran), dtype

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def row_items(self) -> int:
        return math.prod(self.shape[1:])

    def read(self, fd: int | None, start: int, stop: int, use_mmap: bool) -> np.ndarray:
        """Rows ``[start, stop)`` as an array of their own (a window)."""
        n = stop - start
        tail = self.shape[1:]
        if n <= 0:
            return np.empty((0,) + tail, self.dtype)
        if self.fortran and len(self.shape) > 1:
            # Rows of a Fortran-order array are strided over the whole file: copy them
            # out of a mapping dropped right away.
            whole = np.load(self.path, mmap_mode="r")
            out = np.array(whole[start:stop], order="C")
            del whole
            return out
        count = n * self.row_items
        begin = self.offset + start * self.row_items * self.dtype.itemsize
        nbytes = count * self.dtype.itemsize
        if nbytes == 0:
            return np.empty((n,) + tail, self.dtype)
        if use_mmap:
            aligned = begin - begin % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(fd, nbytes + begin - aligned, access=mmap.ACCESS_READ,
                           offset=aligned)
            arr = np.frombuffer(mm, self.dtype, count=count, offset=begin - aligned)
            return arr.reshape((n,) + tail)
        out = np.empty((n,) + tail, self.dtype)
        got = os.preadv(fd, [memoryview(out).cast("B")], begin)
        if got != nbytes:
            raise OSError(f"NpyDataset: {self.path!r} is shorter than its header says "
                          f"(wanted {nbytes} bytes at offset {begin}, got {got})")
        return out


class NpyDataset(Dataset):
    """Rows of one or more ``.npy`` files (``Dataset.from_npy``).

    Args:
        filenames: one path or a list of paths (a file source: FILE auto-sharding deals
            these files over workers).
        mmap: map windows of the file (zero copy, default) or read them into fresh
            arrays.

    ``batch(B)`` on this dataset reads each batch as one window.
    """

    def __init__(self, filenames: Any, mmap: bool = True):
        self._files = as_path_list(filenames)
        if not self._files:
            raise ValueError("NpyDataset needs at least one file")
        self._mmap = bool(mmap)

    def _with_files(self, files: list[str]) -> "NpyDataset":
        new = copy.copy(self)
        new._files = list(files)
        new.__dict__.pop("_meta_cache", None)
        new.__dict__.pop("_spec_cache", None)
        return new

    def _meta(self) -> list[_NpyFile]:
        meta = self.__dict__.get("_meta_cache")
        if meta is None:
            meta = [_NpyFile(p) for p in self._files]
            first = meta[0]
            for m in meta[1:]:
                if m.dtype != first.dtype or m.shape[1:] != first.shape[1:]:
                    raise ValueError(
                        f"NpyDataset: {m.path!r} has rows of shape {m.shape[1:]} and dtype "
                        f"{m.dtype} but {first.path!r} has {first.shape[1:]} and "
                        f"{first.dtype}; all files must agree")
            self.__dict__["_meta_cache"] = meta
        return meta

    def _cardinality(self) -> int:
        return sum(m.rows for m in self._meta())

    def _compute_spec(self):
        m = self._meta()[0]
        return TensorSpec(m.shape[1:], m.dtype)

    def _iter(self, ctx):
        for m in self._meta():
            window = max(1, _WINDOW_BYTES // max(1, m.row_items * m.dtype.itemsize))
            fd = os.open(m.path, os.O_RDONLY)
            try:
                for start in range(0, m.rows, window):
                    yield from m.read(fd, start, min(m.rows, start + window), self._mmap)
            finally:
                os.close(fd)

    def _batch_fused(self, batch_size, drop_remainder):
        return NpyBatchDataset(self, batch_size, drop_remainder)

    def _state_iter(self, ctx):
        return _NpyRowIterator(self)


class NpyBatchDataset(Dataset):
    """``NpyDataset(...).batch(B)``: each batch one window (a batch spanning two files is
    the concatenation of a window of each)."""

    def __init__(self, source: NpyDataset, batch_size: int, drop_remainder: bool):
        self._source = source
        self._files = source._files
        self._batch_size, self._drop = batch_size, drop_remainder

    def _with_files(self, files: list[str]) -> "NpyBatchDataset":
        return NpyBatchDataset(self._source._with_files(files), self._batch_size, self._drop)

    def _cardinality(self) -> int:
        n = self._source._cardinality()
        return n // self._batch_size if self._drop else math.ceil(n / self._batch_size)

    def _compute_spec(self):
        s = self._source.element_spec
        return TensorSpec((self._batch_size if self._drop else None,) + s.shape, s.dtype)

    def _state_iter(self, ctx):
        return _NpyRowIterator(self._source, self._batch_size, self._drop)

    def _iter(self, ctx):
        b, use_mmap = self._batch_size, self._source._mmap
        pieces: list[np.ndarray] = []
        have = 0
        for m in self._source._meta():
            fd = os.open(m.path, os.O_RDONLY)
            try:
                start = 0
                while start < m.rows:
                    stop = min(m.rows, start + b - have)
                    pieces.append(m.read(fd, start, stop, use_mmap))
                    have += stop - start
                    start = stop
                    if have == b:
                        out = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
                        pieces, have = [], 0
                        yield out
            finally:
                os.close(fd)
        if have and not self._drop:
            yield pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


class _NpyRowIterator(StateIterator):
    """The rows of ``.npy`` files, read a window at a time; the state is the file's
    index and the next row."""

    def __init__(self, node: NpyDataset, batch_size: int | None = None,
                 drop_remainder: bool = False):
        self._node = node
        self._batch_size, self._drop = batch_size, drop_remainder
        self._meta = node._meta()
        self._file, self._row = 0, 0
        self._window, self._window_start = None, 0
        self._fd = None

    def _rows(self, want: int) -> np.ndarray | None:
        """Up to ``want`` rows of the current file's current window (a view), or None
        at the end of the last file."""
        while self._file < len(self._meta):
            m = self._meta[self._file]
            if self._row >= m.rows:
                self.close()
                self._file, self._row = self._file + 1, 0
                continue
            if self._batch_size is not None:
                # Batches read exactly their rows (as one piece where they can): a
                # larger window would stay alive, and be concatenated, behind each batch.
                if self._fd is None:
                    self._fd = os.open(m.path, os.O_RDONLY)
                stop = min(m.rows, self._row + want)
                out = m.read(self._fd, self._row, stop, self._node._mmap)
                self._row = stop
                return out
            w = self._window
            if w is None or not self._window_start <= self._row < self._window_start + len(w):
                if self._fd is None:
                    self._fd = os.open(m.path, os.O_RDONLY)
                size = max(1, _WINDOW_BYTES // max(1, m.row_items * m.dtype.itemsize))
                self._window = w = m.read(self._fd, self._row,
                                          min(m.rows, self._row + size), self._node._mmap)
                self._window_start = self._row
            i = self._row - self._window_start
            out = w[i:i + want]
            self._row += len(out)
            return out
        return None

    def __next__(self):
        if self._batch_size is None:
            rows = self._rows(1)
            if rows is None:
                raise StopIteration
            return rows[0]
        pieces, have, b = [], 0, self._batch_size
        while have < b:
            rows = self._rows(b - have)
            if rows is None:
                break
            pieces.append(rows)
            have += len(rows)
        if have == 0 or (have < b and self._drop):
            raise StopIteration
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def save(self):
        return {"file": self._file, "row": self._row,
                "path": self._meta[self._file].path if self._file < len(self._meta) else None}

    def restore(self, state):
        i = int(state["file"])
        if i < len(self._meta) and self._meta[i].path != state["path"]:
            raise ValueError(f"NpyDataset: the saved position is in {state['path']!r}, this "
                             f"dataset's file {i} is {self._meta[i].path!r}: restore into a "
                             "dataset over the same files")
        self._file, self._row = i, int(state["row"])

    def close(self):
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._window = None
