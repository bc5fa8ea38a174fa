"""Helpers of the iterator-position tests: comparable elements, a checkpoint file's
round trip of a state, and resuming a pipeline at every position."""

import io
import json

import numpy as np

from gpustrat import nest
from gpustrat.data.structure import normalize
from gpustrat.train import format as fmt


def canon(element):
    """An element as plain, comparable values (dtypes, values and the outer type)."""
    return [(np.asarray(x).dtype.str, np.asarray(x).tolist()) for x in nest.flatten(element)], \
        type(element).__name__


def roundtrip(state):
    """The state as a checkpoint file would give it back (JSON + .npz)."""
    arrays = {}
    tree = fmt.encode(state, arrays, "it")
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as z:
        return fmt.decode(json.loads(json.dumps(tree)), {k: z[k] for k in z.files})


def state_bytes(state) -> int:
    """What a state costs in a checkpoint: its JSON plus its arrays."""
    arrays = {}
    tree = fmt.encode(state, arrays, "it")
    return len(json.dumps(tree)) + sum(a.nbytes for a in arrays.values())


def resume_everywhere(build, expected=None) -> list:
    """Save after every count of elements k (start and end included), restore into a
    fresh ``build()`` and check that the elements before and after give the
    uninterrupted sequence (``expected`` when given). Returns that sequence and the
    states saved."""
    full = [canon(e) for e in build()]
    if expected is not None:
        assert full == [canon(normalize(e)) for e in expected]
    states = []
    for k in range(len(full) + 1):
        it = iter(build())
        head = [canon(next(it)) for _ in range(k)]
        state = it.get_state()
        states.append(state)
        it.close()
        restored = iter(build())
        restored.set_state(roundtrip(state))
        assert head + [canon(e) for e in restored] == full, k
    return full, states
