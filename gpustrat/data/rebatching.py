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
from gpustrat.data.spec import TensorSpec
from gpustrat.data.transforms import UnaryDataset, _close


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
            parts = []
            while k:
                leaves, start = pending[0]
                n = st.leading_dim(leaves[0]) - start
                used = min(n, k)
                parts.append([v[start:start + used] for v in leaves])
                k -= used
                state["rows"] -= used
                if used == n:
                    pending.popleft()
                else:
                    pending[0][1] = start + used
            if len(parts) == 1:
                return parts[0]
            return [devices.array_module(cols[0]).concatenate(cols) for cols in zip(*parts)]

        try:
            for k in itertools.cycle(self._sizes):
                while state["rows"] < k and not state["done"]:
                    pull()
                if k == 0:
                    if state["template"] is None and not pull():
                        return
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
