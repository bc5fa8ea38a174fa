"""Cutting global batches into per-replica pieces.

A batch of ``n`` rows on ``N`` replicas is cut, in order, into pieces of ``ceil(n/N)``
rows; replicas past the end of the data get an empty piece (zero rows, same trailing
shape and dtype). Every leaf of a nested element is cut at the same row boundaries.
On host arrays and contiguous device arrays a piece is a view: no copy.
"""

from __future__ import annotations

from typing import Any, Iterator

from gpustrat import nest
from gpustrat.kernels.split import split_sizes


class NotBatchedError(ValueError):
    pass


class Splitter:
    """Cuts elements of one fixed structure; the flatten plan is worked out once."""

    def __init__(self, num_pieces: int, what: str = "experimental_distribute_dataset"):
        self.num_pieces = num_pieces
        self._what = what
        self._structure = None
        self._single = False

    def rows(self, flat: list) -> int:
        n = None
        for leaf in flat:
            shape = getattr(leaf, "shape", None)
            if shape is None or len(shape) == 0:
                raise NotBatchedError(
                    f"{self._what} needs a dataset batched by the global batch size, but an "
                    f"element has a scalar component ({leaf!r}); call "
                    "dataset.batch(global_batch_size) before distributing it")
            if n is None:
                n = shape[0]
            elif shape[0] != n:
                raise ValueError(f"the components of a batch have different numbers of rows "
                                 f"({n} and {shape[0]}); every component of a batch must have "
                                 "the same leading (batch) dimension")
        return n

    def flatten(self, element: Any) -> list:
        if self._structure is None:
            self._structure = element
            self._single = not nest.is_nested(element)
        return [element] if self._single else nest.flatten(element)

    def pack(self, flat: list) -> Any:
        return flat[0] if self._single else nest.pack_sequence_as(self._structure, flat)

    def pieces(self, element: Any) -> list:
        """All ``num_pieces`` pieces of ``element``, in replica order."""
        flat = self.flatten(element)
        n = self.rows(flat)
        out = []
        start = 0
        for size in split_sizes(n, self.num_pieces):
            stop = start + size
            out.append(self.pack([leaf[start:stop] for leaf in flat]))
            start = stop
        return out

    def pieces_dealt(self, element: Any, first: int, stride: int, count: int) -> list:
        """Pieces ``first, first+stride, ..., first+(count-1)*stride`` of ``element``:
        a worker's share under DATA, where the pieces are dealt round-robin over
        ``stride`` workers."""
        flat = self.flatten(element)
        n = self.rows(flat)
        sizes = split_sizes(n, self.num_pieces)
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        out = []
        for k in range(first, first + stride * count, stride):
            start, stop = starts[k], starts[k + 1]
            out.append(self.pack([leaf[start:stop] for leaf in flat]))
        return out

    def empty_like(self, element: Any) -> Any:
        """A zero-row piece with ``element``'s structure, trailing shapes and dtypes."""
        flat = self.flatten(element)
        return self.pack([leaf[:0] for leaf in flat])


def deal_steps(batches: Iterator, splitter: Splitter, worker: int, num_workers: int,
               local: int, stream: bool) -> Iterator[list]:
    """Yield one list of ``local`` pieces per step.

    ``stream=False`` (DATA, or one worker): the ``N`` pieces of every global batch are
    dealt round-robin over the workers and each worker hands its pieces to its replicas
    in order, so worker ``w`` takes pieces ``w, w + W, ..., w + (local-1)*W`` (``W``
    workers); a step is one global batch over all replicas in sync. ``stream=True``
    (FILE and OFF across workers): each worker cuts its own batches into ``N`` pieces and
    its replicas take them ``local`` at a time, ``num_workers`` steps per batch (fewer
    when a batch has empty pieces: see :func:`stream_steps_per_batch`).
    """
    if num_workers == 1:
        for batch in batches:
            yield splitter.pieces(batch)
        return
    if not stream:
        for batch in batches:
            yield splitter.pieces_dealt(batch, worker, num_workers, local)
        return
    for batch in batches:
        pieces = splitter.pieces(batch)
        rows = splitter.rows(splitter.flatten(batch))
        for s in range(stream_steps_per_batch(rows, splitter.num_pieces, local)):
            yield pieces[s * local:(s + 1) * local]


def stream_steps_per_batch(rows: int, num_pieces: int, local: int) -> int:
    """Steps one batch of ``rows`` rows gives a worker under FILE or OFF: its non-empty
    pieces, ``local`` at a time (the ceil cut puts the empty pieces last). A step whose
    pieces would all be empty is left out, as TensorFlow 2.21 leaves it out, so that no
    step is empty on every worker. Examples with 2 pieces and ``local=1``: 4 rows give 2
    steps, 1 row gives 1, 0 rows give 0."""
    nonempty = sum(1 for size in split_sizes(rows, num_pieces) if size)
    return -(-nonempty // local)
