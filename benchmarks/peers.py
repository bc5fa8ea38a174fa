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
