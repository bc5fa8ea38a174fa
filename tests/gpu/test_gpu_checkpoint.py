"""Checkpoints of GPU variables: a synchronous save reads them where they live; an
asynchronous save copies them to pinned host memory on the current stream, after the
last update and before the next (on the stream-ordering sanitizer without a GPU, which
reports a copy racing the next update). Skipped without a GPU when the sanitizer cannot
run; a failure when GPUSTRAT_TEST_GPU=1."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_skip import require_gpus  # noqa: E402

import gpustrat as gs  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("enable_async", [False, True])
def test_gpu_variables_and_slots_save_the_state_of_the_call(tmp_path, enable_async):
    n = min(require_gpus(1), 2)
    s = gs.MirroredStrategy([f"gpu:{i}" for i in range(n)])
    with s.scope():
        w = gs.Variable(np.arange(4096, dtype=np.float32), name="w")
        opt = gs.optimizers.Adam(0.01)

    def step():
        opt.apply_gradients([(np.ones(4096, np.float32), w)])
    s.run(step)
    saved_w, saved_m = w.numpy(), opt.get_slot(w, "m").numpy()
    ck = gs.train.Checkpoint(w=w, opt=opt)
    options = gs.train.CheckpointOptions(enable_async=enable_async)
    path = ck.save(str(tmp_path / "ck"), options=options)
    for _ in range(3):           # updates queued right behind the copies
        s.run(step)
    ck.sync()
    with s.scope():
        w2 = gs.Variable(np.zeros(4096, np.float32), name="w")
        opt2 = gs.optimizers.Adam(0.01)
    s.run(lambda: opt2.apply_gradients([(np.zeros(4096, np.float32), w2)]))
    gs.train.Checkpoint(w=w2, opt=opt2).restore(path).assert_consumed()
    np.testing.assert_array_equal(w2.numpy(), saved_w)
    np.testing.assert_array_equal(opt2.get_slot(w2, "m").numpy(), saved_m)
