"""gs.function's replay path on the stand-in backend (gpustrat.testing.stand_in): what a
replayed step asks of the GPUs, counted; skipped where the backend or CuPy is missing."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import gpustrat as gs
from gpustrat import devices, testing

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_function.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_function", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("n, optimizer", [(4, "sgd"), (4, "adam"), (1, "sgd")])
def test_a_replayed_step_is_one_launch_and_one_copy_per_gpu_without_a_host_wait(n, optimizer):
    if not hasattr(testing, "stand_in"):
        pytest.skip("the stand-in backend is not in this checkout")
    bench = _bench()
    try:
        context = testing.stand_in(num_devices=4)
        gpus = context.__enter__()
    except RuntimeError as e:               # no real CuPy package to build on
        pytest.skip(str(e))
    try:
        cp = devices.cupy()
        bench._add_capture(cp)
        strategy, call, fn = bench.make_step(gs, cp, n, bench.MLP_SHAPES, True, optimizer)
        try:
            for _ in range(3):
                call()                      # two warm-up calls, then the capture
            assert fn.experimental_get_tracing_count() == 1
            with gpus.measure() as c:
                for _ in range(5):
                    call()
            assert c["host_syncs"] == 0, c["sync_sites"]
            # Per call: a graph per GPU, SGD's learning rate or Adam's step size set
            # on each GPU (a fill), one output copy; the batch's copy into the static
            # inputs, one per GPU.
            assert c["launches"] == 5 * (n + n + 1)
            assert c["copies"] == 5 * n
            assert c["nccl_calls"] == 0      # inside the graphs
            assert fn.experimental_get_tracing_count() == 1
        finally:
            strategy.close()
    finally:
        context.__exit__(None, None, None)
