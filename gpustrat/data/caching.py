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
        file to refill it. While a pass writes, a lock file (``.lock``, naming the
        writer's process and host, under an ``flock`` the system drops when that
        process ends) makes a second writer fail with a clear error instead of mixing
        two writes; a lock left by a process that died mid-pass is taken over, with a
        warning. The format is
        gpustrat's own (not TensorFlow's); strings, arrays of any dtype and shape and
        nested elements round-trip exactly.
"""

from __future__ import annotations

import itertools
import logging
import os
import struct
from typing import Any, BinaryIO, Iterator

import numpy as np

from gpustrat import devices, nest
from gpustrat.data import structure as st
from gpustrat.data.cache_lock import remove as _remove, take_lock
from gpustrat.data.dataset import Dataset
from gpustrat.data.iterator_state import ListIterator, StateIterator, same_state
from gpustrat.data.unary import UnaryDataset, _close

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
    """What a memory cache holds: the elements of a complete pass, once there is one,
    and the position its input started that pass from (None when not known)."""

    __slots__ = ("elements", "start")

    def __init__(self):
        self.elements: list | None = None
        self.start = None


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
        writer = _FileWriter(path, id(self))
        complete = False
        it = self._input._iter(ctx)
        try:
            for element in it:
                writer.write(element)
                yield element
            writer.commit()
            complete = True
        finally:
            _close(it)
            if not complete:
                writer.abort()

    def _state_iter(self, ctx):
        return _CacheIterator(self, ctx)


class _FileWriter:
    """The writing of a cache file: a lock file while it runs, the elements into a
    temporary file, renamed to the cache file by :meth:`commit`."""

    def __init__(self, path: str, token: int):
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"cache: the folder {folder!r} of the cache file "
                                    f"{path!r} does not exist; create it first")
        self._path, self._lock = path, path + ".lock"
        self._held = take_lock(self._lock, path)
        self._tmp = f"{path}.tmp-{os.getpid()}-{token}"
        try:
            self._out = open(self._tmp, "wb")
            self._out.write(_MAGIC)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        # Removed while still held, so that a process waiting on the old file sees
        # that it was replaced (see cache_lock.take_lock).
        _remove(self._lock)
        self._held.close()

    def write(self, element: Any) -> None:
        _write_element(self._out, element)

    def commit(self) -> None:
        """The pass is complete: the file becomes the cache."""
        self._out.write(_END)
        self._out.close()
        os.replace(self._tmp, self._path)
        self._release()

    def abort(self) -> None:
        """The pass stopped early: nothing is kept."""
        self._out.close()
        _remove(self._tmp)
        log.warning(_PARTIAL, "file")
        self._release()


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
    reader = _FileReplay(path, lambda: spec)
    try:
        yield from reader
    finally:
        reader.close()


class _FileReplay(StateIterator):
    """The elements of a complete cache file; the state is the byte offset after the
    last element returned, the elements returned, and the file's size (a restore into
    another file of that name is an error)."""

    def __init__(self, path: str, spec_fn):
        # The element spec, asked for when the file is opened (at the first next).
        self._path, self._spec_fn = path, spec_fn
        self._f = self._reader = None
        self._offset, self._count, self._size = len(_MAGIC), 0, None
        self._ended = False

    def _open(self) -> None:
        path = self._path
        f = open(path, "rb")
        if f.read(len(_MAGIC)) != _MAGIC:
            f.close()
            raise ValueError(f"cache: {path!r} is not a gpustrat cache file; delete it or "
                             "choose another filename")
        self._check_size(os.fstat(f.fileno()).st_size)
        f.seek(self._offset)
        self._f, self._reader = f, _Reader(f, path)
        self._spec = self._spec_fn()
        self._pack = st.make_plan(self._spec)[1]
        self._n = len(nest.flatten(self._spec))

    def _check_size(self, size: int) -> None:
        if self._size is not None and size != self._size:
            raise ValueError(f"cache: the saved position reads the cache file "
                             f"{self._path!r} of {self._size} bytes, but it now has {size} "
                             "bytes: it was written again (by another pipeline?); restore "
                             "with the cache file the position was saved with")
        self._size = size

    def __next__(self):
        if self._ended:
            raise StopIteration
        if self._f is None:
            self._open()
        r = self._reader
        if r.exact(1) == _END:
            self._ended = True
            self.close()
            raise StopIteration
        n = r.int()
        if n != self._n:
            raise ValueError(f"cache: {self._path!r} holds elements of {n} components, but "
                             f"this dataset's have {self._n} ({self._spec}): it was written "
                             "by another pipeline; delete it or choose another filename")
        element = self._pack([r.leaf() for _ in range(n)])
        self._offset = self._f.tell()
        self._count += 1
        return element

    def save(self):
        if self._size is None:
            self._size = os.path.getsize(self._path)
        return {"offset": self._offset, "count": self._count, "size": self._size}

    def restore(self, state):
        path = self._path
        if not os.path.exists(path):
            raise ValueError(f"cache: the saved position reads the cache file {path!r}, "
                             "which does not exist: restore where that file is (or delete "
                             "the checkpoint's input position and start the epoch again)")
        self._size = int(state["size"])
        self._check_size(os.path.getsize(path))
        self._offset, self._count = int(state["offset"]), int(state["count"])

    def close(self):
        if self._f is not None:
            self._f.close()
            self._f = self._reader = None


class _CacheIterator(StateIterator):
    """``cache``. An iteration replays the cache when it exists at ``iter()`` time;
    otherwise it reads the input and records what it returns (the filling pass).

    State: replaying a memory cache, the index of the next element and the position the
    input started the filling pass from (the elements are not saved: a restore where the
    cache is empty, or was filled from another start, rebuilds it by reading that pass
    again); replaying a file, the byte offset (see :class:`_FileReplay`); filling, the
    input's state, its start position and the number of elements returned. A restore in
    the middle of the filling pass reads the elements before the position again from the
    start position to record them (for a deterministic input, the cache then holds what
    the uninterrupted pass held), and continues from the input's state.
    """

    def __init__(self, node: CacheDataset, ctx):
        self._node, self._ctx = node, ctx
        self._replay = None        # the replaying iterator (a memory or file cache)
        self._replay_start = None  # the memory cache's start position
        self._input = None
        self._inputs: tuple = ()
        store = node._store
        if node._filename and os.path.exists(node.path):
            self._set_replay(_FileReplay(node.path, lambda: node.element_spec))
        elif not node._filename and store.elements is not None:
            self._replay_memory(store)
        else:
            self._fill()

    def _set_replay(self, replay: StateIterator) -> None:
        self._replay = replay
        self._next = replay.fast_iter()

    def _replay_memory(self, store: _Store) -> None:
        self._set_replay(ListIterator(store.elements))
        self._replay_start = store.start

    def _fill(self) -> None:
        """Fill mode: read the input, from its start."""
        self._input = self._node._input._state_iter(self._ctx)
        self._inputs = (self._input,)
        self._start = self._input.save()
        self._kept: list | None = [] if not self._node._filename else None
        self._count = 0        # elements returned (a file cache's; a memory one counts kept)
        self._missing = 0      # elements of a restored pass not read again
        self._head = 0         # elements to read again from the start (a restored file pass)
        self._writer = None
        self._complete = False
        self._next = self._filling()

    def _read_again(self, count: int | None):
        """The pass's first ``count`` elements (all for None), read again from its start."""
        it = self._node._input._state_iter(self._ctx)
        try:
            it.restore(self._start)
            yield from (it if count is None else itertools.islice(it, count))
        finally:
            it.close()

    def _filling(self):
        """The filling pass: the input's elements, recorded (a generator: nothing runs,
        no lock is taken, before the first element is asked for)."""
        source = self._input.fast_iter()
        try:
            if self._kept is not None:
                append = self._kept.append
                for element in source:
                    append(element)
                    yield element
            else:
                writer = self._writer = _FileWriter(self._node.path, id(self))
                n = 0
                for element in self._read_again(self._head):
                    writer.write(element)
                    n += 1
                self._missing = self._head - n
                for element in source:
                    writer.write(element)
                    self._count += 1
                    yield element
            self._finish()
        finally:
            if not self._complete:
                if self._writer is not None:
                    self._writer.abort()
                elif self._kept is not None:
                    log.warning(_PARTIAL, "memory")

    def fast_iter(self):
        return self._next

    def __next__(self):
        return next(self._next)

    def _finish(self) -> None:
        self._complete = True
        if self._missing:
            log.warning("cache: the elements before the restored position read differently "
                        "the second time (the input is not deterministic), so this pass "
                        "does not fill the cache")
            if self._writer is not None:
                self._writer.abort()
            return
        if self._kept is None:
            self._writer.commit()
        elif self._node._store.elements is None:
            self._node._store.elements = self._kept
            self._node._store.start = self._start

    def save(self):
        if isinstance(self._replay, _FileReplay):
            return {"mode": "file", **self._replay.save()}
        if self._replay is not None:
            return {"mode": "memory", "pos": self._replay.save()["pos"],
                    "start": self._replay_start}
        count = self._count if self._kept is None else len(self._kept) + self._missing
        return {"mode": "fill", "start": self._start, "count": count,
                "input": self._input.save()}

    def restore(self, state):
        node, mode = self._node, state["mode"]
        if mode == "fill":
            if self._input is None:
                self._replay = None
                self._fill()
            self._input.restore(state["input"])
            self._start, count = state["start"], int(state["count"])
            if self._kept is not None:
                self._kept[:] = self._read_again(count)
                self._missing = count - len(self._kept)
            else:
                self._head = self._count = count  # read again when writing starts
            self._next = self._filling()          # over the restored input
            return
        if self._input is not None:
            self._input.close()
            self._input, self._inputs = None, ()
        if mode == "file":
            replay = _FileReplay(node.path, lambda: node.element_spec)
            replay.restore(state)
            self._set_replay(replay)
            return
        store, start = node._store, state["start"]
        if store.elements is None or not same_state(store.start, start):
            if start is None:
                raise ValueError("cache: the saved position replays a memory cache whose "
                                 "filling pass was not made by a saveable iterator, so it "
                                 "cannot be rebuilt here")
            self._start = start
            store.elements, store.start = list(self._read_again(None)), start
        self._replay_memory(store)
        self._replay.restore({"pos": state["pos"]})
        self._next = self._replay.fast_iter()

    def close(self):
        if self._replay is not None:
            self._replay.close()
        else:
            self._next.close()
        super().close()
