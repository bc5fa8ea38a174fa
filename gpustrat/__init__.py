"""gpustrat: tf.distribute's programming model on CuPy/NumPy, Numba CUDA, NCCL and MPI.

Importing gpustrat does nothing else: no MPI initialisation, no device probing.

    import gpustrat as gs
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    result = strategy.run(lambda x: x * 2.0, args=(3.0,))   # PerReplica:{0: 6.0, 1: 6.0}
"""

from gpustrat._version import __version__
from gpustrat.distribute.context import (get_cross_replica_context, get_replica_context,
                                         get_strategy, has_strategy,
                                         in_cross_replica_context)
from gpustrat.distribute.mirrored import MirroredStrategy, OneDeviceStrategy
from gpustrat.distribute.replica_context import ReplicaContext, ValueContext
from gpustrat.distribute.strategy import Strategy
from gpustrat.distribute.variables import (Variable, VariableAggregation,
                                           VariableSynchronization)
from gpustrat.reduce_util import ReduceOp
from gpustrat.values import DistributedValues, Mirrored, PerReplica

__all__ = [
    "__version__", "Strategy", "MirroredStrategy", "OneDeviceStrategy",
    "MultiWorkerMirroredStrategy", "ReduceOp", "PerReplica", "Mirrored",
    "DistributedValues", "ReplicaContext", "ValueContext", "InputContext", "InputOptions",
    "get_strategy", "has_strategy", "get_replica_context", "get_cross_replica_context",
    "in_cross_replica_context", "data", "distribute", "Variable", "VariableSynchronization",
    "VariableAggregation", "optimizers", "metrics", "nn", "train", "TensorSpec", "timeline",
]


def __getattr__(name):
    # Submodules and MPI-backed classes load on first use: `import gpustrat` stays cheap
    # and never initialises MPI.
    if name == "MultiWorkerMirroredStrategy":
        from gpustrat.distribute.multi_worker import MultiWorkerMirroredStrategy
        return MultiWorkerMirroredStrategy
    if name in ("InputContext", "InputOptions"):
        from gpustrat.distribute import input_lib
        return getattr(input_lib, name)
    if name in ("data", "distribute", "optimizers", "metrics", "nn", "train", "timeline"):
        import importlib
        return importlib.import_module(f"gpustrat.{name}")
    if name == "TensorSpec":  # tf.TensorSpec
        from gpustrat.data.spec import TensorSpec
        return TensorSpec
    from gpustrat._porting import attribute_error
    raise attribute_error("gpustrat", name)


def __dir__():
    # The lazily loaded names are listed before their first use.
    return sorted(set(globals()) | set(__all__))
