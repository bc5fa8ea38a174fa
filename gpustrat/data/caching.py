"""``cache``: keep a dataset's elements after the first complete pass.

Words:
    complete pass: an iteration of the cache node that reached the end of its input.
        Only a complete pass fills the cache. An iteration that stops early (a
        ``take`` after the cache, a ``break``, an error) leaves nothing behind: its
        partial contents are discarded and the next iteration reads the input again,
        as ``tf.data`` does, so a cache never silently truncates a dataset.
    memory cache: ``cache()``: the elements themselves (no copy) kept by the dataset
        node; every later iteration replays them. Several iterations may run at once;
        the first to complete fills the cache.
    file cache: ``cache(filename)``: the elements written to ``filename`` +
        ``.gpustrat-cache`` while the first pass runs (into a temporary file, renamed
        when the pass completes). Once the file exists, every iteration of any dataset
        caching to that name, in any process, reads it instead of its input; delete the
        file to refill it. While a pass writes, a lock file (``.lock``) makes a second
        writer fail with a clear error instead of mixing two writes. The format is
        gpustrat's own (not TensorFlow's); strings, arrays of any dtype and shape and
        nested elements round-trip exactly.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Any, BinaryIO, Iterator

import numpy as np

from gpustrat import devices, nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import Dataset
from gpustrat.data.transforms import UnaryDataset, _close

log = logging.getLogger("gpustrat")

SUFFIX = ".gpustrat-cache"
_MAGIC = b"GPUSTRAT-CACHE-1\n"
_INT = struct.Struct("<q")
_ARRAY, _SCALAR, _BYTES, _STRINGS, _END = b"a", b"g", b"b", b"o", b"E"

_PARTIAL = ("cache: the iterator did not read the whole dataset, so the %s cache was "
            "discarded (it would have truncated the dataset). A pipeline like "
            "dataset.cache().take(k).repeat() does this every epoch: use "
            "dataset.take(k).cache().repeat() instead.")


class _Store:
    """What a memory cache holds: the elements of a complete pass, once there is one."""

    __slots__ = ("elements",)

    def __init__(self):
        self.elements: list | None = None


class CacheDataset(UnaryDataset):
    """``cache(filename="")``: in memory for ``""``, else in ``filename + SUFFIX``."""

    def __init__(self, input_dataset: Dataset, filename: str | os.PathLike = ""):
        super().__init__(input_dataset)
        if isinstance(filename, bytes):
            filename = filename.decode()
        if not isinstance(filename, (str, os.PathLike)):
            raise TypeError(f"cache: filename must be a string (\"\" for memory), got "
                            f"{type(filename).__name__} {filename!r}")
        self._filename = os.fspath(filename)
        self._store = _Store()

    def _with_inputs(self, inputs):
        # Rebuilt over other inputs (sharded by file, for instance), the data may differ:
        # a memory cache starts empty. A file cache keeps its name; see file_cache_names.
        new = super()._with_inputs(inputs)
        new._store = _Store()
        return new

    def batch_rows(self):
        return self._input.batch_rows()

    @property
    def path(self) -> str | None:
        """The cache file (complete), or None for a memory cache."""
        return self._filename + SUFFIX if self._filename else None

    def _iter(self, ctx):
        if self._filename:
            return self._iter_file(ctx)
        return self._iter_memory(ctx)

    def _iter_memory(self, ctx):
        done = self._store.elements
        if done is not None:
            yield from done
            return
        kept: list = []
        it = self._input._iter(ctx)
        complete = False
        try:
            for element in it:
                kept.append(element)
                yield element
            complete = True
        finally:
            _close(it)
            if complete and not ctx.peek:
                if self._store.elements is None:
                    self._store.elements = kept
            elif not ctx.peek:
                log.warning(_PARTIAL, "memory")

    def _iter_file(self, ctx):
        path = self.path
        if os.path.exists(path):
            yield from _read(path, self.element_spec)
            return
        if ctx.peek:  # looking at one element writes nothing
            yield from self._input._iter(ctx)
            return
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cache: the folder {folder!r} of the cache file "
                                    f"{path!r} does not exist; create it first")
        lock = path + ".lock"
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            raise FileExistsError(
                f"cache: another iterator is writing the cache {path!r} (its lock file "
                f"{lock!r} exists). Two passes cannot fill one cache file at once: give "
                "each process or iterator its own filename; if no writer is running, "
                "delete the lock file") from None
        os.write(fd, f"pid {os.getpid()}\n".encode())
        os.close(fd)
        tmp = f"{path}.tmp-{os.getpid()}-{id(self)}"
        complete = False
        it = self._input._iter(ctx)
        try:
            with open(tmp, "wb") as out:
                out.write(_MAGIC)
                for element in it:
                    _write_element(out, element)
                    yield element
                out.write(_END)
            os.replace(tmp, path)
            complete = True
        finally:
            _close(it)
            if not complete:
                _remove(tmp)
                log.warning(_PARTIAL, "file")
            _remove(lock)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def file_cache_names(dataset: Dataset) -> list[str]:
    """The cache files (complete names) of the file caches in the pipeline."""
    from gpustrat.data.autoshard import file_sources  # noqa: PLC0415
    seen, out, stack = set(), [], [dataset]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, CacheDataset) and node._filename and file_sources(node._input):
            out.append(node.path)
        stack.extend(node._inputs())
    return out


# --- file format: a magic line, then per element its leaves, then an end mark -----

def _write_int(out: BinaryIO, n: int) -> None:
    out.write(_INT.pack(n))


def _write_shape(out: BinaryIO, shape) -> None:
    _write_int(out, len(shape))
    for d in shape:
        _write_int(out, int(d))


def _write_leaf(out: BinaryIO, leaf: Any) -> None:
    if isinstance(leaf, bytes):
        out.write(_BYTES)
        _write_int(out, len(leaf))
        out.write(leaf)
        return
    if devices.is_gpu_array(leaf):
        leaf = leaf.get()
    if isinstance(leaf, np.ndarray) and leaf.dtype == object:
        out.write(_STRINGS)
        _write_shape(out, leaf.shape)
        for item in leaf.reshape(-1):
            _write_int(out, len(item))
            out.write(item)
        return
    kind = _SCALAR if isinstance(leaf, np.generic) else _ARRAY
    arr = np.asarray(leaf)
    dtype = arr.dtype.str.encode()
    out.write(kind)
    _write_int(out, len(dtype))
    out.write(dtype)
    _write_shape(out, arr.shape)
    data = arr.tobytes()
    _write_int(out, len(data))
    out.write(data)


def _write_element(out: BinaryIO, element: Any) -> None:
    leaves = nest.flatten(element)
    out.write(b"e")
    _write_int(out, len(leaves))
    for leaf in leaves:
        _write_leaf(out, leaf)


class _Reader:
    def __init__(self, f: BinaryIO, path: str):
        self._f, self._path = f, path

    def exact(self, n: int) -> bytes:
        data = self._f.read(n)
        if len(data) != n:
            raise ValueError(f"cache: the cache file {self._path!r} is truncated; delete it "
                             "to rebuild the cache")
        return data

    def int(self) -> int:
        return _INT.unpack(self.exact(8))[0]

    def shape(self) -> tuple:
        return tuple(self.int() for _ in range(self.int()))

    def leaf(self) -> Any:
        kind = self.exact(1)
        if kind == _BYTES:
            return self.exact(self.int())
        if kind == _STRINGS:
            shape = self.shape()
            out = np.empty(shape, dtype=object)
            flat = out.reshape(-1)
            for i in range(flat.size):
                flat[i] = self.exact(self.int())
            return out
        if kind not in (_ARRAY, _SCALAR):
            raise ValueError(f"cache: {self._path!r} is not a gpustrat cache file (or is "
                             "damaged); delete it to rebuild the cache")
        dtype = np.dtype(self.exact(self.int()).decode())
        shape = self.shape()
        arr = np.frombuffer(self.exact(self.int()), dtype=dtype).reshape(shape).copy()
        return arr[()] if kind == _SCALAR else arr


def _read(path: str, spec: Any) -> Iterator:
    pack = st.make_plan(spec)[1]
    count = len(nest.flatten(spec))
    with open(path, "rb") as f:
        r = _Reader(f, path)
        if f.read(len(_MAGIC)) != _MAGIC:
            raise ValueError(f"cache: {path!r} is not a gpustrat cache file; delete it or "
                             "choose another filename")
        while True:
            mark = r.exact(1)
            if mark == _END:
                return
            n = r.int()
            if n != count:
                raise ValueError(f"cache: {path!r} holds elements of {n} components, but "
                                 f"this dataset's have {count} ({spec}): it was written by "
                                 "another pipeline; delete it or choose another filename")
            yield pack([r.leaf() for _ in range(n)])

