"""Fusion layouts (gpustrat.collectives.fusion.check_layout / layout_of): planned once
per list of shapes and dtypes, reused by later calls, never reused for another list."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpustrat.collectives.fusion import (FusionLayout, check_layout, fused_all_reduce,
                                         fused_all_reduce_flat, fused_all_reduce_single,
                                         layout_of)
from gpustrat.collectives.host import HostCommunicator
from gpustrat.devices import Device
from gpustrat.reduce_util import ReduceOp


def comm_of(n):
    return HostCommunicator([Device("cpu", i) for i in range(n)])


def tensors_of(shapes, dtypes, n_replicas, seed):
    rng = np.random.default_rng(seed)
    return [[rng.integers(-9, 9, shape).astype(dt) for _ in range(n_replicas)]
            for shape, dt in zip(shapes, dtypes)]


def separate(comm, tensors, op):
    return [HostCommunicator(comm.devices).all_reduce(row, op) for row in tensors]


SHAPE = st.sampled_from([(), (1,), (3,), (2, 3), (0,), (4, 1), (5,)])
DTYPE = st.sampled_from([np.float32, np.float64, np.int32])
LAYOUT = st.lists(st.tuples(SHAPE, DTYPE), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(calls=st.lists(st.tuples(LAYOUT, st.sampled_from([8, 24, 1 << 20]),
                                st.sampled_from([1, 2]), st.sampled_from(list(ReduceOp))),
                      min_size=2, max_size=6),
       seed=st.integers(0, 2**16))
def test_every_call_gets_its_own_layout_whatever_came_before(calls, seed):
    # Consecutive calls with other shapes, the same shapes in another order, or another
    # bucket size: a remembered layout must never be taken for the wrong list.
    for k, (layout, bucket_bytes, n, op) in enumerate(calls):
        shapes = [s for s, _ in layout]
        dtypes = [d for _, d in layout]
        comm = comm_of(n)
        tensors = tensors_of(shapes, dtypes, n, seed + k)
        want = separate(comm, tensors, op)
        got = fused_all_reduce(comm, tensors, op, bucket_bytes=bucket_bytes)
        for g_row, w_row in zip(got, want):
            for g, w in zip(g_row, w_row):
                assert g.shape == w.shape and g.dtype == w.dtype
                np.testing.assert_array_equal(g, w)
        checked, lay = check_layout(comm, tensors, bucket_bytes)
        assert list(lay.shapes) == shapes and list(lay.dtypes) == [np.dtype(d) for d in dtypes]
        again = fused_all_reduce(comm, checked, op, layout=lay)
        for g_row, w_row in zip(again, want):
            for g, w in zip(g_row, w_row):
                np.testing.assert_array_equal(g, w)
        if n == 1:
            single = fused_all_reduce_single(comm, tensors, op, bucket_bytes=bucket_bytes)
            assert len(single) == len(tensors)
            for g, w_row in zip(single, want):
                assert g.shape == w_row[0].shape and g.dtype == w_row[0].dtype
                np.testing.assert_array_equal(g, w_row[0])


def test_equal_layouts_give_one_plan_and_others_another():
    comm = comm_of(2)
    a = tensors_of([(3,), (2, 2)], [np.float32, np.float32], 2, 0)
    b = tensors_of([(3,), (2, 2)], [np.float32, np.float32], 2, 1)
    c = tensors_of([(2, 2), (3,)], [np.float32, np.float32], 2, 2)
    _, la = check_layout(comm, a, 1 << 20)
    _, lc = check_layout(comm, c, 1 << 20)
    _, lb = check_layout(comm, b, 1 << 20)
    assert isinstance(la, FusionLayout)
    assert la is lb and la is not lc
    assert check_layout(comm, a, 8)[1] is not la          # another bucket size
    assert layout_of(((3,), (2, 2)), (np.dtype(np.float32),) * 2, 1 << 20) is la
    # Shapes that only differ in their split (same total size) are another layout.
    assert layout_of([(4,), (3,)], [np.dtype(np.float32)] * 2, 1 << 20) is not la


def test_flat_buckets_follow_the_layout_passed_in():
    comm = comm_of(2)
    tensors = tensors_of([(3,), (5,), (2,)], [np.float32] * 3, 2, 3)
    checked, lay = check_layout(comm, tensors, 16)  # 12 + 20 + 8 bytes: [0], [1], [2]
    buckets = fused_all_reduce_flat(comm, checked, "sum", layout=lay)
    assert [b for b, _ in buckets] == [[0], [1], [2]]
    for (b, bufs), row in zip(buckets, tensors):
        np.testing.assert_array_equal(bufs[1], row[0] + row[1])


def test_check_layout_raises_as_the_fusion_does():
    comm = comm_of(2)
    with pytest.raises(ValueError, match="tensor 1 has 1 replica values but the "
                                         "communicator has 2"):
        check_layout(comm, [[np.zeros(2)] * 2, [np.zeros(2)]])
    with pytest.raises(ValueError, match=r"tensor 0: replica 0 has shape \(2,\) .* "
                                         r"replica 1 has shape \(3,\)"):
        check_layout(comm, [[np.zeros(2), np.zeros(3)]])
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        check_layout(comm, [[np.zeros(2)] * 2], 0)


def test_single_refuses_several_local_replicas():
    with pytest.raises(ValueError, match="needs one local replica, but the communicator "
                                         "has 2: use fused_all_reduce"):
        fused_all_reduce_single(comm_of(2), [[np.zeros(2)] * 2], "sum")
