"""TensorFlow's documented MirroredStrategy examples, on the devices named by
``--devices`` (default: every GPU, else cpu:0 cpu:1):

    python examples/mirrored_basics.py --devices cpu:0 cpu:1 cpu:2
"""

import argparse

import numpy as np

import gpustrat as gs
from gpustrat.demo import default_devices


def main(devices=None):
    strategy = gs.MirroredStrategy(devices or default_devices())
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
    parser = argparse.ArgumentParser(description="TensorFlow's MirroredStrategy examples")
    parser.add_argument("--devices", nargs="+", metavar="DEV",
                        help="local devices, e.g. cpu:0 cpu:1 or gpu:0 gpu:1 "
                             "(default: every GPU, else cpu:0 cpu:1)")
    main(parser.parse_args().devices)
