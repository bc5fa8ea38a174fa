"""Records what Keras 3 gives for the optimizer cases of ``keras_optimizer_cases.py``
into ``keras_optimizers.json`` beside this script (the weights after every step, the
final slots, and at how many steps the clip changed a gradient).

Not a test and not imported by the tests (pytest collects ``test_*.py`` only); the
tests read the JSON file and need no TensorFlow. Keras runs on one device with each
step's whole global batch: the semantics gpustrat keeps at every replica count (its
clipping applies to the gradients summed over the replicas). To record again, with a
venv that has ``tensorflow-cpu==2.21.*`` (Keras 3)::

    /path/to/tf-venv/bin/python tests/variables/record_keras_optimizers.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

from keras_optimizer_cases import (CASES, INF_STEP, KERAS_ACCUMULATOR_SLOT,  # noqa
                                   KERAS_EMA_SLOT, KERAS_SLOTS,
                                   batches, data, dtypes_of, gradients, make_optimizer)


def clipped(kwargs: dict, grads: list) -> bool:
    """Whether Keras's clip changes these gradients (norms in float64)."""
    if kwargs.get("clipvalue") is not None:
        return any(np.abs(g).max() > kwargs["clipvalue"] for g in grads)
    if kwargs.get("clipnorm") is not None:
        return any(np.sqrt((g.astype(np.float64) ** 2).sum()) > kwargs["clipnorm"]
                   for g in grads)
    if kwargs.get("global_clipnorm") is not None:
        total = sum((g.astype(np.float64) ** 2).sum() for g in grads)
        return bool(np.sqrt(total) > kwargs["global_clipnorm"])
    return False


def run(keras, tf, cls: str, kwargs: dict, dtype: str) -> dict:
    _, _, w0, b0 = data(dtype)
    w = keras.Variable(w0, dtype=dtype, name="kernel")
    b = keras.Variable(b0, dtype=dtype, name="bias")
    opt = make_optimizer(keras.optimizers, cls, kwargs, keras=True)
    inner = getattr(opt, "inner_optimizer", opt)
    steps, clips, scales = [], 0, []
    for k, (xb, yb) in enumerate(batches(dtype)):
        grads = gradients(w.numpy(), b.numpy(), xb, yb, len(xb))
        clips += clipped(kwargs, grads)
        if inner is not opt:
            scale = float(opt.scale_loss(1.0))
            scales.append(scale)
            grads = [g * scale * (np.inf if k == INF_STEP else 1) for g in grads]
        opt.apply_gradients([(tf.constant(g), v) for g, v in zip(grads, [w, b])])
        steps.append([w.numpy().tolist(), b.numpy().tolist()])
    slots = {}
    names = dict(KERAS_SLOTS[cls], **(KERAS_EMA_SLOT if kwargs.get("use_ema") else {}),
                 **(KERAS_ACCUMULATOR_SLOT if kwargs.get("gradient_accumulation_steps")
                    else {}))
    for name, attr in names.items():
        held = getattr(inner, attr, None) or []
        if held:
            slots[name] = [held[0].numpy().tolist(), held[1].numpy().tolist()]
    out = {"steps": steps, "slots": slots, "clipped_steps": int(clips),
           "iterations": int(opt.iterations.numpy())}
    if scales:
        out["scales"] = scales + [float(opt.scale_loss(1.0))]
    return out


def main() -> None:
    import keras
    import tensorflow as tf
    out = {"keras": keras.__version__, "tensorflow": tf.__version__, "cases": {},
           "defaults": {}}
    for cls in KERAS_SLOTS:
        config = getattr(keras.optimizers, cls)().get_config()
        out["defaults"][cls] = {k: v for k, v in config.items()
                                if isinstance(v, (int, float, bool)) or v is None}
    for name, (cls, kwargs) in CASES.items():
        for dtype in dtypes_of(name):
            out["cases"][f"{name}/{dtype}"] = run(keras, tf, cls, kwargs, dtype)
    (HERE / "keras_optimizers.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
