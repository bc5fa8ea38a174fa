"""``gs.distribute``: the names of ``tf.distribute``, where gpustrat has the concept.

A TensorFlow program ports by writing ``gs.distribute.`` for ``tf.distribute.``
(``docs/porting.md`` lists what has no counterpart). Names load on first use: importing
this package initialises no MPI and probes no device. The modules of this package
(``strategy``, ``input_lib``, ``runner``, ...) hold the implementation.
"""

from gpustrat._lazy import attach as _attach

_NAMES = {
    # strategies
    "Strategy": "gpustrat.distribute.strategy",
    "MirroredStrategy": "gpustrat.distribute.mirrored",
    "OneDeviceStrategy": "gpustrat.distribute.mirrored",
    "MultiWorkerMirroredStrategy": "gpustrat.distribute.multi_worker",
    # reductions and values
    "ReduceOp": "gpustrat.reduce_util",
    "DistributedValues": "gpustrat.values",
    # contexts
    "ReplicaContext": "gpustrat.distribute.replica_context",
    "get_strategy": "gpustrat.distribute.context",
    "has_strategy": "gpustrat.distribute.context",
    "get_replica_context": "gpustrat.distribute.context",
    "get_cross_replica_context": "gpustrat.distribute.context",
    "in_cross_replica_context": "gpustrat.distribute.context",
    # distributed input
    "InputContext": "gpustrat.distribute.input_lib",
    "InputOptions": "gpustrat.distribute.input_lib",
    "InputReplicationMode": "gpustrat.distribute.input_lib",
    "DistributedDataset": "gpustrat.distribute.input_lib",
    "DistributedIterator": "gpustrat.distribute.input_lib",
    # parameter-server training
    "ShardedVariable": "gpustrat.distribute.parameter_server.variables",
}

__all__ = sorted([*_NAMES, "experimental", "cluster_resolver", "coordinator"])
__getattr__, __dir__ = _attach(__name__, _NAMES, submodules=("experimental", "cluster_resolver",
                                                         "coordinator"))
