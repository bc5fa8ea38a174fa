"""Placing each step's pieces on the replicas' devices.

- CPU devices: pieces are host arrays already; a contiguous cut is a view (no copy).
- GPU devices: a background thread stages host pieces through page-locked (pinned)
  memory and issues asynchronous host-to-device copies on one copy stream per device,
  ``buffer_size`` steps ahead, so copies overlap the replicas' compute. A step is handed
  over only when its copies are complete. Pieces already on a GPU stay there if it is
  the replica's device and are copied device-to-device otherwise.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterator, Sequence

import numpy as np

from gpustrat import nest
from gpustrat.devices import Device, cupy, is_gpu_array, new_stream, pinned_empty, to_device, \
    to_host

_END = object()


class Placer:
    """Pulls steps (one piece per local replica) and places them."""

    def __init__(self, devices: Sequence[Device], steps: Iterator[list],
                 fetch_to_device: bool = True, buffer_size: int = 1):
        self._devices = list(devices)
        self._steps = steps
        self._gpu = fetch_to_device and any(d.is_gpu for d in self._devices)
        self._thread = None
        if self._gpu:
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
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def _produce(self) -> None:
        staging = _Staging(self._devices)
        try:
            for step in self._steps:
                placed = staging.place(step)
                while not self._stop.is_set():
                    try:
                        self._queue.put(placed, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._put_final(_END)
        except BaseException as e:  # re-raised in the consumer with its traceback
            self._put_final(e)

    def _put_final(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def close(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self._thread.join(timeout=5)
        close = getattr(self._steps, "close", None)
        if close is not None and self._thread is None:
            close()


def _any_gpu(step: list) -> bool:
    return any(is_gpu_array(leaf) for p in step for leaf in nest.flatten(p))


def _host_piece(piece):
    return nest.map_structure(to_host, piece)


class _Staging:
    """Per-device copy streams and a growing pinned arena per device."""

    def __init__(self, devices: Sequence[Device]):
        self.devices = list(devices)
        self.streams = [new_stream(d) for d in self.devices]
        self.arenas: list[np.ndarray | None] = [None] * len(self.devices)

    def _arena(self, i: int, nbytes: int) -> np.ndarray:
        a = self.arenas[i]
        if a is None or a.nbytes < nbytes:
            a = self.arenas[i] = pinned_empty((max(nbytes, 1 << 20),), np.uint8)
        return a

    def place(self, step: list) -> list:
        out = []
        for i, (dev, piece) in enumerate(zip(self.devices, step)):
            if not dev.is_gpu:
                out.append(_host_piece(piece))
                continue
            leaves = nest.flatten(piece)
            host = [np.ascontiguousarray(x) for x in leaves if not is_gpu_array(x)]
            arena = self._arena(i, sum(h.nbytes for h in host)) if host else None
            placed, offset = [], 0
            with dev.activate():
                for x in leaves:
                    if is_gpu_array(x):
                        placed.append(to_device(x, dev, stream=self.streams[i]))
                        continue
                    h = np.ascontiguousarray(x)
                    view = arena[offset:offset + h.nbytes].view(h.dtype).reshape(h.shape)
                    np.copyto(view, h)
                    offset += h.nbytes
                    with self.streams[i]:  # the copy stream's own pool arena
                        arr = cupy().empty(h.shape, h.dtype)
                    arr.set(view, stream=self.streams[i])
                    placed.append(arr)
            out.append(placed[0] if not nest.is_nested(piece) else
                       nest.pack_sequence_as(piece, placed))
        for dev, stream in zip(self.devices, self.streams):
            if stream is not None:
                stream.synchronize()  # the arena is reused by the next step
        return out
