"""``gs.distribute.coordinator``: scheduling functions on the workers of a
ParameterServerStrategy. Names load on first use (importing this module initialises no
MPI)."""

from gpustrat._lazy import attach as _attach

_WHERE = "gpustrat.distribute.parameter_server.coordinator"
_NAMES = {
    "ClusterCoordinator": _WHERE,
    "RemoteValue": _WHERE,
    "ServerLostError": "gpustrat.distribute.parameter_server.channel",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
