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

@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_shared_results_are_one_read_only_reduction(op):
    comm = HostCommunicator([Device("cpu", 0), Device("cpu", 1), Device("cpu", 2)])
    rng = np.random.default_rng(1)
    tensors = [[rng.integers(-9, 9, s).astype(np.float32) for _ in range(3)]
               for s in [(4,), (2, 3), ()]]
    want = fused_all_reduce_flat(comm, tensors, op)
    (indices, own), = want
    (indices2, shared), = fused_all_reduce_flat(comm, tensors, op, shared=True)
    assert indices2 == indices
    assert shared[0] is shared[1] is shared[2]
    assert not shared[0].flags.writeable
    np.testing.assert_array_equal(shared[0], own[0])
    assert own[0] is not own[1]            # without shared: one buffer per replica
    with pytest.raises(ValueError, match="read-only"):
        shared[0] += 1


def test_shared_results_of_one_replica_are_its_own():
    comm = HostCommunicator([Device("cpu", 0)])
    tensors = [[np.arange(3, dtype=np.float32)], [np.ones((2, 2), np.float32)]]
    (_, (buf,)), = fused_all_reduce_flat(comm, tensors, "sum", shared=True)
    np.testing.assert_array_equal(buf, [0, 1, 2, 1, 1, 1, 1])


def test_fused_all_reduce_arrays_takes_one_replicas_flat_list():
    from gpustrat.collectives.fusion import fused_all_reduce_arrays, fused_all_reduce_single
    comm = HostCommunicator([Device("cpu", 0)])
    rng = np.random.default_rng(2)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in [(3,), (3,), (2, 2), ()]]
    arrays.append(np.arange(4, dtype=np.int64))
    layout = layout_of([a.shape for a in arrays], [a.dtype for a in arrays], 24)
    got = fused_all_reduce_arrays(comm, arrays, "sum", layout)
    want = fused_all_reduce_single(comm, [[a] for a in arrays], "sum", 24)
    assert [g.shape for g in got] == [a.shape for a in arrays]
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
        assert g.dtype == w.dtype
    two = HostCommunicator([Device("cpu", 0), Device("cpu", 1)])
    with pytest.raises(ValueError, match="one local replica"):
        fused_all_reduce_arrays(two, arrays, "sum", layout)
