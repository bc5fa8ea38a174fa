"""gpustrat.data: a ``tf.data``-compatible input pipeline on NumPy/CuPy arrays.

See ``docs/data.md``. Importing this package starts no thread and touches no file.
"""

from gpustrat.data.dataset import (AUTOTUNE, INFINITE_CARDINALITY, UNKNOWN_CARDINALITY,
                                   Dataset, DatasetIterator)
from gpustrat.data.files import TextLineDataset
from gpustrat.data.npy import NpyDataset
from gpustrat.data.options import AutoShardPolicy, DistributeOptions, Options, ProcessingOptions
from gpustrat.data.processes import WorkerDiedError
from gpustrat.data.sources import SequenceGenerator
from gpustrat.data.spec import STRING, TensorSpec
from gpustrat.data.tfrecord import DataLossError, TFRecordDataset, TFRecordWriter
from gpustrat.data.windowing import DatasetSpec

# Import the modules that the Dataset methods load lazily, so that they are ready.
from gpustrat.data import autoshard, interleave, sources, transforms  # noqa: E402,F401
from gpustrat.data import experimental  # noqa: E402,F401 - gs.data.experimental

__all__ = [
    "DatasetSpec",
    "AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "Dataset", "DatasetIterator",
    "TextLineDataset", "TFRecordDataset", "TFRecordWriter", "DataLossError", "NpyDataset",
    "Options", "AutoShardPolicy", "DistributeOptions", "TensorSpec", "STRING", "experimental",
    "SequenceGenerator", "ProcessingOptions", "WorkerDiedError",
]


def __getattr__(name):
    # A TensorFlow name gpustrat has elsewhere, or not at all, says so.
    from gpustrat._porting import attribute_error  # noqa: PLC0415
    raise attribute_error(__name__, name)
