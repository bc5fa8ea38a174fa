"""Which strategy is current, and in which context code runs.

Words (as in tf.distribute):
- *cross-replica context*: inside ``strategy.scope()`` but not inside ``run``: code
  sees every replica at once; ``get_replica_context()`` is None.
- *replica context*: inside the function given to ``strategy.run``: code runs once per
  replica, each in its own thread; ``get_replica_context()`` names the replica.
- *default context*: outside any scope: the default strategy (one replica, no
  placement) and its default replica context.

The context is thread-local, so that every replica thread sees its own replica.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from gpustrat.distribute.replica_context import ReplicaContext
    from gpustrat.distribute.strategy import Strategy

class _State(threading.local):
    # __init__ runs once per thread, on its first use: every thread has its stack.
    def __init__(self):
        self.stack: list = []


_state = _State()
_NONE = (None, None)


def push(strategy: "Strategy", replica_ctx: "ReplicaContext | None") -> None:
    _state.stack.append((strategy, replica_ctx))


def pop() -> None:
    _state.stack.pop()


def current():
    """(strategy, replica context) on top of this thread's stack, or (None, None)."""
    s = _state.stack
    return s[-1] if s else _NONE


def get_strategy() -> "Strategy":
    """The current strategy: the one whose scope or ``run`` we are in, else the default."""
    strategy, _ = current()
    if strategy is None:
        from gpustrat.distribute.default import default_strategy  # noqa: PLC0415
        return default_strategy()
    return strategy


def has_strategy() -> bool:
    """True inside a non-default strategy's scope or ``run``."""
    return current()[0] is not None


def in_cross_replica_context() -> bool:
    strategy, ctx = current()
    return strategy is not None and ctx is None


def get_replica_context() -> "ReplicaContext | None":
    """The replica context inside ``run``; None in cross-replica context; the default
    strategy's replica context outside any scope."""
    s = _state.stack
    if s:
        strategy, ctx = s[-1]
        if strategy is not None:
            return ctx
    from gpustrat.distribute.default import default_strategy  # noqa: PLC0415
    return default_strategy()._default_replica_context()


def get_cross_replica_context() -> "Strategy | None":
    """The strategy in cross-replica context, else None."""
    strategy, ctx = current()
    return strategy if ctx is None else None
