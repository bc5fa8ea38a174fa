"""Record ``TF_LOOPS`` (tests/variables/tf_recorded_variables.py) with real TensorFlow:
a Python value added in replica context to a SUM variable on 2 replicas, a replica-context
``assign_add`` under OneDeviceStrategy, and ``compute_average_loss`` of int32 losses.

Not a test and not imported by the tests; run it with a Python that has
``tensorflow-cpu==2.21.*``::

    /path/to/tf-venv/bin/python tests/variables/record_tf_loops.py [--check]

It prints what TensorFlow gives; ``--check`` compares that with ``TF_LOOPS`` and exits
1 on a difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def record() -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf  # noqa: PLC0415
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    out = {}

    def outcome(key, fn):
        try:
            out[key] = fn()
        except Exception as e:  # noqa: BLE001 -- the error is what is recorded
            out[key] = f"ERR {type(e).__name__}: {e}"

    two = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with two.scope():
        v = tf.Variable(10.0, aggregation=tf.VariableAggregation.SUM)
    outcome("mirrored/SUM/replica/assign_add(2.0)",
            lambda: (two.run(lambda: v.assign_add(2.0)), float(v.numpy()))[1])
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    with one.scope():
        w = tf.Variable(10.0)
    outcome("one_device/NONE/replica/assign_add(2.0)",
            lambda: (one.run(lambda: w.assign_add(2.0)), float(w.numpy()))[1])
    r = tf.nn.compute_average_loss(tf.constant([1, 2, 3]), global_batch_size=4)
    out["compute_average_loss/int32/global_batch_size=4"] = (r.dtype.name, float(r.numpy()))
    per = two.experimental_local_results(
        two.run(lambda: tf.nn.compute_average_loss(tf.constant([1, 2, 3]))))
    pairs = {(x.dtype.name, float(x.numpy())) for x in per}
    out["compute_average_loss/int32/2 replicas"] = pairs.pop() if len(pairs) == 1 else \
        sorted(pairs)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with TF_LOOPS")
    args = ap.parse_args()
    got = record()
    print(json.dumps(got, indent=1))
    if not args.check:
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from tf_recorded_variables import TF_LOOPS  # noqa: PLC0415
    differ = {k: (TF_LOOPS.get(k), v) for k, v in got.items() if TF_LOOPS.get(k) != v}
    for k, (want, v) in differ.items():
        print(f"DIFFERS {k}: recorded {want!r}, TensorFlow now {v!r}")
    print("same as TF_LOOPS" if not differ else f"{len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
