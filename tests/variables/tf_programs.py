"""The seeded random programs of ``record_tf_programs.py``: lists of operations on
variables, optimizers, metrics and loss helpers, and the values they use (functions of
the seed, the operation and the global replica id, so that every process of an MPI job
and every library computes the same ones). Not a test module."""

from __future__ import annotations

import random

import numpy as np

SYNCS = ("AUTO", "ON_WRITE", "ON_READ", "NONE")
AGGS = ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA")
DTYPES = ("float32", "float64", "float16", "int32", "int64", "pyfloat", "pyint")
SHAPES = ((), (1,), (3,), (2, 3), (5, 1))
UPDATES = ("assign", "assign_add", "assign_sub")
METRICS = ("Mean", "Sum", "Accuracy", "SparseCategoricalAccuracy")
OPTIMIZERS = ("sgd", "sgd_momentum", "sgd_nesterov", "sgd_schedule", "adam", "adam_amsgrad",
              "adamw")


# --- the values a program uses: the same in every process --------------------------------

def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng([abs(hash_int(k)) for k in key])


def hash_int(k) -> int:
    if isinstance(k, int):
        return k
    return sum((i + 1) * ord(c) for i, c in enumerate(str(k)))


def array(key, shape, dtype) -> np.ndarray:
    """Small values exactly representable in every dtype used (multiples of 1/4)."""
    rng = rng_for(*key)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-5, 6, size=shape).astype(dtype)
    return (rng.integers(-8, 9, size=shape) / 4).astype(dtype)


def rows(key, replica: int, pattern: str) -> int:
    """Examples in one replica's piece: ``full`` (3 each), ``partial`` (0 to 3)."""
    if pattern == "full":
        return 3
    return int(rng_for(*key, "rows", replica).integers(0, 4))


def np_dtype(dtype: str) -> str:
    return {"pyfloat": "float32", "pyint": "int32"}.get(dtype, dtype)


# --- programs --------------------------------------------------------------------------------

def make_program(seed: int, length: int = 14) -> list:
    """A list of operations (JSON-able dicts); the same for any number of replicas."""
    r = random.Random(seed)
    ops: list = []
    variables: list = []   # specs of the variables made so far (made or refused)
    metrics: list = []
    optimizers: list = []
    stepped: set = set()   # optimizers that took a step in replica context

    def new_var():
        sync = r.choice(SYNCS[:3] * 3 + SYNCS[3:])
        spec = dict(kind="create", var=len(ops), sync=sync, agg=r.choice(AGGS),
                    dtype=r.choice(DTYPES), shape=list(r.choice(SHAPES)),
                    init=r.choice(("np", "np", "callable")),
                    trainable=r.choice((None, None, True, False)))
        if spec["dtype"].startswith("py"):
            spec["init"] = "py"
        ops.append(spec)
        refused = sync == "NONE" or (spec["agg"] == "MEAN" and "int" in spec["dtype"])
        if not refused:   # later operations use the variables that were made
            variables.append(spec)

    while len(variables) < r.randint(1, 3):
        new_var()
    for i in range(length):
        kind = r.choice(("replica_update",) * 4 + ("cross_update",) * 2 +
                        ("read_cross", "read_replica", "merge", "merge", "ext_update",
                         "reduce_to", "batch_reduce_to", "reduce", "metric", "metric",
                         "optimizer", "optimizer", "loss", "create", "create_in_run",
                         "reduce_var"))
        if kind == "create":
            new_var()
            continue
        if kind == "create_in_run":
            # Every replica makes it with its own initial value; replica 0's is used.
            spec = dict(kind=kind, var=len(ops), sync=r.choice(SYNCS[:3]),
                        agg=r.choice(AGGS), dtype=r.choice(("float32", "float64")),
                        shape=list(r.choice(SHAPES)), trainable=None)
            ops.append(spec)
            variables.append(spec)
            continue
        v = variables[r.randrange(len(variables))]["var"]
        spec = next(s for s in variables if s["var"] == v)
        mirrored = spec["sync"] in ("AUTO", "ON_WRITE")
        if kind in ("replica_update", "cross_update"):
            value = r.choice(("per", "per", "per", "same", "bad_shape", "other_dtype")
                             if kind == "replica_update" else
                             ("same", "same", "same", "py", "bad_shape", "other_dtype"))
            ops.append(dict(kind=kind, var=v, op=r.choice(UPDATES), value=value, step=i,
                            where=r.choice(("scope", "scope", "outside"))))
            if (kind == "replica_update" and mirrored and spec["agg"] == "NONE") or \
                    value == "other_dtype" or \
                    (kind == "cross_update" and not mirrored):
                # Where the libraries differ on purpose (see expected_difference), set
                # every component to one value so that both go on from the same state.
                ops.append(dict(kind="resync", var=v, step=1000 + i))
        elif kind in ("read_cross", "read_replica"):
            ops.append(dict(kind=kind, var=v, how=r.choice(("read_value", "numpy",
                                                            "add_one", "value")),
                            where=r.choice(("scope", "scope", "outside"))))
        elif kind == "merge":
            how = r.choice(("reduce_sum", "reduce_mean", "update", "assign"))
            ops.append(dict(kind=kind, var=v, step=i, how=how))
            if (how == "assign" and spec["sync"] == "ON_READ" and spec["agg"] == "NONE") or \
                    (how == "update" and mirrored):
                ops.append(dict(kind="resync", var=v, step=1000 + i))
        elif kind == "ext_update":
            ops.append(dict(kind=kind, var=v, step=i, where=r.choice(("cross", "replica")),
                            op=r.choice(UPDATES), group=r.choice((True, False))))
            if mirrored and ops[-1]["where"] == "replica":
                # Each component got its replica's value: mirrored copies now differ
                # (as TensorFlow's); make them equal again.
                ops.append(dict(kind="resync", var=v, step=1000 + i))
        elif kind == "reduce_var":
            # TensorFlow cannot SUM a mirrored variable (an internal AssertionError).
            ops.append(dict(kind=kind, var=v, how=r.choice(("reduce", "reduce_to", "gather")),
                            op="MEAN" if mirrored else r.choice(("SUM", "MEAN"))))
        elif kind in ("reduce_to", "batch_reduce_to", "reduce"):
            count = r.randint(1, 3) if kind == "batch_reduce_to" else 1
            ops.append(dict(kind=kind, var=v, step=i, op=r.choice(("SUM", "MEAN")),
                            shapes=[list(r.choice(SHAPES[1:])) for _ in range(count)],
                            dtype=r.choice(("float32", "float64", "int32")),
                            axis=r.choice((None, None, 0))))
        elif kind == "metric":
            if not metrics or r.random() < 0.3:
                metrics.append(r.choice(METRICS))
                ops.append(dict(kind="metric_create", metric=len(metrics) - 1,
                                cls=metrics[-1]))
            m = r.randrange(len(metrics))
            for _ in range(r.randint(1, 3)):
                ops.append(dict(kind="metric_update", metric=m, cls=metrics[m], step=i,
                                rows=r.choice(("full", "partial")),
                                cols=r.choice((0, 0, 1, 2)),
                                weights=r.choice(("none", "none", "per_example",
                                                  "column")),
                                where=r.choice(("replica",) * 4 + ("cross",))))
            ops.append(dict(kind="metric_result", metric=m,
                            where=r.choice(("cross", "cross", "replica"))))
            if r.random() < 0.3:
                ops.append(dict(kind="metric_reset", metric=m))
        elif kind == "optimizer":
            trainable = [s["var"] for s in variables
                         if s["sync"] in ("AUTO", "ON_WRITE") and
                         s["dtype"] in ("float32", "float64", "pyfloat") and
                         s["trainable"] is not False]
            if not trainable:
                continue
            if not optimizers or r.random() < 0.3:
                chosen = sorted(r.sample(trainable, r.randint(1, len(trainable))))
                optimizers.append(chosen)
                ops.append(dict(kind="opt_create", opt=len(optimizers) - 1,
                                cls=r.choice(OPTIMIZERS), vars=chosen,
                                lr=r.choice((0.1, 0.05, 0.5))))
            o = r.randrange(len(optimizers))
            for k in range(r.randint(1, 3)):
                # Outside any scope the gradients are applied as given (Keras fails
                # in the scope's cross-replica context, and outside it before a step in
                # replica context has made the optimizer's slots).
                where = r.choice(("replica",) * 5 + ("outside",)) if o in stepped \
                    else "replica"
                stepped.add(o)
                ops.append(dict(kind="opt_step", opt=o, vars=optimizers[o],
                                step=i * 10 + k, where=where))
        elif kind == "loss":
            ops.append(dict(kind="loss", step=i, dtype=r.choice(("float32", "float64",
                                                                  "float16")),
                            rows=r.choice(("full", "partial")),
                            weights=r.choice(("none", "scalar", "per_example", "column")),
                            gbs=r.choice((None, None, 6, 7)),
                            cols=r.choice((0, 0, 2)),
                            where=r.choice(("replica",) * 6 + ("cross", "reg"))))
    return ops
