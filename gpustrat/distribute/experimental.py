"""``gs.distribute.experimental``: the names of ``tf.distribute.experimental`` that
gpustrat has. Names load on first use (importing this module initialises no MPI)."""

from gpustrat._lazy import attach as _attach

_NAMES = {
    "MultiWorkerMirroredStrategy": "gpustrat.distribute.multi_worker",
    "ValueContext": "gpustrat.distribute.replica_context",
    "ParameterServerStrategy": "gpustrat.distribute.parameter_server.strategy",
    "partitioners": "gpustrat.distribute.parameter_server",
    "coordinator": "gpustrat.distribute:coordinator",
}

__all__ = sorted(_NAMES)
__getattr__, __dir__ = _attach(__name__, _NAMES)
