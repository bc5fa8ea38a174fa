"""The one rule for GPU tests: skip cleanly without a GPU, fail when
``GPUSTRAT_TEST_GPU=1`` says one must be there (on GPU CI machines)."""

from __future__ import annotations

import os

import pytest

ENV = "GPUSTRAT_TEST_GPU"


def gpu_required() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _missing(reason: str):
    if gpu_required():
        pytest.fail(f"{ENV}=1 says a GPU must be present, but {reason}", pytrace=False)
    pytest.skip(f"{reason} (set {ENV}=1 to make this a failure)")


def real_gpu_count() -> int:
    """GPUs real CuPy sees (0 without CuPy or a driver)."""
    try:
        import cupy
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def use_sanitizer() -> bool:
    """Run the ``gpu`` tests on the sanitizer's fake GPUs: no real GPU, none demanded."""
    return not gpu_required() and real_gpu_count() == 0


def sanitized() -> bool:
    """True inside a test running on the sanitizer's fake GPUs."""
    from gpustrat.devices import numba_cuda
    try:
        return bool(getattr(numba_cuda(), "is_fake", False))
    except ImportError:
        return False


def require_real_gpus(n: int = 1) -> int:
    """Like :func:`require_gpus`, for tests the sanitizer cannot run (other processes)."""
    if sanitized():
        pytest.skip("needs real GPUs: it starts processes the sanitizer does not reach")
    return require_gpus(n)


def require_gpus(n: int = 1) -> int:
    """The number of visible GPUs; without any, skip/fail (:func:`gpu_required`); with
    fewer than ``n``, skip."""
    from gpustrat.devices import gpu_count
    count = gpu_count()
    if count < n:
        if count == 0:
            try:
                import cupy  # noqa: F401
            except Exception as e:
                _missing(f"CuPy cannot be imported ({e})")
            _missing("no CUDA GPU is visible")
        # GPUSTRAT_TEST_GPU=1 demands a GPU, not a number of them: a machine with fewer
        # GPUs than a test needs skips it.
        pytest.skip(f"{n} GPUs are needed and {count} are visible")
    return count


def require_numba_cuda():
    """numba.cuda with a working driver, or skip/fail."""
    require_gpus(1)
    try:
        from gpustrat.devices import numba_cuda
        cuda = numba_cuda()
        if not cuda.is_available():
            _missing("numba.cuda finds no usable CUDA driver")
    except ImportError as e:
        _missing(f"Numba CUDA is not installed ({e})")
    return cuda


def require_nccl(n: int = 1) -> int:
    count = require_gpus(n)
    from gpustrat.collectives import nccl
    if not nccl.is_available():
        _missing("cupy.cuda.nccl is not available")
    return count
