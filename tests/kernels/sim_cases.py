"""Kernel cases for the Numba CUDA simulator: every kernel against its NumPy reference.

Not collected by the main test run (the name does not start with ``test_``):
``test_kernels_sim.py`` runs this file in a child pytest with ``NUMBA_ENABLE_CUDASIM=1``
set before Numba is imported, so that the simulator never leaks into other tests.

Launches use 128 threads per block, so the sizes 1, 127, 128, 129 and 300 sit below,
on, just past and well past a block boundary.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", \
    "run through tests/kernels/test_kernels_sim.py, which sets NUMBA_ENABLE_CUDASIM=1"

from gpustrat.kernels import _launch  # noqa: E402
from gpustrat.kernels.pack import pack, pack_reference, unpack, unpack_reference  # noqa: E402
from gpustrat.kernels.split import split, split_reference  # noqa: E402

THREADS = 128
SIZES = (1, 127, 128, 129, 300)
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)


def data(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 100
    return x.astype(dtype)


def assert_same(got, want):
    assert type(got) is np.ndarray
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    np.testing.assert_array_equal(got, want)


def test_simulator_is_on():
    assert _launch.simulating()


# --- split -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_split_matches_reference(n, dtype):
    batch = data((n,), dtype, n)
    for replicas in (1, 3):
        got, want = split(batch, replicas, threads=THREADS), split_reference(batch, replicas)
        assert got.counts == want.counts
        assert sum(got.counts) == n
        for g, w in zip(got.pieces, want.pieces):
            assert_same(g, w)
        # Every row once, in order.
        np.testing.assert_array_equal(np.concatenate(got.pieces), batch)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_gather_split_with_padding_matches_reference(n, dtype):
    src = data((n + 5, 3), dtype, n + 1)
    index = np.random.default_rng(n).permutation(n + 5)[:n].astype(
        np.int32 if n % 2 else np.int64)
    pad = -(-n // 4) + 1
    got = split(src, 4, index=index, pad_to=pad, threads=THREADS)
    want = split_reference(src, 4, index=index, pad_to=pad)
    assert got.counts == want.counts
    for g, w, c in zip(got.pieces, want.pieces, got.counts):
        assert_same(g, w)
        assert g.shape == (pad, 3)
        np.testing.assert_array_equal(g[c:], 0)
    np.testing.assert_array_equal(
        np.concatenate([g[:c] for g, c in zip(got.pieces, got.counts)]), src[index])


def test_gather_walks_rows_and_pieces_past_the_grid(monkeypatch):
    # One block of 8 threads along rows and one grid layer: each thread walks every
    # piece and, four rows a pass, every row of it (zero rows included).
    monkeypatch.setattr(_launch, "MAX_GRID_Y", 1)
    src = data((301, 2), np.float32, 3)
    index = np.random.default_rng(1).permutation(301)[:299]
    for pad in (None, 80):
        got = split(src, 4, index=index, pad_to=pad, threads=8)
        want = split_reference(src, 4, index=index, pad_to=pad)
        assert got.counts == want.counts
        for g, w in zip(got.pieces, want.pieces):
            assert_same(g, w)


@pytest.mark.parametrize("shape,dtype,word", [
    ((130, 3), np.float16, "u2"),      # 6-byte rows move as 2-byte words
    ((129, 2, 2), np.int64, "u8"),     # 32-byte rows as 8-byte words
    ((128, 3), np.uint8, "u1"),        # 3-byte rows byte by byte
    ((127, 5), np.float32, "u4"),
])
def test_split_any_trailing_shape(shape, dtype, word):
    batch = data(shape, dtype, 7)
    row_bytes = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
    assert _launch.word_dtype(row_bytes, 0) == np.dtype(word)
    got, want = split(batch, 3, threads=THREADS), split_reference(batch, 3)
    for g, w in zip(got.pieces, want.pieces):
        assert_same(g, w)


@pytest.mark.parametrize("dtype", [np.dtype("V3"), np.dtype([("a", "u1"), ("b", "<i2")]),
                                   np.dtype("V5")], ids=["V3", "record3", "V5"])
@pytest.mark.parametrize("trailing", [(), (2,), (0,)])
def test_split_of_an_itemsize_that_is_not_a_power_of_two(dtype, trailing):
    # The rows move as words through a byte view: viewing a 3-byte item as 2-byte
    # words directly is refused by NumPy (and CuPy).
    n = 7
    raw = np.random.default_rng(5).integers(0, 256, n * int(np.prod(trailing, dtype=int))
                                            * dtype.itemsize, dtype=np.uint8)
    batch = raw.view(dtype).reshape((n,) + trailing)
    index = np.array([6, 0, 3, 3, 1], np.int64)
    for kwargs in ({}, {"pad_to": 3}, {"index": index, "pad_to": 2}):
        got = split(batch, 3, threads=THREADS, **kwargs)
        want = split_reference(batch, 3, **kwargs)
        assert got.counts == want.counts
        for g, w in zip(got.pieces, want.pieces):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert g.tobytes() == w.tobytes()


def test_split_without_a_gather_merges_adjacent_copies_and_zero_fills():
    from gpustrat.kernels.split import piece_ranges
    # Without padding the pieces are the batch's rows back to back: one copy, and one
    # memset for the rows past the data (the last piece of 7 rows on 4 replicas).
    assert piece_ranges([2, 2, 2, 1], 2, 2, 4) == ([[0, 0, 28]], [[28, 4]])
    # Padding to 3 rows: each piece's rows are a copy of their own, each followed by
    # zeros, and the zeros of an empty piece join the previous piece's.
    assert piece_ranges([2, 2, 0], 2, 3, 4) == ([[0, 0, 8], [12, 8, 8]],
                                                [[8, 4], [20, 16]])


def test_split_past_the_end_and_empty_batches():
    # SPEC: range(8).batch(4) on 3 replicas -> [0,1] [2,3] []
    got = split(np.arange(4, dtype=np.int64), 3, threads=THREADS)
    assert got.counts == [2, 2, 0]
    assert [p.tolist() for p in got.pieces] == [[0, 1], [2, 3], []]
    empty = split(np.zeros((0, 2), np.float32), 2, threads=THREADS)
    assert empty.counts == [0, 0] and all(p.shape == (0, 2) for p in empty.pieces)
    padded = split(np.zeros((0, 2), np.float32) + 1, 2, pad_to=3, threads=THREADS)
    assert padded.counts == [0, 0] and len(padded.pieces) == 2
    assert all(p.shape == (3, 2) and not p.any() for p in padded.pieces)


def test_split_launcher_errors():
    batch = np.arange(10, dtype=np.float32)
    with pytest.raises(ValueError, match="pad_to=2 .* need 4 rows"):
        split(batch, 3, pad_to=2)
    with pytest.raises(IndexError, match="rows 0 .. 10 but the batch has 10"):
        split(batch, 2, index=np.arange(11))
    with pytest.raises(TypeError, match="1-D integer"):
        split(batch, 2, index=np.zeros(3, np.float32))
    # A uint64 index used to pass this check and then fail to compile on a GPU (uint64
    # and the kernel's -1 unify to float64).
    with pytest.raises(TypeError, match=r"got uint64: cast it with index.astype\('int64'\)"):
        split(batch, 2, index=np.arange(4, dtype=np.uint64))
    for kind in (np.int32, np.int64, np.uint32, np.int16):
        got = split(batch, 2, index=np.arange(4, dtype=kind)[::-1].copy(), threads=THREADS)
        assert [p.tolist() for p in got.pieces] == [[3, 2], [1, 0]], kind


# --- pack / unpack ----------------------------------------------------------------------

SHAPES = [(s,) for s in SIZES] + [(0,), (3, 43)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_match_reference(dtype):
    tensors = [data(s, dtype, k) for k, s in enumerate(SHAPES)]
    buf = pack(tensors, threads=THREADS)
    assert_same(buf, pack_reference(tensors))
    assert buf.size == sum(t.size for t in tensors)
    outs = unpack(buf, [t.shape for t in tensors], threads=THREADS)
    for o, t in zip(outs, tensors):
        assert_same(o, t)
    # Into given buffers, at an offset inside a larger fusion buffer.
    big = np.full(buf.size + 10, 7, dtype)
    pack(tensors, out=big, threads=THREADS)
    assert_same(big[:buf.size], buf)
    assert (big[buf.size:] == 7).all()
    targets = [np.zeros(t.shape, dtype) for t in tensors]
    assert unpack(big, [t.shape for t in tensors], out=targets, threads=THREADS)[0] \
        is targets[0]
    for o, t in zip(targets, tensors):
        assert_same(o, t)


@pytest.mark.parametrize("dtype", (np.float16, np.float32, np.float64))
def test_pack_unpack_scale_match_reference(dtype):
    tensors = [data(s, dtype, 10 + k) for k, s in enumerate(SHAPES)]
    shapes = [t.shape for t in tensors]
    buf = pack(tensors, scale=0.25, threads=THREADS)
    assert_same(buf, pack_reference(tensors, scale=0.25))
    np.testing.assert_array_equal(buf, np.concatenate([t.ravel() for t in tensors])
                                  * dtype(0.25))
    back = unpack(buf, shapes, scale=4.0, threads=THREADS)
    want = unpack_reference(buf, shapes, scale=4.0)
    for b, w, t in zip(back, want, tensors):
        assert_same(b, w)
        assert_same(b, t)  # scaling by powers of two is exact


@pytest.mark.parametrize("scale", (None, 0.5))
def test_pack_unpack_many_small_and_empty_tensors_across_chunks(monkeypatch, scale):
    # 32-thread blocks of one pass (chunks of 128 elements): each thread walks
    # elements across tensors, empty ones included (first, middle, last), in its
    # unrolled passes and its tail, and chunks end inside tensors.
    from gpustrat.kernels import pack as pack_mod
    monkeypatch.setattr(pack_mod, "PASSES", 1)
    sizes = [0, 1, 31, 32, 33, 0, 0, 64, 65, 1, 2, 0, 95, 3, 0]
    tensors = [data((n,), np.float32, 50 + k) for k, n in enumerate(sizes)]
    buf = pack(tensors, scale=scale, threads=32)
    assert_same(buf, pack_reference(tensors, scale=scale))
    back = unpack(buf, [t.shape for t in tensors], scale=None if scale is None else 2.0,
                  threads=32)
    for b, t in zip(back, tensors):
        assert_same(b, t)


def resnet50_gradient_shapes():
    """The 161 parameter shapes of ResNet-50 (25,557,032 values): conv weights, batch
    norm scales and offsets, the classifier."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            for co, ci, k in ((width, cin, 1), (width, width, 3), (4 * width, width, 1)):
                shapes += [(co, ci, k, k), (co,), (co,)]
            if b == 0:
                shapes += [(4 * width, cin, 1, 1), (4 * width,), (4 * width,)]
            cin = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def test_pack_of_resnet50_gradients_launches_no_idle_block(monkeypatch):
    from gpustrat.kernels import pack as pack_mod
    launches = []

    class Recorder:
        def __getitem__(self, name):
            return Configured(name)

    class Configured:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, config):
            launches.append((self.name, config[0], config[1]))
            return lambda *args: None      # the sizes, not the copy, are checked here

    shapes = resnet50_gradient_shapes()
    total = sum(int(np.prod(s)) for s in shapes)
    assert (len(shapes), total) == (161, 25557032)
    # Never written: np.empty reserves the 100 MB without touching it.
    tensors = [np.empty(s, np.float32) for s in shapes]
    monkeypatch.setattr(pack_mod, "_kernels", Recorder())
    pack(tensors, threads=256)
    unpack(np.empty(total, np.float32), shapes, out=tensors, threads=256)
    # One block per chunk of the buffer (a 2-D grid sized by the largest tensor
    # launched 9,216 x 161 = 1,483,776 blocks here).
    chunk = 256 * pack_mod.UNROLL * pack_mod.PASSES
    blocks = -(-total // chunk)
    assert launches == [("_pack_copy", blocks, 256), ("_unpack_copy", blocks, 256)]
    # A small list gets one block, the only one with idle threads.
    launches.clear()
    small = [np.empty(n, np.float32) for n in (1, 300, 7, 2049)]
    pack(small, threads=128)
    assert launches == [("_pack_copy", 1, 128)]


def test_pack_errors():
    with pytest.raises(TypeError, match="one dtype"):
        pack([np.zeros(3, np.float32), np.zeros(3, np.float64)])
    with pytest.raises(TypeError, match="floating dtype"):
        pack([np.zeros(3, np.int32)], scale=0.5)
    with pytest.raises(ValueError, match="at least 6 elements"):
        pack([np.zeros(3, np.float32)] * 2, out=np.zeros(5, np.float32))


def test_unpack_shapes_in_any_integer_form_and_wrong_ones_named():
    tensors = [data((3,), np.float32, 1), data((5, 2), np.float32, 2)]
    buf = pack(tensors, threads=THREADS)
    for shapes in ([[3], [5, 2]], ((np.int64(3),), (np.int32(5), 2)),
                   (s for s in [(3,), (5, 2)])):
        outs = [np.zeros(t.shape, np.float32) for t in tensors]
        assert unpack(buf, shapes, out=outs, threads=THREADS) == outs
        for o, t in zip(outs, tensors):
            assert_same(o, t)
        back = unpack(buf, [[3], [5, 2]], threads=THREADS)
        assert [b.shape for b in back] == [(3,), (5, 2)]
    wrong = [np.zeros(3, np.float32), np.zeros((2, 5), np.float32)]
    with pytest.raises(ValueError, match=r"out has shapes \[\(3,\), \(2, 5\)\], "
                                         r"expected \[\(3,\), \(5, 2\)\]"):
        unpack(buf, [[3], [5, 2]], out=wrong)
    with pytest.raises(ValueError, match="at least 13 elements"):
        unpack(buf[:12], [(3,), (5, 2)], out=[np.zeros(3, np.float32),
                                              np.zeros((5, 2), np.float32)])
