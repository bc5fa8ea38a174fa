"""The update cases of ``tf_recorded_variables``, run on gpustrat (in process or in an
mpiexec child): each returns this worker's components after the update, or the error
type, in the shape TensorFlow's values were recorded in."""

from __future__ import annotations

import numpy as np

import gpustrat as gs

SYNCS = ("ON_WRITE", "ON_READ")
DTYPES = ("float32", "int32")
AGGS = ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")
OPS = ("assign", "assign_add", "assign_sub")


def components(strategy, v) -> list:
    return [np.asarray(c).tolist() for c in strategy.experimental_local_results(v)]


def error(e: BaseException) -> str:
    return f"ERR {type(e).__name__}"


def make(strategy, sync: str, dtype: str, agg: str):
    with strategy.scope():
        return gs.Variable(np.array([1, 2], dtype), synchronization=sync, aggregation=agg)


def reset(strategy, v, dtype: str) -> None:
    for c in strategy.experimental_local_results(v):
        c.assign(np.array([1, 2], dtype))


def replica_update(strategy, v, op: str, dtype: str):
    """``op`` in replica context; returns (components, values read inside run,
    value read in cross-replica context) or an error string."""
    def fn():
        r = gs.get_replica_context().replica_id_in_sync_group
        getattr(v, op)((r + 1) * np.array([10, 20], dtype))
        return v.read_value()
    try:
        out = strategy.run(fn)
    except Exception as e:  # noqa: BLE001 - the error is the recorded outcome
        return error(e)
    read = [np.asarray(x).tolist() for x in strategy.experimental_local_results(out)]
    try:
        with strategy.scope():
            cross = np.asarray(v.read_value()).tolist()
    except Exception as e:  # noqa: BLE001
        cross = error(e)
    return components(strategy, v), read, cross


def cross_update(strategy, v, op: str, dtype: str):
    try:
        with strategy.scope():
            getattr(v, op)(np.array([5, 7], dtype))
    except Exception as e:  # noqa: BLE001
        return error(e)
    return components(strategy, v)


def expected(table: dict, key: str, first: int, count: int):
    """TensorFlow's outcome for ``key``: this worker's slice of the components (global
    replicas ``first .. first + count - 1``), an error type, or a plain value."""
    want = table[key]
    if isinstance(want, str) and want.startswith("ERR"):
        return want.split(":")[0]
    if key.endswith("/cross_read"):
        return want
    return want[first:first + count]


def compare_all(strategy, table: dict) -> list:
    """Every recorded case on ``strategy``; returns the mismatches as strings.

    The deliberate difference from TensorFlow: a mirrored variable with aggregation
    NONE updated in replica context raises ValueError (TensorFlow lets the copies
    diverge)."""
    n_local = len(strategy.local_devices)
    first = strategy.worker_index * n_local
    bad = []
    for sync in SYNCS:
        for dt in DTYPES:
            for agg in AGGS:
                key = f"{sync}/{dt}/{agg}"
                try:
                    v = make(strategy, sync, dt, agg)
                except Exception as e:  # noqa: BLE001
                    want = expected(table, key + "/create", 0, 0)
                    if error(e) != want:
                        bad.append(f"{key}/create: got {error(e)}, TF {want}")
                    continue
                if key + "/create" in table:
                    bad.append(f"{key}/create: made a variable, TF raised")
                    continue
                for op in OPS:
                    reset(strategy, v, dt)
                    got = replica_update(strategy, v, op, dt)
                    k = f"{key}/replica/{op}"
                    if sync == "ON_WRITE" and agg == "NONE":
                        if got != "ERR ValueError":
                            bad.append(f"{k}: got {got}, want ValueError (deliberate)")
                    elif isinstance(got, str):
                        bad.append(f"{k}: got {got}, TF {table[k]}")
                    else:
                        comps, read, cross = got
                        for kk, g in ((k, comps), (k, read), (k + "/cross_read", cross)):
                            want = expected(table, kk, first, n_local)
                            if g != want:
                                bad.append(f"{kk}: got {g}, TF {want}")
                    reset(strategy, v, dt)
                    k = f"{key}/cross/{op}"
                    got = cross_update(strategy, v, op, dt)
                    want = expected(table, k, first, n_local)
                    if got != want:
                        bad.append(f"{k}: got {got}, TF {want}")
    return bad
