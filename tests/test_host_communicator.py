"""The host communicator against NumPy: every collective, the in-place form, errors."""

import re

import numpy as np
import pytest

from gpustrat.collectives.host import HostCommunicator
from gpustrat.devices import Device
from gpustrat.reduce_util import ReduceOp


def comm(n):
    return HostCommunicator([Device("cpu", i) for i in range(n)])


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("op,ref", [("sum", np.sum), ("mean", np.mean), ("max", np.max),
                                    ("min", np.min)])
@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_all_reduce_and_in_place_form_agree_with_numpy(n, op, ref, dtype):
    rng = np.random.default_rng(n)
    bufs = [rng.integers(-9, 9, (4, 3)).astype(dtype) for _ in range(n)]
    expected = ref(np.stack(bufs), axis=0)
    kept = [b.copy() for b in bufs]
    out = comm(n).all_reduce(bufs, op)
    for b, k in zip(bufs, kept):  # all_reduce leaves its inputs alone
        np.testing.assert_array_equal(b, k)
    in_place = comm(n).all_reduce_inplace([b.copy() for b in bufs], op)
    assert len(out) == len(in_place) == n
    for a, b in zip(out, in_place):
        np.testing.assert_allclose(a, expected)
        np.testing.assert_allclose(b, expected)
        assert a.dtype == b.dtype
    # Every replica gets its own array.
    assert len({id(a) for a in out}) == n and len({id(b) for b in in_place}) == n


def test_in_place_reuses_the_buffers():
    bufs = [np.ones(5), np.full(5, 2.0)]
    out = comm(2).all_reduce_inplace(bufs, ReduceOp.SUM)
    assert out[0] is bufs[0] and out[1] is bufs[1]
    np.testing.assert_array_equal(bufs[1], np.full(5, 3.0))


def test_in_place_falls_back_for_read_only_input():
    ro = np.ones(3)
    ro.flags.writeable = False
    out = comm(2).all_reduce_inplace([ro, np.ones(3)], "sum")
    np.testing.assert_array_equal(out[0], [2, 2, 2])
    np.testing.assert_array_equal(ro, [1, 1, 1])


def test_layout_mismatch_names_replicas():
    with pytest.raises(ValueError, match=r"replica 0 has shape \(3,\).*replica 1 has shape \(4,\)"):
        comm(2).all_reduce([np.ones(3), np.ones(4)], "sum")
    with pytest.raises(ValueError, match="replica 1 has shape"):
        comm(2).all_reduce_inplace([np.ones(3), np.ones(4)], "sum")


def test_gather_broadcast_reduce_scatter():
    c = comm(3)
    gathered = c.all_gather([np.full((i + 1, 2), i) for i in range(3)], axis=0)
    for g in gathered:
        np.testing.assert_array_equal(g, np.concatenate([np.full((i + 1, 2), i) for i in range(3)]))
    out = c.broadcast([np.zeros(2), np.array([7.0, 8.0]), np.zeros(2)], root=1)
    assert len(out) == 3 and all((o == [7.0, 8.0]).all() for o in out)
    with pytest.raises(ValueError, match="root 3 is not a replica id"):
        c.broadcast([np.zeros(2)] * 3, root=3)
    parts = c.reduce_scatter([np.arange(6.0)] * 3, "sum")
    for i, p in enumerate(parts):
        np.testing.assert_array_equal(p, 3 * np.arange(6.0)[2 * i:2 * i + 2])
    with pytest.raises(ValueError, match="divisible by 3"):
        c.reduce_scatter([np.arange(4.0)] * 3, "sum")


class TwoWorkers:
    """A worker group of this worker (rank 0) and a simulated rank 1 holding ``other``'s
    layout: what the NCCL communicator's layout check sees over its control group."""

    size, rank = 2, 0

    def __init__(self, other):
        self.other = other
        self.calls = []

    def allreduce_ints(self, values, op):
        from gpustrat.collectives.base import layout_code
        self.calls.append(("allreduce_ints", op))
        code = layout_code(*self.other)
        return np.maximum(np.asarray(values), np.array([code, -code]))

    def allgather(self, obj):
        self.calls.append(("allgather",))
        from gpustrat.collectives.base import layout
        return [obj, layout(*self.other)]


def test_layout_agreement_over_a_worker_group():
    from gpustrat.collectives.base import LocalWorkerGroup, agree_layout_over
    same = TwoWorkers(((4, "*"), np.float32))
    agree_layout_over(same, (4, "*"), np.float32, "reduce(SUM, axis=1)")
    assert same.calls == [("allreduce_ints", ReduceOp.MAX)]   # one collective when equal
    for other, shown in [(((2, 3), np.float32), "(2, 3) float32"),
                         (((4, 3), np.float64), "(4, 3) float64"),
                         (((4,), np.float32), "(4,) float32")]:
        group = TwoWorkers(other)
        with pytest.raises(ValueError, match=(
                r"reduce\(SUM, axis=None\): every worker must contribute the same shape "
                rf"and dtype, but the workers hold rank 0: \(4, 3\) float32; rank 1: "
                rf"{re.escape(shown)}\. Pass axis=0")):
            agree_layout_over(group, (4, 3), np.float32, "reduce(SUM, axis=None)",
                              "Pass axis=0")
        assert group.calls == [("allreduce_ints", ReduceOp.MAX), ("allgather",)]
    # One process: nothing to agree on, no collective; duplicate() is the group itself.
    local = LocalWorkerGroup()
    agree_layout_over(local, (1,), np.int8, "x")
    assert local.duplicate() is local
    comm(2).agree_layout((3,), np.float32, "x")     # the host communicator: a no-op


def test_a_second_agreement_joins_the_key_of_a_backend_without_headers():
    # Backends that agree by a collective of their own (NCCL between workers) check the
    # second agreement's words with the key, in that one collective.
    class Recording(HostCommunicator):
        def agree(self, key, what, hint=""):
            self.agreed = (key, what, hint)

    c = Recording([Device("cpu", 0)])
    said = lambda: (("lr=0.1", "iterations=4"), "opt", "use one rate")   # noqa: E731
    with c.agreeing(("a:3:float32",), "fused(SUM)", "same values", also=(5, said)):
        pass
    assert c.agreed == (("a:3:float32", "opt: lr=0.1", "opt: iterations=4"), "fused(SUM)",
                        "same values; use one rate")
    with c.agreeing(("a:3:float32",), "fused(SUM)", "same values"):
        pass
    assert c.agreed == (("a:3:float32",), "fused(SUM)", "same values")
