"""TensorFlow's documented MirroredStrategy examples, on the default devices (every GPU, else cpu:0)
or on the devices named on the command line (e.g. ``cpu:0 cpu:1``)."""

import sys

import numpy as np

import gpustrat as gs


def main(devices=None):
    strategy = gs.MirroredStrategy(devices or None)
    print(f"{strategy}")
    print("run(x * 2.0) on 3.0:", strategy.run(lambda x: x * 2.0, args=(3.0,)))
    ids = strategy.experimental_distribute_values_from_function(
        lambda ctx: ctx.replica_id_in_sync_group)
    print("all_reduce(sum, replica ids):",
          strategy.run(lambda v: gs.get_replica_context().all_reduce("sum", v), args=(ids,)))
    batch = np.arange(9.0)
    n = strategy.num_replicas_in_sync
    per = -(-len(batch) // n)
    pieces = gs.PerReplica([batch[i * per:(i + 1) * per] for i in range(n)])
    doubled = strategy.run(lambda x: x * 2.0, args=(pieces,))
    print("reduce(SUM, axis=0):", strategy.reduce("sum", doubled, axis=0),
          " reduce(MEAN, axis=0):", strategy.reduce("mean", doubled, axis=0))


if __name__ == "__main__":
    main(sys.argv[1:])
