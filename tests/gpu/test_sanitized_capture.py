"""The sanitizer's model of CUDA stream capture: ops recorded, not run; replays on the
same addresses; what CUDA forbids during a capture raises as CUDA does."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gpustrat import devices, testing
from gpustrat.testing.sanitizer import CUDARuntimeError


def _captured(cp, stream, pool, body):
    """Capture ``body()`` on ``stream`` with ``pool`` as the allocator; the graph."""
    with stream, cp.cuda.using_allocator(pool.malloc):
        stream.begin_capture()
        try:
            body()
        finally:
            graph = stream.end_capture()
    return graph


def _setup(cp):
    s = cp.cuda.Stream(non_blocking=True)
    pool = cp.cuda.MemoryPool()
    x = cp.asarray(np.arange(4.0))
    s.wait_event(cp.cuda.get_current_stream().record())
    return s, pool, x


def test_captured_ops_are_recorded_not_run_and_each_replay_runs_them_again_in_order():
    with testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            s, pool, x = _setup(cp)
            out = {}

            def body():
                y = x * 2          # a temporary from the private pool
                x[...] = x + y     # x = 3x, in place: the same address each replay
                out["z"] = x + 1
            with san.measure() as c:
                g = _captured(cp, s, pool, body)
            assert c["launches"] == 4 and c["host_syncs"] == 0
            assert not s.is_capturing()
            np.testing.assert_array_equal(x.get(stream=s), [0, 1, 2, 3])   # nothing ran
            for k in range(1, 3):
                g.launch(s)
                np.testing.assert_array_equal(x.get(stream=s), np.arange(4.0) * 3 ** k)
                np.testing.assert_array_equal(out["z"].get(stream=s),
                                              np.arange(4.0) * 3 ** k + 1)
            assert pool.used_bytes() > 0
    assert not san.reports


@pytest.mark.parametrize("what", ["synchronize", "get", "item", "device", "event_query",
                                  "event_synchronize"])
def test_a_host_wait_in_a_capture_raises_as_cuda_and_invalidates_the_capture(what):
    with testing.sanitize(seed=0, check=False):
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s, pool, x = _setup(cp)
            with s, cp.cuda.using_allocator(pool.malloc):
                s.begin_capture()
                y = x * 2
                with pytest.raises(CUDARuntimeError,
                                   match="cudaErrorStreamCaptureUnsupported") as e:
                    if what == "synchronize":
                        s.synchronize()
                    elif what == "get":
                        y.get()
                    elif what == "item":
                        y[0].item()
                    elif what == "device":
                        cp.cuda.Device(0).synchronize()
                    elif what == "event_query":
                        _ = s.record().done
                    else:
                        s.record().synchronize()
                assert "test_sanitized_capture.py" in str(e.value)   # the line that did it
                with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureInvalidated"):
                    s.end_capture()
            assert not s.is_capturing()


def test_an_allocation_from_the_default_pool_in_a_capture_raises():
    with testing.sanitize(seed=0, check=False):
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s, pool, x = _setup(cp)
            with s:
                s.begin_capture()
                with pytest.raises(CUDARuntimeError, match="default memory pool"):
                    x * 2
                with pytest.raises(CUDARuntimeError, match="Invalidated"):
                    s.end_capture()


def test_legacy_default_stream_work_while_a_blocking_stream_captures_raises_implicit():
    with testing.sanitize(seed=0, check=False):
        cp = devices.cupy()
        with cp.cuda.Device(0):
            x = cp.asarray(np.arange(4.0))
            blocking = cp.cuda.Stream()                     # synchronizes with the legacy one
            blocking.wait_event(cp.cuda.get_current_stream().record())
            pool = cp.cuda.MemoryPool()
            with cp.cuda.using_allocator(pool.malloc):
                with blocking:
                    blocking.begin_capture()
                    x * 2
                with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureImplicit"):
                    x * 3                                   # on the legacy default stream
                with pytest.raises(CUDARuntimeError, match="Invalidated"):
                    blocking.end_capture()
            with pytest.raises(CUDARuntimeError, match="legacy default stream"):
                cp.cuda.get_current_stream().begin_capture()


def test_global_mode_forbids_another_threads_event_query_and_relaxed_mode_allows_it():
    rt = None
    for mode, forbidden in (("streamCaptureModeGlobal", True),
                            ("streamCaptureModeRelaxed", False)):
        with testing.sanitize(seed=0, check=False):
            cp = devices.cupy()
            rt = cp.cuda.runtime
            with cp.cuda.Device(0):
                other = cp.cuda.Stream(non_blocking=True)
                ev = other.record()
                s, pool, x = _setup(cp)
                s.begin_capture(getattr(rt, mode))
                errors = []

                def query():
                    try:
                        _ = ev.done
                    except CUDARuntimeError as e:
                        errors.append(e)
                t = threading.Thread(target=query)
                t.start()
                t.join()
                assert bool(errors) == forbidden, errors
                if forbidden:
                    with pytest.raises(CUDARuntimeError, match="Invalidated"):
                        s.end_capture()
                else:
                    s.end_capture()


def test_waits_across_captures_and_unjoined_forks_raise():
    with testing.sanitize(seed=0, check=False):
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s, pool, x = _setup(cp)
            side = cp.cuda.Stream(non_blocking=True)
            outside = side.record()                          # before the capture
            with cp.cuda.using_allocator(pool.malloc):
                s.begin_capture()
                with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureIsolation"):
                    s.wait_event(outside)
                with pytest.raises(CUDARuntimeError, match="Invalidated"):
                    s.end_capture()
                # A fork that is not joined back.
                s.begin_capture()
                side.wait_event(s.record())                  # side joins the capture
                with side:
                    x * 2
                with pytest.raises(CUDARuntimeError, match="cudaErrorStreamCaptureUnjoined"):
                    s.end_capture()
                # Joined back: the fork's work is in the graph.
                s.begin_capture()
                side.wait_event(s.record())
                with side:
                    x[...] = x * 2
                s.wait_event(side.record())
                g = s.end_capture()
            g.launch(s)
            np.testing.assert_array_equal(x.get(stream=s), np.arange(4.0) * 2)


def test_nccl_calls_captured_on_each_device_meet_again_at_each_replay():
    with testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        nccl = devices.nccl_library()
        comms = nccl.NcclCommunicator.initAll([0, 1])
        streams, bufs, graphs, pools = [], [], [], []
        for d in (0, 1):
            with cp.cuda.Device(d):
                s = cp.cuda.Stream(non_blocking=True)
                b = cp.asarray(np.full(3, d + 1.0, np.float32))
                s.wait_event(cp.cuda.get_current_stream().record())
                streams.append(s)
                bufs.append(b)
                pools.append(cp.cuda.MemoryPool())
        for d in (0, 1):
            with cp.cuda.Device(d), cp.cuda.using_allocator(pools[d].malloc):
                streams[d].begin_capture()
                comms[d].allReduce(bufs[d].data.ptr, bufs[d].data.ptr, 3, nccl.NCCL_FLOAT32,
                                   nccl.NCCL_SUM, streams[d].ptr)
        for d in (0, 1):
            with cp.cuda.Device(d):
                graphs.append(streams[d].end_capture())
        for k in range(1, 3):
            for d in (0, 1):
                with cp.cuda.Device(d):
                    graphs[d].launch(streams[d])
            for d in (0, 1):
                with cp.cuda.Device(d):
                    np.testing.assert_array_equal(bufs[d].get(stream=streams[d]),
                                                  [3.0 * 2 ** (k - 1)] * 3)
    assert not san.reports


def test_rewriting_a_graphs_input_while_a_replay_may_read_it_is_reported():
    with testing.sanitize(seed=0, run_probability=0, check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s, pool, x = _setup(cp)
            staging = cp.cupyx.empty_pinned((4,), np.float64)
            out = {}
            g = _captured(cp, s, pool, lambda: out.setdefault("y", x * 2))
            g.launch(s)
            staging[...] = 7.0
            x.set(staging)                  # the host's next input, on the legacy stream
            assert [r.kind for r in san.reports] == ["replay"], san.reports
            assert "rewrote" in san.reports[0].message
            san.reports.clear()
            # Ordered after the replay (the copy on the launch stream): nothing to report.
            s.wait_event(cp.cuda.get_current_stream().record())
            g.launch(s)
            again = cp.cupyx.empty_pinned((4,), np.float64)
            again[...] = 8.0
            x.set(again, stream=s)
            assert not san.reports


def test_an_upload_staged_through_pinned_buffers_in_a_capture_is_reported():
    with testing.sanitize(seed=0, check=False) as san:
        cp = devices.cupy()
        with cp.cuda.Device(0):
            s, pool, x = _setup(cp)
            _captured(cp, s, pool, lambda: x + cp.asarray(np.ones(4)))
    assert [r.kind for r in san.reports] == ["capture"]
