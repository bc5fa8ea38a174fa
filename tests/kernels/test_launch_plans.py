"""The launch path of the kernels on a GPU, without one: the arguments laid out as
Numba's kernel ABI takes them, the plans kept per layout, and launches on the
stream-ordering sanitizer (the device and stream they use, what a hit skips)."""

from __future__ import annotations

import numpy as np
import pytest

from gpustrat import devices, testing
from gpustrat.kernels import _launch
from gpustrat.kernels import pack as pack_mod
from gpustrat.kernels import split as split_mod

Arg = _launch.Arg
F32, I64 = np.dtype(np.float32), np.dtype(np.int64)


def test_an_array_is_the_words_of_numbas_layout_and_a_scalar_its_value():
    sig = (Arg(F32, 2), Arg(I64), Arg(np.dtype(np.float16)), Arg(np.dtype(np.int32), 1))
    params = _launch.flatten(sig, [(0x1000, (3, 4)), 7, 0.5, (0x2000, (5,))])
    # meminfo, parent, nitems, itemsize, data, shape, C strides in bytes.
    assert [int(p) for p in params[:9]] == [0, 0, 12, 4, 0x1000, 3, 4, 16, 4]
    assert params[9] == 7 and params[9].dtype == I64
    assert params[10].dtype == np.float16 and params[10] == 0.5      # two bytes
    assert [int(p) for p in params[11:]] == [0, 0, 5, 4, 0x2000, 5, 4]
    assert all(p.dtype == I64 for p in params[:10] + params[11:])
    # Where each array's address sits (the word a launch replaces for a new buffer).
    assert [_launch.data_slot(sig, k) for k in (0, 3)] == [4, 15]
    assert params[_launch.data_slot(sig, 3)] == 0x2000
    with pytest.raises(ValueError, match="rank 2 got shape"):
        _launch.flatten(sig, [(0, (3,)), 7, 0.5, (0, (5,))])
    with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
        _launch.flatten(sig, [(0, (3, 4)), 7, 0.5])


def test_plans_keep_the_most_recently_used_layouts():
    plans = _launch.Plans(size=2)
    plans.put("a", 1)
    plans.put("b", 2)
    assert plans.get("a") == 1             # "a" is now the most recent
    plans.put("c", 3)
    assert (plans.get("a"), plans.get("b"), plans.get("c"), len(plans)) == (1, None, 3, 2)
    _launch.clear_table_cache()
    assert len(plans) == 0


def _hosts(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in ((3,), (4, 2), (1,), (130,))]


def test_a_launch_runs_on_the_tensors_device_and_its_current_stream():
    # The caller's current device is another one: the launch is made with the
    # tensors' device current (the sanitizer reports a kernel touching memory of
    # another device than the current one), queued on that device's current stream,
    # and the caller's device is current again afterwards.
    hosts = _hosts()
    with testing.sanitize(seed=1) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            tensors = [cp.asarray(h) for h in hosts]
            s1 = cp.cuda.Stream(non_blocking=True)
            s1.wait_event(cp.cuda.get_current_stream().record())
        with cp.cuda.Device(1), s1:
            with cp.cuda.Device(0):
                buf = pack_mod.pack(tensors)
                assert cp.cuda.runtime.getDevice() == 0
            plan = next(reversed(pack_mod._pack_plans._plans.values()))
            key = next(reversed(pack_mod._pack_plans._plans))
            assert plan.device == 1 and key[:2] == (1, s1.ptr)
            assert buf.device.id == 1
            got = buf.get()
    assert not san.reports
    np.testing.assert_array_equal(got, pack_mod.pack_reference(hosts))


def test_a_layout_on_another_stream_or_of_another_kind_gets_its_own_plan():
    hosts = _hosts(1)
    with testing.sanitize(seed=2) as san:
        cp = devices.cupy()
        with cp.cuda.Device(2):
            tensors = [cp.asarray(h) for h in hosts]
            other = cp.cuda.Stream(non_blocking=True)
            with san.measure() as first:
                pack_mod.pack(tensors)
            with san.measure() as again:
                pack_mod.pack(tensors)
            # The table is uploaded on the stream that reads it: another stream's
            # launch uploads its own (reading the first stream's would be a race).
            with san.measure() as elsewhere:
                pack_mod.pack(tensors, stream=other)
            with san.measure() as scaled:
                out = pack_mod.pack(tensors, scale=0.5)
            # The same addresses and sizes as another dtype: not the same layout.
            as_ints = [t.view(np.int32) for t in tensors]
            ints = pack_mod.pack(as_ints)
            got, got_ints = out.get(), ints.get()
    # A scaled pack is another plan (another kernel) with the same table: the table of
    # a content is uploaded once per stream, whatever plans use it.
    assert (first["copies"], again["copies"], elsewhere["copies"], scaled["copies"]) == \
        (1, 0, 1, 0)
    assert first["launches"] == again["launches"] == 1
    np.testing.assert_array_equal(got, pack_mod.pack_reference(hosts, scale=0.5))
    np.testing.assert_array_equal(got_ints, pack_mod.pack_reference(
        [h.view(np.int32) for h in hosts]))
    assert ints.dtype == np.int32


def test_a_strided_tensor_at_a_known_address_is_checked_not_taken_for_the_plan():
    with testing.sanitize(seed=3):
        cp = devices.cupy()
        x = cp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4))
        pack_mod.pack([x.reshape(12)[:6]])
        # A view with the same address and size but not C-contiguous is a miss, and
        # then the checks name it.
        strided = x[:, ::2]
        assert strided.data.ptr == x.data.ptr and strided.size == 6
        with pytest.raises(ValueError, match=r"tensor 0 \(shape \(3, 2\)\) is not C-contiguous"):
            pack_mod.pack([strided])


def test_tensors_moved_as_a_whole_share_their_table():
    # A step whose tensors start elsewhere with the same sizes and gaps (the pool
    # handed out other blocks of the same arena) is a new plan over the same table.
    with testing.sanitize(seed=5) as san:
        cp = devices.cupy()
        arena = cp.zeros(64, np.float32)
        first = [arena[0:3], arena[8:13]]
        moved = [arena[16:19], arena[24:29]]
        with san.measure() as a:
            pack_mod.pack(first)
        with san.measure() as b:
            buf = pack_mod.pack(moved)
        assert (a["copies"], b["copies"], b["launches"]) == (1, 0, 1)
        arena[...] = cp.asarray(np.arange(64, dtype=np.float32))
        got = pack_mod.pack(moved).get()
        del buf
    assert got.tolist() == [16, 17, 18, 24, 25, 26, 27, 28]


def test_a_gather_plan_is_kept_only_for_arrays_used_as_they_are():
    with testing.sanitize(seed=4) as san:
        cp = devices.cupy()
        batch = cp.asarray(np.arange(12, dtype=np.float32).reshape(6, 2))
        index = cp.asarray(np.array([5, 4, 3, 2, 1, 0]))
        split_mod._plans.clear()
        split_mod.split(batch, 2, index=index, check_index=False)
        assert len(split_mod._plans) == 1
        with san.measure() as c:
            res = split_mod.split(batch, 2, index=index, check_index=False)
        assert c["launches"] == 1 and c["allocations"] == 1     # the output only
        # A reversed view is copied first (the kernel reads a contiguous index): that
        # copy is new each call, so its plan is not kept.
        split_mod.split(batch, 2, index=cp.arange(6)[::-1], check_index=False)
        assert len(split_mod._plans) == 1
        got = [p.get() for p in res.pieces]
    assert [g.ravel().tolist() for g in got] == [[10, 11, 8, 9, 6, 7], [4, 5, 2, 3, 0, 1]]


def test_a_module_image_is_numbas_cubin_or_else_the_ptx():
    # What CuPy loads: the cubin Numba's linker makes (nvJitLink needs no device),
    # or, where it cannot link here, the PTX for the driver to compile.
    cuda = pytest.importorskip("numba.cuda")
    from numba.cuda.cudadrv import nvvm
    try:
        nvvm.NVVM()
    except Exception as e:
        pytest.skip(f"no libNVVM to compile with ({type(e).__name__})")
    ptx, entry = pack_mod.specialisations()[0].ptx((9, 0))
    data, kind = _launch.image(cuda, ptx, (9, 0))
    assert kind in ("cubin", "ptx")
    if kind == "cubin":
        assert data[:4] == b"\x7fELF"
    else:
        assert data == ptx and f".entry {entry}(" in ptx
    path = _launch._ptx_file(data, kind)
    assert path.endswith("." + kind)
    with open(path, "rb") as f:
        assert f.read() == (data.encode() if kind == "ptx" else data)
