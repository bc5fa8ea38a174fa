"""Where the GPU tests run: on real GPUs when CuPy sees one (or ``GPUSTRAT_TEST_GPU=1``
demands one), otherwise on the stream-ordering sanitizer's fake GPUs (gpustrat.testing),
so that every GPU path runs in CI with its ordering checked."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_skip import use_sanitizer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _gpu_backend(request):
    """A module of ``gpu`` tests shares one sanitizer (module-scoped fixtures hold its
    arrays and communicators); it must end with nothing reported."""
    marked = any(m.name == "gpu" for m in request.node.iter_markers())
    if not marked or not use_sanitizer():
        yield None
        return
    from gpustrat import testing
    with testing.sanitize(seed=len(request.node.name)) as san:
        yield san


@pytest.fixture(autouse=True)
def _no_new_reports(_gpu_backend):
    before = len(_gpu_backend.reports) if _gpu_backend is not None else 0
    yield
    if _gpu_backend is not None:
        new = _gpu_backend.reports[before:]
        assert not new, "the sanitizer reported:\n" + "\n".join(map(str, new[:5]))
