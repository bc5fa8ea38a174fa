"""A training step captured as one CUDA graph per local GPU, and replayed: what
``gs.function`` does on GPU strategies.

Words:
- *capture stream*: per local GPU, the stream the step's work is captured on and
  replayed on: the strategy's replica stream of that GPU (a stream of its own for a
  strategy that runs its one replica in the caller). While capturing, it is also the
  calling thread's current stream of its GPU, so that every piece of gpustrat that
  orders its work after "the current stream" (``strategy.run``'s joins,
  ``strategy.reduce``, the NCCL communicator's calls) stays inside the capture.
- *private pool*: a ``cupy.cuda.MemoryPool`` per set of graphs. Every allocation made
  while capturing comes from it (it is the process's allocator during the capture),
  and nothing else allocates from it afterwards, so the addresses the graphs use stay
  theirs for as long as the graphs live, and replays reuse them.
- *static inputs*: for every GPU array among the arguments (a distributed value's
  components included), a buffer of the private pool that the captured step reads.
  A replay copies the call's arrays into them on the capture streams (one
  device-to-device copy each, ordered after the caller's streams), then launches.
- *outputs*: what the step returned, captured in the private pool and overwritten by
  each replay. Each replay copies them out (one copy per array, on its device's
  capture stream right after the graph, so that the join that orders the caller's
  streams after the replay covers the copies): the caller may keep what a call
  returned across later calls, as with an eager step.
- *constants*: host data the step sends to a GPU while capturing (such as the ``1``
  added to ``optimizer.iterations``) is uploaded once, outside the capture, into the
  private pool, and the graph reads it: its value is the capture's.
- *step scalars*: a 0-d device array of the graphs holding a value an optimizer
  computes from the learning rate and the step count (SGD's learning rate, Adam's
  step size), set before each launch by a fill kernel that takes the value as its
  argument: a learning-rate schedule's next value reaches the graphs without a new
  capture and without a host wait.
- *guards*: the Python values a captured step read that can change between calls
  without the arguments changing: each optimizer's settings, its learning rate where
  it is not a step scalar (weight decay, other algorithms), and the step count for
  algorithms whose update holds it as a host number (all but SGD and Adam). A replay first checks them; a changed one makes ``gs.function`` capture
  again (as ``tf.function`` traces again), and a key whose guards change at every
  call runs eagerly after a few captures (a learning-rate schedule that changes every
  step). After a replay the optimizers' host step count advances, as an eager step's
  does.

What the capture refuses (:class:`~gpustrat.function.CaptureError`, naming the
operation and the user's line): a host synchronization, a host read of device data
(``.get()``, ``.item()``, ``float()`` of a CuPy array), an allocation from another
pool than the private one, a wait for work issued outside the capture, a step that
returns a Python number or host array (a replay cannot compute it again), NumPy
arrays as arguments (their values would be baked into the graph), several workers
(the agreement between workers runs on the host each step), and a communicator whose
watchdog found a failure. Replicas that issue different collectives raise as they do
eagerly. The NCCL watchdog does not watch the captured collectives (it would query
events recorded in a capture, which CUDA forbids); each replay hands it an event per
GPU recorded after the launch, so a replay whose peer died still times out.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import threading
import traceback

import numpy as np

from gpustrat import devices, nest
from gpustrat.devices import (Device, cupy, current_stream, is_gpu_array, new_stream,
                              wait_for_current)
from gpustrat.function import _RECAPTURE, CaptureError, map_leaves
from gpustrat.values import DistributedValues

#: One capture at a time in a process (the private pool is the process's allocator).
_capturing = threading.Lock()
_HERE = os.path.dirname(os.path.abspath(__file__))


def unsupported(strategy) -> str | None:
    """Why ``strategy``'s steps are not captured, or None where they may be."""
    devs = list(strategy.local_devices)
    cpus = [d.name for d in devs if not d.is_gpu]
    if cpus:
        return (f"the strategy's devices {cpus} are CPU devices: there is no CUDA graph "
                "to capture (the step runs as Python, which is what a CPU step costs)")
    if strategy.num_workers > 1:
        return (f"the strategy has {strategy.num_workers} workers: the agreement between "
                "workers runs on the host at each step, which a graph cannot replay; "
                "steps run eagerly")
    comm = strategy.communicator
    if len(devs) > 1 and type(comm).__name__ != "NcclCommunicator":
        return (f"the strategy's collectives go through {type(comm).__name__} (host "
                "staged), which a graph cannot replay: capture needs NCCL")
    return None


class _Active:
    """What the device layer, the NCCL communicator and the optimizers consult while a
    step is captured (``gpustrat.devices.capture_state``)."""

    def __init__(self, devs, streams, pool):
        self.devices = {d.index: (d, s) for d, s in zip(devs, streams)}
        self.pool = pool
        self.scalar_pool = cupy().cuda.MemoryPool()
        self.held: list = []
        self.constants: dict = {}
        self.optimizers: dict = {}     # id -> (optimizer, lr, settings, step)
        self.uploads: list = []        # (device index, event after the constant's upload)
        self.host_steps: list = []     # (optimizer, its host step before the capture)
        self.scalars: dict = {}        # (optimizer id, device, dtype) -> 0-d device array
        self.scalar_fns: list = []     # (device index, that array, optimizer, fn(lr, step))
        self.scalar_owners: set = set()  # ids of the optimizers that made one
        self._side: dict = {}

    def constant(self, host, device: Device):
        """Host data a captured step sends to ``device``: uploaded now, outside the
        capture (on a side stream the host waits for: not a capturing stream), once
        per value; the graph reads the copy."""
        a = np.array(devices.to_host(host), order="C")   # (keeps a 0-d array 0-d)
        key = (device.index, a.dtype.str, a.shape, a.tobytes())
        out = self.constants.get(key)
        if out is None:
            cp = cupy()
            with cp.cuda.Device(device.index):
                side = self._side.get(device.index)
                if side is None:
                    side = self._side[device.index] = cp.cuda.Stream(non_blocking=True)
                with side:
                    out = cp.asarray(a)
                side.synchronize()
                # The replays, queued later (perhaps by another thread), come after it.
                self.uploads.append((device.index, side.record()))
            self.constants[key] = out
        return out

    def hold(self, obj) -> None:
        """Keep ``obj`` (a captured collective's buffers) alive with the graphs."""
        self.held.append(obj)

    def note_optimizer(self, opt, lr, step: int) -> None:
        if id(opt) not in self.optimizers:
            self.host_steps.append((opt, opt._host_step))
        self.optimizers[id(opt)] = (opt, lr, opt._settings(), step)

    def step_scalar(self, opt, like, fn):
        """A 0-d device array on ``like``'s device, of its dtype, holding
        ``fn(lr, step)`` of ``opt``'s next step: set before each launch of the graphs
        (a fill, outside them), read by them. One per optimizer, device and dtype."""
        key = (id(opt), int(like.device.id), like.dtype.str)
        out = self.scalars.get(key)
        if out is None:
            cp = cupy()
            # From a pool of their own: a block the private pool hands out now may
            # have held a temporary of the graph's earlier work, which each replay
            # writes again, after the value was set.
            with cp.cuda.Device(int(like.device.id)), \
                    cp.cuda.using_allocator(self.scalar_pool.malloc):
                out = cp.empty((), like.dtype)
            self.scalars[key] = out
            self.scalar_fns.append((int(like.device.id), out, opt, fn))
            self.scalar_owners.add(id(opt))
        return out

    def undo_host_steps(self) -> None:
        """A capture that failed queued no device work: the optimizers' host step
        counts go back to what they were (iterations was not incremented)."""
        for opt, host_step in self.host_steps:
            opt._host_step = host_step


def _lr_on_device(opt, scalars: set) -> bool:
    """Whether the captured update of ``opt`` read its learning rate only through a
    step scalar: one was made for it in this capture (SGD's and Adam's updates make
    one), and no weight decay multiplies by the rate on the host."""
    return id(opt) in scalars and _plain(opt) and not opt.weight_decay


def _reads_step(opt, scalars: set) -> bool:
    """Whether the captured update of ``opt`` holds its step count as a host value
    (a reason to capture again when it changes): not SGD's (it reads no step), nor
    Adam's and AdamW's where their step size was a step scalar of this capture."""
    from gpustrat.optimizers.sgd import SGD  # noqa: PLC0415
    if not _plain(opt):
        return True
    return not (isinstance(opt, SGD) or id(opt) in scalars)


def _plain(opt) -> bool:
    """SGD or Adam (AdamW) with their own update, not a subclass's."""
    from gpustrat.optimizers.adam import Adam  # noqa: PLC0415
    from gpustrat.optimizers.sgd import SGD  # noqa: PLC0415
    t = type(opt)
    return any(isinstance(opt, base) and t.update_step is base.update_step and
               t.update_replicas is base.update_replicas for base in (SGD, Adam))


class StepGraphs:
    """The graphs of one trace key: their streams, pool, static inputs and outputs."""

    @classmethod
    def capture(cls, name: str, fn, strategy, args: tuple, kwargs: dict, state):
        """Capture ``fn(*args, **kwargs)`` and run it once through the graphs; the
        result is :attr:`first_result`."""
        with _capturing:
            self = cls(name, strategy, state)
            self._capture(fn, args, kwargs)
            self.first_result = self._launch()
            return self

    def __init__(self, name: str, strategy, state):
        cp = cupy()
        self.name = name
        self.strategy = strategy
        self.state = state
        self.devices = list(strategy.local_devices)
        runner = getattr(strategy, "_runner", None)
        streams = getattr(runner, "_streams", None) if runner is not None else None
        # (A lone replica has none of its own: it runs on the caller's stream, which
        # the capture makes one of its own.)
        self.streams = list(streams) if streams and None not in streams else \
            [new_stream(d) for d in self.devices]
        self.pool = cp.cuda.MemoryPool()
        self.position = {d.index: i for i, d in enumerate(self.devices)}
        self.inputs: list = []        # (position, static buffer) in argument order
        self.graphs: list = []
        self.outputs = None
        self.active: _Active | None = None

    # --- capture ---------------------------------------------------------------------
    def _static(self, leaf):
        if isinstance(leaf, np.ndarray):
            raise CaptureError(
                f"gs.function({self.name}): an argument is a NumPy array of shape "
                f"{leaf.shape}: its values would be baked into the graph; pass device "
                "arrays or distributed values (experimental_distribute_dataset), or "
                "capture=False")
        if not is_gpu_array(leaf):
            return leaf
        i = self.position.get(int(leaf.device.id))
        if i is None:
            raise CaptureError(
                f"gs.function({self.name}): an argument lives on gpu:{leaf.device.id}, "
                f"which is not one of the strategy's devices "
                f"{[d.name for d in self.devices]}")
        cp = cupy()
        d, s = self.devices[i], self.streams[i]
        with cp.cuda.Device(d.index), cp.cuda.using_allocator(self.pool.malloc):
            with s:
                buf = cp.empty(leaf.shape, leaf.dtype)
        self.inputs.append((i, buf))
        return buf

    def _capture(self, fn, args, kwargs) -> None:
        cp = cupy()
        static = map_leaves(self._static, (list(args), kwargs))
        self._copy_inputs((args, kwargs))
        self.active = _Active(self.devices, self.streams, self.pool)
        # (None where CuPy has not made its default pool yet; None given back to
        # set_allocator would turn the pool off.)
        previous = cp.cuda.get_allocator() or cp.get_default_memory_pool().malloc
        error = None
        out = None
        begun = []
        with contextlib.ExitStack() as stack:
            for d, s in zip(self.devices, self.streams):
                stack.enter_context(current_stream(d, s))
            cp.cuda.set_allocator(self.pool.malloc)
            try:
                # (The NCCL watchdog records no event from here until capture_state is
                # None again: one on a stream being captured would join the graph.)
                with devices.capture_lock:
                    devices.capture_state = self.active
                    for d, s in zip(self.devices, self.streams):
                        with cp.cuda.Device(d.index):
                            s.begin_capture()
                        begun.append((d, s))
                out = fn(*static[0], **static[1])
            except BaseException as e:  # noqa: BLE001 - ended below, then raised
                error = e
            finally:
                ends = []
                for d, s in begun:
                    with cp.cuda.Device(d.index):
                        try:
                            self.graphs.append(s.end_capture())
                        except Exception as e:  # noqa: BLE001
                            ends.append(e)
                devices.capture_state = None
                cp.cuda.set_allocator(previous)
        if error is not None or ends:
            self.active.undo_host_steps()
            cause = error if error is not None else ends[0]
            raise _explain(self.name, cause) from cause
        for index, uploaded in self.active.uploads:
            i = self.position[index]
            with cp.cuda.Device(index):
                self.streams[i].wait_event(uploaded)
        try:
            self.outputs = map_leaves(self._check_output, out)
        except CaptureError:
            self.active.undo_host_steps()
            raise

    def _check_output(self, leaf):
        if leaf is None or is_gpu_array(leaf):
            return leaf
        if isinstance(leaf, (bool, int, float, complex, np.number, np.ndarray)):
            raise CaptureError(
                f"gs.function({self.name}) returned a host value ({type(leaf).__name__} "
                f"{leaf!r}) computed when the step was captured: a replay does not run "
                "the Python that computed it. Return device arrays (strategy.reduce of "
                "the replicas' device losses), or use capture=False")
        return leaf

    # --- replay ----------------------------------------------------------------------
    def replay(self, args: tuple, kwargs: dict):
        """Run the step through the graphs with these arguments; ``_RECAPTURE`` when
        a guard changed."""
        guards = self._guards()
        if guards is _RECAPTURE:
            return _RECAPTURE
        sources: list = []
        _gpu_leaves((args, kwargs), sources)
        if len(sources) != len(self.inputs):
            raise CaptureError(f"gs.function({self.name}): {len(sources)} device arrays "
                               f"given where the capture had {len(self.inputs)}")
        out = self._launch(sources, {id(opt): (lr, step) for opt, lr, step in guards})
        for opt, _, step in guards:
            opt._remember_step(step)
        return out

    def _guards(self):
        out = []
        scalars = self.active.scalar_owners
        for opt, lr, settings, step in self.active.optimizers.values():
            now = opt.learning_rate
            if now != lr and not _lr_on_device(opt, scalars):
                self.state.last_guard = (f"{opt.name}'s learning rate changed from "
                                         f"{lr!r} to {now!r}")
                return _RECAPTURE
            if opt._settings() != settings:
                self.state.last_guard = f"{opt.name}'s settings changed"
                return _RECAPTURE
            next_step = opt._step_count() + 1
            if next_step != step and _reads_step(opt, scalars):
                self.state.last_guard = (f"{type(opt).__name__} {opt.name!r} reads the "
                                         f"step count, which is now {next_step}, not "
                                         f"{step}")
                return _RECAPTURE
            out.append((opt, now, next_step))
        return out

    def _copy_inputs(self, given) -> None:
        """Fill the static inputs before the capture (on the capture streams)."""
        cp = cupy()
        sources: list = []
        _gpu_leaves(given, sources)
        for (i, buf), src in zip(self.inputs, sources):
            d, s = self.devices[i], self.streams[i]
            with cp.cuda.Device(d.index):
                wait_for_current(d, s)    # the arrays were written on the caller's
                with s:
                    buf[...] = src

    def _plan(self) -> list:
        """Per device, once: its index, capture stream, graph, static inputs (by
        position among the call's device arrays), step scalars, outputs and two
        timing-free events."""
        cp = cupy()
        plan = []
        outputs: list = []
        map_leaves(lambda v: outputs.append(v) if is_gpu_array(v) else None, self.outputs)
        for i, (d, s, g) in enumerate(zip(self.devices, self.streams, self.graphs)):
            with cp.cuda.Device(d.index):
                plan.append((d.index, s, g,
                             [(k, buf) for k, (j, buf) in enumerate(self.inputs) if j == i],
                             [(a, opt, fn) for index, a, opt, fn in self.active.scalar_fns
                              if index == d.index],
                             [leaf for leaf in outputs if int(leaf.device.id) == d.index],
                             cp.cuda.Event(disable_timing=True),
                             cp.cuda.Event(disable_timing=True)))
        return plan

    def _launch(self, sources=None, steps=None):
        """Per device, in one visit: the capture stream waits for the caller's current
        stream (where the arguments were written), the call's arrays are copied into
        the static inputs and the step scalars set, the graph is launched, its outputs
        on that device are copied out, and the caller's current stream waits for all
        that; then the current device's current stream waits for every device (CuPy's
        ``get()`` copies there). Events only: no host wait."""
        cp = cupy()
        comm = self.strategy.communicator
        failure = getattr(getattr(comm, "_watchdog", None), "failure", None)
        if failure is not None:
            raise CaptureError(f"gs.function({self.name}): the NCCL watchdog found a "
                               f"failure ({failure}); make a new strategy") from failure
        plan = self.__dict__.get("_launch_plan")
        if plan is None:
            plan = self._launch_plan = self._plan()
            # The capture streams in the communicator's device order, for its watchdog.
            by_index = {d.index: s for d, s in zip(self.devices, self.streams)}
            self._comm_streams = [by_index.get(d.index) for d in
                                  getattr(comm, "devices", self.devices)]
        here = int(cp.cuda.runtime.getDevice())
        events = []
        if steps is None:     # the capture's own step
            steps = {id(o): (lr, step) for o, lr, _, step in self.active.optimizers.values()}
        values = {}
        copies: dict = {}
        for index, s, graph, inputs, scalars, outputs, before, after in plan:
            with cp.cuda.Device(index):
                current = cp.cuda.get_current_stream()
                other = current.ptr != s.ptr
                if other:
                    before.record(current)
                    s.wait_event(before)
                if (sources is not None and inputs) or scalars:
                    with s:
                        for k, buf in (inputs if sources is not None else ()):
                            src = sources[k]
                            if src is buf:
                                continue
                            if src.flags.c_contiguous:      # (same shape and dtype)
                                buf.data.copy_from_device_async(src.data, buf.nbytes, s)
                            else:
                                buf[...] = src
                        for a, opt, fn in scalars:
                            v = values.get((opt, fn))
                            if v is None:
                                v = values[(opt, fn)] = fn(*steps[id(opt)])
                            a.fill(v)     # a kernel taking the value: no host buffer
                graph.launch(s)
                if outputs:
                    with s:   # copied out before the join, so the caller reads in order
                        for leaf in outputs:
                            copies[id(leaf)] = leaf.copy()
                after.record(s)
                if other:
                    current.wait_event(after)
                events.append(after)
        if len(plan) > 1:
            current = cp.cuda.get_current_stream()
            for (index, *_), ev in zip(plan, events):
                if index != here:
                    current.wait_event(ev)
        watch = getattr(comm, "watch_replay", None)
        if watch is not None:
            watch(self._comm_streams, self._what)
        out = self.outputs
        if is_gpu_array(out):
            return copies[id(out)]
        return map_leaves(lambda leaf: copies.get(id(leaf), leaf), out)

    def _what(self) -> str:
        return f"a replay of gs.function({self.name})"


def _gpu_leaves(x, out: list) -> None:
    """Append the GPU arrays of ``x`` (a distributed value's components included) to
    ``out``, in the order :func:`~gpustrat.function.map_leaves` visits them."""
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            _gpu_leaves(v, out)
    elif isinstance(x, DistributedValues):
        for v in x.values:
            if is_gpu_array(v):
                out.append(v)
    elif isinstance(x, dict):
        for k in sorted(x):
            _gpu_leaves(x[k], out)
    elif isinstance(x, tuple):        # a namedtuple
        for v in x:
            _gpu_leaves(v, out)
    elif is_gpu_array(x):
        out.append(x)


def _explain(name: str, error: BaseException) -> BaseException:
    """A capture's failure in the user's words: CUDA's capture errors become a
    :class:`CaptureError` naming the operation and the user's line; others stay."""
    text = str(error)
    if isinstance(error, CaptureError):
        return error
    if "StreamCapture" not in text and "capturing" not in text:
        if hasattr(error, "add_note"):
            error.add_note(f"(raised while gs.function({name}) captured the step)")
        return error
    frames = traceback.extract_tb(error.__traceback__)
    last = max((k for k, f in enumerate(frames) if _is_user(f.filename)), default=None)
    user = frames[last] if last is not None else None
    inner = [f.name for f in frames[(last or 0) + 1:] if "/testing/" not in f.filename]
    op = _operation(text, frames)
    where = (f"{os.path.basename(user.filename)}:{user.lineno} ({user.name}): "
             f"{(user.line or linecache.getline(user.filename, user.lineno)).strip()}"
             if user is not None else "an unknown line")
    via = (f" (through {inner[0]}{' ... ' + inner[-1] if len(inner) > 1 else ''})"
           if inner else "")
    status = text.split(":", 1)[0]
    return CaptureError(
        f"gs.function({name}) cannot capture the step: {op} at {where}{via}; CUDA "
        f"refuses it while capturing ({status}). {_advice(op)}")


def _is_user(filename: str) -> bool:
    """A frame of the user's code (the demo's counts as such), not of gpustrat's
    runtime, CuPy, Numba or the standard library's plumbing."""
    f = os.path.abspath(filename)
    if f == os.path.join(_HERE, "demo.py"):
        return True
    return not (f.startswith(_HERE + os.sep) or "/cupy" in f or "contextlib" in f
                or "threading" in f or "/numba" in f)


def _operation(text: str, frames) -> str:
    names = {f.name for f in frames}
    if names & {"get", "item", "__float__", "__int__", "__bool__", "asnumpy", "to_host"}:
        return "a host read of device data (.get(), .item(), float())"
    if "allocation" in text:
        return "an allocation outside the capture's private memory pool"
    if "Isolation" in text:
        return "a wait for work issued outside the capture"
    if "Implicit" in text:
        return "work on the legacy default stream"
    if "event" in text:
        return "an event query or synchronization"
    return "a host synchronization"


def _advice(op: str) -> str:
    if op.startswith("a host read"):
        return ("Keep the value on the device inside the step (return it, and read it "
                "after the call), or use capture=False.")
    if op.startswith("an allocation"):
        return "Let CuPy's current allocator allocate inside the step."
    return "Move it out of the step, or use capture=False."
