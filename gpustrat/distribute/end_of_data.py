"""Agreement between workers on when an epoch ends.

Every worker must run the same number of steps, so that no collective is left waiting:
a worker whose data ran out keeps yielding empty per-replica batches while any worker
still has data. What an epoch costs in collectives between workers:

- one worker: none;
- every worker's number of steps known in advance (finite cardinality): one
  ``allgather`` at the start of the epoch. Under DATA and OFF every worker should run
  the same steps anyway; the allgather makes sure, so that a rank-dependent or
  unseeded pipeline cannot leave a collective waiting;
- otherwise: workers read ahead in blocks of 1, 2, 4, ... up to ``MAX_BLOCK`` steps and
  agree once per block with one ``allreduce`` of an int (MAX of the steps each has
  ready): about ``log2(MAX_BLOCK) + steps / MAX_BLOCK + 1`` collectives per epoch,
  instead of TensorFlow's one per step. Read-ahead is capped at ``MAX_BLOCK_BYTES``.

The first round also shares each worker's empty-piece template (structure, trailing
shapes, dtypes), so that a worker with no data at all can still yield empty pieces.

Under the DATA auto-shard policy every worker must run exactly the same steps (each
keeps its own pieces of the same global batches: a worker whose data ends early would
lose the others' pieces of the batches it lacks). There the same collectives also
compare the workers' counts, at no extra cost: the known step counts at the start of the
epoch, and each block's minimum beside its maximum (one ``allreduce`` of two ints). A
difference raises :class:`DataLengthMismatch` on every worker, naming each worker's
count.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

import numpy as np

from gpustrat import nest
from gpustrat.collectives.base import WorkerGroup
from gpustrat.reduce_util import ReduceOp

MAX_BLOCK = 64
MAX_BLOCK_BYTES = 256 << 20


def _nbytes(step: list) -> int:
    return sum(int(getattr(leaf, "nbytes", 0)) for piece in step for leaf in nest.flatten(piece))


class DataLengthMismatch(ValueError):
    """Workers that must read the same data under the DATA policy have different amounts."""


def _mismatch(counts: list) -> DataLengthMismatch:
    """``counts``: per worker, (steps, whether its data ended)."""
    named = ", ".join(f"worker {w}: {'' if ended else 'at least '}{c} steps"
                      for w, (c, ended) in enumerate(counts))
    return DataLengthMismatch(
        f"under AutoShardPolicy.DATA every worker must read the same data, but the "
        f"workers' pipelines have different lengths ({named}), so the pieces of "
        "the batches some workers lack would be lost: make the pipeline the same on every "
        "worker (no rank-dependent sizes or filters; seeded shuffles), or shard it yourself "
        "with AutoShardPolicy.OFF or distribute_datasets_from_function")


class Agreement:
    """Counts the collectives an epoch spent (tests check the documented cost)."""

    def __init__(self):
        self.collectives = 0


def agreed_steps(steps: Iterator[list], workers: WorkerGroup, local: int,
                 known_steps: int | None, empty_like: Callable[[Any], Any],
                 stats: Agreement, same_steps: bool = False) -> Iterator[list]:
    """Yield ``steps``, padded with empty steps until every worker's data has ended.

    ``same_steps`` (the DATA policy): every worker must have the same number of steps;
    raises :class:`DataLengthMismatch` on every worker where they differ.
    """
    first = next(steps, None)
    mine = None if first is None else _template_desc(first)
    # Round 0: steps known in advance (or -1), and an empty-piece template.
    shared = workers.allgather((-1 if known_steps is None else int(known_steps), mine))
    stats.collectives += 1
    template = next((t for _, t in shared if t is not None), None)
    if template is None:
        return  # no worker has any data

    def empty_step():
        base = empty_like(first[0]) if first is not None else _build_empty(template)
        return [base] * local

    if all(k >= 0 for k, _ in shared):
        known_steps = int(known_steps)
        counts = [k for k, _ in shared]
        if same_steps and len(set(counts)) > 1:
            raise _mismatch([(c, True) for c in counts])
        total = max(counts)
        produced = 0
        if first is not None:
            yield first
            produced = 1
            for step in steps:
                if produced == known_steps:
                    raise RuntimeError(
                        f"worker {workers.rank} has more than the {known_steps} steps its "
                        "dataset's cardinality promised; the cardinality is wrong")
                yield step
                produced += 1
        if produced < known_steps:
            raise RuntimeError(
                f"worker {workers.rank} has {produced} steps but its dataset's cardinality "
                f"promised {known_steps}; the cardinality is wrong")
        for _ in range(total - produced):
            yield empty_step()
        return

    buffer: collections.deque = collections.deque()
    if first is not None:
        buffer.append(first)
    exhausted = first is None
    block = 1
    done = 0  # steps yielded before this block
    step_bytes = max(1, _nbytes(first)) if first is not None else 1
    while True:
        while len(buffer) < block and not exhausted:
            nxt = next(steps, None)
            if nxt is None:
                exhausted = True
            else:
                buffer.append(nxt)
        # The maximum of the steps ready, and of their negation: the minimum.
        ready = np.array([len(buffer), -len(buffer)], dtype=np.int64)
        agreed, least = (int(v) for v in workers.allreduce_ints(ready, ReduceOp.MAX))
        least = -least
        stats.collectives += 1
        if same_steps and least != agreed:
            counts = workers.allgather((done + len(buffer), exhausted))
            stats.collectives += 1
            raise _mismatch(counts)
        if agreed == 0:
            return
        for _ in range(agreed):
            yield buffer.popleft() if buffer else empty_step()
        done += agreed
        if agreed == block:
            block = min(2 * block, MAX_BLOCK, max(1, MAX_BLOCK_BYTES // step_bytes))


def _template_desc(step: list) -> Any:
    flat = nest.flatten(step[0])
    return ([(tuple(leaf.shape[1:]), str(leaf.dtype)) for leaf in flat],
            _structure_skeleton(step[0]))


def _structure_skeleton(x: Any) -> Any:
    # The structure with leaves replaced by None: picklable, no data.
    return nest.map_structure(lambda _: None, x) if nest.is_nested(x) else None


def _build_empty(template: Any) -> Any:
    leaves, skeleton = template
    arrays = [np.empty((0,) + shape, dtype=np.dtype(dtype)) for shape, dtype in leaves]
    return arrays[0] if skeleton is None else nest.pack_sequence_as(skeleton, arrays)
