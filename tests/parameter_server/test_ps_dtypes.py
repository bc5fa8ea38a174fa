"""Arrays of every NumPy dtype travel intact: dates, records, strings and objects, as
arguments, results and per-worker values, through the wire's layouts, the pipe and
MPI; variables on the servers refuse the dtypes that updates cannot add."""

from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from gpustrat.distribute.parameter_server import wire
from gpustrat.distribute.parameter_server.pipe import Pipe

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok  # noqa: E402

#: Python source of each sample, evaluated here and in the child jobs.
SOURCES = {
    "datetime64": "np.array(['2020-01-01', '2021-02-03'], dtype='datetime64[D]')",
    "datetime64 0-d": "np.array(np.datetime64('2020-01-01T10:00', 'ms'))",
    "timedelta64": "np.array([1, 2], dtype='timedelta64[s]')",
    "structured": "np.array([(1, 2.5), (3, 4.5)], dtype=[('x', '<i4'), ('y', '<f8')])",
    "aligned record": "np.ones(2, np.dtype([('a', 'u1'), ('b', '<f8')], align=True))",
    "record with a subarray": "np.array([([1, 2], b'ab')], "
                              "dtype=[('v', '<i2', (2,)), ('s', 'S2')])",
    "void": "np.array([b'abcde'], dtype='V5')",
    "unicode": "np.array(['héllo', 'x'])",
    "bytes": "np.array([b'ab', b'c'])",
    "complex64": "np.array([1 + 2j, 3 - 4j], np.complex64)",
    "longdouble": "np.array([1.5, 2.5], np.longdouble)",
    "big-endian": "np.arange(3, dtype='>f4')",
    "empty datetime64": "np.zeros((0, 3), 'datetime64[s]')",
}
SAMPLES = {k: eval(src) for k, src in SOURCES.items()}  # noqa: S307 - fixed sources


def _same(got, expected) -> bool:
    return got.dtype == expected.dtype and got.dtype.names == expected.dtype.names \
        and got.shape == expected.shape and got.tobytes() == expected.tobytes()


@pytest.mark.parametrize("kind", sorted(SAMPLES))
def test_layouts_describe_dtypes_exactly_and_raw_gives_the_bytes(kind):
    a = SAMPLES[kind]
    (back,) = wire.empty_like_metas(wire.metas([a]))
    assert back.dtype == a.dtype and back.dtype.names == a.dtype.names
    assert back.shape == a.shape
    assert bytes(wire.raw(a)) == a.tobytes()


@pytest.mark.parametrize("shared", [True, False])
def test_the_pipe_moves_every_dtype(shared):
    a_end, b_end = socket.socketpair()
    a, b = Pipe(a_end, shared=shared), Pipe(b_end, shared=shared)
    arrays = list(SAMPLES.values())
    for views in (False, True):
        got = []
        reader = threading.Thread(target=lambda: got.append(b.recv(views=views)))
        reader.start()
        a.send(("run",), arrays)
        reader.join(timeout=60)
        assert all(_same(g, e) for g, e in zip(got[0][1], arrays)), got
        b.send(("ack",))  # lets a write its arena again
        a.recv()
    a.close()
    b.close()


def test_object_arrays_travel_in_the_pickle():
    obj = np.array([{"k": 1}, "s", None, 2.5], dtype=object)
    mixed = np.array([(1, [1, 2])], dtype=[("i", "<i4"), ("o", "O")])
    blob, arrays = wire.pack((obj, mixed, SAMPLES["structured"]))
    assert len(arrays) == 1  # only the plain record array goes outside the pickle
    o, m, s = wire.unpack(blob, [x.copy() for x in arrays])
    assert o.dtype == object and o.tolist() == obj.tolist()
    assert m.dtype == mixed.dtype and m[0]["o"] == [1, 2]
    assert _same(s, SAMPLES["structured"])


# Every sample (plus object arrays) as an argument, a result made in the function,
# inside a per-worker value and nested in a structure; a variable of a dtype the
# servers cannot add into is a TypeError on the coordinator, and the job goes on.
DTYPES = r"""
import numpy as np
import gpustrat as gs

SAMPLES = {samples}
resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(resolver)
coord = gs.distribute.coordinator.ClusterCoordinator(strategy)
W = strategy.num_workers
SAMPLES["object"] = "np.array([{'k': 1}, 'x', None], dtype=object)"

def same(got, expected):
    if not (got.dtype == expected.dtype and got.dtype.names == expected.dtype.names
            and got.shape == expected.shape):
        return False
    if expected.dtype.hasobject:
        return got.tolist() == expected.tolist()
    # Values made in a function may differ in their padding bytes (records, longdouble).
    if expected.dtype.names:
        return all(np.array_equal(got[n], expected[n]) for n in expected.dtype.names)
    if expected.dtype.kind == "V":
        return got.tobytes() == expected.tobytes()
    return np.array_equal(got, expected)

def echo(a):
    return a, str(a.dtype), a.dtype.names

def make(src):
    import numpy as np
    return eval(src)

for kind, src in SAMPLES.items():
    expected = eval(src)
    got, seen, names = coord.schedule(echo, args=(expected,)).fetch()
    assert same(got, expected) and seen == str(expected.dtype), (kind, got, seen)
    assert names == expected.dtype.names, (kind, names)
    got = coord.schedule(make, args=(src,)).fetch()
    assert same(got, expected), (kind, got)
    pwv = gs.distribute.coordinator.PerWorkerValues([expected] * W)
    got = coord.schedule(lambda p: {"v": [p]}, args=(pwv,)).fetch()["v"][0]
    assert same(got, expected), (kind, got)
    print("OK", kind, flush=True)

with strategy.scope():
    for src in ("np.array(['2020-01-01'], 'datetime64[D]')", "np.array([1], 'm8[s]')",
                SAMPLES["structured"]):
        try:
            gs.Variable(eval(src), name="v")
            raise SystemExit(f"a variable of {src} was made")
        except TypeError as e:
            assert "variable 'v'" in str(e) and "int64" in str(e), e
    # Strings are variables as in TensorFlow.
    s = gs.Variable(np.array(["ab", "c"]), name="s")
    flags = gs.Variable(np.array([True, False]), name="flags")
assert s.numpy().tolist() == ["ab", "c"]
assert coord.schedule(lambda: s.numpy()).fetch().tolist() == ["ab", "c"]
# Arithmetic NumPy has not for a dtype is a TypeError for the caller, the variable
# unchanged (it used to end the job from the server, after the update was taken).
def refused(call, words):
    try:
        call()
    except TypeError as e:
        assert words in str(e), e
    else:
        raise SystemExit(f"no error: {words}")
for var, update, value in ((s, "assign_add", s.numpy()), (s, "assign_sub", s.numpy()),
                           (flags, "assign_sub", flags.numpy())):
    refused(lambda: getattr(var, update)(value),
            f"{update} of variable {var.name!r} of dtype {var.dtype}")
# From a function: its fetch raises, and so does the next join (then it is cleared).
words = "assign_sub of variable 'flags' of dtype bool"
remote = coord.schedule(lambda: flags.assign_sub(np.array([True, True])))
refused(remote.fetch, words)
refused(coord.join, words)
flags.assign_add(np.array([False, True]))    # a logical or, as NumPy adds booleans
assert flags.numpy().tolist() == [True, True] and s.numpy().tolist() == ["ab", "c"]
s.assign(np.array(["x", "yz"]))
assert s.numpy().tolist() == ["x", "yz"]
assert coord.schedule(lambda: 1).fetch() == 1
print("OK", flush=True)
"""


def test_every_dtype_travels_to_and_from_functions():
    out = assert_mpi_ok(3, DTYPES.replace("{samples}", repr(SOURCES)), timeout=120,
                        expect_lines=len(SOURCES) + 2)
    assert out.rstrip().endswith("OK")
