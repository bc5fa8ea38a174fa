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


class Agreement:
    """Counts the collectives an epoch spent (tests check the documented cost)."""

    def __init__(self):
        self.collectives = 0


def agreed_steps(steps: Iterator[list], workers: WorkerGroup, local: int,
                 known_steps: int | None, empty_like: Callable[[Any], Any],
                 stats: Agreement) -> Iterator[list]:
    """Yield ``steps``, padded with empty steps until every worker's data has ended."""
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
        total = max(k for k, _ in shared)
        produced = 0
        if first is not None:
            yield first
            produced = 1
            for step in steps:
                if produced == total:
                    raise RuntimeError(
                        f"worker {workers.rank} has more than the {total} steps its dataset's "
                        "cardinality promised; the cardinality is wrong")
                yield step
                produced += 1
        for _ in range(total - produced):
            yield empty_step()
        return

    buffer: collections.deque = collections.deque()
    if first is not None:
        buffer.append(first)
    exhausted = first is None
    block = 1
    step_bytes = max(1, _nbytes(first)) if first is not None else 1
    while True:
        while len(buffer) < block and not exhausted:
            nxt = next(steps, None)
            if nxt is None:
                exhausted = True
            else:
                buffer.append(nxt)
        ready = np.array([len(buffer)], dtype=np.int64)
        agreed = int(workers.allreduce_ints(ready, ReduceOp.MAX)[0])
        stats.collectives += 1
        if agreed == 0:
            return
        for _ in range(agreed):
            yield buffer.popleft() if buffer else empty_step()
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
