"""``gs.distribute.cluster_resolver``: roles of the ranks of an MPI launch. Names load
on first use (importing this module initialises no MPI)."""

from gpustrat._lazy import attach as _attach

_NAMES = {
    "MpiClusterResolver": "gpustrat.distribute.parameter_server.resolver",
    "ClusterSpec": "gpustrat.distribute.parameter_server.resolver",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
