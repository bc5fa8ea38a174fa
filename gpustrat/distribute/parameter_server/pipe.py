"""The pipe between a worker rank and its function process: a local socket for the
headers and a shared-memory arena per direction for the arrays.

A message is an 8-byte length, then the pickled ``(header, array layouts, where the
arrays are, how many arena messages of the other end this end has taken)``. Its arrays
travel one of two ways:

- through the sender's *arena* (a ``memfd`` mapped by both processes): the sender
  copies each array in, the receiver copies it out into a new array, one ``memcpy``
  each way and no system call for the bytes. The arena grows (a new ``memfd``, passed
  with the message as ``SCM_RIGHTS``) when a message needs more, up to
  :data:`ARENA_LIMIT`, and keeps the size of the largest message so far;
- or after the header on the socket, sent in one ``sendmsg`` from the arrays' own
  memory and received with ``recv_into`` straight into the new arrays (the kernel's
  two copies): for messages larger than the arena may grow, where ``memfd`` is
  missing, and whenever the other end has not yet taken the previous arena message.

Every message says how many arena messages its sender has taken, so an end writes
its arena again only after the other end has taken the previous message: copied its
arrays out or, having received views of them (``recv(views=True)``), sent a message
since. An arena is never overwritten while it is read, whatever order the messages go
in. A sender may also fill its arena in place (:meth:`Pipe.placed`: a worker rank
receives a variable's bytes from MPI straight into the answer to its process).
"""

from __future__ import annotations

import array
import math
import mmap
import os
import pickle
import socket
import struct

import numpy as np

from gpustrat.distribute.parameter_server.wire import empty_like_metas, metas, raw

_LENGTH = struct.Struct("<Q")
_PROTOCOL = pickle.HIGHEST_PROTOCOL
#: The largest arena (bytes); larger messages take the socket.
ARENA_LIMIT = 256 << 20
_ARENA_MIN = 1 << 20
_ALIGN = 64


def _count(shape) -> int:
    """The number of elements of an array of ``shape`` (``math.prod``: a NumPy
    reduction costs microseconds per message)."""
    return int(math.prod(shape))


class _Layout:
    """An array's size, for :func:`_offsets` before the array exists."""

    def __init__(self, dtype, shape):
        self.nbytes = _count(shape) * np.dtype(dtype).itemsize


def _offsets(arrays: list) -> tuple[list, int]:
    """Where each array starts in an arena (64-byte aligned), and the bytes in all."""
    out, at = [], 0
    for a in arrays:
        out.append(at)
        at += -(-a.nbytes // _ALIGN) * _ALIGN
    return out, at


def _layout_offsets(ms: list) -> list:
    """:func:`_offsets` of arrays described by their layouts."""
    return _offsets([_Layout(dt, shape) for dt, shape in ms])[0]


class Pipe:
    """One end of the pipe (see the module docstring); ``shared=False`` sends every
    array on the socket."""

    def __init__(self, sock: socket.socket, shared: bool = True):
        self.sock = sock
        self.shared = shared and hasattr(os, "memfd_create")
        self._out = None  # this end's arena (mmap), its size and address
        self._out_size = 0
        self._out_address = 0
        self._new_fd = None  # a new arena's descriptor, for the next message
        self._in = None  # the other end's arena, as this end maps it
        self._sent = 0  # arena messages sent
        self._acked = 0  # of those, how many the other end has taken
        self._taken = 0  # arena messages of the other end taken here

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()
        if self._new_fd is not None:
            os.close(self._new_fd)
            self._new_fd = None
        # The arenas are unmapped when the last array viewing them goes.
        self._out = self._in = None

    # --- sending ------------------------------------------------------------------
    def send(self, header, arrays=()) -> None:
        """Send ``header`` (picklable) and ``arrays`` (C-contiguous). Arrays that
        :meth:`placed` gave, already where the arena holds them, are not copied."""
        arrays = [np.asarray(a) for a in arrays]
        offsets, total = _offsets(arrays)
        in_arena = self._arena_free(total) and self._reserve(total)
        if in_arena:
            view = memoryview(self._out)
            for a, at in zip(arrays, offsets):
                if a.nbytes and a.ctypes.data != self._out_address + at:
                    view[at:at + a.nbytes] = raw(a)
            view.release()
            self._sent += 1
        fds = [self._new_fd] if self._new_fd is not None else []
        self._new_fd = None
        blob = pickle.dumps((header, metas(arrays), in_arena, self._taken),
                            protocol=_PROTOCOL)
        parts = [memoryview(_LENGTH.pack(len(blob))), memoryview(blob)]
        if not in_arena:
            parts += [raw(a) for a in arrays if a.nbytes]
        try:
            self._sendmsg(parts, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def placed(self, layouts: list):
        """New arrays of ``layouts`` (``(dtype, shape)`` pairs) where this end's next
        message will carry them in its arena, for the caller to fill and then
        :meth:`send` without a copy; None when that message cannot use the arena (the
        caller makes its own arrays)."""
        offsets, total = _offsets([_Layout(dt, shape) for dt, shape in layouts])
        if not (self._arena_free(total) and self._reserve(total)):
            return None
        return [np.frombuffer(self._out, np.dtype(dt), _count(shape), at).reshape(shape)
                for (dt, shape), at in zip(layouts, offsets)]

    def _arena_free(self, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` of arrays may go through this end's arena:
        some bytes, not too many, and the other end has taken the last one."""
        return (self.shared and 0 < nbytes <= ARENA_LIMIT
                and self._acked == self._sent)

    def _reserve(self, nbytes: int) -> bool:
        """Make this end's arena hold ``nbytes`` (a new, larger arena when it must grow:
        its descriptor goes with the next message); False where no arena can be made."""
        if nbytes <= self._out_size:
            return True
        size = max(nbytes, 2 * self._out_size, _ARENA_MIN)
        size = min(-(-size // mmap.PAGESIZE) * mmap.PAGESIZE,
                   max(ARENA_LIMIT, nbytes))
        try:
            fd = os.memfd_create("gpustrat-pipe", os.MFD_CLOEXEC)
        except OSError:
            self.shared = False
            return False
        try:
            os.ftruncate(fd, size)
            arena = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if self._new_fd is not None:
            os.close(self._new_fd)
        # The old arena is unmapped when the last array viewing it goes.
        self._out, self._out_size, self._new_fd = arena, size, fd
        self._out_address = np.frombuffer(arena, np.uint8, 1).ctypes.data
        return True

    def _sendmsg(self, parts: list, fds: list) -> None:
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while parts:
            sent = self.sock.sendmsg(parts, anc)
            anc = []  # the descriptors went with the first bytes
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]

    # --- receiving ----------------------------------------------------------------
    def recv(self, views: bool = False):
        """``(header, arrays)``; ``EOFError`` when the other end is gone. With
        ``views``, arrays that came through the arena are views of it instead of
        copies: valid only until this end sends its next message (the other end may
        then write its arena again)."""
        (n,) = _LENGTH.unpack(self._first(_LENGTH.size))
        header, ms, in_arena, taken = pickle.loads(self._exact(n))
        self._acked = taken
        if in_arena:
            self._taken += 1
            if views:
                return header, [
                    np.frombuffer(self._in, np.dtype(dt), _count(shape), at).reshape(shape)
                    for (dt, shape), at in zip(ms, _layout_offsets(ms))]
        arrays = empty_like_metas(ms)
        if in_arena:
            view = memoryview(self._in)
            for a, at in zip(arrays, _layout_offsets(ms)):
                if a.nbytes:
                    raw(a)[:] = view[at:at + a.nbytes]
            view.release()
        else:
            for a in arrays:
                if a.nbytes:
                    self._into(raw(a))
        return header, arrays

    def _first(self, n: int) -> bytearray:
        """The first ``n`` bytes of a message, and the arena that comes with it."""
        buf = bytearray(n)
        view = memoryview(buf)
        k, anc, _, _ = self.sock.recvmsg_into([view], socket.CMSG_SPACE(4 * 4))
        fds = []
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", data[:len(data) - len(data) % 4]).tolist()
        for fd in fds[:-1]:
            os.close(fd)
        if fds:
            self._map(fds[-1])
        if k == 0:
            raise EOFError("the other end of the pipe closed it")
        if k < n:
            self._into(view[k:])
        return buf

    def _map(self, fd: int) -> None:
        try:
            self._in = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    def _exact(self, n: int) -> bytearray:
        buf = bytearray(n)
        self._into(memoryview(buf))
        return buf

    def _into(self, view: memoryview) -> None:
        got = 0
        while got < len(view):
            k = self.sock.recv_into(view[got:])
            if k == 0:
                raise EOFError("the other end of the pipe closed it")
            got += k
