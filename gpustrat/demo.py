"""Data-parallel training of a two-layer MLP, the workload behind ``python -m gpustrat demo``.

The model, its gradients and the data are plain NumPy (CuPy on GPU devices: every
function takes its array module from the arrays it gets); the training loop is
``tf.distribute``'s custom training loop, with variables, an optimizer and a metric:

    with strategy.scope():
        weights = {k: gs.Variable(v, name=k) for k, v in init.items()}
        optimizer = gs.optimizers.SGD(learning_rate)
        train_loss = gs.metrics.Mean("train_loss")
    dist = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    for batch in dist:
        strategy.run(train_step, args=(batch,))
    print(train_loss.result())

Words:
- *piece*: one replica's rows of a global batch; it may hold 0 rows (the last, partial
  batch cut over more replicas than it has rows).
- *exact data parallelism*: each replica computes the gradients of its piece's summed
  loss and divides them by the number of examples in the whole global batch (what
  ``gs.nn.compute_average_loss`` divides the loss by); the optimizer sums them over the
  replicas in one fused reduction. The update is then the one-replica full-batch
  gradient step, whatever the topology, up to the order of floating-point additions
  (see ``tests/test_train_topology.py``).

The weights are mirrored variables: one copy per replica, on its device, starting from
worker 0's values and kept equal by the optimizer's identical updates.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from typing import Callable

import numpy as np

# Defaults of the full demo; ``--quick`` shrinks them for a smoke run.
N_SAMPLES = 20_000      # deliberately not a multiple of GLOBAL_BATCH: the last batch is partial
N_FEATURES = 16
HIDDEN = 64
GLOBAL_BATCH = 256
LEARNING_RATE = 0.05
EPOCHS = 5
NOISE = 0.05           # the standard deviation of the targets' noise
PROGRESS_S = 5.0       # seconds between progress lines within an epoch
DATA_SEED = 0
INIT_SEED = 1

WEIGHT_NAMES = ("w1", "b1", "w2", "b2")


def make_dataset(n_samples: int = N_SAMPLES, n_features: int = N_FEATURES,
                 seed: int = DATA_SEED, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic regression set: ``y = sin(x @ a) + 0.5 * (x @ b)**2 / d + noise``.

    Deterministic in ``seed``; returns ``(x, y)`` with shapes ``(n, d)`` and ``(n, 1)``.
    """
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_samples, n_features))
    a = rng.standard_normal((n_features, 1)) / np.sqrt(n_features)
    b = rng.standard_normal((n_features, 1)) / np.sqrt(n_features)
    y = np.sin(x @ a) + 0.5 * (x @ b) ** 2 + NOISE * rng.standard_normal((n_samples, 1))
    return x.astype(dtype), y.astype(dtype)


def init_weights(n_features: int = N_FEATURES, hidden: int = HIDDEN, n_out: int = 1,
                 seed: int = INIT_SEED, dtype=np.float64) -> dict:
    """Glorot-scaled weights of the MLP ``tanh(x @ w1 + b1) @ w2 + b2``, from ``seed``."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((n_features, hidden)) / np.sqrt(n_features)).astype(dtype),
        "b1": np.zeros(hidden, dtype),
        "w2": (rng.standard_normal((hidden, n_out)) / np.sqrt(hidden)).astype(dtype),
        "b2": np.zeros(n_out, dtype),
    }


def forward_backward(weights: dict, x, y):
    """Per-example losses and the gradients of their **sum** over the rows of ``x``.

    Loss per example: ``0.5 * ||pred - y||^2``. Works for 0 rows (zero gradients, an
    empty loss vector). Returns ``(per_example_loss, grads)``, ``grads`` keyed as
    ``weights``.
    """
    from gpustrat.devices import array_module  # noqa: PLC0415
    xp = array_module(x)                                  # numpy, or cupy on a GPU replica
    h = xp.tanh(x @ weights["w1"] + weights["b1"])        # (n, H)
    err = h @ weights["w2"] + weights["b2"] - y           # (n, O)
    losses = 0.5 * (err * err).sum(axis=1)                # (n,)
    dh = (err @ weights["w2"].T) * (1.0 - h * h)          # (n, H)
    grads = {"w1": x.T @ dh, "b1": dh.sum(axis=0),
             "w2": h.T @ err, "b2": err.sum(axis=0)}
    return losses, grads


def build_model(strategy, init: dict, learning_rate: float, dtype=np.float64):
    """Under ``strategy``'s scope: mirrored weight variables from ``init``, an SGD
    optimizer and a Mean metric of the per-example loss."""
    import gpustrat as gs  # noqa: PLC0415
    with strategy.scope():
        weights = {k: gs.Variable(init[k], name=k) for k in WEIGHT_NAMES}
        optimizer = gs.optimizers.SGD(learning_rate)
        train_loss = gs.metrics.Mean(name="train_loss", dtype=dtype)
    return weights, optimizer, train_loss


def make_train_step(weights: dict, optimizer, train_loss) -> Callable:
    """The per-replica training step for ``strategy.run(train_step, args=(batch,))``;
    returns the replica's share of the global batch's mean loss."""
    import gpustrat as gs  # noqa: PLC0415
    variables = [weights[k] for k in WEIGHT_NAMES]

    def train_step(batch):
        x, y = batch
        per_example_loss, grad_sums = forward_backward(
            {k: v.value() for k, v in weights.items()}, x, y)
        # The examples of this global batch over every replica of every worker (the
        # last batch is partial): every example weighs the same.
        n = gs.get_replica_context().all_reduce("sum", float(x.shape[0]))
        loss = gs.nn.compute_average_loss(per_example_loss, global_batch_size=n)
        optimizer.apply_gradients(zip([grad_sums[k] / n for k in WEIGHT_NAMES], variables))
        train_loss.update_state(per_example_loss)
        return loss
    return train_step


def train(strategy, epochs: int = EPOCHS, n_samples: int = N_SAMPLES,
          n_features: int = N_FEATURES, hidden: int = HIDDEN,
          global_batch: int = GLOBAL_BATCH, learning_rate: float = LEARNING_RATE,
          data_seed: int = DATA_SEED, init_seed: int = INIT_SEED, dtype=np.float64,
          log: Callable[[str], None] | None = print,
          progress_every: float = PROGRESS_S) -> dict:
    """Train the MLP with ``strategy`` and return the final weights as NumPy arrays.

    Every worker builds the same dataset from the seed; the weights start from worker
    0's values; the distributed dataset gives each replica its piece of every global
    batch. Progress (epoch, mean loss over the epoch's examples, samples/s) goes to
    ``log`` on worker 0 only, with a line every ``progress_every`` seconds within an
    epoch that takes longer (examples so far; no collective, so worker 0 alone decides).

    Returns:
        ``{"w1", "b1", "w2", "b2"}``: host copies of the first local replica's weights
        (every replica's copy is the same).
    """
    from gpustrat.data import Dataset  # noqa: PLC0415

    x, y = make_dataset(n_samples, n_features, data_seed, dtype)
    init = init_weights(n_features, hidden, y.shape[1], init_seed, dtype)
    weights, optimizer, train_loss = build_model(strategy, init, learning_rate, dtype)
    dataset = Dataset.from_tensor_slices((x, y)).batch(global_batch)
    dist = strategy.experimental_distribute_dataset(dataset)
    train_step = make_train_step(weights, optimizer, train_loss)
    talk = log is not None and strategy.worker_index == 0
    if talk:
        log(f"training a {n_features}-{hidden}-1 MLP on {n_samples} examples, global batch "
            f"{global_batch}, {strategy.num_replicas_in_sync} replica(s) "
            f"({strategy.num_workers} worker(s) x {len(strategy.local_devices)}: "
            f"{', '.join(d.name for d in strategy.local_devices)})")
        log(expected_loss(y))
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        note_at, steps = t0 + progress_every, 0
        for batch in dist:
            strategy.run(train_step, args=(batch,))
            steps += 1
            if talk and time.perf_counter() >= note_at:
                note_at = time.perf_counter() + progress_every
                log(f"  epoch {epoch}/{epochs}: {min(steps * global_batch, n_samples):,}"
                    f"/{n_samples:,} examples, {time.perf_counter() - t0:.1f} s")
        loss = float(train_loss.result())      # over every replica of every worker
        train_loss.reset_state()
        elapsed = time.perf_counter() - t0
        if talk:
            log(f"epoch {epoch}/{epochs}  loss {loss:.6f}  "
                f"{n_samples / elapsed:,.0f} samples/s")
    return {k: np.array(strategy.experimental_local_results(weights[k])[0].numpy())
            for k in WEIGHT_NAMES}


def expected_loss(y) -> str:
    """What loss a run should show: where it starts (what predicting the mean of ``y``
    scores), where it cannot go below (the noise), and the defaults' figure."""
    return (f"loss: the mean squared error; predicting the mean scores {float(y.var()):.3f} "
            f"and the noise alone {NOISE ** 2:.4f}: expect it to fall every epoch between "
            f"those (the defaults reach about 0.16 in {EPOCHS} epochs)")


def default_devices() -> list[str]:
    """The demo's devices in one process: every visible GPU, else two logical CPU
    devices, so that even a machine without a GPU shows two replicas in sync."""
    from gpustrat.devices import gpu_count  # noqa: PLC0415
    n = gpu_count()
    return [f"gpu:{i}" for i in range(n)] if n else ["cpu:0", "cpu:1"]


def make_strategy(devices=None, multi_worker: bool = False):
    """MirroredStrategy on ``devices`` (default :func:`default_devices`), or
    MultiWorkerMirroredStrategy over the MPI ranks when ``multi_worker`` (default
    devices: each worker's GPU by node-local rank, else cpu:0)."""
    import gpustrat as gs  # noqa: PLC0415
    if multi_worker:
        return gs.MultiWorkerMirroredStrategy(devices=devices)
    return gs.MirroredStrategy(devices or default_devices())


def describe_topology(strategy) -> str:
    """One line: workers, replicas, this worker's devices and the collectives used."""
    workers, local = strategy.num_workers, len(strategy.local_devices)
    return (f"topology: {workers} worker(s) x {local} replica(s) = "
            f"{strategy.num_replicas_in_sync} replica(s) in sync; worker "
            f"{strategy.worker_index} devices: "
            f"{', '.join(d.name for d in strategy.local_devices)}; collectives: "
            f"{type(strategy.communicator).__name__}")


class _Parser(argparse.ArgumentParser):
    """Misuse is reported in one line (on the first rank of an MPI launch), exit 2."""

    def error(self, message):
        from gpustrat.launch import detect_launch  # noqa: PLC0415
        launch = detect_launch()
        if launch is None or launch.rank == 0:
            print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr, flush=True)
        raise SystemExit(2)


def _at_least(minimum, kind=int):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
        if not value >= minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {text}")
        return value
    return parse


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected float, got {text!r}") from None
    if not 0 < value < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(
        prog=prog, description="Data-parallel training of a two-layer MLP (NumPy/CuPy, "
        "hand-written gradients) on a synthetic regression set. Under an MPI launcher "
        "(mpiexec, mpirun, srun) with more than one process it trains over all of them.")
    p.add_argument("--devices", nargs="+", metavar="DEV",
                   help="local devices, e.g. cpu:0 cpu:1 or gpu:0 gpu:1 (default: every "
                        "GPU, else cpu:0 cpu:1; with several workers, each worker's GPU by "
                        "node-local rank, else cpu:0)")
    p.add_argument("--epochs", type=_at_least(1),
                   help=f"epochs (default: {EPOCHS}; 2 with --quick)")
    p.add_argument("--samples", type=_at_least(1),
                   help=f"examples in the data set (default: {N_SAMPLES}; 2000 with --quick)")
    p.add_argument("--batch", type=_at_least(1), default=GLOBAL_BATCH,
                   help=f"global batch size (default: {GLOBAL_BATCH})")
    p.add_argument("--lr", type=_positive_float, default=LEARNING_RATE,
                   help=f"learning rate (default: {LEARNING_RATE})")
    p.add_argument("--multi-worker", action=argparse.BooleanOptionalAction, default=None,
                   help="MultiWorkerMirroredStrategy over the MPI ranks (default: on when "
                        "an MPI launcher started more than one process, else off)")
    p.add_argument("--quick", action="store_true",
                   help="a small, fast run (default: off)")
    p.add_argument("--save", metavar="FILE.npz",
                   help="write the final weights here, from worker 0 (default: not saved)")
    return p


#: Numba's warning for a launch of few blocks (its text may carry terminal colours).
LOW_OCCUPANCY_WARNING = r".*Grid size \d+ will likely result in GPU under-utilization"


def main(argv=None, prog: str | None = None) -> dict:
    """Parse ``argv``, train, print progress on worker 0; return the final weights."""
    from pathlib import Path  # noqa: PLC0415

    from gpustrat.launch import detect_launch  # noqa: PLC0415
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    epochs = args.epochs if args.epochs is not None else (2 if args.quick else EPOCHS)
    samples = args.samples if args.samples is not None else (2000 if args.quick else N_SAMPLES)
    if args.save:
        # Written as given: numpy.savez would add .npz to any other name.
        if not args.save.endswith(".npz"):
            parser.error(f"argument --save: {args.save} does not end in .npz (the weights "
                         "are written as a NumPy .npz file); name it FILE.npz")
        folder = Path(args.save).expanduser().absolute().parent
        if not folder.is_dir():
            parser.error(f"argument --save: the folder {folder} does not exist; create it "
                         "or choose another path")
    # The demo's launches are small: Numba's warning that a small grid leaves the GPU
    # underused says nothing its user can act on.
    warnings.filterwarnings("ignore", message=LOW_OCCUPANCY_WARNING)
    launch = detect_launch()
    multi_worker = args.multi_worker
    if multi_worker is None:
        multi_worker = launch is not None and launch.size > 1
    try:
        strategy = make_strategy(args.devices, multi_worker)
    except (ValueError, RuntimeError, TypeError) as e:
        parser.error(f"argument --devices: {e}" if args.devices else str(e))
    try:
        if strategy.worker_index == 0:
            if args.multi_worker is None and multi_worker:
                print(f"{launch.launcher} started {launch.size} processes: training over all "
                      "of them (--no-multi-worker trains each on its own)", flush=True)
            if args.multi_worker and strategy.num_workers == 1:
                print("--multi-worker without an MPI launcher: one worker, on "
                      f"{', '.join(d.name for d in strategy.local_devices)} (launch W "
                      "workers with mpiexec -n W python -m gpustrat demo; --devices cpu:0 "
                      "cpu:1 gives each two replicas)", flush=True)
            print(describe_topology(strategy), flush=True)
            if samples < args.batch:
                print(f"note: --samples {samples} is less than --batch {args.batch}: each "
                      f"epoch is one partial batch of {samples} examples", flush=True)
        weights = train(strategy, epochs=epochs, n_samples=samples,
                        global_batch=args.batch, learning_rate=args.lr,
                        log=lambda line: print(line, flush=True))
        if args.save and strategy.worker_index == 0:
            np.savez(Path(args.save).expanduser(), **weights)
            print(f"weights {', '.join(weights)} written to {args.save}", flush=True)
    finally:
        strategy.close()
    return weights


if __name__ == "__main__":
    main(sys.argv[1:])
