"""A custom training loop over a distributed dataset, in the shape of tf.distribute's loop.

A linear model ``y = x @ w`` fitted by SGD with momentum, with hand-written gradients:
``w`` is a mirrored variable made in the strategy's scope; each replica computes the
gradient of its piece's share of the global batch's mean squared error
(``gs.nn.compute_average_loss``); ``optimizer.apply_gradients`` sums the replicas'
gradients in one fused reduction and updates every copy of ``w``; a ``Mean`` metric
accumulates the loss over the epoch. Runs on the devices named by ``--devices``
(default: every GPU, else cpu:0 cpu:1), e.g.

    python examples/custom_training_loop.py --devices cpu:0 cpu:1 cpu:2 --epochs 10
"""

import argparse

import numpy as np

import gpustrat as gs
from gpustrat.data import Dataset
from gpustrat.demo import default_devices

GLOBAL_BATCH = 16
LEARNING_RATE = 0.05


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

    with strategy.scope():
        w = gs.Variable(np.zeros(x.shape[1]), name="w")
        optimizer = gs.optimizers.SGD(LEARNING_RATE, momentum=0.5)
        train_loss = gs.metrics.Mean(name="train_loss", dtype=np.float64)

    def train_step(inputs):
        features, labels = inputs                         # a piece may have 0 rows
        err = features @ w - labels
        per_example_loss = err ** 2
        # The examples of this global batch (the last one is partial), over every replica.
        n = gs.get_replica_context().all_reduce("sum", float(len(labels)))
        loss = gs.nn.compute_average_loss(per_example_loss, global_batch_size=n)
        grad = 2.0 * features.T @ err / n                  # d(loss)/dw, by hand
        optimizer.apply_gradients([(grad, w)])
        train_loss.update_state(per_example_loss)
        return loss

    for epoch in range(epochs):
        for inputs in dist_dataset:
            per_replica_losses = strategy.run(train_step, args=(inputs,))
            # The replicas' shares add up to the global batch's mean loss.
            batch_loss = strategy.reduce("sum", per_replica_losses, axis=None)
        if epoch % 5 == 4 or epoch == epochs - 1:
            print(f"epoch {epoch + 1:3d}  loss {float(train_loss.result()):.5f}  "
                  f"last batch {float(batch_loss):.5f}  w {np.round(w.numpy(), 3)}")
        train_loss.reset_state()

    # The get_next_as_optional form of the loop stops cleanly at the end of the data.
    iterator = iter(strategy.experimental_distribute_dataset(Dataset.range(9).batch(4)))
    while True:
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            break
        print(strategy.experimental_local_results(
            strategy.run(lambda v: v, args=(optional.get_value(),))))
    return w.numpy(), true_w


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", metavar="DEV",
                        help="local devices, e.g. cpu:0 cpu:1 or gpu:0 gpu:1 "
                             "(default: every GPU, else cpu:0 cpu:1)")
    parser.add_argument("--epochs", type=int, default=20, help="epochs (default: 20)")
    args = parser.parse_args()
    main(args.devices, args.epochs)
