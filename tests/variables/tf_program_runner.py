"""Running a program of ``tf_programs`` with TensorFlow (``MirroredStrategy`` on logical
CPUs) or with gpustrat (in one process, or one MPI worker's part), and recording each
operation's outcome the same way for both. Not a test module."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import numpy as np

from tf_programs import array, make_program, np_dtype, rng_for, rows

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
            sched = gs_schedule(self.gs)
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


def gs_schedule(gs):
    """:func:`schedule` as a gpustrat LearningRateSchedule."""
    class Halving(gs.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):
            return schedule(step)
    return Halving()


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
