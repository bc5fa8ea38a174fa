"""``rebatch``: the rows of batches regrouped into batches of other sizes.

``ds.rebatch(sizes)`` gives what ``ds.unbatch().batch(N)`` would, with ``N`` cycling
through ``sizes`` (an int or a list of ints, zeros allowed), without unbatching: rows
are taken as slices of the input batches (a view when one input batch holds all of an
output batch, else one concatenation per component). An output batch may span input
batches. With ``drop_remainder`` a last batch with fewer rows than its size is dropped.

The batch dimension of the spec is static, ``b``, only when every size is ``b`` and
every output batch has ``b`` rows: under ``drop_remainder``, or when the input's static
batch dimension is a multiple of ``b`` (as ``tf.data`` decides). The cardinality is
unknown, as in ``tf.data``.
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from gpustrat import devices, nest
from gpustrat.data import structure as st
from gpustrat.data.dataset import UNKNOWN_CARDINALITY, Dataset
from gpustrat.data.iterator_state import StateIterator, load_element, save_element
from gpustrat.data.spec import TensorSpec
from gpustrat.data.unary import UnaryDataset, _close


def _check_sizes(batch_sizes) -> list[int]:
    sizes = batch_sizes.tolist() if isinstance(batch_sizes, np.ndarray) else batch_sizes
    if isinstance(sizes, (int, np.integer)) and not isinstance(sizes, bool):
        sizes = [sizes]
    if not isinstance(sizes, (list, tuple)) or not sizes:
        raise ValueError(f"rebatch: batch_size must be an int or a non-empty list of ints, "
                         f"got {batch_sizes!r}")
    out = []
    for s in sizes:
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0:
            raise ValueError(f"rebatch: batch sizes must be non-negative ints, got {s!r} "
                             f"in {batch_sizes!r}")
        out.append(int(s))
    if not any(out):
        raise ValueError(f"rebatch: at least one batch size must be positive, got "
                         f"{batch_sizes!r} (only empty batches would come out, forever)")
    return out


class RebatchDataset(UnaryDataset):
    """``rebatch(batch_size, drop_remainder)``."""

    def __init__(self, input_dataset: Dataset, batch_size, drop_remainder: bool = False):
        super().__init__(input_dataset)
        self._sizes = _check_sizes(batch_size)
        self._drop = bool(drop_remainder)

    def _cardinality(self):
        return UNKNOWN_CARDINALITY  # as tf.data

    def _compute_spec(self):
        spec = self._input.element_spec
        dims = []
        for s in nest.flatten(spec):
            if not isinstance(s, TensorSpec) or not s.shape:
                raise ValueError(f"rebatch needs batched elements (every component of rank "
                                 f">= 1), but the element_spec is {spec}: call "
                                 ".batch(batch_size) before rebatch")
            dims.append(s.shape[0])
        known = {d for d in dims if d is not None}
        if len(known) > 1:
            raise ValueError(f"rebatch: the components' batch dimensions differ "
                             f"({dims}); they must be equal")
        new = None
        if len(set(self._sizes)) == 1:
            b = self._sizes[0]
            if self._drop or (known and b and next(iter(known)) % b == 0):
                new = b
        return nest.map_structure(lambda s: TensorSpec((new,) + s.shape[1:], s.dtype), spec)

    def _iter(self, ctx):
        it = self._input._iter(ctx)
        pending: collections.deque = collections.deque()  # [leaves, start row]
        state = {"rows": 0, "template": None, "done": False, "plan": None}

        def pull() -> bool:
            element = next(it, None)
            if element is None:
                state["done"] = True
                return False
            if state["plan"] is None:
                self.element_spec  # a clear error for unbatched input, before any batch
                state["plan"] = st.make_plan(element)
            leaves = list(state["plan"][0](element))
            rows = {st.leading_dim(v) for v in leaves}
            if len(rows) != 1:
                raise ValueError(f"rebatch: an element's components have different "
                                 f"batch dimensions {sorted(rows)}; they must be equal")
            if state["template"] is None:
                state["template"] = [v[:0] for v in leaves]
            n = rows.pop()
            if n:
                pending.append([leaves, 0])
                state["rows"] += n
            return True

        def take(k: int) -> list:
            state["rows"] -= k
            return _take_rows(pending, k)

        try:
            for k in itertools.cycle(self._sizes):
                while state["rows"] < k and not state["done"]:
                    pull()
                if k == 0:
                    if state["template"] is None and not pull():
                        empty = self._empty_from_spec()
                        if empty is None:
                            return
                        state["plan"], state["template"] = empty
                    yield state["plan"][1](list(state["template"]))
                    continue
                if state["rows"] >= k:
                    yield state["plan"][1](take(k))
                    continue
                # The input has ended with fewer rows than this batch needs.
                if state["rows"] and not self._drop:
                    yield state["plan"][1](take(state["rows"]))
                return
        finally:
            _close(it)

    def _empty_from_spec(self):
        """``(plan, leaves)`` of an empty batch made from the element spec, for a batch
        of size 0 before the input gave any element (as tf.data: unknown dimensions are
        0); None where the spec is unknown."""
        try:
            spec = self._input.element_spec
        except ValueError:
            return None
        specs = nest.flatten(spec)
        if not all(isinstance(x, TensorSpec) and x.shape for x in specs):
            return None
        leaves = [np.zeros((0,) + tuple(d or 0 for d in x.shape[1:]), x.dtype)
                  for x in specs]
        return st.make_plan(spec), leaves

    def _state_iter(self, ctx):
        return _RebatchIterator(self, self._input._state_iter(ctx))


class _RebatchIterator(StateIterator):
    """``rebatch``: the state is the input's, the rows read but not yet handed out
    (the rest of the input batches they belong to), and which size comes next."""

    def __init__(self, node: RebatchDataset, source: StateIterator):
        self._node = node
        self._inputs = (source,)
        self._pending: collections.deque = collections.deque()   # [leaves, start row]
        self._rows = 0
        self._template = None   # the leaves of an empty batch, once one was read
        self._plan = None
        self._done = False      # the input has ended
        self._finished = False  # so has the output
        self._next_size = 0     # index into node._sizes

    def _pull(self) -> bool:
        try:
            element = next(self._inputs[0])
        except StopIteration:
            self._done = True
            return False
        if self._plan is None:
            self._node.element_spec  # a clear error for unbatched input, before any batch
            self._plan = st.make_plan(element)
        leaves = list(self._plan[0](element))
        rows = {st.leading_dim(v) for v in leaves}
        if len(rows) != 1:
            raise ValueError(f"rebatch: an element's components have different "
                             f"batch dimensions {sorted(rows)}; they must be equal")
        if self._template is None:
            self._template = [v[:0] for v in leaves]
        n = rows.pop()
        if n:
            self._pending.append([leaves, 0])
            self._rows += n
        return True

    def _take(self, k: int) -> list:
        self._rows -= k
        return _take_rows(self._pending, k)

    def __next__(self):
        if self._finished:
            raise StopIteration
        sizes = self._node._sizes
        k = sizes[self._next_size]
        self._next_size = (self._next_size + 1) % len(sizes)
        while self._rows < k and not self._done:
            self._pull()
        if k == 0:
            if self._template is None and not self._pull():
                empty = self._node._empty_from_spec()
                if empty is None:
                    self._finished = True
                    raise StopIteration
                self._plan, self._template = empty
            return self._plan[1](list(self._template))
        if self._rows >= k:
            return self._plan[1](self._take(k))
        # The input has ended with fewer rows than this batch needs.
        self._finished = True
        if self._rows and not self._node._drop:
            return self._plan[1](self._take(self._rows))
        raise StopIteration

    def save(self):
        return {"input": self._inputs[0].save(),
                "pending": [save_element(tuple(v[start:] for v in leaves))
                            for leaves, start in self._pending],
                "template": None if self._template is None else
                save_element(tuple(self._template)),
                "done": self._done, "finished": self._finished,
                "next_size": self._next_size}

    def restore(self, state):
        self._inputs[0].restore(state["input"])
        self._pending = collections.deque([list(load_element(p)), 0]
                                          for p in state["pending"])
        self._rows = sum(st.leading_dim(p[0][0]) for p in self._pending)
        if state["template"] is not None:
            self._template = list(load_element(state["template"]))
            self._plan = st.make_plan(self._node._input.element_spec)
        self._done, self._finished = bool(state["done"]), bool(state["finished"])
        self._next_size = int(state["next_size"])


def _take_rows(pending, k: int) -> list:
    """The next ``k`` rows of ``pending`` (a deque of ``[leaves, first unread row]``),
    as one list of leaves: views where they come from one element, else concatenated."""
    parts = []
    while k:
        leaves, start = pending[0]
        n = st.leading_dim(leaves[0]) - start
        used = min(n, k)
        parts.append([v[start:start + used] for v in leaves])
        k -= used
        if used == n:
            pending.popleft()
        else:
            pending[0][1] = start + used
    if len(parts) == 1:
        return parts[0]
    return [devices.array_module(cols[0]).concatenate(cols) for cols in zip(*parts)]
