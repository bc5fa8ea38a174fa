"""``gs.data.experimental``: the names of ``tf.data.experimental`` that gpustrat has.

Constants, the distribution options and the transformations for ``Dataset.apply``
(``ds.apply(gs.data.experimental.scan(0, f))``). A transformation is listed when the
Dataset method behind it exists (see :mod:`gpustrat.data.experimental_ops`). Names
load on first use.
"""

from gpustrat._lazy import attach as _attach
from gpustrat.data import experimental_ops as _ops

_NAMES = {
    "AUTOTUNE": "gpustrat.data.dataset",
    "INFINITE_CARDINALITY": "gpustrat.data.dataset",
    "UNKNOWN_CARDINALITY": "gpustrat.data.dataset",
    "AutoShardPolicy": "gpustrat.data.options",
    "DistributeOptions": "gpustrat.data.options",
    "ProcessingOptions": "gpustrat.data.options",
    "TFRecordWriter": "gpustrat.data.tfrecord",
    "Optional": "gpustrat.distribute.input_lib",
    "cardinality": "gpustrat.data.experimental_ops",
    "get_single_element": "gpustrat.data.experimental_ops",
    "get_structure": "gpustrat.data.experimental_ops",
    "shuffle_and_repeat": "gpustrat.data.experimental_ops",
    "map_and_batch": "gpustrat.data.experimental_ops",
    "parallel_interleave": "gpustrat.data.experimental_ops",
}

globals().update(_ops.available())
__all__ = sorted([*_NAMES, *_ops.available()])
__getattr__, __dir__ = _attach(__name__, _NAMES)
