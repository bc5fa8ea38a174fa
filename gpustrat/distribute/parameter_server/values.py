"""What a ClusterCoordinator hands back: results to come and values that live on the
workers.

Words:
- :class:`RemoteValue`: the future result of one scheduled function.
- :class:`PerWorkerValues`: one value per worker. Sent with a scheduled function (an
  argument, or a global or closure value of the function), it arrives there as the
  value of the worker running it. The values are *placed* on the workers once (each
  worker keeps its own in its function process) and referred to by a number from then
  on, so sending one costs a few bytes per call, whatever the values' size.
- *per-worker resource*: a value made on every worker by calling a function there
  (``ClusterCoordinator.create_per_worker_resources``): a dataset, an iterator, a
  cache. The coordinator holds a :class:`PerWorkerValues` of placeholders
  (:class:`WorkerLocal`); the objects stay on the workers, and a worker whose function
  process is replaced makes them again by calling the same function (so an iterator
  starts over there).

Per-worker datasets and iterators are per-worker resources:
:class:`PerWorkerDataset` holds the datasets, ``iter()`` of it gives a
:class:`PerWorkerIterator`, a :class:`PerWorkerValues` of the workers' iterators.
"""

from __future__ import annotations

import threading

from gpustrat import timeline as _tl
from gpustrat.distribute.parameter_server.wire import Unsendable


class RemoteValue:
    """The future result of a scheduled function (``tf.distribute.experimental.
    coordinator.RemoteValue``)."""

    def __init__(self, name: str):
        self._name = name
        self._event = threading.Event()
        self._value = None
        self._error = None

    def _set(self, value) -> None:
        self._value = value
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._event.set()

    @_tl.traced("ps fetch")
    def fetch(self):
        """Wait for the function and return its result (NumPy values), or raise its
        error."""
        self._event.wait()
        if self._error is not None:
            raise self._error
        return self._value

    def get(self):
        """The same as :meth:`fetch`."""
        return self.fetch()

    def __reduce__(self):
        # As an argument of a scheduled function: its result, once there is one.
        if not self._ready():
            raise Unsendable(f"the RemoteValue of {self._name} is not ready yet: pass "
                             "remote_value.fetch() (which waits for its result) to a "
                             "scheduled function, not the RemoteValue")
        if self._error is not None:
            raise Unsendable(f"the RemoteValue of {self._name} has no result: the "
                             f"function failed with {type(self._error).__name__}: "
                             f"{self._error}")
        return (_identity, (self._value,))

    def _ready(self) -> bool:
        return self._event.is_set()

    def __repr__(self) -> str:
        state = "ready" if self._ready() else "pending"
        return f"<RemoteValue of {self._name} ({state})>"


def _identity(x):
    return x


class WorkerLocal:
    """On the coordinator, the stand-in for an object that lives on worker ``worker``
    (a per-worker resource): it can be passed to scheduled functions inside its
    :class:`PerWorkerValues`, not read here."""

    __slots__ = ("worker", "what")

    def __init__(self, worker: int, what: str):
        self.worker = worker
        self.what = what

    def __reduce__(self):
        raise TypeError(f"{self!r} lives on worker {self.worker}: pass the "
                        "PerWorkerValues that holds it to schedule, not one of its values")

    def __repr__(self) -> str:
        return f"<{self.what} on worker {self.worker}>"


class PerWorkerValues:
    """One value per worker (``tf.distribute.experimental.coordinator.PerWorkerValues``,
    ``tf.distribute.coordinator.PerWorkerValue``).

    ``PerWorkerValues([v0, v1, ...])`` takes the values in worker order, one per
    worker; a scheduled function given it (among ``schedule``'s arguments, or as a
    global or closure value) gets the value of the worker that runs it. The values
    travel to their workers at the first ``schedule`` that sends them (each value as
    functions' arguments travel), and stay there: a function that changes its
    worker's value in place changes it for the next function on that worker.
    ``ClusterCoordinator.create_per_worker_resources`` makes one whose values are made
    on the workers.

    Raises (at ``schedule``):
        ValueError: not one value per worker.
        TypeError: a value cannot be sent to a worker.
    """

    #: Why a ``gs.train.Checkpoint`` refuses it as an entry (see graph.check_entry).
    _checkpoint_refused = (
        "per-worker values and iterators are not saved in checkpoints under "
        "ParameterServerStrategy (as in TensorFlow): a restored job makes them again and "
        "each worker's dataset starts from its beginning. Leave it out of the "
        "Checkpoint; to go on part-way through the data, save a number (such as the "
        "step count, optimizer.iterations) and let dataset_fn skip or reseed from it")

    def __init__(self, values):
        if isinstance(values, PerWorkerValues):
            values = values._values
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"PerWorkerValues takes a list or tuple of values, one per "
                            f"worker, got {type(values).__name__}")
        self._values = tuple(values)
        #: The number its values have on the workers, once placed.
        self._ident = None
        self._placed_by = None

    @property
    def values(self) -> tuple:
        """The values, in worker order (placeholders for objects made on the workers)."""
        return self._values

    def __len__(self) -> int:
        return len(self._values)

    def __reduce__(self):
        if self._ident is None:  # met as a global or closure value: placed now
            if _coordinator is None:
                raise TypeError("a PerWorkerValues is sent with functions scheduled by a "
                                "ClusterCoordinator: make the coordinator first")
            _coordinator._place(self)
        return (_local_value, (self._ident,))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self._values)!r})"


def _local_value(ident: int):
    """Inside a function process: this worker's value number ``ident``."""
    from gpustrat.distribute.parameter_server import executor  # noqa: PLC0415
    resources = executor.state["resources"]
    try:
        return resources[ident]
    except KeyError:
        if executor.state["worker"] is None:
            raise RuntimeError("per-worker values are read inside scheduled functions (on "
                               "a worker), not on the coordinator") from None
        missing = executor.state["missing"].get(ident)
        raise RuntimeError(missing or f"worker {executor.state['worker']} has no "
                           f"per-worker value #{ident}: making it failed here (see the "
                           "error raised when it was made)") from None


#: The ClusterCoordinator of this process (there is one per strategy, one strategy per
#: coordinator process), which places PerWorkerValues met while sending a function.
_coordinator = None


def set_coordinator(coordinator) -> None:
    global _coordinator
    _coordinator = coordinator


def find_unplaced(args, kwargs) -> list:
    """The PerWorkerValues among ``args`` and ``kwargs`` not yet on the workers (placed
    before the function is packed, so that their errors keep their type)."""
    out, seen = [], set()
    stack = [tuple(args or ()), dict(kwargs or {})]
    while stack:
        x = stack.pop()
        if isinstance(x, PerWorkerValues):
            if x._ident is None and id(x) not in seen:
                seen.add(id(x))
                out.append(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return out


class PerWorkerDataset:
    """A dataset made on every worker (``create_per_worker_dataset``); ``iter()`` gives
    a :class:`PerWorkerIterator`. ``values`` is the :class:`PerWorkerValues` of the
    workers' datasets."""

    _checkpoint_refused = PerWorkerValues._checkpoint_refused

    def __init__(self, coordinator, values: PerWorkerValues):
        self._coordinator = coordinator
        self.values = values

    def __iter__(self) -> "PerWorkerIterator":
        made = self._coordinator._create_resources(iter, (self.values,), {}, "iterator")
        return PerWorkerIterator(made)

    def __reduce__(self):
        raise TypeError("pass iter(per_worker_dataset) to scheduled functions, not the "
                        "per-worker dataset itself")


class PerWorkerIterator(PerWorkerValues):
    """An iterator on every worker: inside a scheduled function it is the iterator of
    the worker running it, and ``next()`` takes that worker's next element."""

    def __init__(self, values: PerWorkerValues):
        super().__init__(values._values)
        self._ident = values._ident
        self._placed_by = values._placed_by

    def __iter__(self):
        return self

    def __next__(self):
        raise RuntimeError("a per-worker iterator is read inside a scheduled function "
                           "(on a worker), not on the coordinator: pass it to schedule")

    def get_next(self):
        return next(self)

    def __repr__(self) -> str:
        return f"<PerWorkerIterator #{self._ident} over {len(self._values)} workers>"


def experimental_get_current_worker_index() -> int:
    """The index of the worker running the calling scheduled function
    (``tf.distribute.coordinator.experimental_get_current_worker_index``).

    Raises:
        RuntimeError: called outside a scheduled function (on the coordinator).
    """
    from gpustrat.distribute.parameter_server import executor  # noqa: PLC0415
    worker = executor.state["worker"]
    if worker is None:
        raise RuntimeError("experimental_get_current_worker_index is called inside a "
                           "function scheduled with ClusterCoordinator.schedule (on a "
                           "worker), not on the coordinator")
    return worker
