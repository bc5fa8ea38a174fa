"""SPEC's splitting rule (``split_sizes``) and the NumPy split reference: properties
and the observed TensorFlow outputs. No Numba needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpustrat.kernels import _launch
from gpustrat.kernels.pack import layout, pack_reference, unpack_reference
from gpustrat.kernels.split import split_reference, split_sizes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))  # for mpi_util
from mpi_util import repo_env  # noqa: E402


@given(n=st.integers(0, 10_000), replicas=st.integers(1, 300))
@settings(max_examples=400, deadline=None)
def test_split_sizes_delivers_every_row_once_in_order(n, replicas):
    sizes = split_sizes(n, replicas)
    chunk = -(-n // replicas)
    assert len(sizes) == replicas
    assert sum(sizes) == n
    assert all(0 <= s <= chunk for s in sizes)
    # In order: the pieces are consecutive ranges, full ones first, then at most one
    # shorter piece, then empty ones.
    nonempty = [s for s in sizes if s]
    assert sizes[:len(nonempty)] == nonempty
    assert all(s == chunk for s in nonempty[:-1])
    starts = np.cumsum([0] + sizes[:-1])
    rows = np.concatenate([np.arange(a, a + s) for a, s in zip(starts, sizes)] or [[]])
    np.testing.assert_array_equal(rows, np.arange(n))


@pytest.mark.parametrize("n,replicas,want", [
    (4, 2, [2, 2]), (2, 2, [1, 1]),          # range(6).batch(4), N=2
    (4, 5, [1, 1, 1, 1, 0]),                 # range(4).batch(4), N=5
    (4, 3, [2, 2, 0]),                       # range(8).batch(4), N=3
    (1, 2, [1, 0]),                          # range(9).batch(4), N=2, last step
    (6, 4, [2, 2, 2, 0]), (4, 4, [1, 1, 1, 1]),  # range(10).batch(6), N=4
    (7, 3, [3, 3, 1]), (6, 3, [2, 2, 2]),    # range(13).batch(7), N=3
    (5, 2, [3, 2]),                          # range(17).batch(5, drop_remainder), N=2
    (0, 3, [0, 0, 0]),
])
def test_split_sizes_matches_spec_table(n, replicas, want):
    assert split_sizes(n, replicas) == want


def test_split_sizes_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_replicas must be at least 1, got 0"):
        split_sizes(4, 0)
    with pytest.raises(ValueError, match="negative number of rows"):
        split_sizes(-1, 2)


@given(n=st.integers(0, 60), replicas=st.integers(1, 9), extra=st.integers(0, 3),
       gather=st.booleans(), width=st.integers(0, 3), seed=st.integers(0, 2**16))
@settings(max_examples=200, deadline=None)
def test_split_reference_pieces(n, replicas, extra, gather, width, seed):
    rng = np.random.default_rng(seed)
    src = rng.integers(-100, 100, size=(n + 4, width)).astype(np.float32)
    index = rng.permutation(n + 4)[:n] if gather else None
    rows = src[index] if gather else src
    pad = -(-n // replicas) + extra
    plain = split_reference(src if gather else src[:n], replicas, index=index)
    fixed = split_reference(src if gather else src[:n], replicas, index=index, pad_to=pad)
    assert plain.counts == fixed.counts == split_sizes(n, replicas)
    np.testing.assert_array_equal(np.concatenate(plain.pieces), rows[:n])
    for p, f, c in zip(plain.pieces, fixed.pieces, plain.counts):
        assert p.shape == (c, width) and f.shape == (pad, width)
        np.testing.assert_array_equal(f[:c], p)
        assert not f[c:].any()


def test_split_reference_errors():
    with pytest.raises(ValueError, match="pad_to=1 .* need 2 rows"):
        split_reference(np.arange(4), 2, pad_to=1)
    with pytest.raises(IndexError, match="rows -1 .. 2"):
        split_reference(np.arange(4), 2, index=np.array([-1, 2]))
    with pytest.raises(ValueError, match="leading batch axis"):
        split_reference(np.float32(3), 2)


def test_split_sizes_imports_without_numba():
    code = ("import sys; sys.modules['numba'] = None\n"
            "from gpustrat.kernels.split import split_sizes, split_reference\n"
            "import gpustrat.kernels.pack\n"
            "assert split_sizes(10, 4) == [3, 3, 3, 1]\n"
            "assert 'numba.cuda' not in sys.modules\n"
            "print('OK')\n")
    env = repo_env()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stderr


# --- launch helpers and the other references --------------------------------------------

@pytest.mark.parametrize("rows,cols,threads,want", [
    (1, 1, 256, ((1, 1), (1, 256))),
    (300, 1, 128, ((1, 3), (1, 128))),         # scalar labels: rows fill the block
    (3, 1000, 256, ((4, 3), (256, 1))),        # long rows: a full block along x
    (10, 3, 256, ((1, 1), (4, 64))),
    (10**7, 7, 256, ((1, 65535), (8, 32))),    # grid y capped; the loop covers the rest
])
def test_launch_config_2d(rows, cols, threads, want):
    got = _launch.launch_config_2d(rows, cols, threads)
    assert got == want
    (gx, gy), (bx, by) = got
    assert bx * by <= threads and gy <= _launch.MAX_GRID_Y


def test_word_dtype():
    assert _launch.word_dtype(24, 0) == np.dtype("u8")
    assert _launch.word_dtype(24, 4) == np.dtype("u4")    # address only 4-aligned
    assert _launch.word_dtype(6, 0) == np.dtype("u2")
    assert _launch.word_dtype(3, 0) == np.dtype("u1")


def test_env_threads(monkeypatch):
    monkeypatch.setenv("GPUSTRAT_KERNEL_THREADS", "512")
    assert _launch.env_threads() == 512
    monkeypatch.setenv("GPUSTRAT_KERNEL_THREADS", "many")
    with pytest.raises(ValueError, match="not an integer"):
        _launch.env_threads()


def test_pack_references():
    ts = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(0, np.float32),
          np.full(4, 2, np.float32)]
    sizes, starts, total = layout([t.shape for t in ts])
    assert sizes.tolist() == [6, 0, 4] and starts.tolist() == [0, 6, 6] and total == 10
    buf = pack_reference(ts, scale=0.5)
    np.testing.assert_array_equal(buf, [0, .5, 1, 1.5, 2, 2.5, 1, 1, 1, 1])
    back = unpack_reference(buf, [t.shape for t in ts], scale=2.0)
    for b, t in zip(back, ts):
        assert b.shape == t.shape
        np.testing.assert_array_equal(b, t)
