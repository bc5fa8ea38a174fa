"""Peers measured beside gpustrat, when they are importable: PyTorch (CPU) pipelines that
do the same work as a gpustrat suite, so that a suite can print both and their ratio.

Neither peer is a dependency: every function returns None when its library does not
import. Install them for a one-off comparison (CPU wheels):
``pip install torch==2.13.0`` and/or ``pip install tensorflow-cpu==2.21.0``.
TensorFlow's equivalents live in the suites themselves (``bench_run.py``,
``bench_input.py``, ``bench_data.py``), next to the gpustrat code they mirror.

What is compared:
- ``torch_run_overhead``: PyTorch runs CPU data parallelism as one process per replica
  (``torch.distributed`` with gloo; ``nn.parallel.parallel_apply``, its in-process
  threads, needs an accelerator), so the per-step cost of a step that only synchronises
  is one small ``all_reduce``: compared with ``strategy.run`` of an ``all_reduce``.
- ``torch_input_throughput``: a ``DataLoader`` over a ``TensorDataset`` of the same
  array and global batch size, each batch cut into ``replicas`` pieces (the same
  ``ceil(n / N)`` rule), summed per piece and the sums added: the work of
  ``bench_input``'s gpustrat step, in one process without distributed input, which
  PyTorch does not have for in-process replicas. Two loaders: the default one
  (``batch_size=b``, rows fetched one by one and collated, as most code writes it) and
  one whose sampler yields whole index batches (a single fancy-indexing per batch, the
  fastest plain DataLoader).
- ``gil_map``: a GIL-bound pure-Python function (:func:`python_work`, the one
  ``bench_data``'s gpustrat rows call) mapped over ``range(n)`` by TensorFlow's
  ``Dataset.map(lambda i: tf.py_function(f, [i], tf.int64), num_parallel_calls=AUTOTUNE)``
  and by PyTorch's ``DataLoader(dataset, batch_size=None, num_workers=2)``, with a serial
  loop of the same interpreter beside them. ``bench_data`` runs it in a child process
  (``python benchmarks/peers.py gil-map ...``), with another interpreter when it is given
  one (``--peers-python``, or ``GPUSTRAT_PEERS_PYTHON``): the peers can live in a virtual
  environment of their own, and neither is imported by the process that measures
  gpustrat.
"""

from __future__ import annotations

import time


def torch():
    """The torch module, or None when it does not import."""
    try:
        import torch as t  # noqa: PLC0415 - optional peer
    except Exception:
        return None
    return t


def versions() -> dict:
    """Versions of the importable peers (absent ones map to None)."""
    from importlib import metadata  # noqa: PLC0415
    out = {}
    for dist in ("torch", "tensorflow-cpu", "tensorflow"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _free_port() -> int:
    import socket  # noqa: PLC0415
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _gloo_worker(rank: int, world: int, port: int, n_steps: int, out_path: str) -> None:
    import json  # noqa: PLC0415

    import torch as t  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    t.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    try:
        x = t.ones(1)
        dist.all_reduce(x)
        assert float(x[0]) == world, float(x[0])

        def steps():
            for _ in range(n_steps):
                dist.all_reduce(x)
        best = _best_time(steps, 3) / n_steps * 1e6
        dist.barrier()
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"replicas": world, "gloo_all_reduce_us": best}, f)
    finally:
        dist.destroy_process_group()


def torch_run_overhead(replicas: int = 2, n_steps: int = 2000) -> dict | None:
    """Microseconds per one-float ``torch.distributed.all_reduce`` over ``replicas``
    processes with the gloo backend (on the loopback interface): PyTorch's CPU data
    parallelism has one process per replica, so its per-step cost is this collective,
    the peer of gpustrat's ``run`` with an ``all_reduce`` inside. None without torch."""
    t = torch()
    if t is None:
        return None
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    import torch.multiprocessing as mp  # noqa: PLC0415
    with tempfile.TemporaryDirectory(prefix="gpustrat-peer-") as tmp:
        out = os.path.join(tmp, "gloo.json")
        mp.spawn(_gloo_worker, args=(replicas, _free_port(), n_steps, out), nprocs=replicas,
                 join=True)
        with open(out) as f:
            return json.load(f)


def _cut(batch, replicas: int):
    # The splitting rule of experimental_distribute_dataset: pieces of ceil(n / N) rows.
    n = batch.shape[0]
    size = -(-n // replicas)
    return [batch[i * size:(i + 1) * size] for i in range(replicas)]


def torch_input_throughput(array, batch: int, replicas: int = 2, epochs: int = 3) -> dict | None:
    """Batches/s and GB/s of a DataLoader doing ``bench_input``'s step; None without torch.

    Returns ``{"default": {...}, "batched_sampler": {...}}``, each with ``steps``,
    ``seconds``, ``batches_per_s``, ``gb_per_s``.
    """
    t = torch()
    if t is None:
        return None
    from torch.utils.data import (BatchSampler, DataLoader,  # noqa: PLC0415
                                  SequentialSampler, TensorDataset)
    data = TensorDataset(t.from_numpy(array))
    loaders = {
        "default": DataLoader(data, batch_size=batch, shuffle=False),
        "batched_sampler": DataLoader(
            data, batch_size=None,
            sampler=BatchSampler(SequentialSampler(range(len(data))), batch, False)),
    }
    expected = float(array[:, 0].sum(dtype="float64"))
    out = {}
    for name, loader in loaders.items():
        state = {}

        def epoch(loader=loader, state=state):
            steps, total = 0, 0.0
            for (x,) in loader:
                parts = [p.sum(dim=0) for p in _cut(x, replicas)]
                total += float(sum(parts)[0])
                steps += 1
            state["steps"], state["total"] = steps, total
        seconds = _best_time(epoch, epochs)
        if abs(state["total"] - expected) > 1e-3 * max(1.0, abs(expected)):
            raise AssertionError(f"torch {name} loader summed {state['total']}, "
                                 f"expected {expected}")
        out[name] = {"steps": state["steps"], "seconds": seconds,
                     "batches_per_s": state["steps"] / seconds,
                     "gb_per_s": array.nbytes / seconds / 1e9}
    return out


# --- a GIL-bound map, run in a child process ------------------------------------------

def python_work(x, loops: int):
    """Pure Python arithmetic: holds the GIL for the whole call (about ``loops`` times
    40 ns here)."""
    s = 0
    for k in range(loops):
        s += (k * 7 + x) % 13
    return s


def _steady_epochs(make_iter, elements: int, repeats: int) -> tuple[float, float]:
    """(seconds to the first element, seconds for the rest), each the fastest of
    ``repeats`` epochs."""
    first = rest = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        it = make_iter()
        next(it)
        t1 = time.perf_counter()
        n = 1 + sum(1 for _ in it)
        t2 = time.perf_counter()
        assert n == elements, (n, elements)
        first, rest = min(first, t1 - t0), min(rest, t2 - t1)
        del it
    return first, rest


def _tensorflow():
    try:
        import tensorflow as tf  # noqa: PLC0415 - optional peer
    except Exception:
        return None
    return tf


def gil_map(loops: int, elements: int, repeats: int) -> dict:
    """Steady-state seconds (the first element excluded) of TensorFlow's and PyTorch's
    parallel maps of :func:`python_work` over ``range(elements)``, the fastest of
    ``repeats`` epochs, and of a serial loop here; a peer that does not import is left
    out (its key absent), with its error under ``missing``."""
    import functools  # noqa: PLC0415
    import sys  # noqa: PLC0415
    fn = functools.partial(python_work, loops=loops)
    out = {"python": sys.version.split()[0], "missing": {}}
    _, out["serial_s"] = _steady_epochs(lambda: map(fn, range(elements)), elements,
                                        repeats)
    tf = _tensorflow()
    if tf is None:
        out["missing"]["tensorflow"] = "does not import"
    else:
        def tf_fn(i):
            return tf.py_function(lambda v: fn(int(v)), [i], tf.int64)
        ds = tf.data.Dataset.range(elements).map(tf_fn, num_parallel_calls=tf.data.AUTOTUNE)
        out["tf_first_s"], out["tf_s"] = _steady_epochs(lambda: iter(ds), elements, repeats)
        out["tf_version"] = tf.__version__
    t = torch()
    if t is None:
        out["missing"]["torch"] = "does not import"
    else:
        class Items(t.utils.data.Dataset):
            def __len__(self):
                return elements

            def __getitem__(self, i):
                return fn(i)

        loader = t.utils.data.DataLoader(Items(), batch_size=None, num_workers=2)
        out["torch_first_s"], out["torch_s"] = _steady_epochs(lambda: iter(loader),
                                                              elements, repeats)
        out["torch_version"] = t.__version__
    return out


def run_gil_map(python: str, loops: int, elements: int, repeats: int,
                timeout: float = 900) -> dict:
    """:func:`gil_map` in a child process of interpreter ``python`` (this file run as a
    script); ``{"error": text}`` when the child fails."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)   # the peers' environment, not gpustrat's
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        proc = subprocess.run([python, os.path.abspath(__file__), "gil-map", str(loops),
                               str(elements), str(repeats)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{python}: {e}"}
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": f"{python} exited with status {proc.returncode}: "
                         + " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _work_at(start_at: float, loops: int, count: int) -> None:
    """Wait for the monotonic clock to reach ``start_at``, then call
    :func:`python_work` ``count`` times; print (start, end) on that clock and the
    processor seconds the calls took."""
    while time.monotonic() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.monotonic())))
    t0, c0 = time.monotonic(), time.process_time()
    for i in range(count):
        python_work(i, loops)
    print(t0, time.monotonic(), time.process_time() - c0)


def two_core_ceiling(loops: int, elements: int) -> tuple[float, list[float]]:
    """Seconds two plain processes of this interpreter take for ``elements`` calls of
    :func:`python_work` between them (half each, started together once both are up):
    what 2 cores give this function at the moment, no pipeline involved; and each
    process's processor seconds per call (beside a lone process's, what a call costs
    when both cores are busy)."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415
    start_at = time.monotonic() + 1.0
    half = [elements // 2, elements - elements // 2]
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "work",
                               repr(start_at), str(loops), str(n)],
                              stdout=subprocess.PIPE, text=True) for n in half]
    spans = [tuple(map(float, p.communicate()[0].split())) for p in procs]
    return (max(e for _, e, _ in spans) - min(s for s, _, _ in spans),
            [cpu / n for (_, _, cpu), n in zip(spans, half)])


if __name__ == "__main__":
    import json
    import sys
    if sys.argv[1:2] == ["work"] and len(sys.argv) == 5:
        _work_at(float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1:2] == ["gil-map"] and len(sys.argv) == 5:
        print(json.dumps(gil_map(*map(int, sys.argv[2:]))))
    else:
        sys.exit("usage: python peers.py gil-map LOOPS ELEMENTS REPEATS")
