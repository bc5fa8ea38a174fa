"""fused_all_reduce_flat: the same reductions as fused_all_reduce, given as each
bucket's flat buffers (what an optimizer updates its variables from)."""

from __future__ import annotations

import numpy as np
import pytest

from gpustrat.collectives.fusion import fused_all_reduce, fused_all_reduce_flat, layout_of
from gpustrat.collectives.host import HostCommunicator
from gpustrat.devices import Device


@pytest.mark.parametrize("bucket_bytes", [None, 64, 10 ** 9])
@pytest.mark.parametrize("known", [False, True])
def test_flat_buckets_hold_the_fused_results_back_to_back(bucket_bytes, known):
    comm = HostCommunicator([Device("cpu", 0), Device("cpu", 1)])
    rng = np.random.default_rng(0)
    shapes = [(3,), (2, 5), (), (7,), (4, 1)]
    tensors = [[rng.integers(-9, 9, s).astype(np.float32) for _ in range(2)]
               for s in shapes]
    tensors.append([np.arange(3, dtype=np.int64), np.ones(3, np.int64)])  # another dtype
    want = fused_all_reduce(comm, tensors, "sum", bucket_bytes)
    layout = layout_of([t[0].shape for t in tensors], [t[0].dtype for t in tensors],
                       bucket_bytes) if known else None
    for _ in range(2):  # the second call reuses the layout's bucket plan
        buckets = fused_all_reduce_flat(comm, tensors, "sum", bucket_bytes, layout=layout)
    seen = [j for indices, _ in buckets for j in indices]
    assert sorted(seen) == list(range(len(tensors)))
    if bucket_bytes == 64:
        assert len(buckets) > 2          # several buckets of one dtype
    for indices, buffers in buckets:
        assert len(buffers) == 2
        for i, buf in enumerate(buffers):
            assert buf.ndim == 1
            np.testing.assert_array_equal(
                buf, np.concatenate([want[j][i].reshape(-1) for j in indices]))


def test_a_known_layout_is_planned_once_per_bucket_size():
    shapes, dtypes = [(3,), (2, 5), (7,)], [np.dtype(np.float32)] * 3
    small = layout_of(shapes, dtypes, 40)           # 12, 40 and 28 bytes
    assert [list(b[0]) for b in small.buckets] == [[0], [1], [2]]
    assert layout_of(list(shapes), list(dtypes), 40) is small
    assert [list(b[0]) for b in layout_of(shapes, dtypes, 10 ** 6).buckets] == [[0, 1, 2]]