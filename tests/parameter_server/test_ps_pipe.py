"""The pipe between a worker rank and its function process: headers on a local
socket, arrays through a shared-memory arena per direction or on the socket."""

from __future__ import annotations

import socket
import sys
import threading

import numpy as np
import pytest

from gpustrat.distribute.parameter_server import pipe as pipe_mod
from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.pipe import Pipe
from gpustrat.distribute.parameter_server.worker import FunctionProcess


def _pair(shared=True):
    a_end, b_end = socket.socketpair()
    return Pipe(a_end, shared=shared), Pipe(b_end, shared=shared)


@pytest.mark.parametrize("shared", [True, False])
def test_the_pipe_moves_headers_and_large_arrays(shared):
    a, b = _pair(shared)
    big = np.arange(3 << 20, dtype=np.float32).reshape(-1, 3)  # larger than a socket buffer
    small, empty = np.float64(2.5).reshape(()), np.zeros((0, 4), np.int8)
    got = []
    reader = threading.Thread(target=lambda: got.append(b.recv()))
    reader.start()
    a.send(("var", 1, {"k": [1, 2]}), [big, small, empty])
    reader.join(timeout=60)
    header, arrays = got[0]
    assert header == ("var", 1, {"k": [1, 2]})
    assert np.array_equal(arrays[0], big) and arrays[0].dtype == big.dtype
    assert arrays[1].shape == () and arrays[1] == 2.5 and arrays[2].shape == (0, 4)
    assert (a._sent == 1) is shared  # the arrays took the arena when it is on
    a.close()
    with pytest.raises(EOFError):
        b.recv()
    b.close()


def test_requests_and_answers_reuse_and_grow_the_arenas():
    a, b = _pair()
    rng = np.random.default_rng(0)
    try:
        # Alternating messages (as a function's requests and their answers go), each
        # larger than the last: both arenas grow, and every array arrives intact.
        for n in (10, 1000, 300_000, 700_000, 50, 2_000_000):
            x = rng.normal(size=n).astype(np.float32)
            i = rng.integers(0, 9, size=(n % 7 + 1, 3))
            a.send(("req", n), [x, i])
            (kind, m), (x2, i2) = b.recv()
            assert (kind, m) == ("req", n)
            assert np.array_equal(x2, x) and np.array_equal(i2, i) and i2.dtype == i.dtype
            b.send(("ans", n), [x2 * 2])
            (_, m), (y,) = a.recv()
            assert m == n and np.array_equal(y, x * 2)
        assert a._sent == b._sent == 6 and a._taken == b._taken == 6
        assert a._out_size >= 2_000_000 * 4 and b._out_size >= 2_000_000 * 4
        # The received arrays are the receiver's own: the next message cannot change them.
        a.send(("req", 0), [np.ones(5, np.float32)])
        (_, _), (kept,) = b.recv()
        a.send(("req", 1), [np.zeros(5, np.float32)])
        b.recv()
        assert np.array_equal(kept, np.ones(5, np.float32))
    finally:
        a.close()
        b.close()


def test_an_arena_is_not_overwritten_before_the_other_end_has_read_it():
    a, b = _pair()
    try:
        first, second = np.full(1000, 1.0), np.full(1000, 2.0)
        a.send(("one",), [first])  # into the arena
        a.send(("two",), [second])  # unread first message: this one takes the socket
        (h1, (x1,)), (h2, (x2,)) = b.recv(), b.recv()
        assert h1 == ("one",) and np.array_equal(x1, first)
        assert h2 == ("two",) and np.array_equal(x2, second)
        assert a._sent == 1
        # Once the other end says it took it, the arena is used again.
        b.send(("ok",))
        a.recv()
        a.send(("three",), [first])
        assert a._sent == 2 and np.array_equal(b.recv()[1][0], first)
    finally:
        a.close()
        b.close()


def test_messages_larger_than_the_arena_limit_take_the_socket(monkeypatch):
    monkeypatch.setattr(pipe_mod, "ARENA_LIMIT", 4096)
    a, b = _pair()
    try:
        x = np.arange(10_000, dtype=np.float64)
        got = []
        reader = threading.Thread(target=lambda: got.append(b.recv()))
        reader.start()
        a.send(("big",), [x])
        reader.join(timeout=60)
        assert np.array_equal(got[0][1][0], x) and a._sent == 0 and a._out is None
    finally:
        a.close()
        b.close()


def test_arrays_placed_in_the_arena_travel_without_a_copy_and_views_stay_until_a_reply():
    a, b = _pair()
    try:
        # An answer filled where the arena carries it (as a worker rank receives a
        # variable's bytes from MPI), first growing the arena.
        into = a.placed([("<f4", (600, 1000)), ("<i8", ())])
        assert into is not None and a._new_fd is not None
        into[0][...] = 3.0
        into[1][...] = 7
        a.send(("ans",), into)
        (_,), (x, n) = b.recv()
        assert np.all(x == 3.0) and x.shape == (600, 1000) and n == 7
        # Views of the other end's arena (a request's arrays on their way to a server)
        # hold until this end answers; the other end then writes the arena again.
        b.send(("req",), [np.arange(10.0)])
        (_,), (view,) = a.recv(views=True)
        assert np.array_equal(view, np.arange(10.0))
        assert b.placed([("<f8", (10,))]) is None  # not taken back yet
        a.send(("done",))
        b.recv()
        again = b.placed([("<f8", (10,))])
        assert again is not None
        again[0][...] = 5.0  # the same memory: the view was good only until the answer
        assert np.all(view == 5.0)
        # Until the other end has taken a message, nothing is placed: the caller's own
        # arrays then take the socket.
        a.send(("one",), [np.ones(4)])
        assert a.placed([("<f8", (4,))]) is None
        a.send(("two",), [np.full(4, 2.0)])
        assert np.all(b.recv()[1][0] == 1.0) and np.all(b.recv()[1][0] == 2.0)
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="page faults from /proc")
def test_the_function_process_keeps_the_memory_its_steps_free():
    # A step that makes and frees several large arrays, like a training step's
    # activations and gradients: the process keeps the pages instead of handing them
    # back to the kernel and faulting them in again (zeroed) at the next step.
    def churn():
        import numpy as np

        def faults():
            with open("/proc/self/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[7])  # minor faults

        def step():
            arrays = [np.ones(1 << 18, np.float32) for _ in range(4)]  # 4 x 1 MiB
            del arrays
        step()
        before = faults()
        for _ in range(10):
            step()
        return (faults() - before) / 10

    fp = FunctionProcess({"worker": 0, "num_workers": 1, "devices": []})
    fp.start()
    try:
        blob, arrays = wire.pack((churn, (), {}))
        fp.conn.send(("run", 7, blob), arrays)
        header, arrays = fp.conn.recv()
        assert header[:2] == ("done", 7), header
        per_step = wire.unpack(header[2], arrays)
    finally:
        fp.stop()
    # 4 MiB freed and made again per step would be 1024 pages faulted in.
    assert per_step < 64, f"{per_step} page faults per step"
