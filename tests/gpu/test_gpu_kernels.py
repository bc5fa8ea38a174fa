"""The kernels on a real GPU against their NumPy references (CuPy arrays, CuPy streams).

Skipped without a GPU; a failure when GPUSTRAT_TEST_GPU=1."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_skip import require_numba_cuda  # noqa: E402

pytestmark = pytest.mark.gpu

SIZES = (1, 255, 256, 257, 1000, 100_003)
DTYPES = (np.float16, np.float32, np.float64, np.int32, np.int64)


@pytest.fixture(scope="module")
def cp():
    require_numba_cuda()
    from gpustrat.devices import cupy
    return cupy()


def data(shape, dtype, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 100).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_split_gather_pad_on_gpu(cp, n, dtype):
    from gpustrat.kernels.split import split, split_reference
    host = data((n, 3), dtype, n)
    index = np.random.default_rng(1).permutation(n).astype(np.int64)
    stream = cp.cuda.Stream(non_blocking=True)
    for kwargs in ({}, {"pad_to": -(-n // 3) + 2}):
        got = split(cp.asarray(host), 3, stream=stream, **kwargs)
        stream.synchronize()
        want = split_reference(host, 3, **kwargs)
        assert got.counts == want.counts
        for g, w in zip(got.pieces, want.pieces):
            assert isinstance(g, cp.ndarray)
            np.testing.assert_array_equal(g.get(), w)
        got = split(cp.asarray(host), 3, index=cp.asarray(index), **kwargs)
        want = split_reference(host, 3, index=index, **kwargs)
        for g, w in zip(got.pieces, want.pieces):
            np.testing.assert_array_equal(g.get(), w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_unpack_on_gpu(cp, dtype):
    from gpustrat.kernels.pack import pack, pack_reference, unpack
    shapes = [(s,) for s in SIZES] + [(0,), (3, 7)]
    host = [data(s, dtype, k) for k, s in enumerate(shapes)]
    dev = [cp.asarray(h) for h in host]
    scale = 0.5 if np.dtype(dtype).kind == "f" else None
    buf = pack(dev, scale=scale)
    np.testing.assert_array_equal(buf.get(), pack_reference(host, scale=scale))
    back = unpack(pack(dev), shapes)
    for b, h in zip(back, host):
        np.testing.assert_array_equal(b.get(), h)
    # The same layout again (its plan reused) with new values in the same tensors.
    for d, h in zip(dev, host):
        d[...] = cp.asarray(h * 2)
    again = unpack(pack(dev), shapes, out=back)
    for b, h in zip(again, host):
        np.testing.assert_array_equal(b.get(), h * 2)


def test_scatter_to_every_gpu(cp):
    from gpustrat.devices import Device, gpu_count
    from gpustrat.kernels.split import scatter
    n = gpu_count()
    batch = cp.arange(10 * 4, dtype=cp.float32).reshape(10, 4)
    res = scatter(batch, [Device("gpu", i) for i in range(n)])
    rows = np.concatenate([p.get() for p in res.pieces])
    np.testing.assert_array_equal(rows, batch.get())
    for i, p in enumerate(res.pieces):
        assert p.device.id == i
