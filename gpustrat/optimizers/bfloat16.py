"""bfloat16 gradient compression: 16 bits per value on the wire, summed in float32.

Neither NumPy, CuPy nor MPI has a bfloat16 type to reduce in, so the values travel as
their bfloat16 bit patterns (the top 16 bits of a float32, rounded to nearest even) in
an all-gather, and each replica decodes and sums the gathered values in float32, in
replica order (so every replica gets the same sum). An all-gather moves
``(replicas - 1) / replicas`` of every replica's share, so this halves the bytes of a
float32 all-reduce for a few replicas and stops paying beyond about four.
"""

from __future__ import annotations

import numpy as np

from gpustrat.collectives.fusion import bucket_bytes_from_env, plan_buckets
from gpustrat.devices import array_module, on_device_of

#: The marker ``compression_dtype("bfloat16")`` returns.
BFLOAT16 = np.dtype([("bfloat16", np.uint16)])


def to_bits(x):
    """float32 values to bfloat16 bit patterns (uint16), rounded to nearest even."""
    xp = array_module(x)
    u = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounded = (u + (((u >> 16) & 1) + 0x7FFF)) >> 16
    # A NaN gets the quiet-NaN pattern (rounding may carry its bits into infinity's),
    # chosen element by element on the device: no host read of whether there is one.
    return xp.where(x != x, xp.uint16(0x7FC0), rounded.astype(xp.uint16))


def from_bits(bits):
    """bfloat16 bit patterns (uint16) to float32."""
    xp = array_module(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def reduce_sum(comm, tensors: list) -> list:
    """``tensors[j][i]`` summed over every replica in sync with bfloat16 on the wire;
    returns ``out[j][i]`` in each tensor's dtype."""
    first = [row[0] for row in tensors]
    sizes = [int(t.size) for t in first]
    plan = plan_buckets(sizes, [np.dtype(np.uint16)] * len(sizes), bucket_bytes_from_env())
    out: list = [None] * len(tensors)
    for bucket in plan:
        packed = []
        # Each replica's encoding and decoding runs on its own device (and, under run,
        # on its replica stream, the current stream there).
        for i in range(comm.num_local):
            t = tensors[bucket[0]][i]
            xp = array_module(t)
            with on_device_of(t):
                flat = xp.concatenate([tensors[j][i].reshape(-1).astype(xp.float32)
                                       for j in bucket])
                packed.append(to_bits(flat))
        total = sum(sizes[j] for j in bucket)
        gathered = comm.all_gather(packed, axis=0)
        sums = []
        for g in gathered:
            with on_device_of(g):
                sums.append(from_bits(g).reshape(-1, total).sum(axis=0, dtype=np.float32))
        start = 0
        for j in bucket:
            shape, dtype = first[j].shape, first[j].dtype
            out[j] = []
            for s in sums:
                with on_device_of(s):
                    out[j].append(s[start:start + sizes[j]].reshape(shape).astype(dtype))
            start += sizes[j]
    return out
