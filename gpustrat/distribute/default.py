"""The default strategy: what ``get_strategy()`` gives outside any scope.

One replica, run in the calling thread, on ``cpu:0`` for collectives (which are then
identities); values are not moved.
"""

from __future__ import annotations

import threading

from gpustrat.collectives.host import HostCommunicator
from gpustrat.devices import Device
from gpustrat.distribute.strategy import Strategy

_lock = threading.Lock()
_default = None


class _DefaultStrategy(Strategy):
    #: Variables made under the default strategy are plain (as in tf.distribute).
    is_default = True

    def __init__(self):
        dev = Device("cpu", 0)
        super().__init__([dev], HostCommunicator([dev]), inline=True)

    def __repr__(self) -> str:
        return "DefaultStrategy()"


def default_strategy() -> Strategy:
    global _default
    if _default is None:
        with _lock:
            if _default is None:
                _default = _DefaultStrategy()
    return _default
