"""Asynchronous training with ParameterServerStrategy: a linear model on one server,
steps scheduled on the workers. Run it on 4 ranks (coordinator, 1 server, 2 workers):

    mpiexec -n 4 python examples/parameter_server_training.py

Every rank runs this script; ParameterServerStrategy(...) does not return on the server
and worker ranks (they serve, then exit with status 0), so the rest runs on the
coordinator only.
"""

import numpy as np

import gpustrat as gs

resolver = gs.distribute.cluster_resolver.MpiClusterResolver(num_ps=1)
strategy = gs.distribute.experimental.ParameterServerStrategy(
    resolver,
    variable_partitioner=gs.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=256 << 10, max_shards=resolver.num_ps))

TRUE_W = np.array([[2.0], [-3.0], [0.5], [1.0]], np.float32)

with strategy.scope():                       # variables live on the server(s)
    w = gs.Variable(np.zeros((4, 1), np.float32), name="w")
    b = gs.Variable(0.0, name="b")
    optimizer = gs.optimizers.SGD(0.1)       # its steps run on the servers too

coordinator = gs.distribute.coordinator.ClusterCoordinator(strategy)


def dataset_fn(input_context):
    # Called on each worker: one input pipeline per worker, no auto-sharding.
    rng = np.random.default_rng(input_context.input_pipeline_id)
    x = rng.normal(size=(1024, 4)).astype(np.float32)
    y = x @ TRUE_W + 0.25
    batch = input_context.get_per_replica_batch_size(64)
    return gs.data.Dataset.from_tensor_slices((x, y)).shuffle(1024, seed=1).repeat() \
        .batch(batch)


per_worker_dataset = coordinator.create_per_worker_dataset(
    strategy.distribute_datasets_from_function(dataset_fn))
per_worker_iterator = iter(per_worker_dataset)


def train_step(iterator):
    """Runs on a worker: the batch comes from that worker's pipeline."""
    x, y = next(iterator)

    def replica_fn(x, y):
        err = x @ w.numpy() + b.numpy() - y          # reads from the server
        optimizer.apply_gradients([(x.T @ err / len(x), w),
                                   (np.float32(err.mean()), b)])
        return float((err ** 2).mean())

    return strategy.run(replica_fn, args=(x, y))


for epoch in range(3):
    losses = [coordinator.schedule(train_step, args=(per_worker_iterator,))
              for _ in range(40)]
    coordinator.join()                       # raises a step's error, naming the worker
    print(f"epoch {epoch}: loss {losses[-1].fetch():.6f}", flush=True)

print("w", np.round(w.numpy().ravel(), 3).tolist(), "b", round(float(b.numpy()), 3),
      flush=True)
