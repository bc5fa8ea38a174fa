"""The background placer and the memory pool on the stream-ordering sanitizer: a block
goes back to its stream's pool the moment its last reference goes (as in CuPy), in
the thread that dropped it, so pieces the consumer released after seeing its work
complete are reused without a report whichever thread collects garbage; a training loop
fed by the placer frees its pieces without the garbage collector and runs with nothing
reported while another thread collects garbage all the time."""

from __future__ import annotations

import contextlib
import gc
import threading
import time

import numpy as np
import pytest

import gpustrat as gs
from gpustrat import devices, finalizers, testing
from gpustrat.data import Dataset
from gpustrat.devices import Device, join_streams_into_current, new_stream, wait_for_current
from gpustrat.distribute import placement
from gpustrat.distribute.placement import Placer

DEVS = [Device("gpu", 0), Device("gpu", 1)]


@contextlib.contextmanager
def _no_automatic_collection():
    """Only explicit ``gc.collect()`` calls collect garbage inside the block."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# --- the pool -------------------------------------------------------------------------------

def test_a_block_goes_back_to_its_pool_when_its_last_reference_goes():
    with _no_automatic_collection(), testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        a = cp.empty((64,), np.float32)
        addr = a.data.ptr
        view, pointer = a[8:], a.data
        del a
        b = cp.empty((64,), np.float32)
        assert b.data.ptr != addr          # a view still refers to the block
        del view
        c = cp.empty((64,), np.float32)
        assert c.data.ptr != addr          # so does a MemoryPointer, as CuPy's
        del pointer
        d = cp.empty((64,), np.float32)
        assert d.data.ptr == addr          # no collection needed
        del b, c, d
    assert not san.reports


def test_a_reuse_report_names_the_thread_that_freed_the_block():
    with _no_automatic_collection(), testing.sanitize(check=False, run_probability=0) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
            with a:
                x = cp.full((64,), 1.0, dtype=np.float32)
            b.wait_event(a.record())
            with b:
                y = x + 1                                # b reads x
            cycle = [x]
            cycle.append(cycle)                          # only a collection frees x
            del x, cycle
            t = threading.Thread(target=gc.collect, name="collector")
            t.start()
            t.join(10)
            with a:
                cp.empty((64,), np.float32)              # x's block, while b may read it
        del y
    assert [r.kind for r in san.reports] == ["reuse"]
    assert "(collector, by the garbage collector)" in san.reports[0].message


def test_an_address_lookup_during_another_threads_allocation_finds_its_block():
    with testing.sanitize(seed=0) as san:
        cp = devices.cupy()
        with cp.cuda.Device(1):
            x = cp.empty((64,), np.float32)   # gpu:1's addresses lie above gpu:0's
        found, lookups = {}, []

        def look():
            try:
                found["block"] = san.block_at(x.data.ptr, x.nbytes)[0]
            except Exception as e:  # noqa: BLE001 (the assertion below shows it)
                found["error"] = e

        class Hooked(list):
            # Another thread looks x up between the allocation's two list insertions.
            def insert(self, k, v):
                super().insert(k, v)
                t = threading.Thread(target=look)
                t.start()
                t.join(0.2)
                lookups.append(t)

        san._addrs = Hooked(san._addrs)
        with cp.cuda.Device(0):
            y = cp.empty((64,), np.float32)   # goes before x's block in both lists
        lookups[0].join(10)
        assert "error" not in found, found
        assert found["block"].addr == x.data.ptr
        del y
    assert not san.reports


# --- the placer --------------------------------------------------------------------------

class _Gated:
    """A host piece that the placer's thread converts only once the test lets it. By
    then the thread has read which consumer events the copy stream waits for; a garbage
    collection runs there before the copies are queued."""

    def __init__(self, value: np.ndarray, entered: threading.Event, go: threading.Event):
        self.value, self.entered, self.go = value, entered, go

    def __array__(self, dtype=None, copy=None):
        self.entered.set()
        assert self.go.wait(10)
        gc.collect()
        return self.value if dtype is None else self.value.astype(dtype)


def _read_on(streams, pieces) -> list:
    """Each piece read on a stream of its device, ordered as ``run`` orders a replica
    stream: after the caller's stream, and the caller's stream after it."""
    out = []
    for dev, stream, piece in zip(DEVS, streams, pieces):
        wait_for_current(dev, stream)
        with dev.activate(), stream:
            out.append((piece - 1).sum())
    join_streams_into_current(DEVS, streams)
    return out


def test_pieces_released_at_a_handover_are_reused_after_a_collection_in_the_placers_thread():
    # The placer starts placing step 2 before the consumer takes step 1, so its copy
    # stream waits for step 0's hand-over events only, which order nothing of step 0's
    # reads. Taking step 1 sees those reads complete and releases step 0's pieces: their
    # blocks go back to the copy stream's pool then, in the consumer's thread, and step
    # 2 reuses them. (When arrays were freed by the garbage collector, the collection in
    # the placer's thread freed them there, and the sanitizer reported the reuse.)
    entered, go = threading.Event(), threading.Event()
    steps = [[np.full((64,), float(k), np.float32) for _ in DEVS] for k in (0, 1)]
    steps.append([_Gated(np.full((64,), 2.0, np.float32), entered, go) for _ in DEVS])
    with _no_automatic_collection(), testing.sanitize(seed=0, run_probability=0) as san:
        placer = Placer(DEVS, iter(steps))
        streams = [new_stream(d) for d in DEVS]
        try:
            first = placer.next()
            addrs = [p.data.ptr for p in first]
            sums = [_read_on(streams, first)]
            del first
            assert entered.wait(10)         # step 2 is being placed
            second = placer.next()          # step 0's pieces are released here
            sums.append(_read_on(streams, second))
            del second
            go.set()
            third = placer.next()
            assert [p.data.ptr for p in third] == addrs
            sums.append(_read_on(streams, third))
            del third
            with pytest.raises(StopIteration):
                placer.next()
        finally:
            go.set()
            placer.close()
        got = [[float(devices.to_host(s)) for s in step] for step in sums]
    assert got == [[-64.0, -64.0], [0.0, 0.0], [64.0, 64.0]]
    assert not san.reports


def _busy(san, streams) -> threading.Event:
    """Work first on each of ``streams`` that runs only once the returned event is set:
    the GPUs are busy, and an event query sees the work queued after it pending."""
    go = threading.Event()
    for stream in streams:
        san.enqueue(stream._s, "earlier work", ready=go.is_set, count=None)
    return go


def _in_use(san) -> set:
    return {b.serial for b in san.blocks if not b.free}


def _blocks(san, arrays) -> set:
    return {san.block_at(a.data.ptr)[0].serial for a in arrays}


def _placer_activity() -> None:
    """What prunes the retired pieces without touching a GPU: creating a placer."""
    Placer([Device("cpu", 0)], iter([])).close()


@pytest.mark.parametrize("end", [StopIteration, ValueError])
def test_the_last_steps_pieces_stay_out_of_the_pool_until_the_work_reading_them_has_run(end):
    # The copy stream is destroyed once the data ends (or fails), and the driver may
    # give its handle, and so its pool arena, to a later stream: the last step's blocks
    # must not go back to that arena while the consumer's queued reads of them have not
    # run.
    def upstream():
        for k in (0, 1):
            yield [np.full((64,), float(k), np.float32) for _ in DEVS]
        if end is ValueError:
            raise ValueError("bad record")

    with _no_automatic_collection(), testing.sanitize(seed=0, run_probability=0) as san:
        streams = [new_stream(d) for d in DEVS]
        placer = Placer(DEVS, upstream())
        try:
            sums = [_read_on(streams, placer.next())]
            go = _busy(san, streams)
            last = placer.next()
            blocks = _blocks(san, last)
            sums.append(_read_on(streams, last))
            del last
            with pytest.raises(end):
                placer.next()
        finally:
            placer.close()   # the placer's thread has ended
        del placer
        assert blocks <= _in_use(san)     # the reads are still queued
        _placer_activity()
        assert blocks <= _in_use(san)
        go.set()
        for stream in streams:
            stream.synchronize()          # the reads have run ...
        assert blocks <= _in_use(san)     # ... and the blocks wait for a pruning
        _placer_activity()
        assert not blocks & _in_use(san)
        got = [[float(devices.to_host(s)) for s in step] for step in sums]
    assert got == [[-64.0, -64.0], [0.0, 0.0]]
    assert not san.reports


def test_closing_with_steps_queued_keeps_the_pieces_until_the_work_using_them_has_run():
    steps = [[np.full((64,), float(k), np.float32) for _ in DEVS] for k in range(6)]
    asked = threading.Event()

    def upstream():
        for k, step in enumerate(steps):
            if k == 3:
                asked.set()   # steps 1 and 2 are queued, and step 3 is being placed
            yield step

    with _no_automatic_collection(), testing.sanitize(seed=0, run_probability=0) as san:
        streams = [new_stream(d) for d in DEVS]
        before = _in_use(san)
        placer = Placer(DEVS, upstream(), buffer_size=2)
        try:
            go = _busy(san, streams)
            first = placer.next()
            blocks = _blocks(san, first)
            sums = _read_on(streams, first)
            del first
            assert asked.wait(10)
        finally:
            placer.close()
        del placer
        results = _blocks(san, sums)
        # The queued steps' copies completed before the placer's thread ended (it waits
        # for the copies reading its pinned buffers): their blocks are back in the pool.
        assert _in_use(san) - before - results == blocks
        _placer_activity()
        assert _in_use(san) - before - results == blocks   # the reads are still queued
        go.set()
        for stream in streams:
            stream.synchronize()
        _placer_activity()
        assert not blocks & _in_use(san)
        got = [float(devices.to_host(s)) for s in sums]
    assert got == [-64.0, -64.0]
    assert not san.reports


def test_an_iterator_collected_where_its_close_would_wait_is_closed_on_the_cleanup_thread():
    # The collector may run a dropped iterator's finalizer on a thread that holds a lock
    # the close needs (here the retired pieces' lock; in a test suite the sanitizer's,
    # which the placer's thread was waiting for): the close goes to the cleanup thread,
    # and the last step's pieces stay out of the pool until the work queued on the
    # streams that consumed them has run.
    with _no_automatic_collection(), testing.sanitize(seed=0, run_probability=0) as san:
        cp = devices.cupy()
        s = gs.MirroredStrategy([d.name for d in DEVS])
        try:
            x = np.arange(64 * 3, dtype=np.float32).reshape(64, 3)
            dist = s.experimental_distribute_dataset(Dataset.from_tensor_slices(x).batch(16))
            held = [iter(dist)]
            pieces = list(s.experimental_local_results(next(held[0])))
            blocks = _blocks(san, pieces)
            current = []
            for d in DEVS:
                with cp.cuda.Device(d.index):
                    current.append(cp.cuda.get_current_stream())
            go = _busy(san, current)
            sums = []
            for d, piece in zip(DEVS, pieces):
                with d.activate():
                    sums.append((piece - 1).sum())
            del pieces, piece

            def drop():
                with placement._retired_lock:
                    held.pop()
                    gc.collect()

            t = threading.Thread(target=drop, daemon=True)
            t.start()
            t.join(20)
            assert not t.is_alive(), "the finalizer waited for a lock its own thread held"
            assert finalizers.wait()
            assert not [t for t in threading.enumerate() if t.name == "gpustrat-placer"]
            assert blocks <= _in_use(san)     # the reads are still queued
            _placer_activity()
            assert blocks <= _in_use(san)
            go.set()
            for d in DEVS:
                cp.cuda.Device(d.index).synchronize()
            _placer_activity()
            assert not blocks & _in_use(san)
            got = [float(devices.to_host(v)) for v in sums]
        finally:
            s.close()
    assert got == [float((x[:8] - 1).sum()), float((x[8:16] - 1).sum())]
    assert not san.reports


# --- training fed by the placer --------------------------------------------------------------

ROWS = 8


def _data(steps: int):
    x = (np.arange(steps * ROWS * 3, dtype=np.float32).reshape(steps * ROWS, 3) % 7) / 7
    return x, (x @ np.array([1.0, -2.0, 0.5], np.float32)).astype(np.float32)


def _reference(x, y, lr=0.1):
    w = np.zeros(3, np.float32)
    for k in range(len(x) // ROWS):
        xb, yb = x[k * ROWS:(k + 1) * ROWS], y[k * ROWS:(k + 1) * ROWS]
        w -= lr * (xb * (xb @ w - yb)[:, None]).sum(axis=0) * np.float32(2.0 / ROWS)
    return w


def _fit(san, x, y, buffer_size=1):
    """Linear regression over a distributed dataset of (x, y) tuples, 2 GPUs. Returns
    the weights of each replica, the blocks in use after each step and each step's
    counts."""
    s = gs.MirroredStrategy([d.name for d in DEVS])
    try:
        with s.scope():
            w = gs.Variable(np.zeros(3, np.float32))
            opt = gs.optimizers.SGD(0.1)

        def step(xb, yb):
            err = (xb * w.value()).sum(axis=1) - yb
            opt.apply_gradients([((xb * err.reshape(-1, 1)).sum(axis=0) * (2.0 / ROWS), w)])

        options = gs.InputOptions(experimental_per_replica_buffer_size=buffer_size)
        dist = s.experimental_distribute_dataset(
            Dataset.from_tensor_slices((x, y)).batch(ROWS), options)
        in_use, counts = [], []
        for xb, yb in dist:
            with san.measure() as c:
                s.run(step, args=(xb, yb))
            counts.append(c)
            in_use.append(sum(not b.free for b in san.blocks))
        return [devices.to_host(c._array) for c in s.experimental_local_results(w)], \
            in_use, counts
    finally:
        s.close()


def test_a_training_loop_frees_its_pieces_and_temporaries_without_the_garbage_collector():
    x, y = _data(24)
    with _no_automatic_collection(), testing.sanitize(seed=1) as san:
        ws, in_use, _ = _fit(san, x, y)
    assert not san.reports
    # The blocks in use stop growing once the pipeline is full (and shrink as it drains
    # at the end): nothing a step allocates waits for a collection to go back to the pool.
    # Where the placer's thread stands when a step ends moves the count by up to a batch
    # (a batch is 4 pieces, x and y on 2 devices; the step's temporaries add a few);
    # a block kept per step would add 20 over the steady steps.
    steady = in_use[2:-2]
    assert max(steady) - min(steady) <= 8, str(in_use)
    assert in_use[-1] <= min(steady), str(in_use)   # no more held once the data ends
    for w in ws:
        np.testing.assert_allclose(w, _reference(x, y), rtol=1e-5)


@contextlib.contextmanager
def _collecting_all_the_time():
    """Another thread runs full garbage collections back to back inside the block."""
    stop = threading.Event()

    def collect():
        while not stop.is_set():
            gc.collect()
            time.sleep(0.001)
    t = threading.Thread(target=collect, name="collector", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(10)


@pytest.mark.parametrize("run_probability", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("buffer_size", [1, 2])
@pytest.mark.parametrize("seed", [0, 1])
def test_training_through_the_placer_while_another_thread_collects_garbage(
        seed, buffer_size, run_probability):
    x, y = _data(6)
    with _collecting_all_the_time(), testing.sanitize(
            seed=seed, run_probability=run_probability) as san:
        ws, _, counts = _fit(san, x, y, buffer_size)
    assert not san.reports, san.reports
    for w in ws:
        np.testing.assert_allclose(w, _reference(x, y), rtol=1e-5)
    for c in counts:   # the step's threads wait for no device (the placer's may)
        assert [t for t, _, _ in c["sync_sites"] if t != "gpustrat-placer"] == []
