"""Loss scaling, gradient accumulation, EMA and the new optimizers on GPU replicas, under
the stream-ordering sanitizer (:func:`gpustrat.testing.sanitize`): every step's work
runs on the replicas' devices, ordered, and gives what the same program gives on two
CPU replicas."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, testing

O = gs.optimizers

PROGRAMS = {
    "loss_scaled_sgd": lambda: O.LossScaleOptimizer(O.SGD(0.05, momentum=0.9),
                                                    initial_scale=64.0,
                                                    dynamic_growth_steps=2),
    "accumulated_adam_ema": lambda: O.Adam(0.05, gradient_accumulation_steps=2, use_ema=True,
                                           ema_momentum=0.8, ema_overwrite_frequency=3),
    "accumulated_adamw_clipped": lambda: O.AdamW(0.05, gradient_accumulation_steps=3,
                                                 global_clipnorm=0.5,
                                                 exclude_from_weight_decay=["b"]),
    "lion": lambda: O.Lion(0.01),
    "lamb": lambda: O.Lamb(0.01),
    "ftrl": lambda: O.Ftrl(0.05, l1_regularization_strength=0.01),
    "adafactor": lambda: O.Adafactor(0.05),
}


def _run(names, make, buffers, gpu, seed=0):
    """Six steps of linear regression on ``names``; the weights, slots and scale."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 2, 4, 3)).astype(np.float32)     # step, replica, rows
    y = (x @ np.float32([1.5, -2.0, 0.5]) + 0.25).astype(np.float32)
    xp = devices.cupy() if gpu else np
    s = gs.MirroredStrategy(names)
    try:
        with s.scope():
            w = gs.Variable(np.zeros((3, 2), np.float32), name="w")
            b = gs.Variable(np.zeros((2,), np.float32), name="b")
            opt = make()

        def step(k):
            r = gs.get_replica_context().replica_id_in_sync_group
            xb, yb = xp.asarray(x[k, r]), xp.asarray(y[k, r])
            err = (xb.reshape(4, 3, 1) * w.value().reshape(1, 3, 2)).sum(axis=1) + \
                b.value().reshape(1, 2) - yb.reshape(4, 1)
            scale = 2.0 / 16 * (float(opt.scale_loss(1.0)) if hasattr(opt, "scale_loss")
                                else 1.0)
            gw = (xb.reshape(4, 3, 1) * err.reshape(4, 1, 2)).sum(axis=0) * scale
            gb = err.sum(axis=0) * scale
            if k == 2 and hasattr(opt, "scale_loss") and r == 1:
                gw = gw * xp.float32(np.inf)               # an overflowing step: skipped
            if buffers:
                bw, bb = opt.gradient_buffers([w, b])
                bw[...] = gw
                bb[...] = gb
                gw, gb = bw, bb
            opt.apply_gradients([(gw, w), (gb, b)])
        for k in range(6):
            s.run(step, args=(k,))
        inner = getattr(opt, "inner_optimizer", opt)
        out = [devices.to_host(c._array) for v in [w, b] + [inner.get_slot(v, n)
                                                           for v in (w, b)
                                                           for n in inner.kept_slot_names]
               for c in s.experimental_local_results(v)]
        if gpu:
            comps = s.experimental_local_results(w)
            assert [type(c._array) for c in comps] == [devices.cupy().ndarray] * 2
        if hasattr(opt, "scale_loss"):
            out.append(np.float32(opt.scale_loss(1.0)))
        return out
    finally:
        s.close()


@pytest.mark.parametrize("buffers", [False, True])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("nccl", [True, False], ids=["nccl", "staged"])
def test_on_sanitized_gpus_as_on_cpus(program, buffers, nccl):
    want = _run(["cpu:0", "cpu:1"], PROGRAMS[program], buffers, gpu=False)
    with testing.sanitize(seed=1, nccl=nccl, check=False) as san:
        got = _run(["gpu:0", "gpu:1"], PROGRAMS[program], buffers, gpu=True)
        san.drain()
    assert not san.reports, [str(r) for r in san.reports[:3]]
    assert len(got) == len(want)
    for g, e in zip(got, want):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-6)
