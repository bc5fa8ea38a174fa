"""A distributed iterator's position in an element order that does not depend on the
topology, and how each topology continues from it.

Words:
- *stream*: the batches a worker's pipeline yields in an epoch, in order: a function of
  the dataset, its seeds and the epoch. Under DATA and OFF, and on one worker, every
  worker reads the dataset whole, so the stream is the dataset's own (the *global*
  stream), the same whatever the number of workers and replicas. Under FILE each worker
  reads the files it was given: its stream exists only for that number of workers.
- *position*: ``(b, c)``: the stream's batches ``0 .. b-1`` consumed whole and the first
  ``c`` rows of batch ``b``.
- *layout*: how a topology of ``W`` workers x ``R`` replicas per worker (``N = W * R``
  pieces of ``ceil(n / N)`` rows per batch of ``n`` rows, the empty ones last) turns
  batches into steps:
  *dealt* (DATA, and one worker): one step per batch; worker ``w`` takes pieces
  ``w, w + W, ..., w + (R - 1) * W``.
  *stream* (OFF and FILE on several workers): each worker cuts every batch of its
  stream into the ``N`` pieces and takes ``R`` at a time, pieces ``s*R .. s*R + R - 1``
  at step ``s``: ``W`` steps per batch, fewer when the last pieces are empty (a step
  whose pieces would all be empty is left out). Under OFF every worker takes the same
  pieces.
  A step *covers* rows ``[lo, hi)`` of its batch: the rows of all its pieces over every
  worker (the whole batch for a dealt step).
- *continuing* from ``(b, c)`` on a topology: the steps an uninterrupted run of that
  topology takes, from the step of batch ``b`` covering row ``c`` on (the whole epoch
  for ``(0, 0)``); in that first step the rows before ``c`` are taken out of its pieces
  (which become shorter, or empty). Where ``c`` falls on one of that topology's step
  boundaries (the same topology; another replica count under FILE/OFF with pieces that
  divide alike; any batch boundary), that is exactly the uninterrupted run's remaining
  steps; in every case each row after the position is delivered once.

A saved position is its epoch's start (the dataset iterator's state before its first
element), an *origin* ``(b, c)`` (where the iterator continued from: ``(0, 0)`` unless
it was itself restored) and the number of steps taken since, with the layout that took
them. Restoring reads the stream from the start again, replays those steps with the
saved layout to find the position, and continues on the restoring topology.
"""

from __future__ import annotations

from typing import Any, Iterator

from gpustrat.distribute.splitting import Splitter


class Layout:
    """How one topology cuts the batches of a stream into steps (see the module words)."""

    def __init__(self, num_workers: int, local: int, dealt: bool, worker: int = 0):
        self.num_workers, self.local, self.dealt = int(num_workers), int(local), bool(dealt)
        self.worker = int(worker)
        self.num_pieces = self.num_workers * self.local

    @classmethod
    def of(cls, state: dict) -> "Layout":
        """The layout that took the steps of a saved distributed iterator position."""
        workers, local = state["topology"]
        return cls(workers, local, state["layout"] == "dealt", int(state["worker"]))

    def __repr__(self) -> str:
        return (f"Layout({self.num_workers}x{self.local}, "
                f"{'dealt' if self.dealt else 'stream'})")

    def _piece_rows(self, n: int) -> int:
        return -(-n // self.num_pieces) if n else 0

    def steps(self, n: int) -> list[tuple[int, int]]:
        """The rows ``[lo, hi)`` each step of a batch of ``n`` rows covers."""
        if self.dealt:
            return [(0, n)]
        p = self._piece_rows(n)
        if not p:
            return []
        nonempty = -(-n // p)
        span = self.local * p
        return [(s * span, min(n, (s + 1) * span))
                for s in range(-(-nonempty // self.local))]

    def kept(self, n: int, c: int) -> list[int]:
        """The steps of a batch of ``n`` rows that hold rows at or after row ``c``."""
        bounds = self.steps(n)
        if c <= 0:
            return list(range(len(bounds)))
        return [s for s, (_, hi) in enumerate(bounds) if hi > c]

    def pieces(self, n: int, step: int) -> list[tuple[int, int]]:
        """The rows ``[a, b)`` of this worker's pieces (one per local replica) at
        ``step`` of a batch of ``n`` rows."""
        p = self._piece_rows(n)
        if self.dealt:
            index = [self.worker + j * self.num_workers for j in range(self.local)]
        else:
            index = [step * self.local + j for j in range(self.local)]
        return [(min(n, k * p), min(n, (k + 1) * p)) for k in index]

    def steps_left(self, card: int, rows: tuple[int, int] | None, position: tuple,
                   current_rows: int | None = None) -> int | None:
        """Steps from ``position`` to the end of a stream of ``card`` batches whose rows
        are ``rows`` = (every batch but the last, the last); None where unknown."""
        b, c = position
        if b >= card:
            return 0
        if self.dealt:
            return card - b
        if rows is None:
            return None
        full, last = rows
        n_b = current_rows if current_rows is not None else (full if b < card - 1 else last)
        total = len(self.kept(n_b, c))
        if b < card - 1:
            total += (card - 2 - b) * len(self.steps(full)) + len(self.steps(last))
        return total


def replay(source: Iterator, layout: Layout, origin: tuple, steps: int,
           splitter: Splitter) -> tuple[tuple[int, int], Any]:
    """Read ``source`` (a stream at its start) past ``steps`` steps of ``layout`` taken
    from ``origin``: ``(position, current)``, where ``current`` is the partly consumed
    batch ``b`` already read (None when ``c == 0``: ``source`` is then at batch ``b``)."""
    b, c = (int(v) for v in origin)
    current = None
    for _ in range(b):
        if next(source, _END) is _END:
            return (b, 0), None
    if c:
        current = next(source, _END)
        if current is _END:
            return (b, 0), None
    left = int(steps)
    while left > 0:
        batch = current if current is not None else next(source, _END)
        current = None
        if batch is _END:
            break   # the remaining steps were empty ones, padded at the end of data
        if layout.dealt and not c:
            left -= 1
            b += 1
            continue
        n = splitter.rows(splitter.flatten(batch))
        kept = layout.kept(n, c)
        if left >= len(kept):
            left -= len(kept)
            b, c = b + 1, 0
            continue
        c = layout.steps(n)[kept[left - 1]][1]
        current, left = batch, 0
    return (b, c), current


def clipped_steps(batch, c: int, layout: Layout, splitter: Splitter) -> list[list]:
    """This worker's steps of a batch consumed up to row ``c``: the steps holding rows
    from ``c`` on, with the rows before ``c`` taken out of their pieces."""
    flat = splitter.flatten(batch)
    n = splitter.rows(flat)
    out = []
    for s in layout.kept(n, c):
        out.append([splitter.pack([leaf[max(a, c):max(hi, c)] for leaf in flat])
                    for a, hi in layout.pieces(n, s)])
    return out


_END = object()


# --- what a position may be restored onto -------------------------------------------

def describe_topology(topology, policy: str) -> str:
    return f"{topology[0]} worker(s) x {topology[1]} replica(s) per worker (policy {policy})"


def source_state(states: list, worker: int) -> dict:
    """The saved state a worker continues from when the number of workers changed:
    worker ``k`` takes saved worker ``k mod W``'s (under DATA they are all alike; under
    OFF each worker read the whole dataset, in its own order for an unseeded shuffle)."""
    return states[worker % len(states)]


def upgrade(state: dict) -> dict:
    """A position saved before positions named their stream (a step count from the start
    of the epoch, with ``batch_aligned``), in today's form."""
    if "stream" in state:
        return state
    policy = str(state.get("policy", "FUNCTION"))
    if policy == "FUNCTION":
        return {**state, "stream": "function"}
    dealt = bool(state.get("batch_aligned"))
    kind = "global" if dealt or not policy.endswith("FILE") else "worker"
    return {**state, "stream": kind, "origin": [0, 0],
            "layout": "dealt" if dealt else "stream"}


def check_compatible(state: dict, kind: str, topology: list, policy: str,
                     worker: int) -> None:
    """Raise ValueError unless a position saved as ``state`` can continue on a topology
    whose stream is ``kind`` ("global", "worker" or "function")."""
    saved_kind = state.get("stream", "function")
    saved_top = list(state["topology"])
    saved = describe_topology(saved_top, state.get("policy", "?"))
    here = describe_topology(topology, policy)
    if saved_kind == "global" and kind == "global":
        return
    if saved_kind == "worker" and kind == "worker" and saved_top[0] == topology[0]:
        if int(state["worker"]) != worker:
            raise ValueError(f"this position was saved by worker {state['worker']}, not "
                             f"worker {worker}: each worker restores its own position")
        return
    if saved_kind == "function" and kind == "function" and saved_top == list(topology):
        if int(state["worker"]) != worker:
            raise ValueError(f"this position was saved by worker {state['worker']}, not "
                             f"worker {worker}: each worker restores its own position")
        return
    if saved_kind == "worker" and kind == "worker":
        why = ("under the FILE policy each worker reads its own files, so its position "
               "exists only for the same number of workers (any number of replicas per "
               f"worker): restart with {saved_top[0]} workers, or use "
               "AutoShardPolicy.DATA or OFF, whose positions move to any topology")
    elif saved_kind == "function" or kind == "function":
        why = ("a distribute_datasets_from_function position depends on the topology "
               "(each worker's dataset_fn builds its own pipeline): restart with the saved "
               "topology")
    else:
        why = ("a FILE position (each worker's own files) and a DATA/OFF or one-worker "
               "position (the whole dataset's stream) are positions in different "
               "streams: restore with the auto-shard policy and worker count it was "
               "saved with")
    raise ValueError(f"cannot restore a distributed iterator saved on {saved} onto "
                     f"{here}: {why}")
