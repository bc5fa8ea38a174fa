"""Placing each step's pieces on the replicas' devices.

- CPU devices: pieces are host arrays already; a contiguous cut is a view (no copy).
- GPU devices: a background thread stages host pieces through page-locked (pinned)
  memory and issues asynchronous host-to-device copies on one copy stream per device,
  ``buffer_size`` steps ahead, so copies overlap the replicas' compute. Pieces already
  on a GPU stay there if it is the replica's device and are copied device-to-device
  otherwise.

Ordering, with no host wait in the consumer: a step is handed over with an event per
device recorded after its copies, and the consumer's current stream of each device
waits for it (``run`` then orders the replica streams after that stream), as does its
current stream of the current device, where CuPy's ``get()`` copies. The pieces'
memory comes from the copy stream's pool arena, so it must not be handed out again
while the consumer may still read it: each handover records an event on the
consumer's streams, the placer keeps the previous step's pieces alive until that event
has completed, and the copy stream waits for the latest such event before copying.
Pieces a placer stops keeping (at the end of the data, on an error, at ``close``, and
the steps still queued then) are *retired*: CuPy keys a pool arena by the raw stream
handle, and the driver may give a destroyed copy stream's handle to a later stream,
which would then be handed those blocks. A module-level list keeps them alive until
events after which nothing uses them have completed (one recorded on the consumer's
current streams for pieces handed over, the copies' own events for pieces never handed
over), and is pruned, by event queries, whenever a placer hands a step over, retires
pieces or is created. It holds at most one epoch's in-flight steps.
Pinned staging buffers are a ring of ``buffer_size + 2`` per device, each reused once
the copies that read it are complete (a wait in the background thread only when the
GPU is that far behind).
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Sequence

import numpy as np

from gpustrat import finalizers, nest
from gpustrat import timeline as _tl
from gpustrat.devices import PER_THREAD_STREAM, Device, cupy, is_gpu_array, kept_event, \
    kept_events, new_stream, pinned_empty, to_device, to_host

_END = object()

#: Retired pieces, each ``(events, pieces)``: kept until every event has completed (see
#: the module docstring). Shared by all placers, of any thread.
_retired: list = []
_retired_lock = threading.Lock()


def _retire(events: list, pieces) -> None:
    """Keep ``pieces`` alive until every event of ``events`` (None: no event) has completed."""
    with _retired_lock:
        _retired.append((events, pieces))
    _prune_retired()


def _prune_retired() -> None:
    """Drop the retired pieces whose events have all completed (queries, no host wait)."""
    with _retired_lock:
        keep, done = [], []
        for entry in _retired:
            (done if all(e is None or e.done for e in entry[0]) else keep).append(entry)
        _retired[:] = keep
    del done   # the blocks go back to their pools here, outside the lock


class Placer:
    """Pulls steps (one piece per local replica) and places them."""

    def __init__(self, devices: Sequence[Device], steps: Iterator[list],
                 fetch_to_device: bool = True, buffer_size: int = 1):
        self._devices = list(devices)
        self._steps = steps
        self._gpu = fetch_to_device and any(d.is_gpu for d in self._devices)
        self._thread = None
        #: Consumer side: steps handed over and still possibly in use (see the module
        #: docstring), and the events the copy streams wait for before the next copies.
        self._held: list = []
        self._last = None
        self._release: list | None = None
        #: The consumer's streams at the last handover, ``(stream, device index)`` pairs
        #: (None for CPU devices): a close from a finalizer orders after them.
        self._consumer: list | None = None
        _prune_retired()
        if self._gpu:
            finalizers.start()
            self._buffer_size = buffer_size
            self._queue: queue.Queue = queue.Queue(maxsize=buffer_size)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._produce, name="gpustrat-placer",
                                            daemon=True)
            self._thread.start()
        self._done = False

    def next(self) -> list:
        if self._done:
            raise StopIteration
        if not self._gpu:
            try:
                step = next(self._steps)
            except StopIteration:
                self._done = True
                raise
            return [_host_piece(p) for p in step] if _any_gpu(step) else step
        item = self._queue.get()
        if item is _END or isinstance(item, BaseException):
            self._done = True
            self._retire_held()
            if item is _END:
                raise StopIteration
            try:
                raise item
            finally:
                del item   # its traceback holds this frame: no reference cycle
        placed, ready = item
        self._hand_over(placed, ready)
        return placed

    def _hand_over(self, placed: list, ready: list) -> None:
        """Order the consumer's streams after the step's copies; keep earlier steps'
        pieces alive until the consumer's work queued so far has completed."""
        cp = cupy()
        here = int(cp.cuda.Device().id)
        self._consumer = self._consumer_streams()
        released = self._consumer_events(self._consumer)   # after everything queued before
        for dev, ev in zip(self._devices, ready):
            if ev is not None:
                with cp.cuda.Device(dev.index):
                    cp.cuda.get_current_stream().wait_event(ev)
        # CuPy's get() copies on the current device's stream, whichever the array's.
        current = cp.cuda.get_current_stream()
        for dev, ev in zip(self._devices, ready):
            if ev is not None and dev.index != here:
                current.wait_event(ev)
        # The previous step's pieces were consumed by work queued before ``released``.
        if self._last is not None:
            self._held.append((released, self._last))
        self._last = placed
        self._held = [(evs, p) for evs, p in self._held
                      if not all(e is None or e.done for e in evs)]
        self._release = released
        _prune_retired()

    def _consumer_streams(self) -> list:
        """Per device, the calling thread's current stream of it as ``(stream, device
        index)`` (None for CPU devices), then its current stream of the current device if
        that is none of them (CuPy's ``get()`` copies there)."""
        cp = cupy()
        pairs = []
        for dev in self._devices:
            if not dev.is_gpu:
                pairs.append(None)
                continue
            with cp.cuda.Device(dev.index):
                pairs.append((cp.cuda.get_current_stream(), dev.index))
        here = int(cp.cuda.Device().id)
        if here not in {d.index for d in self._devices if d.is_gpu}:
            pairs.append((cp.cuda.get_current_stream(), here))
        return pairs

    @staticmethod
    def _consumer_events(pairs: list) -> list:
        """An event recorded now on each stream of :meth:`_consumer_streams`' pairs (None
        for None): after the work queued there so far."""
        gpu = [p for p in pairs if p is not None]
        events = iter(kept_events([s for s, _ in gpu], [d for _, d in gpu]))
        return [None if p is None else next(events) for p in pairs]

    def _retire_held(self, pairs: list | None = None) -> None:
        """Retire the pieces handed over and still possibly in use, until the work queued
        so far on ``pairs``' streams (default: the calling thread's current streams) has
        completed."""
        if self._held or self._last is not None:
            pairs = self._consumer_streams() if pairs is None else pairs
            _retire(self._consumer_events(pairs), (self._held, self._last))
        self._held, self._last = [], None

    def _retire_queued(self) -> None:
        """Retire the steps placed but never handed over, until their copies complete."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                placed, ready = item
                _retire(ready, placed)

    def _produce(self) -> None:
        staging = _Staging(self._devices, self._buffer_size)
        try:
            for step in self._steps:
                placed = _tl.timed("place", staging.place, step, self._release) if _tl.ON \
                    else staging.place(step, self._release)
                if not self._put(placed):
                    _retire(placed[1], placed[0])
                    return
                placed = None   # the consumer's now, not kept by an error's traceback
            self._put(_END)
        except BaseException as e:  # re-raised in the consumer with its traceback
            self._put(e)
        finally:
            staging.finish()
            if self._stop.is_set():   # close() may have drained the queue before a put
                self._retire_queued()

    def _put(self, item) -> bool:
        """Queue ``item`` for the consumer; False if the placer was closed first."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def close(self) -> None:
        """Stop placing; the pieces placed or handed over are retired (see the module
        docstring), ordered after the calling thread's current streams."""
        self._close(None)

    def close_later(self) -> None:
        """:meth:`close` for a finalizer: it only queues the close on the cleanup thread
        (:mod:`gpustrat.finalizers`), which orders the pieces handed over after the
        streams that consumed the last step instead."""
        if self._thread is None:   # (what the garbage collector does anyway)
            self._close(None)
        else:
            finalizers.defer(self._close, self._consumer or [])

    def _close(self, pairs: list | None) -> None:
        if self._thread is not None:
            if self._thread.is_alive():
                self._stop.set()
                self._thread.join(timeout=5)
            self._retire_queued()
            if pairs is not None and any(p is not None and p[0].ptr == PER_THREAD_STREAM
                                         for p in pairs):
                # Another thread's per-thread stream cannot be recorded on from here:
                # wait for the devices instead (this is the cleanup thread, not the user's).
                for p in pairs:
                    if p is not None:
                        cupy().cuda.Device(p[1]).synchronize()
                pairs = []
            self._retire_held(pairs)
        close = getattr(self._steps, "close", None)
        if close is not None and self._thread is None:
            close()


def _any_gpu(step: list) -> bool:
    return any(is_gpu_array(leaf) for p in step for leaf in nest.flatten(p))


def _host_piece(piece):
    return nest.map_structure(to_host, piece)


class _Staging:
    """Per-device copy streams and a ring of growing pinned buffers per device."""

    def __init__(self, devices: Sequence[Device], buffer_size: int = 1):
        self.devices = list(devices)
        self.streams = [new_stream(d) for d in self.devices]
        self.ring = max(int(buffer_size), 1) + 2
        #: arenas[i][k]: ``[pinned buffer, event after the copies that read it]``
        self.arenas: list[list] = [[[None, None] for _ in range(self.ring)]
                                   for _ in self.devices]
        self.step = 0

    def _arena(self, i: int, nbytes: int) -> np.ndarray:
        slot = self.arenas[i][self.step % self.ring]
        if slot[1] is not None and not slot[1].done:
            slot[1].synchronize()   # the GPU is a ring behind: wait, in this thread
        a = slot[0]
        if a is None or a.nbytes < nbytes:
            a = slot[0] = pinned_empty((max(nbytes, 1 << 20),), np.uint8)
        return a

    def finish(self) -> None:
        """Wait (in the placer's thread, once at the end) for the copies still reading
        the pinned buffers, which go back to CuPy's pinned pool when dropped."""
        for slots in self.arenas:
            for slot in slots:
                if slot[1] is not None and not slot[1].done:
                    slot[1].synchronize()

    def place(self, step: list, release: list | None = None) -> tuple[list, list]:
        """Queue the copies of one step; returns the placed pieces and, per device, the
        event their copies complete at (None for CPU devices)."""
        allocated: list = []
        try:
            return self._place(step, release, allocated)
        except BaseException:
            # Copies into this step's arrays may still be queued: keep the arrays alive
            # until those complete.
            events = []
            for dev, stream in zip(self.devices, self.streams):
                if stream is not None:
                    with dev.activate():
                        events.append(kept_event(stream, dev.index))
            _retire(events, allocated)
            raise

    def _place(self, step: list, release: list | None, allocated: list) -> tuple[list, list]:
        out, ready = [], []
        for i, (dev, piece) in enumerate(zip(self.devices, step)):
            if not dev.is_gpu:
                out.append(_host_piece(piece))
                ready.append(None)
                continue
            leaves = nest.flatten(piece)
            host = [np.ascontiguousarray(x) for x in leaves if not is_gpu_array(x)]
            arena = self._arena(i, sum(h.nbytes for h in host)) if host else None
            placed, offset = [], 0
            stream = self.streams[i]
            with dev.activate():
                if release is not None and release[i] is not None:
                    stream.wait_event(release[i])
                for x in leaves:
                    if is_gpu_array(x):
                        placed.append(to_device(x, dev, stream=stream))
                        allocated.append(placed[-1])
                        continue
                    h = np.ascontiguousarray(x)
                    view = arena[offset:offset + h.nbytes].view(h.dtype).reshape(h.shape)
                    np.copyto(view, h)
                    offset += h.nbytes
                    with stream:  # the copy stream's own pool arena
                        arr = cupy().empty(h.shape, h.dtype)
                    allocated.append(arr)
                    arr.set(view, stream=stream)
                    placed.append(arr)
                done = kept_event(stream, dev.index)   # timing-free
            self.arenas[i][self.step % self.ring][1] = done
            ready.append(done)
            out.append(placed[0] if not nest.is_nested(piece) else
                       nest.pack_sequence_as(piece, placed))
        self.step += 1
        return out, ready
