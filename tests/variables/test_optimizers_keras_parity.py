"""Every optimizer case of ``keras_optimizer_cases.py`` trained under 2 and 3 mirrored
replicas gives the weights (after every step) and slots that Keras 3 gave on one device
with the same global batches (recorded in ``keras_optimizers.json`` by
``record_keras_optimizers.py``): clipping and weight decay apply to the gradients
summed over the replicas, and each algorithm follows Keras's formulas."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset
from keras_optimizer_cases import (BATCH, CASES, DTYPES, INF_STEP, data, dtypes_of,
                                   gradients, make_optimizer)

RECORDED = json.loads((Path(__file__).resolve().parent / "keras_optimizers.json")
                      .read_text())["cases"]
# float32: the gradients are summed over the replicas in another order than one
# device's; Adam-like steps of a gradient near zero amplify that.
TOLERANCE = {"float32": dict(rtol=1e-5, atol=1e-5), "float64": dict(rtol=1e-11, atol=1e-13)}
#: Nadam's constant 0.96 is float32 in Keras (see keras_optimizer_cases), and so is a
#: schedule's learning rate: float64 agrees to about 1e-8 there.
NADAM_FLOAT64 = dict(rtol=1e-6, atol=1e-8)


def train(strategy, name: str, dtype: str, buffers: bool = False):
    """Train case ``name``; returns (the weights after every step, as replica 0 has
    them; the final slots; every replica's final weights; the optimizer; the loss
    scale before every step and after the last, for a loss-scaled case)."""
    cls, kwargs = CASES[name]
    x, y, w0, b0 = data(dtype)
    with strategy.scope():
        w = gs.Variable(w0, name="kernel")
        b = gs.Variable(b0, name="bias")
        opt = make_optimizer(gs.optimizers, cls, kwargs, keras=False)
    inner = getattr(opt, "inner_optimizer", opt)
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(BATCH))
    last = strategy.num_replicas_in_sync - 1
    scales = []

    def step(batch, k):
        xb, yb = batch
        ctx = gs.get_replica_context()
        count = ctx.all_reduce("sum", float(len(xb)))
        gw, gb = gradients(np.asarray(w.value()), np.asarray(b.value()), xb, yb, count)
        if inner is not opt:
            # The scaled loss's gradients; at INF_STEP one replica's overflow.
            scale = float(opt.scale_loss(1.0))
            bad = np.inf if k == INF_STEP and ctx.replica_id_in_sync_group == last else 1
            gw, gb = gw * scale * bad, gb * scale * bad
        if buffers:
            bw, bb = opt.gradient_buffers([w, b])
            bw[...], bb[...] = gw, gb
            gw, gb = bw, bb
        opt.apply_gradients(zip([gw, gb], [w, b]))

    local = strategy.experimental_local_results
    steps = []
    for epoch in range(2):
        for batch in dist:
            if inner is not opt:
                scales.append(float(opt.scale_loss(1.0)))
            strategy.run(step, args=(batch, len(steps)))
            steps.append([np.asarray(local(w)[0]), np.asarray(local(b)[0])])
    if scales:
        scales.append(float(opt.scale_loss(1.0)))
    slots = {s: [np.asarray(local(inner.get_slot(v, s))[0]) for v in (w, b)]
             for s in inner.kept_slot_names}
    final = [(np.asarray(cw), np.asarray(cb)) for cw, cb in zip(local(w), local(b))]
    return steps, slots, final, opt, scales


def check(name, dtype, steps, slots, final, opt=None, scales=()):
    want = RECORDED[f"{name}/{dtype}"]
    tol = TOLERANCE[dtype]
    if dtype == "float64" and (CASES[name][0] == "Nadam" or
                               isinstance(CASES[name][1].get("learning_rate"), tuple)):
        tol = NADAM_FLOAT64
    assert len(steps) == len(want["steps"])
    if opt is not None:
        assert int(opt.iterations.numpy()) == want["iterations"], name
    for i, (got, expected) in enumerate(zip(steps, want["steps"])):
        for g, e, what in zip(got, expected, ("kernel", "bias")):
            assert g.dtype == np.dtype(dtype)
            np.testing.assert_allclose(g, e, err_msg=f"{name} {dtype} step {i + 1} {what}",
                                       **tol)
    assert sorted(slots) == sorted(want["slots"])
    for s, values in slots.items():
        for g, e in zip(values, want["slots"][s]):
            np.testing.assert_allclose(g, e, err_msg=f"{name} {dtype} slot {s}", **tol)
    assert list(scales) == want.get("scales", [])
    for cw, cb in final[1:]:     # every replica holds the same values
        np.testing.assert_array_equal(cw, final[0][0])
        np.testing.assert_array_equal(cb, final[0][1])


@pytest.mark.parametrize("name, dtype", [(n, d) for n in sorted(CASES) for d in dtypes_of(n)])
@pytest.mark.parametrize("n", [2, 3])
def test_same_as_keras_on_the_global_batch(name, dtype, n):
    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    try:
        steps, slots, final, opt, scales = train(strategy, name, dtype)
        check(name, dtype, steps, slots, final, opt, scales)
    finally:
        strategy.close()


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_as_keras_with_gradient_buffers(name):
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        steps, slots, final, opt, scales = train(strategy, name, "float32", buffers=True)
        check(name, "float32", steps, slots, final, opt, scales)
    finally:
        strategy.close()


def test_recorded_clips_were_active_where_named_so():
    for key, want in RECORDED.items():
        name = key.split("/")[0]
        if name.endswith("_active"):
            assert want["clipped_steps"] == want["iterations"], key
        elif name.endswith("_inactive"):
            assert want["clipped_steps"] == 0, key
    assert sorted(RECORDED) == sorted(f"{n}/{d}" for n in CASES for d in dtypes_of(n))
    # An active clip changed the training; an inactive one did not (to rounding).
    for dtype in DTYPES:
        plain = RECORDED[f"rmsprop/{dtype}"]["steps"][-1][0]
        assert not np.allclose(RECORDED[f"rmsprop_clipnorm_active/{dtype}"]["steps"][-1][0],
                               plain, rtol=1e-3)
        np.testing.assert_allclose(
            RECORDED[f"rmsprop_clipnorm_inactive/{dtype}"]["steps"][-1][0], plain,
            rtol=1e-5)


#: Keras arguments gpustrat's optimizers do not take.
UNSUPPORTED = {"loss_scale_factor"}


def test_defaults_are_keras_defaults():
    defaults = json.loads((Path(__file__).resolve().parent / "keras_optimizers.json")
                          .read_text())["defaults"]
    for cls, keras_config in defaults.items():
        config = getattr(gs.optimizers, cls)().get_config()
        for key, value in keras_config.items():
            if key == "learning_rate":   # a float32 variable in Keras
                assert config[key] == pytest.approx(value, rel=1e-7), cls
            elif key in UNSUPPORTED:
                with pytest.raises(ValueError, match=key):
                    getattr(gs.optimizers, cls)(**{key: 2.0})
            else:
                assert config.get(key) == value, f"{cls}.{key}"
        # A config Keras wrote (its settings, every common one included) builds ours.
        again = getattr(gs.optimizers, cls).from_config(dict(keras_config)).get_config()
        assert again.pop("learning_rate") == pytest.approx(config.pop("learning_rate"),
                                                           rel=1e-7)   # float32 there
        assert again == config, cls
