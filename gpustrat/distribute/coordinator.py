"""``gs.distribute.coordinator`` (also ``gs.distribute.experimental.coordinator``):
scheduling functions on the workers of a ParameterServerStrategy. Names load on first
use (importing this module initialises no MPI)."""

from gpustrat._lazy import attach as _attach

_VALUES = "gpustrat.distribute.parameter_server.values"
_NAMES = {
    "ClusterCoordinator": "gpustrat.distribute.parameter_server.coordinator",
    "RemoteValue": _VALUES,
    "PerWorkerValues": _VALUES,
    "PerWorkerValue": _VALUES + ":PerWorkerValues",
    "experimental_get_current_worker_index": _VALUES,
    "ServerLostError": "gpustrat.distribute.parameter_server.channel",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
