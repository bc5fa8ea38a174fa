"""A custom training loop over a distributed dataset, in the shape of TensorFlow's custom-loop guide.

A linear model ``y = x @ w`` fitted by gradient descent with hand-written gradients:
each replica computes the squared-error gradient of its piece of the global batch, the
replicas all-reduce it, and every replica applies the same update. Runs on the devices
named by ``--devices`` (default: every GPU, else cpu:0 cpu:1), e.g.

    python examples/custom_training_loop.py --devices cpu:0 cpu:1 cpu:2 --epochs 10
"""

import argparse

import numpy as np

import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.demo import default_devices

GLOBAL_BATCH = 16
LEARNING_RATE = 0.1


def make_data(n=100, d=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    true_w = np.arange(1.0, d + 1.0)
    return x, x @ true_w + 0.01 * rng.standard_normal(n), true_w


def main(devices=None, epochs=20):
    strategy = gs.MirroredStrategy(devices or default_devices())
    x, y, true_w = make_data()
    dist_dataset = strategy.experimental_distribute_dataset(
        Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH))
    w = np.zeros(x.shape[1])

    def train_step(inputs):
        features, labels = inputs
        xp = gs.devices.array_module(features)
        err = features @ xp.asarray(w) - labels          # a piece may have 0 rows
        ctx = gs.get_replica_context()
        grad_sum, count = ctx.all_reduce("sum", (features.T @ err, np.float64(len(labels))))
        return grad_sum / count, (err ** 2)              # the same gradient everywhere

    steps_per_epoch = len(dist_dataset)
    for epoch in range(epochs):
        dist_iterator = iter(dist_dataset)
        for _ in range(steps_per_epoch):
            grad, sq_err = strategy.run(train_step, args=(next(dist_iterator),))
            w -= LEARNING_RATE * np.asarray(strategy.experimental_local_results(grad)[0])
            loss = strategy.reduce("mean", sq_err, axis=0)  # every example weighs the same
        if epoch % 5 == 4 or epoch == epochs - 1:
            print(f"epoch {epoch + 1:3d}  loss {float(loss):.5f}  w {np.round(w, 3)}")

    # The get_next_as_optional form of the loop stops cleanly at the end of the data.
    iterator = iter(strategy.experimental_distribute_dataset(Dataset.range(9).batch(4)))
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        print(strategy.experimental_local_results(
            strategy.run(lambda v: v, args=(optional.get_value(),))))
    return w, true_w


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", metavar="DEV",
                        help="local devices, e.g. cpu:0 cpu:1 or gpu:0 gpu:1 "
                             "(default: every GPU, else cpu:0 cpu:1)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs (default: 20)")
    args = parser.parse_args()
    main(args.devices, args.epochs)
