"""The pack and unpack kernels' index arithmetic, without Numba: which tensor holds
each buffer element (a thread's binary search, then its walk forward), and the grid."""

from __future__ import annotations

import importlib.util

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from gpustrat.kernels import _launch, pack

# The plain Python function, whether or not a launch has compiled it for the device.
tensor_at = getattr(pack._tensor_at, "py_func", pack._tensor_at)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
       stride=st.integers(1, 97), first=st.integers(0, 96))
def test_every_element_maps_to_the_tensor_holding_it(sizes, stride, first):
    sizes_a, starts, total = pack.layout([(n,) for n in sizes])
    table = np.stack([np.zeros_like(starts), sizes_a, starts])
    k = 0
    # One thread's grid-stride walk: its previous tensor is the lower bound.
    for g in range(first, total, stride):
        k = tensor_at(table, g, k)
        assert starts[k] <= g < starts[k] + sizes_a[k], (g, k, sizes)
    # Every element from a cold start too.
    for g in range(total):
        k = tensor_at(table, g, 0)
        assert starts[k] <= g < starts[k] + sizes_a[k]


def _plain_pack_module():
    """A fresh copy of the pack module, its device functions plain Python (a launch in
    this process rebinds the module's own names to compiled device functions, which
    Python cannot call)."""
    spec = importlib.util.spec_from_file_location("gpustrat.kernels._pack_plain",
                                                  pack.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAIN = _plain_pack_module()


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), min_size=1, max_size=30),
       threads=st.sampled_from([1, 2, 3, 8, 32]), passes=st.integers(1, 3))
def test_every_thread_walks_its_chunk_onto_the_right_tensors(sizes, threads, passes):
    # Every block and thread of a launch, as the kernels walk: each element of the
    # buffer is visited exactly once, and mapped into the tensor holding it.
    sizes_a, starts, total = pack.layout([(n,) for n in sizes])
    if total == 0:
        return
    offsets = np.cumsum(np.r_[0, sizes_a[:-1] + 3])        # gaps between allocations
    table = np.stack([offsets, sizes_a, starts])
    chunk = threads * pack.UNROLL * passes
    grid = -(-total // chunk)
    seen = np.zeros(total, np.int64)
    for b in range(grid):
        for t in range(threads):
            g, end, tot, k, nxt, shift = PLAIN._chunk_start(table, chunk, b, t)
            assert tot == total and end == min((b + 1) * chunk, total)
            while g < end:
                k, nxt, shift = PLAIN._walk(table, g, k, nxt, shift, total)
                assert starts[k] <= g < starts[k] + sizes_a[k], (g, k, sizes)
                assert shift + g == offsets[k] + g - starts[k]
                seen[g] += 1
                g += threads
    assert (seen == 1).all()


@given(total=st.integers(0, 1 << 40), threads=st.sampled_from([32, 128, 256, 1024]))
def test_the_grid_has_one_block_per_chunk(total, threads):
    grid, block, chunk = pack.launch_config(total, threads)
    assert block == threads and chunk == threads * pack.UNROLL * pack.PASSES
    assert grid == max(-(-total // chunk), 1)
    # No block without work, and every element in some block's chunk.
    assert (grid - 1) * chunk < max(total, 1) <= grid * chunk
