"""The several-epochs loop of docs/checkpoint.md: a job stopped mid-epoch and restarted
from the manager's latest checkpoint sees the batches an uninterrupted job sees."""

import numpy as np

import gpustrat as gs
from gpustrat.data import Dataset


def job(directory, epochs, stop_after=None):
    strategy = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    dist = strategy.experimental_distribute_dataset(
        Dataset.range(20).shuffle(8, seed=3).batch(4))
    with strategy.scope():
        w = gs.Variable(np.zeros(1, np.float32), name="w")
    seen = []
    ckpt = gs.train.Checkpoint(w=w, iterator=iter(dist), epoch=0)
    manager = gs.train.CheckpointManager(ckpt, directory, max_to_keep=3)
    ckpt.restore(manager.latest_checkpoint)      # None on the first run
    while ckpt.epoch < epochs:
        for step, batch in enumerate(ckpt.iterator):
            rows = [np.asarray(p).tolist() for p in strategy.experimental_local_results(batch)]
            seen.append((ckpt.epoch, rows))
            w.assign_add(np.ones(1, np.float32))
            manager.save()
            if stop_after is not None and len(seen) == stop_after:
                return seen, w.numpy().tolist()
        ckpt.epoch += 1
        ckpt.iterator = iter(dist)
    manager.save()
    return seen, w.numpy().tolist()


def test_a_stopped_multi_epoch_job_resumes_where_it_stopped(tmp_path):
    whole, w_whole = job(str(tmp_path / "whole"), epochs=3)
    head, _ = job(str(tmp_path / "run"), epochs=3, stop_after=7)  # in the second epoch
    tail, w_tail = job(str(tmp_path / "run"), epochs=3)
    assert [e for e, _ in whole] == [0] * 5 + [1] * 5 + [2] * 5
    assert head + tail == whole
    assert w_tail == w_whole == [15.0]
