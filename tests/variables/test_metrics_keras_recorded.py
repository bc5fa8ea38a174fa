"""Every metric case of ``keras_metric_cases.py`` gives, after each update and after a
reset, what Keras 3 gave (recorded in ``keras_metrics.json`` by
``record_keras_metrics.py``): without a strategy, and on 3 mirrored replicas that each
update with their share of every batch's rows (odd sizes: one replica takes fewer), so
that the replicas' aggregate is the whole batch's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from keras_metric_cases import CASES, batches, make, update

RECORDED = json.loads((Path(__file__).resolve().parent / "keras_metrics.json")
                      .read_text())
# Keras keeps its totals in float32; gpustrat keeps them in the metric's dtype
# (float32) too, but sums rows in another order over the replicas.
TOLERANCE = dict(rtol=2e-6, atol=1e-6)


def _shares(x, n: int) -> list:
    """``x``'s rows in ``n`` consecutive pieces as equal as can be (the first ones one
    row longer), or ``x`` for every replica when it is None."""
    if x is None:
        return [None] * n
    return np.array_split(x, n)


def results(name: str, strategy) -> list:
    cls, kwargs, _, _ = CASES[name]
    if strategy is None:
        m = make(gs.metrics, cls, kwargs)
    else:
        with strategy.scope():
            m = make(gs.metrics, cls, kwargs)
    out = []
    for k, (y_true, y_pred, weight) in enumerate(batches(name)):
        if k == 3:
            m.reset_state()
        if strategy is None:
            update(m, y_true, y_pred, weight)
        else:
            n = strategy.num_replicas_in_sync
            pieces = [_shares(x, n) for x in (y_true, y_pred, weight)]
            values = strategy.experimental_distribute_values_from_function(
                lambda ctx: tuple(p[ctx.replica_id_in_sync_group] for p in pieces))
            strategy.run(lambda v: update(m, *v), args=(values,))
        out.append(np.asarray(m.result()))
    return out


@pytest.mark.parametrize("replicas", [None, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_same_as_keras(name, replicas):
    strategy = None if replicas is None else \
        gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    try:
        got = results(name, strategy)
    finally:
        if strategy is not None:
            strategy.close()
    want = RECORDED["cases"][name]
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, np.asarray(w, np.float32),
                                   err_msg=f"{name}, result after update {k + 1}",
                                   **TOLERANCE)


def test_every_case_is_recorded():
    assert sorted(RECORDED["cases"]) == sorted(CASES)
    assert RECORDED["keras"].startswith("3.")
