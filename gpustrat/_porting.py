"""Where a TensorFlow name lives in gpustrat, for the AttributeError of a namespace.

A program ported by the namespace change (``tf.`` to ``gs.``, ``tf.distribute.`` to
``gs.distribute.``, ``tf.data.`` to ``gs.data.``) that reads a TensorFlow name gpustrat
does not have gets an AttributeError saying where the concept lives here, or that it has
no counterpart, instead of a bare "no attribute" (docs/porting.md has the table).
"""

from __future__ import annotations

_NONE = "has no counterpart in gpustrat"

# {namespace module: {TensorFlow name: where it lives here, or why it has no counterpart}}
WHERE = {
    "gpustrat": {
        "constant": "use np.asarray(value) (a CuPy array on GPU devices)",
        "convert_to_tensor": "use np.asarray(value)",
        "Tensor": "gpustrat's values are NumPy (or CuPy) arrays: np.ndarray",
        "TensorShape": "shapes are tuples: (4,) for tf.TensorShape([4])",
        "float16": "use np.float16", "float32": "use np.float32",
        "float64": "use np.float64", "int32": "use np.int32", "int64": "use np.int64",
        "bool": "use np.bool_", "string": "use gs.data.STRING",
        "py_function": "not needed: map calls Python functions directly",
        "numpy_function": "not needed: map calls Python functions directly",
        "print": "use print",
        "reduce_sum": "use np.sum", "reduce_mean": "use np.mean", "cast": "use x.astype",
        "GradientTape": f"{_NONE}: it has no automatic differentiation; compute the "
                        "gradients in the replica function (NumPy or CuPy) and apply them "
                        "with a gs.optimizers optimizer",
        "keras": f"{_NONE} (no Keras); optimizers are gs.optimizers, metrics gs.metrics, "
                 "loss helpers gs.nn",
        "io": "tf.io.TFRecordWriter is gs.data.TFRecordWriter; tf.io's other readers have "
              "no counterpart",
        "config": f"{_NONE}: devices are named in the strategy (\"CPU:0\", \"GPU:0\"); "
                  "python -m gpustrat info lists them",
        "device": f"{_NONE}: a strategy places each replica on its device",
        "SparseTensor": _NONE, "RaggedTensor": _NONE, "RaggedTensorSpec": _NONE,
        "Module": f"{_NONE}: any object whose attributes hold gs.Variable is saved by "
                  "gs.train.Checkpoint",
        "random": "use np.random",
        "math": "use NumPy (np.add, np.sqrt, ...)",
        "linalg": "use np.linalg",
        "bfloat16": f"{_NONE}: NumPy has no bfloat16; use np.float16 or np.float32",
        "half": "use np.float16", "double": "use np.float64",
        "summary": f"{_NONE}: write metrics with print or a logger on worker 0; "
                   "gs.timeline records where a step's time goes (docs/timeline.md)",
        "saved_model": f"{_NONE}: save and restore variables with gs.train.Checkpoint",
        "losses": "loss helpers are gs.nn (compute_average_loss, scale_regularization_loss)",
        "image": f"{_NONE}: decode and transform images in a map function (NumPy, PIL)",
        "strings": f"{_NONE}: handle strings in a map function (Python str)",
        "sparse": _NONE, "ragged": _NONE, "autograph": f"{_NONE}: gs.function runs Python",
    },
    "gpustrat.distribute": {
        "TPUStrategy": f"{_NONE} (no TPUs)",
        "ParameterServerStrategy": "gs.distribute.experimental.ParameterServerStrategy",
        "CrossDeviceOps": f"{_NONE}: the strategy picks NCCL, MPI or host reductions from "
                          "its devices",
        "NcclAllReduce": f"{_NONE}: GPU replicas of a worker reduce with NCCL by themselves",
        "HierarchicalCopyAllReduce": f"{_NONE}: the strategy picks the reduction",
        "ReductionToOneDevice": f"{_NONE}: the strategy picks the reduction",
        "StrategyExtended": "strategy.extended (the object's methods are reached through it)",
        "RunOptions": f"{_NONE}: strategy.run takes fn, args and kwargs",
        "Server": f"{_NONE}: workers are MPI ranks (mpiexec -n W python train.py)",
        "experimental_set_strategy": "use `with strategy.scope():`",
        "PerReplica": "gs.PerReplica", "Mirrored": "gs.Mirrored",
        "CentralStorageStrategy": f"{_NONE}; MirroredStrategy keeps a copy per replica",
    },
    "gpustrat.distribute.experimental": {
        "PreemptionCheckpointHandler": f"{_NONE}: save a gs.train.CheckpointManager "
                                       "checkpoint every few steps and resume with "
                                       "restore_or_initialize (docs/checkpoint.md)",
        "CollectiveHints": f"{_NONE}: fusion is planned per layout "
                           "(GPUSTRAT_FUSION_BUCKET_BYTES sets the bucket size)",
        "CentralStorageStrategy": f"{_NONE}; MirroredStrategy keeps a copy per replica",
        "TPUStrategy": f"{_NONE} (no TPUs)",
        "CommunicationOptions": f"{_NONE}: the strategy picks NCCL, MPI or host reductions",
        "CommunicationImplementation": f"{_NONE}: the strategy picks NCCL, MPI or host "
                                       "reductions",
    },
    "gpustrat.data": {
        "Iterator": "gs.data.DatasetIterator (what iter(dataset) returns)",
        "NumpyIterator": "dataset.as_numpy_iterator() (gs.data.DatasetIterator)",
        "FixedLengthRecordDataset": f"{_NONE}: read records with from_generator or "
                                    "NpyDataset",
        "IteratorSpec": _NONE,
        "ThreadingOptions": f"{_NONE}: parallel map and prefetch size their own threads",
        "SqlDataset": _NONE,
    },
}


# TensorFlow's dtypes and array functions that NumPy has under the same name (reductions
# drop their reduce_ prefix): for tf.NAME, use np.NAME.
_NUMPY_DTYPES = ("int8", "int16", "uint8", "uint16", "uint32", "uint64", "complex64",
                 "complex128")
_NUMPY_FUNCTIONS = ("zeros", "ones", "zeros_like", "ones_like", "fill", "range", "reshape",
                    "concat", "stack", "unstack", "split", "tile", "transpose", "squeeze",
                    "expand_dims", "matmul", "tensordot", "einsum", "where", "abs", "sqrt",
                    "exp", "square", "maximum", "minimum", "argmax", "argmin", "sort",
                    "argsort", "cumsum", "equal", "gather", "one_hot", "clip_by_value",
                    "reduce_max", "reduce_min", "reduce_prod", "reduce_any", "reduce_all",
                    "rank", "size", "shape", "identity", "linspace", "meshgrid")
_NUMPY_SPELLING = {"fill": "np.full", "range": "np.arange", "concat": "np.concatenate",
                   "unstack": "list(x) or np.split", "gather": "np.take",
                   "one_hot": "np.eye(depth)[indices]", "clip_by_value": "np.clip",
                   "rank": "x.ndim", "size": "x.size", "shape": "x.shape",
                   "identity": "x (or x.copy())"}
for _name in _NUMPY_DTYPES + _NUMPY_FUNCTIONS:
    _np_name = _NUMPY_SPELLING.get(_name, "np." + _name.removeprefix("reduce_"))
    WHERE["gpustrat"].setdefault(_name, f"use {_np_name}")
del _name, _np_name


def attribute_error(module: str, name: str) -> AttributeError:
    """The AttributeError for ``module.name``: where a TensorFlow name of that namespace
    lives in gpustrat, or that it has none."""
    where = WHERE.get(module, {}).get(name)
    text = f"module {module!r} has no attribute {name!r}"
    if where is not None:
        tf = "tf" + module[len("gpustrat"):]
        text += (f"; TensorFlow's {tf}.{name} {where}" if where.startswith(_NONE)
                 else f"; for TensorFlow's {tf}.{name}: {where}") + " (see docs/porting.md)"
    return AttributeError(text)
