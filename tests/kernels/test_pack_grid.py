"""The pack and unpack kernels' index arithmetic, without Numba: which tensor holds
each buffer element (the binary search the kernels run per element), and the grid."""

from __future__ import annotations

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


@given(total=st.integers(0, 1 << 26), threads=st.sampled_from([32, 128, 256, 1024]))
def test_the_grid_is_one_thread_per_element_up_to_the_cap(total, threads):
    grid, block = pack.launch_config(total, threads)
    assert block == threads
    assert grid == min(max(-(-total // threads), 1), _launch.MAX_USEFUL_GRID_X)
    # No block without work (below the cap), and every element has a thread or a
    # grid-stride turn.
    assert (grid - 1) * threads < max(total, 1)
