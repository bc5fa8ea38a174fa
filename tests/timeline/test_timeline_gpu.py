"""The timeline on (the sanitizer's fake) GPUs: no host synchronization is added to a
step, NVTX ranges open and close on every thread, and the collectives' device times
are read from CUDA events once they have completed, onto one track per GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_checks import check_trace, load  # noqa: E402


@pytest.mark.parametrize("seed", (0, 1, 2))
def test_a_gpu_step_recorded_waits_for_nothing_more_on_the_host(tmp_path, seed):
    path = tmp_path / "t.json"
    with testing.sanitize(seed=seed) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        try:
            with s.scope():
                w = gs.Variable(np.zeros(256, np.float32), name="w")
                b = gs.Variable(np.zeros(4, np.float32), name="b")
                opt = gs.optimizers.SGD(0.1)

            def step(x):
                r = gs.get_replica_context().replica_id_in_sync_group
                opt.apply_gradients([(cp.full((256,), r + 1.0, dtype=np.float32), w),
                                     (cp.ones((4,), dtype=np.float32) * x.sum(), b)])
                return gs.get_replica_context().all_reduce("sum", cp.ones((2,), np.float32))

            def steps():
                # Each batch is copied to the GPUs by the placement thread.
                dist = s.experimental_distribute_dataset(
                    gs.data.Dataset.from_tensor_slices(np.zeros((12, 2), np.float32))
                    .batch(4))
                for x in dist:
                    s.run(step, args=(x,))
            steps()                                     # the first steps make the plans
            with san.measure() as off:
                steps()
            with gs.timeline.record(path):
                with san.measure() as on:
                    steps()
            assert on["host_syncs"] == off["host_syncs"], (on["sync_sites"], off)
            assert on["nvtx_ranges"] >= 3 * (2 + 2)     # runs, collectives, merges
            assert off.get("nvtx_ranges", 0) == 0
            assert cp._nvtx() == []                     # every range was closed
            got = devices.to_host(w.values[0].value())
            assert np.allclose(got, -0.1 * 3 * 9), got   # 9 steps of 1 + 2
        finally:
            s.close()
    spans = check_trace(load(path))
    device = [e for e in spans if e["cat"] == "device"]
    assert {e["tid"] for e in device} == {1000, 1001}  # gpu:0 and gpu:1
    colls = [e for e in spans if e["cat"] == "collective"]
    assert len(device) == 2 * len(colls)               # each read once per GPU
    assert all(e["args"]["device_ms"] >= 0 for e in device)
    runs = [e for e in spans if e["name"] == "run"]
    assert {e["tid"] for e in runs} == {0, 1} and len(runs) == 6
    data = load(path)
    threads = {e["tid"]: e["args"]["name"] for e in data["traceEvents"]
               if e["name"] == "thread_name"}
    placed = [e for e in spans if e["name"] == "place"]
    assert len(placed) == 3 and {threads[e["tid"]] for e in placed} == {"gpustrat-placer"}
    assert len([e for e in spans if e["name"] == "get_next"]) == 4
