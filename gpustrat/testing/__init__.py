"""Test backends for code that runs on GPUs, usable on machines without one.

:func:`sanitize` swaps CuPy, ``cupy.cuda.nccl`` and ``numba.cuda`` for the stream-ordering
sanitizer's fakes (see :mod:`gpustrat.testing.sanitizer`) inside a ``with`` block::

    with gpustrat.testing.sanitize(seed=3) as san:
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1"])
        ...
    # san.reports: the races found; san.counts(): host syncs, launches, ...

:func:`stand_in` swaps them for counting stand-ins over real CuPy arrays (see
:mod:`gpustrat.testing.standin`): nothing runs on a device and no value is computed,
so a test or a benchmark measures what a GPU path costs the host and counts what it
asks of the GPU (host synchronizations, launches, NCCL calls, events, device
entries, allocations)::

    with gpustrat.testing.stand_in(num_devices=4) as gpus:
        strategy = gs.MirroredStrategy(["gpu:0", "gpu:1", "gpu:2", "gpu:3"])
        ...                                    # warm up: plans are built once
        with gpus.measure() as c:
            strategy.run(step, args=(batch,))
        assert c["host_syncs"] == 0, c["sync_sites"]
"""

from __future__ import annotations

import contextlib
import gc

from gpustrat.testing.sanitizer import Report, Sanitizer, SanitizerError
from gpustrat.testing.standin import StandIn

__all__ = ["Report", "Sanitizer", "SanitizerError", "StandIn", "sanitize", "stand_in"]


@contextlib.contextmanager
def sanitize(seed: int = 0, num_devices: int = 4, run_probability: float = 0.5,
             strict: bool = False, nccl: bool = True, check: bool = True):
    """Run the block on ``num_devices`` fake GPUs of a new :class:`Sanitizer`.

    Args:
        seed: the randomized scheduler's seed (run several to vary the interleavings).
        nccl: offer ``cupy.cuda.nccl`` (False: the host-staged path is chosen).
        check: on leaving, run every queued op and raise if anything was reported.
    """
    from gpustrat import devices  # noqa: PLC0415
    from gpustrat.kernels import _launch  # noqa: PLC0415
    from gpustrat.testing.fake_cupy import FakeCupy  # noqa: PLC0415
    from gpustrat.testing.fake_nccl import FakeNccl  # noqa: PLC0415
    from gpustrat.testing.fake_numba import FakeNumbaCuda  # noqa: PLC0415
    san = Sanitizer(seed=seed, run_probability=run_probability, strict=strict,
                    num_devices=num_devices)
    cp = FakeCupy(san)
    backend = devices.Backend(cupy=cp, cupyx=cp.cupyx,
                              nccl=FakeNccl(san, cp) if nccl else None,
                              numba_cuda=FakeNumbaCuda(san, cp))
    san.cupy = cp
    _launch.clear_table_cache()
    gc.callbacks.append(san.gc_callback)
    try:
        with devices.use_backend(backend):
            yield san
            if check:
                san.drain()
    finally:
        gc.callbacks.remove(san.gc_callback)
        _launch.clear_table_cache()
    if check:
        san.check()


@contextlib.contextmanager
def stand_in(num_devices: int = 4, nccl: bool = True, launch_us: float = 0.0,
             numba_launch_us: float = 0.0):
    """Run the block on ``num_devices`` stand-in GPUs of a new
    :class:`~gpustrat.testing.standin.StandIn` (yielded: ``counts()``, ``reset()``,
    ``measure()``, ``sync_sites``).

    Args:
        nccl: offer ``cupy.cuda.nccl`` (False: the host-staged path is chosen).
        launch_us: host microseconds each launch and NCCL call spends beyond the
            stand-in's own cost (a model of CuPy's dispatch and the driver's; 0: none).
        numba_launch_us: host microseconds a Numba kernel's launch spends on top (a
            model of Numba's dispatcher; 0: none).
    Raises:
        RuntimeError: the real CuPy package is not importable (the message says how to
            install it without a GPU).
    """
    from gpustrat import devices  # noqa: PLC0415
    from gpustrat.kernels import _launch  # noqa: PLC0415
    from gpustrat.testing.standin import build  # noqa: PLC0415
    model = StandIn(num_devices=num_devices, launch_us=launch_us,
                    numba_launch_us=numba_launch_us)
    cp, cupyx, nccl_module, numba_cuda = build(model)
    backend = devices.Backend(cupy=cp, cupyx=cupyx, nccl=nccl_module if nccl else None,
                              numba_cuda=numba_cuda)
    _launch.clear_table_cache()
    try:
        with devices.use_backend(backend):
            yield model
    finally:
        _launch.clear_table_cache()
