"""Saving and restoring distributed iterators: the same remaining steps, every element
once across the two runs; under mpiexec -n 2 with 1 and 2 replicas per worker."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import assert_mpi_ok, run_mpi  # noqa: E402


def steps_of(strategy, it, k=None):
    out = []
    for x in it:
        out.append([np.asarray(p).tolist() for p in strategy.experimental_local_results(x)])
        if k is not None and len(out) == k:
            break
    return out


def build():
    return Dataset.range(37).shuffle(16, seed=5).map(lambda x: x * 10).batch(4).prefetch(2)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_same_remaining_steps_after_restore(tmp_path, replicas):
    s = gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    full = steps_of(s, iter(s.experimental_distribute_dataset(build())))
    it = iter(s.experimental_distribute_dataset(build()))
    head = steps_of(s, it, 4)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    assert head + steps_of(s, it) == full
    # A restarted job: new strategy objects, new dataset, restored position.
    s2 = gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])
    it2 = iter(s2.experimental_distribute_dataset(build()))
    gs.train.Checkpoint(input=it2).restore(path)
    assert head + steps_of(s2, it2) == full


def unseeded():
    # Every build draws its own seeds, as a restarted job does. The repeat's shuffle and
    # the sampled inputs' shuffles make their iterators only after the first save.
    evens = Dataset.range(0, 40, 2).shuffle(8)
    odds = Dataset.range(1, 40, 2).shuffle(8)
    mixed = Dataset.sample_from_datasets([evens, odds], weights=[0.5, 0.5])
    return mixed.shuffle(20).batch(4).repeat(3)


@pytest.mark.parametrize("replicas", [None, 1, 2])
@pytest.mark.parametrize("taken", [0, 3])
def test_unseeded_shuffles_resume_in_the_saved_order(tmp_path, replicas, taken):
    # A repeated unseeded shuffle saved at its epoch's start (as every distributed
    # iterator's position is) used to draw a new seed in the restored job.
    if replicas is None:  # a plain dataset iterator
        def make():
            return iter(unseeded())

        def take(it, k=None):
            return [np.asarray(x).tolist() for x in (it if k is None else
                                                     [next(it) for _ in range(k)])]
    else:
        s = gs.MirroredStrategy([f"cpu:{i}" for i in range(replicas)])

        def make():
            return iter(s.experimental_distribute_dataset(unseeded()))

        def take(it, k=None):
            return steps_of(s, it, k)
    it = make()
    if taken:
        take(it, taken)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    rest = take(it)
    again = make()
    gs.train.Checkpoint(input=again).restore(path)
    assert take(again) == rest
    assert len(rest) == 30 - taken


def test_inputs_opened_again_after_the_save_take_the_saved_epochs(tmp_path):
    # An input that a sampling or a repeat opens again after the save (one exhausted
    # before it) used to take epoch 0 again in the restored process: pass 2 of the
    # repeat came in another order in about one case in ten, so 40 are tried.
    for trial in range(40):
        it = iter(unseeded())
        for _ in range(3 + trial % 5):
            next(it)
        path = gs.train.Checkpoint(input=it).save(str(tmp_path / f"ck{trial}"))
        rest = [x.tolist() for x in it]
        again = iter(unseeded())
        gs.train.Checkpoint(input=again).restore(path)
        assert [x.tolist() for x in again] == rest, trial


@pytest.mark.parametrize("before,after", [(2, 1), (1, 3), (2, 4)])
def test_batch_aligned_position_moves_to_another_replica_count(tmp_path, before, after):
    s = gs.MirroredStrategy([f"cpu:{i}" for i in range(before)])
    it = iter(s.experimental_distribute_dataset(build()))
    head = steps_of(s, it, 3)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    s2 = gs.MirroredStrategy([f"cpu:{i}" for i in range(after)])
    it2 = iter(s2.experimental_distribute_dataset(build()))
    gs.train.Checkpoint(input=it2).restore(path)
    flat = lambda steps: [v for step in steps for piece in step for v in piece]  # noqa: E731
    rest = flat(steps_of(s2, it2))
    assert len(head) == 3
    assert sorted(flat(head) + rest) == [x * 10 for x in range(37)]
    # The remaining elements come in the uninterrupted order (batch after batch).
    assert flat(steps_of(s, it)) == rest


def test_a_position_in_the_earlier_form_restores():
    # Positions saved before they named their stream: a step count and batch_aligned.
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    it = iter(s.experimental_distribute_dataset(build()))
    steps_of(s, it, 4)
    state = it.get_state()
    earlier = {k: state[k] for k in ("steps", "start", "topology", "worker", "policy")}
    earlier["batch_aligned"] = True
    it2 = iter(s.experimental_distribute_dataset(build()))
    it2.set_state(earlier)
    assert steps_of(s, it2) == steps_of(s, it)


def test_other_topology_is_a_clear_error_where_steps_are_not_batches(tmp_path):
    def fn(ctx):
        return Dataset.range(40).batch(2)
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    it = iter(s.distribute_datasets_from_function(fn))
    next(it)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    s1 = gs.MirroredStrategy(["cpu:0"])
    it1 = iter(s1.distribute_datasets_from_function(fn))
    with pytest.raises(RuntimeError, match=r"saved on 1 worker\(s\) x 2 replica\(s\) per "
                                           r"worker \(policy FUNCTION\) onto 1 worker\(s\) "
                                           r"x 1 replica.*restart with the saved topology"):
        gs.train.Checkpoint(input=it1).restore(path)


def test_unsaveable_pipeline_names_the_transformation(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    def gen():
        yield from range(20)
    it = iter(s.experimental_distribute_dataset(Dataset.from_generator(
        gen, output_signature=gs.data.TensorSpec((), np.int64)).batch(4)))
    next(it)
    # At the moment it is given to the Checkpoint, not at the first save.
    with pytest.raises(ValueError, match=r"cannot save the position.*from_generator\(gen\)"):
        gs.train.Checkpoint(input=it)


MPI_RESUME = r"""
import os, sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset, Options, AutoShardPolicy as P

R, policy, directory = int(sys.argv[1]), sys.argv[2], sys.argv[3]
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(R)])
rank = s.worker_index

def build():
    if policy == "FILE":
        paths = []
        for f in range(4):
            p = os.path.join(directory, f"part-{f}.txt")
            if not os.path.exists(p):
                with open(p + f".tmp{rank}", "w") as out:
                    out.write("".join(f"{f * 1000 + i}\n" for i in range(20 + 3 * f)))
                os.replace(p + f".tmp{rank}", p)
            paths.append(p)
        ds = gs.data.TextLineDataset(paths).map(
            lambda line: np.int64(int(line))).batch(6)
    elif policy == "DATA_NODES":   # every element once through these nodes too
        ds = Dataset.range(90).shuffle(20, seed=3).cache().window(3, shift=3).flat_map(
            lambda w: w).scan(np.int64(0), lambda c, x: (c + 1, x)).unique().group_by_window(
            lambda x: x % 2, lambda k, w: w, window_size=4).batch(9).rebatch(6)
    else:
        ds = Dataset.range(90).shuffle(20, seed=3).batch(6)
    o = Options()
    o.experimental_distribute.auto_shard_policy = getattr(P, policy.split("_")[0])
    return ds.with_options(o)

def steps(it, k=None):
    out = []
    for x in it:
        out.append([np.asarray(p).tolist() for p in s.experimental_local_results(x)])
        if k is not None and len(out) == k:
            break
    return out

with s.scope():
    w = gs.Variable(np.zeros(3, np.float32), name="w")
full = steps(iter(s.experimental_distribute_dataset(build())))
it = iter(s.experimental_distribute_dataset(build()))
head = steps(it, 3)
ck = gs.train.Checkpoint(input=it, w=w, step=3)
mgr = gs.train.CheckpointManager(ck, directory, max_to_keep=2)
w.assign(np.ones(3, np.float32))
path = mgr.save()
tail = steps(it)
assert head + tail == full, (head, tail, full)
# restart: fresh objects restore the latest checkpoint and finish the epoch
it2 = iter(s.experimental_distribute_dataset(build()))
with s.scope():
    w2 = gs.Variable(np.zeros(3, np.float32), name="w")
ck2 = gs.train.Checkpoint(input=it2, w=w2, step=0)
ck2.restore(gs.train.CheckpointManager(ck2, directory).latest_checkpoint)
tail2 = steps(it2)
assert tail2 == tail and ck2.step == 3 and w2.numpy().tolist() == [1, 1, 1]
# every element once over the two runs, over all workers (DATA splits each batch)
mine = [v for step in head + tail2 for piece in step for v in piece]
every = sorted(v for part in s.workers.allgather(mine) for v in part)
if policy.startswith("DATA"):
    assert every == [x * 1 for x in range(90)], every
if policy == "FILE":
    assert every == sorted(f * 1000 + i for f in range(4) for i in range(20 + 3 * f)), every
print(f"OK rank {rank} files {sorted(os.listdir(directory))}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("replicas", [1, 2])
def test_mpi_resume_mid_epoch_same_topology(tmp_path, replicas):
    out = assert_mpi_ok(2, MPI_RESUME, timeout=120, args=(replicas, "DATA", tmp_path),
                        expect_lines=2)
    assert "ckpt-1.worker-1-of-2.npz" in out and "ckpt-1.index" in out


@pytest.mark.mpi
def test_mpi_resume_through_cache_window_scan_unique_group_and_rebatch(tmp_path):
    assert_mpi_ok(2, MPI_RESUME, timeout=120, args=(2, "DATA_NODES", tmp_path),
                  expect_lines=2)


@pytest.mark.mpi
@pytest.mark.parametrize("replicas", [1, 2])
def test_mpi_file_sharded_text_resumes_on_the_same_topology(tmp_path, replicas):
    assert_mpi_ok(2, MPI_RESUME, timeout=120, args=(replicas, "FILE", tmp_path),
                  expect_lines=2)


MPI_CRASH = r"""
import os, sys
import numpy as np
import gpustrat as gs
from gpustrat.train import saving as ckmod

directory, phase = sys.argv[1], sys.argv[2]
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
with s.scope():
    w = gs.Variable(np.zeros(2, np.float32), name="w")
it = iter(s.experimental_distribute_dataset(gs.data.Dataset.range(40).batch(4)))
ck = gs.train.Checkpoint(w=w, input=it)
mgr = gs.train.CheckpointManager(ck, directory)
if phase == "crash":
    next(it)
    w.assign(np.full(2, 1.0, np.float32))
    mgr.save()
    next(it)
    w.assign(np.full(2, 2.0, np.float32))
    if s.worker_index == 0:
        ckmod._before_commit = lambda: os._exit(3)   # dies after every worker wrote
    mgr.save()
    print("NOT REACHED", flush=True)
else:
    latest = mgr.latest_checkpoint
    ck.restore(latest)
    nxt = [np.asarray(p).tolist() for p in s.experimental_local_results(next(it))]
    print(f"OK {s.worker_index} {os.path.basename(latest)} {w.numpy().tolist()} {nxt}",
          flush=True)
"""


@pytest.mark.mpi
def test_mpi_crash_before_commit_keeps_previous_checkpoint(tmp_path):
    rc, out, err = run_mpi(2, MPI_CRASH, timeout=90, args=(tmp_path, "crash"))
    assert rc != 0 and "NOT REACHED" not in out, (rc, out, err)
    leftovers = sorted(os.listdir(tmp_path))
    assert "ckpt-2.index" not in leftovers and "ckpt-1.index" in leftovers, leftovers
    out = assert_mpi_ok(2, MPI_CRASH, timeout=90, args=(tmp_path, "resume"), expect_lines=2)
    for line in out.splitlines():
        if line.startswith("OK"):
            assert "ckpt-1 [1.0, 1.0]" in line, out
    # DATA: worker r takes piece r of the second global batch [4..7].
    assert "OK 0 ckpt-1 [1.0, 1.0] [[4, 5]]" in out and "OK 1 ckpt-1 [1.0, 1.0] [[6, 7]]" in out



MPI_MOVE = r"""
import json, os, sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset, Options, AutoShardPolicy as P

R, policy, directory, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
epochs = int(sys.argv[5]) if len(sys.argv) > 5 else 1
s = gs.MultiWorkerMirroredStrategy(devices=[f"cpu:{i}" for i in range(R)])

def build():
    # Unseeded: the seed the workers agreed on is saved (a repeat's next pass must
    # shuffle as the saving job would have).
    ds = Dataset.range(96).shuffle(30).repeat(epochs).batch(12)
    o = Options()
    o.experimental_distribute.auto_shard_policy = getattr(P, policy)
    return ds.with_options(o)

def elements(it, k=None):
    out, n = [], 0
    for x in it:
        out += [v for p in s.experimental_local_results(x) for v in np.asarray(p).tolist()]
        n += 1
        if n == k:
            break
    return sorted(v for part in s.workers.allgather(out) for v in part)

it = iter(s.experimental_distribute_dataset(build()))
ck = gs.train.Checkpoint(input=it)
if phase == "save":
    head = elements(it, 3)
    ck.write(os.path.join(directory, "ck"))
    if s.worker_index == 0:
        json.dump(head, open(os.path.join(directory, "head.json"), "w"))
    print("OK saved", flush=True)
else:
    try:
        ck.read(os.path.join(directory, "ck"))
    except RuntimeError as e:
        print(f"OK error {s.worker_index}: {e}", flush=True)
        sys.exit(0)
    rest = elements(it)
    head = json.load(open(os.path.join(directory, "head.json")))
    assert sorted(head + rest) == sorted(list(range(96)) * epochs), (head, rest)
    assert len(head) == 36
    print(f"OK resumed {s.worker_index}", flush=True)
"""


@pytest.mark.mpi
def test_mpi_data_position_moves_to_other_worker_counts(tmp_path):
    assert_mpi_ok(2, MPI_MOVE, timeout=90, args=(1, "DATA", tmp_path, "save"), expect_lines=2)
    out = assert_mpi_ok(3, MPI_MOVE, timeout=90, args=(1, "DATA", tmp_path, "load"),
                        expect_lines=3)
    assert out.count("OK resumed") == 3, out
    out = assert_mpi_ok(1, MPI_MOVE, timeout=90, args=(2, "DATA", tmp_path, "load"),
                        expect_lines=1)
    assert "OK resumed" in out, out


@pytest.mark.mpi
@pytest.mark.parametrize("saved,restored", [((2, 1), (2, 1)), ((2, 2), (3, 1))])
def test_mpi_data_unseeded_shuffle_resumes_its_next_pass(tmp_path, saved, restored):
    # Distributing agrees one seed for the workers; the restored job agrees another,
    # and used to shuffle the repeat's passes with it.
    (n, r), (n2, r2) = saved, restored
    assert_mpi_ok(n, MPI_MOVE, timeout=90, args=(r, "DATA", tmp_path, "save", 3),
                  expect_lines=n)
    out = assert_mpi_ok(n2, MPI_MOVE, timeout=90, args=(r2, "DATA", tmp_path, "load", 3),
                        expect_lines=n2)
    assert out.count("OK resumed") == n2, out


MPI_ONE_RANK_FAILS = r"""
import os, sys
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset

directory = sys.argv[1]
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
with s.scope():
    m = gs.metrics.Mean()
    m.update_state(np.float32(s.worker_index))
def gen():
    yield from range(4)
# worker 1's own pipeline cannot save its position; worker 0's can
ds = Dataset.range(4) if s.worker_index == 0 else Dataset.from_generator(
    gen, output_signature=gs.data.TensorSpec((), np.int64))
it = iter(ds)
next(it)
with s.scope():
    try:
        # Refused where the iterator is given to the checkpoint (worker 1), which then
        # leaves; worker 0's save is told of it instead of waiting.
        ck = gs.train.Checkpoint(input=it, metric=m)
        ck.save(os.path.join(directory, "ck"))
    except Exception as e:      # worker 0: a CollectiveTimeout naming rank 1's exit
        print(f"OK {s.worker_index} {type(e).__name__}: {e}", flush=True)
"""


@pytest.mark.mpi
def test_mpi_a_failure_on_one_worker_is_an_error_on_every_worker(tmp_path):
    out = assert_mpi_ok(2, MPI_ONE_RANK_FAILS, timeout=60, args=(tmp_path,), expect_lines=2)
    assert "OK 1 ValueError: Checkpoint: cannot save input=DatasetIterator: " \
           "from_generator(gen) cannot save its position" in out, out
    assert "OK 0 " in out and "rank 1" in out.split("OK 0 ")[1], out
    assert not [f for f in os.listdir(tmp_path)], os.listdir(tmp_path)


def test_restoring_into_another_dataset_is_a_clear_error(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    it = iter(s.experimental_distribute_dataset(build()))
    next(it)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    other = Dataset.range(41).shuffle(16, seed=5).map(lambda x: x * 10).batch(4).prefetch(2)
    it2 = iter(s.experimental_distribute_dataset(other))
    with pytest.raises(RuntimeError, match=r"saved for another dataset: saved for "
                                           r"\['PrefetchDataset:10'.*'RangeDataset:37'\]"):
        gs.train.Checkpoint(input=it2).restore(path)
