"""Records what Keras 3 gives for the metric cases of ``keras_metric_cases.py`` into
``keras_metrics.json`` beside this script (the result after every update).

Not a test and not imported by the tests; the tests read the JSON file and need no
TensorFlow. To record again, with a venv that has ``tensorflow-cpu==2.21.*`` (Keras 3)::

    /path/to/tf-venv/bin/python tests/variables/record_keras_metrics.py
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

from keras_metric_cases import CASES, batches, make, update  # noqa: E402


def run(keras, name: str) -> list:
    cls, kwargs, _, _ = CASES[name]
    m = make(keras.metrics, cls, kwargs)
    results = []
    for k, (y_true, y_pred, weight) in enumerate(batches(name)):
        if k == 3:
            m.reset_state()
        update(m, y_true, y_pred, weight)
        results.append(np.asarray(m.result()).tolist())
    return results


def main() -> None:
    import keras
    import tensorflow as tf
    out = {"keras": keras.__version__, "tensorflow": tf.__version__,
           "cases": {name: run(keras, name) for name in CASES}}
    (HERE / "keras_metrics.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
