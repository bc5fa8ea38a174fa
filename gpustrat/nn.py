"""Loss helpers for training under a strategy (``tf.nn.compute_average_loss`` and
``tf.nn.scale_regularization_loss``).

Under a strategy, each replica computes the loss of its piece of the global batch and
the optimizer *sums* the replicas' gradients. Dividing each replica's summed loss by the
number of examples in the whole global batch makes that sum the gradient of the global
batch's mean loss.

Difference from TensorFlow: without ``global_batch_size``, TensorFlow divides by the
local rows times the number of replicas, which weighs the examples of a partial batch
unequally (a batch of 4 cut 3 + 1 divides by 6 on one replica and 2 on the other). Here
the denominator is the true number of examples in the global batch, found with one small
all-reduce of the row counts; so every example weighs the same, and an empty piece adds
nothing. Give ``global_batch_size`` to skip that reduction (and to match TensorFlow
exactly when batches are full).
"""

from __future__ import annotations

import numpy as np

from gpustrat.devices import array_module
from gpustrat.distribute import context


def _replica_context(what: str, required: bool = True, hint: str = ""):
    """The replica context (None outside any strategy, and in cross-replica context when
    not ``required``)."""
    strategy, ctx = context.current()
    if strategy is not None and ctx is None:
        if not required:
            return None
        raise RuntimeError(f"{what} was called in cross-replica context; call it inside "
                           f"the function given to strategy.run (replica context){hint}")
    from gpustrat.distribute.context import get_replica_context  # noqa: PLC0415
    return get_replica_context()


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """This replica's share of the global batch's mean loss.

    Args:
        per_example_loss: the losses of this replica's examples, an array of rank >= 1
            (rows first; further axes are summed too, as TensorFlow does).
        sample_weight: a weight per example (or a scalar), multiplied in first.
        global_batch_size: the number of examples in the global batch; default: the
            true count over every replica in sync (one small all-reduce).
    Returns:
        ``sum(per_example_loss * sample_weight) / global_batch_size`` as a 0-d array of
        the loss's dtype (float64 for integer losses, as TensorFlow's division gives;
        their weights are cast to the loss's dtype first, as TensorFlow casts them), on
        the replica's device; 0 when ``global_batch_size`` is 0.
        Summed over replicas, it is the global batch's mean loss.
    Raises:
        ValueError: a rank-0 loss, or a negative ``global_batch_size``.
        TypeError: a loss that is not a number (a bool or a string).
        RuntimeError: called in cross-replica context without ``global_batch_size``
            (with it, the division needs no replica, as in TensorFlow).
    """
    ctx = _replica_context("compute_average_loss without global_batch_size",
                           required=global_batch_size is None,
                           hint=", or give global_batch_size")
    xp = array_module(per_example_loss)
    loss = xp.asarray(per_example_loss)
    if loss.dtype.kind not in "fciu":
        raise TypeError(f"compute_average_loss needs numeric losses, got dtype "
                        f"{loss.dtype}: cast them (e.g. loss.astype('float32'))")
    # Integer losses are summed as integers and divided as TensorFlow's ``/`` divides
    # them: into float64.
    out = loss.dtype if loss.dtype.kind in "fc" else np.dtype(np.float64)
    if loss.ndim == 0:
        raise ValueError("compute_average_loss needs per-example losses (rank >= 1, one "
                         f"row per example), got a scalar {per_example_loss!r}")
    if sample_weight is not None:
        weight = xp.asarray(sample_weight, dtype=loss.dtype)
        if weight.ndim == loss.ndim + 1 and weight.shape[-1] == 1:
            weight = weight[..., 0]   # (n, 1) weights of (n,) losses, as TensorFlow
        if weight.ndim > loss.ndim:
            raise ValueError(f"sample_weight of shape {tuple(weight.shape)} has more axes "
                             f"than per_example_loss of shape {tuple(loss.shape)}")
        if weight.ndim and weight.shape[0] != loss.shape[0]:
            raise ValueError(f"sample_weight of shape {tuple(weight.shape)} does not match "
                             f"the {loss.shape[0]} examples of per_example_loss")
        weight = weight.reshape(weight.shape + (1,) * (loss.ndim - weight.ndim))
        loss = loss * weight
    total = loss.sum(dtype=loss.dtype).astype(out)
    if global_batch_size is None:
        # The count is reduced as an array, so on GPUs it stays on the device: the step
        # does not wait for the reduction. Every piece empty: nothing to average, 0.
        rows = np.asarray(loss.shape[0], np.float64)
        count = ctx.all_reduce("sum", rows) if ctx is not None else rows
        count = xp.asarray(count).astype(out)
        empty = (count == 0).astype(out)
        return xp.asarray(total / (count + empty) * (1 - empty), dtype=out)
    count = float(global_batch_size)
    if not count >= 0:
        raise ValueError(f"global_batch_size must be non-negative, got {global_batch_size}")
    if count == 0:  # as TensorFlow's div_no_nan: no examples, no loss
        return xp.zeros((), dtype=out)
    return xp.asarray(total / out.type(count), dtype=out)


def scale_regularization_loss(regularization_loss):
    """This replica's share of a regularization loss: its sum divided by the number of
    replicas in sync, so that the replicas' summed gradients count it once."""
    ctx = _replica_context("scale_regularization_loss")
    n = ctx.num_replicas_in_sync if ctx is not None else 1
    xp = array_module(regularization_loss)
    loss = xp.asarray(regularization_loss)
    dtype = loss.dtype if loss.dtype.kind in "fc" else np.dtype(np.float32)
    return xp.asarray(loss.sum(dtype=dtype) / dtype.type(n), dtype=dtype)
