"""Variable partitioners (``tf.distribute.experimental.partitioners``): how many shards
along axis 0 a variable gets under ``ParameterServerStrategy(variable_partitioner=...)``.

Each is called as ``partitioner(shape, dtype)`` and returns ``[num_shards, 1, ...]``
(one entry per dimension), with TensorFlow's arithmetic.
"""

from __future__ import annotations

import math

import numpy as np


def _element_bytes(dtype, bytes_per_string: int) -> int:
    dt = np.dtype(dtype)
    return bytes_per_string if dt.kind in "SUO" else dt.itemsize


def _check_shape(shape, axis: int) -> tuple:
    shape = tuple(int(n) for n in shape)
    if axis >= len(shape):
        raise ValueError(f"cannot partition a variable of shape {shape} along axis {axis}")
    return shape


class Partitioner:
    """Base: ``__call__(shape, dtype, axis=0) -> list`` of shards per dimension."""

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        raise NotImplementedError


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer when axis 0 has fewer rows)."""

    def __init__(self, num_shards: int):
        if int(num_shards) < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        self._num_shards = int(num_shards)

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = _check_shape(shape, axis)
        out = [1] * len(shape)
        out[axis] = min(self._num_shards, shape[axis])
        return out


class MinSizePartitioner(Partitioner):
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards``."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1,
                 bytes_per_string: int = 16):
        if min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes must be positive, got {min_shard_bytes}")
        if max_shards < 1:
            raise ValueError(f"max_shards must be positive, got {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be positive, got {bytes_per_string}")
        self._min_shard_bytes = min_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = _check_shape(shape, axis)
        total = math.prod(shape) * _element_bytes(dtype, self._bytes_per_string)
        out = [1] * len(shape)
        out[axis] = max(1, min(shape[axis], self._max_shards,
                               int(math.ceil(total / self._min_shard_bytes))))
        return out


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each at most ``max_shard_bytes`` (at least one row per
    shard), at most ``max_shards`` when given."""

    def __init__(self, max_shard_bytes: int, max_shards: int | None = None,
                 bytes_per_string: int = 16):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        if max_shards is not None and max_shards < 1:
            raise ValueError(f"max_shards must be positive, got {max_shards}")
        if bytes_per_string < 1:
            raise ValueError(f"bytes_per_string must be positive, got {bytes_per_string}")
        self._max_shard_bytes = max_shard_bytes
        self._max_shards = max_shards
        self._bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list:
        shape = _check_shape(shape, axis)
        out = [1] * len(shape)
        if shape[axis] == 0:
            return out
        per_row = math.prod(shape) / shape[axis] * _element_bytes(dtype, self._bytes_per_string)
        rows_per_shard = max(1, math.floor(self._max_shard_bytes / per_row)) if per_row else \
            shape[axis]
        shards = int(math.ceil(shape[axis] / rows_per_shard))
        if self._max_shards:
            shards = min(self._max_shards, shards)
        out[axis] = shards
        return out
