"""Random programs over variables, optimizers, metrics and loss helpers, run with real
TensorFlow (``MirroredStrategy`` on logical CPUs) or with gpustrat, and compared.

Not a test and not imported by the tests (pytest collects ``test_*.py`` only); the
regression tests hard-code what this script found. A program is a seeded list of
operations (see :func:`make_program`): variables made with every synchronization,
aggregation and dtype; ``assign``/``assign_add``/``assign_sub`` in replica context (each
replica with its own value) and in cross-replica context; reads in both contexts;
``merge_call``; ``strategy.extended.update``/``reduce_to``/``batch_reduce_to``;
``strategy.reduce``; metrics' ``update_state``/``result``/``reset_state``; SGD (momentum,
Nesterov, a schedule), Adam and AdamW steps with per-replica gradients;
``compute_average_loss`` with and without ``global_batch_size`` and sample weights,
over pieces of unequal size (partial batches). Each operation's outcome is recorded as
values, dtypes and shapes (per replica where the result is per replica), or the type of
the exception raised (messages are not compared: gpustrat words its own).

With a venv that has ``tensorflow-cpu==2.21.*`` (Keras 3)::

    /path/to/tf-venv/bin/python tests/variables/record_tf_programs.py tf \\
        --seeds 0:200 --replicas 1,2,3,4 > /tmp/tf_programs.json
    python tests/variables/record_tf_programs.py gs --seeds 0:200 --replicas 1,2,3,4 \\
        --compare /tmp/tf_programs.json

and across MPI workers, against a one-process recording of the same total replicas
(``--local`` replicas on each of the ``-n`` ranks; rank 0 prints the differences)::

    python tests/variables/record_tf_programs.py gs --seeds 0:200 --replicas 4 \\
        > /tmp/gs4.json
    mpiexec -n 2 python tests/variables/record_tf_programs.py gs-mpi --local 2 \\
        --seeds 0:200 --compare /tmp/gs4.json

The documented differences from TensorFlow are not reported (see
:func:`expected_difference`): updating a mirrored variable with aggregation NONE in
replica context is a ValueError here (TensorFlow lets the copies diverge; the program
assigns the variable in cross-replica context right after, so both libraries go on from
the same state), and ``compute_average_loss`` without ``global_batch_size`` divides by
the true number of examples of the global batch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
from pathlib import Path

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


# --- the two libraries, by the same names ---------------------------------------------------

_TF_STRATEGIES: dict = {}


class Api:
    """What a program needs from either library."""

    def __init__(self, which: str, n: int, local: int | None = None):
        self.which = which
        self.n = n
        if which == "tf":
            import keras
            import tensorflow as tf
            self.tf, self.keras = tf, keras
            # One strategy per replica count: TensorFlow's eager collectives number
            # their instances per process, and a new strategy's reuse the numbers.
            if n not in _TF_STRATEGIES:
                _TF_STRATEGIES[n] = tf.distribute.MirroredStrategy(
                    [f"/cpu:{i}" for i in range(n)])
            self.strategy = _TF_STRATEGIES[n]
            self.Variable = tf.Variable
            self.Sync, self.Agg = tf.VariableSynchronization, tf.VariableAggregation
            self.ReduceOp = tf.distribute.ReduceOp
            self.nn = tf.nn
            self.metrics = keras.metrics
        else:
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            import gpustrat as gs
            self.gs = gs
            if which == "gs-mpi":
                self.strategy = gs.MultiWorkerMirroredStrategy(
                    devices=[f"cpu:{i}" for i in range(local)])
            else:
                self.strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
            self.Variable = gs.Variable
            self.Sync, self.Agg = gs.VariableSynchronization, gs.VariableAggregation
            self.ReduceOp = gs.ReduceOp
            self.nn = gs.nn
            self.metrics = gs.metrics

    def close(self) -> None:
        if self.which != "tf":
            self.strategy.close()

    def replica_context(self):
        if self.which == "tf":
            return self.tf.distribute.get_replica_context()
        return self.gs.get_replica_context()

    def per_replica(self, fn):
        """A per-replica value: ``fn(global replica id)`` on each replica (as tensors
        for TensorFlow, whose Keras optimizers refuse NumPy gradients)."""
        if self.which == "tf":
            tf = self.tf
            return self.strategy.experimental_distribute_values_from_function(
                lambda ctx: tf.nest.map_structure(
                    tf.constant, fn(int(ctx.replica_id_in_sync_group))))
        return self.strategy.experimental_distribute_values_from_function(
            lambda ctx: fn(int(ctx.replica_id_in_sync_group)))

    def host(self, x):
        """A replica's value as NumPy (TensorFlow converts NumPy values into a
        variable's dtype where it refuses a tensor of another dtype)."""
        return x.numpy() if hasattr(x, "numpy") else x

    def local(self, value) -> tuple:
        return tuple(self.strategy.experimental_local_results(value))

    def optimizer(self, cls: str, lr: float):
        if self.which == "tf":
            opt = self.keras.optimizers
            sched = _tf_schedule(self.keras)
        else:
            opt = self.gs.optimizers
            sched = schedule
        return {"sgd": lambda: opt.SGD(lr),
                "sgd_momentum": lambda: opt.SGD(lr, momentum=0.9),
                "sgd_nesterov": lambda: opt.SGD(lr, momentum=0.5, nesterov=True),
                "sgd_schedule": lambda: opt.SGD(sched),
                "adam": lambda: opt.Adam(lr),
                "adam_amsgrad": lambda: opt.Adam(lr, amsgrad=True),
                "adamw": lambda: opt.AdamW(lr, weight_decay=0.1)}[cls]()


def schedule(step):
    """A learning-rate schedule, ``0.2 * 0.5 ** step``."""
    return 0.2 * 0.5 ** step


def _tf_schedule(keras):
    class Halving(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return 0.2 * 0.5 ** keras.ops.cast(step, "float32")
    return Halving()


# --- describing outcomes, the same way for both ---------------------------------------------

def to_numpy(x) -> np.ndarray:
    if hasattr(x, "numpy"):
        return np.asarray(x.numpy())
    return np.asarray(x)


def leaf(x) -> dict:
    a = to_numpy(x)
    return {"v": a.tolist(), "dtype": str(a.dtype), "shape": list(a.shape)}


def error(e: BaseException) -> dict:
    return {"err": type(e).__name__}


def per(api, value) -> dict:
    """A per-replica outcome: one leaf per local replica."""
    return {"per": [leaf(c) for c in api.local(value)]}


def one(x) -> dict:
    return {"one": leaf(x)}


# --- running a program -----------------------------------------------------------------------

class Runner:
    def __init__(self, api: Api, seed: int):
        self.api = api
        self.seed = seed
        self.vars: dict = {}
        self.metrics: dict = {}
        self.opts: dict = {}

    def run(self, program: list) -> list:
        out = []
        for i, op in enumerate(program):
            try:
                got = getattr(self, "op_" + op["kind"])(op)
            except Exception as e:  # noqa: BLE001 - the error is the outcome
                got = error(e)
                if os.environ.get("RECORD_DEBUG"):
                    print(f"seed {self.seed} op {i} {op}: {type(e).__name__}: {e}",
                          file=sys.stderr)
            out.append({"i": i, "kind": op["kind"], **got})
        return out

    # --- variables ------------------------------------------------------------------
    def var(self, op):
        v = self.vars.get(op["var"])
        if v is None:
            raise LookupError("variable not made")
        return v

    def components(self, v) -> dict:
        return per(self.api, v)

    def op_create(self, op):
        api = self.api
        dtype = np_dtype(op["dtype"])
        value = array((self.seed, "init", op["var"]), op["shape"], dtype)
        init = value.tolist() if op["init"] == "py" else \
            (lambda: value) if op["init"] == "callable" else value
        kw = dict(synchronization=getattr(api.Sync, op["sync"]),
                  aggregation=getattr(api.Agg, op["agg"]), name=f"v{op['var']}")
        if op["trainable"] is not None:
            kw["trainable"] = op["trainable"]
        with api.strategy.scope():
            v = api.Variable(init, **kw)
        self.vars[op["var"]] = v
        dt = v.dtype
        return {"what": [type(v).__name__, bool(v.trainable),
                         getattr(dt, "name", str(dt)), list(v.shape),
                         v.synchronization.name, v.aggregation.name],
                "comps": self.components(v)["per"]}

    def op_create_in_run(self, op):
        api = self.api
        shape, dtype = op["shape"], op["dtype"]

        def fn():
            r = int(api.replica_context().replica_id_in_sync_group)
            v = api.Variable(array((self.seed, "init", op["var"], r), shape, dtype),
                             synchronization=getattr(api.Sync, op["sync"]),
                             aggregation=getattr(api.Agg, op["agg"]), name=f"v{op['var']}")
            made.append(v)
            return v.read_value()
        made: list = []
        got = api.strategy.run(fn)
        v = made[0]
        assert all(m is v for m in made), "replicas made different variables"
        self.vars[op["var"]] = v
        return {"what": [type(v).__name__, bool(v.trainable), str(np.dtype(
            getattr(v.dtype, "as_numpy_dtype", v.dtype))), list(v.shape),
            v.synchronization.name, v.aggregation.name],
            "ret": per(api, got)["per"], "comps": self.components(v)["per"]}

    def op_reduce_var(self, op):
        api = self.api
        v = self.var(op)
        with api.strategy.scope():
            if op["how"] == "reduce":
                return one(api.strategy.reduce(getattr(api.ReduceOp, op["op"]), v, axis=None))
            if op["how"] == "gather":
                return one(api.strategy.gather(v, axis=0))
            return per(api, api.strategy.extended.reduce_to(
                getattr(api.ReduceOp, op["op"]), v, destinations=v))

    def update_value(self, op, v, replica: int | None):
        dtype = np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype))
        shape = list(v.shape)
        kind = op["value"]
        key = (self.seed, "upd", op["step"])
        if kind == "bad_shape":
            return array(key, shape + [2], dtype)
        if kind == "other_dtype":   # a float into an int variable, or the reverse
            return array(key, shape, "float32") + 0.5 if dtype.kind in "iu" else \
                array(key, shape, "int32")
        if kind == "py":
            return array(key, shape, dtype).tolist()
        if kind == "per" and replica is not None:
            return array(key + (replica,), shape, dtype)
        return array(key, shape, dtype)

    def op_replica_update(self, op):
        api = self.api
        v = self.var(op)
        x = api.per_replica(lambda r: self.update_value(op, v, r))

        def fn(x):
            getattr(v, op["op"])(api.host(x))
            return v.read_value()
        got = api.strategy.run(fn, args=(x,))
        return {"ret": per(api, got)["per"], "comps": self.components(v)["per"]}

    def op_resync(self, op):
        api = self.api
        v = self.var(op)
        d = array((self.seed, "resync", op["step"]), list(v.shape),
                  np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)))
        with api.strategy.scope():
            api.strategy.extended.update(v, lambda c, d: c.assign(d), args=(d,))
        return {"comps": self.components(v)["per"]}

    def op_cross_update(self, op):
        v = self.var(op)
        with self.context(op):
            getattr(v, op["op"])(self.update_value(op, v, None))
        return {"comps": self.components(v)["per"]}

    def read(self, v, how):
        if how == "read_value":
            return v.read_value()
        if how == "numpy":
            return v.numpy()
        if how == "value":
            return v.value()
        return v + 1

    def context(self, op):
        """The strategy's scope, or nothing (outside any scope a distributed variable
        behaves as in its strategy's cross-replica context)."""
        if op.get("where", "scope") == "outside":
            return contextlib.nullcontext()
        return self.api.strategy.scope()

    def op_read_cross(self, op):
        v = self.var(op)
        with self.context(op):
            return one(self.read(v, op["how"]))

    def op_read_replica(self, op):
        api = self.api
        v = self.var(op)
        how = "read_value" if op["how"] == "numpy" else op["how"]  # no numpy() in run
        return per(api, api.strategy.run(lambda: self.read(v, how)))

    def op_merge(self, op):
        api = self.api
        v = self.var(op)
        dtype = np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype))
        x = api.per_replica(lambda r: array((self.seed, "merge", op["step"], r),
                                            list(v.shape), dtype))
        how = op["how"]

        def merge_fn(strategy, x):
            if how == "reduce_sum":
                return strategy.reduce(api.ReduceOp.SUM, x, axis=None)
            if how == "reduce_mean":
                return strategy.reduce(api.ReduceOp.MEAN, x, axis=None)
            if how == "update":
                strategy.extended.update(v, lambda c, d: c.assign_add(d), args=(x,))
                return None
            v.assign(strategy.reduce(api.ReduceOp.SUM, x, axis=None))
            return None

        def fn(x):
            out = api.replica_context().merge_call(merge_fn, args=(x,))
            return out if out is not None else v.read_value()
        got = api.strategy.run(fn, args=(x,))
        return {"ret": per(api, got)["per"], "comps": self.components(v)["per"]}

    def op_ext_update(self, op):
        api = self.api
        v = self.var(op)
        dtype = np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype))
        upd = op["op"]

        def fn(c, d):
            getattr(c, upd)(d)
            return c.read_value()
        if op["where"] == "cross":
            d = array((self.seed, "ext", op["step"]), list(v.shape), dtype)
            with api.strategy.scope():
                got = api.strategy.extended.update(v, fn, args=(d,), group=op["group"])
            ret = [leaf(c) for c in (got if not op["group"] else api.local(got))]
            return {"ret": ret, "comps": self.components(v)["per"]}
        x = api.per_replica(lambda r: array((self.seed, "ext", op["step"], r),
                                            list(v.shape), dtype))

        def replica_fn(x):
            api.strategy.extended.update(v, fn, args=(x,), group=op["group"])
            return v.read_value()
        got = api.strategy.run(replica_fn, args=(x,))
        return {"ret": per(api, got)["per"], "comps": self.components(v)["per"]}

    def reduce_inputs(self, op):
        api = self.api
        return [api.per_replica(lambda r, j=j, s=s: array(
            (self.seed, "red", op["step"], j, r), s, op["dtype"]))
            for j, s in enumerate(op["shapes"])]

    def op_reduce_to(self, op):
        api = self.api
        v = self.var(op)
        x = self.reduce_inputs(op)[0]
        with api.strategy.scope():
            got = api.strategy.extended.reduce_to(getattr(api.ReduceOp, op["op"]), x,
                                                  destinations=v)
        return per(api, got)

    def op_batch_reduce_to(self, op):
        api = self.api
        v = self.var(op)
        xs = self.reduce_inputs(op)
        with api.strategy.scope():
            got = api.strategy.extended.batch_reduce_to(
                getattr(api.ReduceOp, op["op"]), [(x, v) for x in xs])
        return {"list": [per(api, g)["per"] for g in got]}

    def op_reduce(self, op):
        api = self.api
        x = self.reduce_inputs(op)[0]
        return one(api.strategy.reduce(getattr(api.ReduceOp, op["op"]), x,
                                       axis=op["axis"]))

    # --- metrics -----------------------------------------------------------------------
    def op_metric_create(self, op):
        api = self.api
        with api.strategy.scope():
            self.metrics[op["metric"]] = getattr(api.metrics, op["cls"])()
        return {}

    def metric_args(self, op, replica: int):
        n = rows((self.seed, "metric", op["step"]), replica, op["rows"])
        key = (self.seed, "metric", op["step"], replica)
        rng = rng_for(*key)
        cls = op["cls"]
        cols = [op["cols"]] if op.get("cols") else []
        if cls in ("Mean", "Sum"):
            args = [array(key, [n] + cols, "float32")]
        elif cls == "Accuracy":   # cols 1: (n, 1) labels, (n,) predictions
            args = [rng.integers(0, 3, [n] + cols).astype(np.float32),
                    rng.integers(0, 3, [n] + (cols if cols != [1] else [])
                                 ).astype(np.float32)]
        else:   # labels of shape (n,) or (n, 1)
            args = [rng.integers(0, 4, (n,) if replica % 2 else (n, 1)).astype(np.int64),
                    rng.standard_normal((n, 4)).astype(np.float32)]
        if op["weights"] == "per_example":
            args.append(rng.integers(0, 3, n).astype(np.float32))
        elif op["weights"] == "column":
            args.append(rng.integers(0, 3, (n, 1)).astype(np.float32))
        return tuple(args)

    def op_metric_update(self, op):
        api = self.api
        m = self.metrics[op["metric"]]
        if op["where"] == "cross":
            with api.strategy.scope():
                m.update_state(*self.metric_args(op, 0))
            return {}
        x = api.per_replica(lambda r: self.metric_args(op, r))
        api.strategy.run(lambda x: m.update_state(*x), args=(x,))
        return {}

    def op_metric_result(self, op):
        api = self.api
        m = self.metrics[op["metric"]]
        if op["where"] == "cross":
            with api.strategy.scope():
                return one(m.result())
        return per(api, api.strategy.run(m.result))

    def op_metric_reset(self, op):
        api = self.api
        m = self.metrics[op["metric"]]
        with api.strategy.scope():
            m.reset_state()
            return one(m.result())

    # --- optimizers --------------------------------------------------------------------
    def op_opt_create(self, op):
        api = self.api
        for j in op["vars"]:
            self.var({"var": j})
        with api.strategy.scope():
            self.opts[op["opt"]] = api.optimizer(op["cls"], op["lr"])
        return {}

    def op_opt_step(self, op):
        api = self.api
        opt = self.opts[op["opt"]]
        vs = [self.var({"var": j}) for j in op["vars"]]

        def grads(r):
            return [array((self.seed, "grad", op["step"], j, r), list(v.shape),
                          np.dtype(getattr(v.dtype, "as_numpy_dtype", v.dtype)))
                    for j, v in enumerate(vs)]
        if op.get("where") == "outside":
            opt.apply_gradients(zip(grads(0), vs))
        else:
            g = api.per_replica(grads)
            api.strategy.run(lambda g: opt.apply_gradients(zip(g, vs)), args=(g,))
        with api.strategy.scope():
            iterations = int(to_numpy(opt.iterations))
        return {"vars": [self.components(v)["per"] for v in vs], "iterations": iterations}

    # --- loss helpers ------------------------------------------------------------------
    def loss_args(self, op, replica: int):
        n = rows((self.seed, "loss", op["step"]), replica, op["rows"])
        key = (self.seed, "loss", op["step"], replica)
        shape = [n] + ([op["cols"]] if op["cols"] else [])
        loss = np.abs(array(key, shape, op["dtype"]))
        if op["weights"] == "scalar":
            return loss, np.asarray(0.5, op["dtype"])
        if op["weights"] == "per_example":
            return loss, array(key + ("w",), [n], op["dtype"])
        if op["weights"] == "column":
            return loss, array(key + ("w",), [n, 1], op["dtype"])
        return loss, None

    def op_loss(self, op):
        api = self.api
        if op["where"] == "cross":
            loss, w = self.loss_args(op, 0)
            with api.strategy.scope():
                return one(api.nn.compute_average_loss(loss, sample_weight=w,
                                                       global_batch_size=op["gbs"]))
        x = api.per_replica(lambda r: self.loss_args(op, r)[0])
        if op["where"] == "reg":
            return per(api, api.strategy.run(api.nn.scale_regularization_loss, args=(x,)))
        w = api.per_replica(lambda r: self.loss_args(op, r)[1]) \
            if op["weights"] != "none" else None

        def fn(x, w):
            return api.nn.compute_average_loss(x, sample_weight=w,
                                               global_batch_size=op["gbs"])
        return per(api, api.strategy.run(fn, args=(x, w)))


def record(which: str, seeds, replicas, local: int | None = None) -> dict:
    out = {}
    for n in replicas:
        for seed in seeds:
            api = Api(which, n, local)
            try:
                out[f"{seed}/{n}"] = Runner(api, seed).run(make_program(seed))
            finally:
                api.close()
    return out


# --- comparing ------------------------------------------------------------------------------

#: Keras computes Adam's bias correction ``sqrt(1 - beta_2 ** t)`` in float32, also for
#: float64 variables (it casts the betas from float32): relative errors of 1e-5 to 1e-4
#: in a step, which a few steps with a learning rate of 0.5 carry to 1e-4. The values a
#: program writes are multiples of 1/4, so any real difference is far larger.
TOLERANCE = {"float16": (2e-3, 2e-3), "float32": (1e-4, 1e-4), "float64": (1e-4, 1e-4)}


def same_leaf(a: dict, b: dict) -> bool:
    if a["dtype"] != b["dtype"] or a["shape"] != b["shape"]:
        return False
    x, y = np.asarray(a["v"]), np.asarray(b["v"])
    rtol, atol = TOLERANCE.get(a["dtype"], (0, 0))
    return np.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True) if x.size else True


#: TensorFlow's op errors and the Python exception gpustrat raises for the same misuse.
SAME_ERRORS = {"InvalidArgumentError": "ValueError"}


def same(a, b) -> bool:
    if isinstance(a, dict) and "dtype" in a and isinstance(b, dict) and "dtype" in b:
        return same_leaf(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        if "err" in a and "err" in b:
            return SAME_ERRORS.get(a["err"], a["err"]) == b["err"]
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) == 1 and len(b) > 1 and all(isinstance(x, dict) and "dtype" in x
                                              for x in a + b):
            # TensorFlow's run hands back one value when every replica returned the
            # very same object (a merge_call's result); gpustrat one per replica.
            return all(same_leaf(a[0], x) for x in b)
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def expected_difference(op: dict, want: dict, got: dict, n: int, seed: int,
                        tf_side: bool) -> bool:
    """The documented differences from TensorFlow (``tf_side``: ``want`` is
    TensorFlow's)."""
    if op["kind"] == "metric_result" and op["split"]:
        return "per" in got and "per" in want
    if not tf_side:
        return False
    if op["kind"] == "replica_update" and op["sync"] in ("AUTO", "ON_WRITE") and \
            op["agg"] == "NONE" and "err" not in want:
        return got.get("err") == "ValueError"
    if op["kind"] in ("replica_update", "cross_update") and op["value"] == "other_dtype":
        # NumPy floats into an integer variable: TensorFlow truncates them (or, in
        # replica context of an aggregated mirrored variable, raises ValueError), here
        # a TypeError. NumPy integers into a float variable: TensorFlow raises
        # ValueError in replica context of an aggregated mirrored variable, here they
        # convert, as TensorFlow converts them everywhere else.
        if "int" in op["dtype"]:
            return got.get("err") == "TypeError"
        return "err" not in got and want.get("err") == "ValueError"
    if op["kind"] in ("reduce", "reduce_to", "batch_reduce_to", "reduce_var") and \
            n == 1 and op["op"] == "MEAN" and "int" in op["dtype"]:
        # One replica: TensorFlow reduces nothing and keeps the integer dtype; a MEAN
        # of integers is float64 here, as TensorFlow's is on two replicas or more.
        return True
    if op["kind"] == "reduce_var" and op["op"] == "MEAN" and "int" in op["dtype"] and \
            op["sync"] in ("AUTO", "ON_WRITE"):
        # TensorFlow hands back a mirrored value's MEAN as it is (integers stay
        # integers); a MEAN of integers is float64 here, as TensorFlow's of per-replica
        # integers on two replicas or more.
        return True
    if op["kind"] == "reduce_var" and op["how"] == "gather" and n == 1 and \
            got.get("err") == "ValueError":
        # One replica: TensorFlow gathers nothing and hands back even a scalar; here a
        # scalar cannot be gathered along axis 0, on any number of replicas.
        return True
    if op["kind"] == "cross_update" and op["value"] == "py" and op["sync"] == "ON_READ" \
            and op["agg"] == "SUM" and want.get("err") == "TypeError":
        # TensorFlow divides the value by the number of replicas before converting it:
        # a Python list is a TypeError there.
        return "err" not in got
    if op["kind"] == "batch_reduce_to" and op["dtype"] == "int32" and \
            len(op["shapes"]) > 1 and want.get("err") == "ValueError":
        # TensorFlow keeps int32 tensors in host memory and refuses to batch them
        # with others ("all on the host or all on the compute devices").
        return True
    if op["kind"] == "loss" and op["gbs"] is None and op["where"] == "replica" and \
            "per" in got:
        # The true global count: sum(loss * weight) / (rows of every replica).
        counts = [rows((seed, "loss", op["step"]), r, op["rows"]) for r in range(n)]
        total = sum(counts)
        fake = Runner.__new__(Runner)
        fake.seed = seed
        for r, g in enumerate(got["per"]):
            loss, w = fake.loss_args(op, r)
            if w is not None:
                if w.ndim == loss.ndim + 1:   # (n, 1) weights of (n,) losses
                    w = w[..., 0]
                loss = loss * w.reshape(w.shape + (1,) * (loss.ndim - w.ndim))
            s = loss.sum()
            wish = {"v": (s / total if total else 0.0), "dtype": op["dtype"], "shape": []}
            if not same_leaf(dict(wish, v=float(np.asarray(wish["v"], op["dtype"]))), g):
                return False
        return True
    return False


def split_metric_results(program: list) -> set:
    """The replica-context ``result()`` calls of metrics updated in cross-replica context
    since their last reset: the replicas' own states then depend on how the update was
    spread (Keras adds ``value / n`` to every replica's state, gpustrat adds ``value``
    to the first one; the totals agree)."""
    dirty, out = set(), set()
    for i, op in enumerate(program):
        if op["kind"] == "metric_update" and op["where"] == "cross":
            dirty.add(op["metric"])
        elif op["kind"] == "metric_reset":
            dirty.discard(op["metric"])
        elif op["kind"] == "metric_result" and op["where"] == "replica" and \
                op["metric"] in dirty:
            out.add(i)
    return out


def compare(want: dict, got: dict, tf_side: bool) -> list:
    """The differences between two recordings of the same programs."""
    bad = []
    for key, records in got.items():
        if key not in want:
            continue
        seed, n = map(int, key.split("/"))
        program = make_program(seed)
        specs = {op["var"]: op for op in program
                 if op["kind"] in ("create", "create_in_run")}
        split = split_metric_results(program)
        for w, g in zip(want[key], records):
            op = dict(program[g["i"]])
            if "var" in op and op["kind"] not in ("create", "create_in_run"):
                op.update(sync=specs[op["var"]]["sync"], agg=specs[op["var"]]["agg"],
                          dtype=op.get("dtype", np_dtype(specs[op["var"]]["dtype"])))
            op["split"] = g["i"] in split
            if same(w, g) or expected_difference(op, w, g, n, seed, tf_side):
                continue
            bad.append({"case": key, "op": program[g["i"]], "want": w, "got": g})
    return bad


# --- across MPI workers ----------------------------------------------------------------------

def gather_ranks(local_records: dict) -> dict | None:
    """Rank 0: the records with every rank's per-replica lists joined in rank order (and
    a check that every rank saw the same single values and errors); None elsewhere."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    everything = comm.gather(local_records, root=0)
    if comm.rank != 0:
        return None
    joined = {}
    for key in everything[0]:
        joined[key] = [join([ranks[key][i] for ranks in everything])
                       for i in range(len(everything[0][key]))]
    return joined


def join(items: list):
    first = items[0]
    if isinstance(first, dict) and "per" in first and all(isinstance(i, dict) and "per" in i
                                                          for i in items):
        return {**first, "per": [x for i in items for x in i["per"]]}
    if isinstance(first, dict) and "dtype" in first:
        return first if all(same(first, i) for i in items) else {"ranks differ": items}
    if isinstance(first, dict) and all(isinstance(i, dict) and i.keys() == first.keys()
                                       for i in items):
        if set(first) >= {"per"} or any(k in ("ret", "comps") for k in first):
            pass
        return {k: (join([i[k] for i in items]) if k in ("ret", "comps", "vars", "list")
                    else join_same([i[k] for i in items])) for k in first}
    if isinstance(first, list) and all(isinstance(i, list) for i in items):
        # Lists of per-replica leaves ("ret", "comps") join; nested lists join per item.
        if first and isinstance(first[0], dict) and "dtype" in first[0]:
            return [x for i in items for x in i]
        if all(len(i) == len(first) for i in items):
            return [join([i[k] for i in items]) for k in range(len(first))]
    return join_same(items)


def join_same(items: list):
    first = items[0]
    return first if all(same(first, i) for i in items) else {"ranks differ": items}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("which", choices=("tf", "gs", "gs-mpi"))
    p.add_argument("--seeds", default="0:50", help="A:B, the seeds A .. B-1")
    p.add_argument("--replicas", default="1,2,3,4", help="numbers of replicas in sync")
    p.add_argument("--local", type=int, default=1, help="gs-mpi: replicas per rank")
    p.add_argument("--compare", help="a recording to compare with")
    p.add_argument("--out", help="write the recording here (default: stdout)")
    args = p.parse_args(argv)
    a, b = map(int, args.seeds.split(":"))
    seeds = range(a, b)
    if args.which == "tf" and "," not in args.replicas:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf
        tf.get_logger().setLevel("ERROR")
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] *
            max(4, *(int(n) for n in args.replicas.split(","))))
    if args.which == "gs-mpi":
        from mpi4py import MPI
        size = MPI.COMM_WORLD.size
        got = gather_ranks(record("gs-mpi", seeds, [size * args.local], args.local))
        if got is None:
            return 0
    elif args.which == "tf" and "," in args.replicas:
        # One process per replica count: TensorFlow's collectives keep group keys per
        # process, and strategies of two sizes in one process clash.
        import subprocess
        got = {}
        for n in args.replicas.split(","):
            text = subprocess.run([sys.executable, __file__, "tf", "--seeds", args.seeds,
                                   "--replicas", n], check=True, capture_output=True,
                                  text=True).stdout
            got.update({k: v for k, v in json.loads(text).items() if k != "_library"})
    else:
        got = record(args.which, seeds, [int(n) for n in args.replicas.split(",")])
    if args.compare:
        want = json.loads(Path(args.compare).read_text())
        tf_side = want.get("_library") == "tf"
        bad = compare(want, got, tf_side)
        for d in bad:
            print(json.dumps(d))
        print(f"{len(bad)} differences in {len(got)} programs", file=sys.stderr)
        if args.out:
            Path(args.out).write_text(json.dumps({"_library": args.which, **got}))
        return 1 if bad else 0
    text = json.dumps({"_library": args.which, **got})
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
