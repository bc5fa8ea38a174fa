"""The ``tf.data`` transformations, under the names they have always been imported by.

Each lives in the module of its family:
    :mod:`gpustrat.data.unary`: the base of one-input transformations, ``prefetch``
        and ``with_options``;
    :mod:`gpustrat.data.batching`: ``batch`` and ``unbatch``;
    :mod:`gpustrat.data.mapping`: ``map`` and ``filter``;
    :mod:`gpustrat.data.shuffling`: ``shuffle``;
    :mod:`gpustrat.data.positional`: ``repeat``, ``take``, ``skip``, ``shard`` and
        ``enumerate``;
    :mod:`gpustrat.data.combining`: ``Dataset.zip`` and ``concatenate``.
"""

from gpustrat.data.batching import BatchDataset, UnbatchDataset
from gpustrat.data.combining import ConcatenateDataset, ZipDataset
from gpustrat.data.mapping import FilterDataset, MapDataset
from gpustrat.data.positional import (EnumerateDataset, RepeatDataset, ShardDataset,
                                      SkipDataset, TakeDataset)
from gpustrat.data.shuffling import ShuffleDataset
from gpustrat.data.unary import OptionsDataset, PrefetchDataset, UnaryDataset

__all__ = [
    "UnaryDataset", "BatchDataset", "UnbatchDataset", "MapDataset", "FilterDataset",
    "ShuffleDataset", "RepeatDataset", "TakeDataset", "SkipDataset", "ShardDataset",
    "EnumerateDataset", "PrefetchDataset", "OptionsDataset", "ZipDataset",
    "ConcatenateDataset",
]
