"""SIGKILL a rank of the demo's training mid-epoch under mpiexec, restart from the latest
checkpoint with the same and with another number of workers: every example is trained
on exactly once over the two runs, and on the same topology the final weights are the
uninterrupted run's."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, run_mpi  # noqa: E402

pytestmark = pytest.mark.mpi

TRAIN = r"""
import os, signal, sys
import numpy as np
import gpustrat as gs
from gpustrat import demo
from gpustrat.data import Dataset

directory, run, kill_at, every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
rank = s.worker_index
x, y = demo.make_dataset(600, 8, 0)
weights, optimizer, train_loss = demo.build_model(s, demo.init_weights(8, 16, 1, 1), 0.05)
dataset = Dataset.from_tensor_slices((x, y)).shuffle(100, seed=4).batch(48)
it = iter(s.experimental_distribute_dataset(dataset))
train_step = demo.make_train_step(weights, optimizer, train_loss)
ck = gs.train.Checkpoint(optimizer=optimizer, loss=train_loss, input=it, step=0, **weights)
manager = gs.train.CheckpointManager(ck, os.path.join(directory, "ckpt"), max_to_keep=2)
if manager.latest_checkpoint:
    ck.restore(manager.latest_checkpoint)
step = ck.step
log = open(os.path.join(directory, f"log-{run}-{rank}.txt"), "a")
for batch in it:
    s.run(train_step, args=(batch,))
    step += 1
    ids = [repr(float(v)) for p in s.experimental_local_results(batch[0]) for v in
           np.asarray(p)[:, 0]]
    log.write(f"{step} {' '.join(ids)}\n")
    log.flush()
    if step % every == 0:
        ck.step = step
        manager.save()
    if step == kill_at and rank == s.num_workers - 1:
        os.kill(os.getpid(), signal.SIGKILL)
loss = train_loss.result()      # a collective: every worker
if rank == 0:
    np.savez(os.path.join(directory, f"final-{run}.npz"),
             **{k: v.numpy() for k, v in weights.items()}, loss=loss)
print(f"OK {rank} {step}", flush=True)
"""

STEPS = 13      # 600 examples in global batches of 48: 12 full and one of 24


def consumed(directory, run, upto=None):
    out = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(f"log-{run}-"):
            for line in open(os.path.join(directory, name)):
                step, *ids = line.split()
                if upto is None or int(step) <= upto:
                    out += ids
    return out


def test_sigkill_and_resume_same_and_other_worker_count(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    assert_mpi_ok(2, TRAIN, timeout=120, args=(ref, "ref", -1, 100), expect_lines=2)
    all_ids = sorted(consumed(ref, "ref"))
    assert len(all_ids) == 600 and len(set(all_ids)) == 600
    expected = np.load(ref / "final-ref.npz")

    for n_after, kill_at, every in ((2, 8, 3), (3, 5, 2)):
        d = tmp_path / f"to{n_after}"
        d.mkdir()
        rc, out, err = run_mpi(2, TRAIN, timeout=120, args=(d, "first", kill_at, every))
        assert rc != 0 and "OK" not in out, (rc, out, err)
        saved_at = kill_at - kill_at % every
        out = assert_mpi_ok(n_after, TRAIN, timeout=120, args=(d, "second", -1, every),
                            expect_lines=n_after)
        assert f"OK 0 {STEPS}" in out, out
        ids = consumed(d, "first", upto=saved_at) + consumed(d, "second")
        assert sorted(ids) == all_ids      # every example once over the two runs
        got = np.load(d / "final-second.npz")
        for k in ("w1", "b1", "w2", "b2", "loss"):
            if n_after == 2:   # the same topology: the uninterrupted run's weights
                np.testing.assert_allclose(got[k], expected[k], rtol=0, atol=1e-12)
            else:              # another one: the same training up to summation order
                np.testing.assert_allclose(got[k], expected[k], rtol=1e-9, atol=1e-12)
