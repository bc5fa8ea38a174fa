"""A linear least-squares model trained with gs optimizers, and the same training in
plain NumPy (the reference). Used in process and by mpiexec children.

23 examples in global batches of 8: the last batch has 7 rows, so pieces are unequal
(4 + 3 on 2 replicas, 2 + 2 + 2 + 1 on 4).
"""

from __future__ import annotations

import math

import numpy as np

import gpustrat as gs
from gpustrat.data import Dataset

N, D, K, BATCH, EPOCHS = 23, 3, 2, 8, 3


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D)).astype(np.float32)
    y = (x @ rng.standard_normal((D, K)) + 0.5).astype(np.float32)
    w0 = rng.standard_normal((D, K)).astype(np.float32)
    return x, y, w0, np.zeros(K, np.float32)


def decay(step):
    return 0.05 * 0.9 ** step


OPTIMIZERS = {
    "sgd_momentum": lambda: gs.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: gs.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "sgd_schedule": lambda: gs.optimizers.SGD(gs.optimizers.schedules.ExponentialDecay(0.05, 1, 0.9)),
    "adam": lambda: gs.optimizers.Adam(0.05),
    "adam_amsgrad": lambda: gs.optimizers.Adam(0.05, amsgrad=True),
    "adamw": lambda: gs.optimizers.AdamW(0.05, weight_decay=0.1,
                                         exclude_from_weight_decay=["bias"]),
    "sgd_float16": lambda: gs.optimizers.SGD(0.05, momentum=0.9, compression="float16"),
    "sgd_bfloat16": lambda: gs.optimizers.SGD(0.05, momentum=0.9, compression="bfloat16"),
}


def train(strategy, which: str, epochs: int = EPOCHS, buffers: bool = False):
    """Train with ``strategy``; returns (every local component of w and b, iterations).
    ``buffers``: the gradients are written into ``opt.gradient_buffers``."""
    x, y, w0, b0 = data()
    with strategy.scope():
        w = gs.Variable(w0, name="kernel")
        b = gs.Variable(b0, name="bias")
        opt = OPTIMIZERS[which]()
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(BATCH))

    def step(batch):
        xb, yb = batch
        err = xb @ w + b - yb
        count = gs.get_replica_context().all_reduce("sum", float(len(xb)))
        if not buffers:
            opt.apply_gradients(zip([xb.T @ err / count, err.sum(axis=0) / count], [w, b]))
            return
        gw, gb = opt.gradient_buffers([w, b])
        np.matmul(xb.T, err, out=gw)
        gw /= count
        np.sum(err, axis=0, out=gb)
        gb /= count
        opt.apply_gradients(zip([gw, gb], [w, b]))

    for _ in range(epochs):
        for batch in dist:
            strategy.run(step, args=(batch,))
    local = strategy.experimental_local_results
    return ([np.asarray(c) for c in local(w)], [np.asarray(c) for c in local(b)],
            int(opt.iterations))


def reference(which: str, epochs: int = EPOCHS):
    """The same training in plain NumPy, from the algorithms' formulas."""
    x, y, w, b = data()
    params = {"kernel": w.copy(), "bias": b.copy()}
    state = {k: {"m": np.zeros_like(p), "v": np.zeros_like(p), "vhat": np.zeros_like(p)}
             for k, p in params.items()}
    t = 0
    for _ in range(epochs):
        for start in range(0, N, BATCH):
            xb, yb = x[start:start + BATCH], y[start:start + BATCH]
            err = xb @ params["kernel"] + params["bias"] - yb
            grads = {"kernel": xb.T @ err / len(xb), "bias": err.sum(axis=0) / len(xb)}
            for k, g in grads.items():
                if which.endswith("float16") and which != "sgd_bfloat16":
                    g = g.astype(np.float16).astype(np.float32)
                if which == "sgd_bfloat16":
                    g = bfloat16_round(g)
                p, s = params[k], state[k]
                if which.startswith("sgd"):
                    lr = decay(t) if which == "sgd_schedule" else 0.05
                    if which == "sgd_schedule":
                        p -= lr * g
                        continue
                    s["m"] = 0.9 * s["m"] - lr * g
                    p += (0.9 * s["m"] - lr * g) if which == "sgd_nesterov" else s["m"]
                else:
                    lr, step = 0.05, t + 1
                    if which == "adamw" and k != "bias":
                        p -= p * 0.1 * lr
                    s["m"] = s["m"] + (g - s["m"]) * 0.1
                    s["v"] = s["v"] + (g * g - s["v"]) * 0.001
                    v = s["v"]
                    if which == "adam_amsgrad":
                        s["vhat"] = np.maximum(s["vhat"], s["v"])
                        v = s["vhat"]
                    alpha = lr * math.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
                    p -= s["m"] * alpha / (np.sqrt(v) + 1e-7)
            t += 1
    return params["kernel"], params["bias"], t


def bfloat16_round(g):
    """Round float32 values to bfloat16 precision (nearest even), kept as float32."""
    u = np.ascontiguousarray(g, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)
