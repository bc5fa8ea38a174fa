"""Checkpoints of ``from_generator`` pipelines: an iterator that cannot save its position
is refused when it is given to the Checkpoint (not at the first save); a checkpoint of
trained variables without the iterator warns; ``SequenceGenerator`` resumes exactly."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for mpi_util
from mpi_util import format_result, run_mpi  # noqa: E402

SPEC = gs.data.TensorSpec((), np.int64)


def gen():
    yield from range(24)


def generator_iterator(strategy):
    return iter(strategy.experimental_distribute_dataset(
        Dataset.from_generator(gen, output_signature=SPEC).batch(4)))


def test_a_generator_iterator_is_refused_when_given_to_the_checkpoint(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    it = generator_iterator(s)
    with pytest.raises(ValueError, match=r"cannot save iterator=DistributedIterator: .*"
                                         r"from_generator\(gen\).*Leave the iterator out"):
        gs.train.Checkpoint(iterator=it)
    with s.scope():
        w = gs.Variable(np.zeros(2))
    ckpt = gs.train.Checkpoint(w=w)
    with pytest.raises(ValueError, match=r"cannot save iterator=DistributedIterator"):
        ckpt.iterator = it  # each epoch's new iterator, set as an attribute
    # Inside a container, and a plain dataset iterator.
    with pytest.raises(ValueError, match=r"cannot save state/0=DatasetIterator: "
                                         r"from_generator\(gen\)"):
        gs.train.Checkpoint(state=[iter(Dataset.from_generator(gen, output_signature=SPEC))])
    assert "iterator" not in ckpt._objects


def _trained(strategy):
    with strategy.scope():
        w = gs.Variable(np.zeros(2), name="w")
    it = iter(strategy.experimental_distribute_dataset(Dataset.range(16).batch(4)))
    next(it)
    return w, it


def test_a_checkpoint_of_trained_variables_without_the_iterator_warns_once(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    w, it = _trained(s)
    ckpt = gs.train.Checkpoint(w=w)
    with pytest.warns(UserWarning, match=r"holds variables trained from a distributed "
                                         r"iterator but not the iterator"):
        ckpt.save(str(tmp_path / "a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.save(str(tmp_path / "a"))  # once per checkpoint
        gs.train.Checkpoint(w=w, iterator=it).save(str(tmp_path / "b"))  # with it: none
        s2 = gs.MirroredStrategy(["cpu:0"])
        with s2.scope():
            v = gs.Variable(np.zeros(2))
        gs.train.Checkpoint(v=v).save(str(tmp_path / "c"))  # no step taken: none


def _pipeline(items):
    return (Dataset.from_generator(gs.data.SequenceGenerator(items), output_signature=SPEC)
            .map(lambda i: i * 10, num_parallel_calls=gs.data.AUTOTUNE)
            .shuffle(8, seed=3).batch(4))


def test_a_sequence_generator_resumes_exactly_by_position(tmp_path):
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    items = list(range(40))
    it = iter(s.experimental_distribute_dataset(_pipeline(items)))
    seen = [np.concatenate(s.experimental_local_results(next(it))) for _ in range(3)]
    path = gs.train.Checkpoint(iterator=it).save(str(tmp_path / "ck"))
    rest = [np.concatenate(s.experimental_local_results(b)).tolist() for b in it]
    again = iter(s.experimental_distribute_dataset(_pipeline(items)))
    gs.train.Checkpoint(iterator=again).restore(path)
    assert [np.concatenate(s.experimental_local_results(b)).tolist() for b in again] == rest
    # Every item once over the epoch, and the same order as one uninterrupted epoch.
    whole = [np.concatenate(s.experimental_local_results(b)).tolist()
             for b in iter(s.experimental_distribute_dataset(_pipeline(items)))]
    assert [x.tolist() for x in seen] + rest == whole
    assert sorted(v for b in whole for v in b) == [10 * i for i in items]

    # A dataset iterator restores the generator's own position; another sequence length
    # is refused, naming both.
    plain = iter(_pipeline(items))
    for _ in range(2):
        next(plain)
    state = plain.get_state()
    following = [x.tolist() for x in plain]
    again = iter(_pipeline(items))
    again.set_state(state)
    assert [x.tolist() for x in again] == following
    other = iter(_pipeline(list(range(44))))
    with pytest.raises(ValueError, match=r"sequence of 40 items, but this one holds 44"):
        other.set_state(state)


def test_a_sequence_generator_needs_a_sequence():
    with pytest.raises(TypeError, match=r"needs a sequence .*got generator"):
        gs.data.SequenceGenerator(x for x in range(3))
    ds = Dataset.from_generator(gs.data.SequenceGenerator(range(5)), output_signature=SPEC)
    assert [int(x) for x in ds] == [0, 1, 2, 3, 4]
    assert [int(x) for x in ds] == [0, 1, 2, 3, 4]  # each epoch again


REFUSED = r"""
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
def gen():
    yield from range(24)
it = iter(s.experimental_distribute_dataset(
    Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((), np.int64)).batch(4)))
try:
    gs.train.Checkpoint(iterator=it)
except ValueError as e:
    print("REFUSED", s.worker_index, str(e).count("from_generator(gen)"), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_every_worker_is_refused_once_before_any_training():
    rc, out, err = run_mpi(2, REFUSED, timeout=80, env={"GPUSTRAT_TIMEOUT": "30"})
    report = format_result(rc, out, err)
    assert rc == 0, report
    assert sorted(line for line in out.splitlines() if line.startswith("REFUSED")) == \
        ["REFUSED 0 1", "REFUSED 1 1"], report


WARNED = r"""
import sys, tempfile, warnings
import numpy as np
import gpustrat as gs
from gpustrat.data import Dataset
s = gs.MultiWorkerMirroredStrategy(devices=["cpu:0"])
with s.scope():
    w = gs.Variable(np.zeros(2), name="w")
it = iter(s.experimental_distribute_dataset(Dataset.range(16).batch(4)))
next(it)
path = sys.argv[1]
ckpt = gs.train.Checkpoint(w=w)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    ckpt.save(path + "/a")
    ckpt.save(path + "/a")
texts = [str(c.message) for c in caught]
print("WARNED", s.worker_index, len(texts),
      sum("but not the iterator (1 steps taken so far)" in t for t in texts), flush=True)
"""


@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_the_missing_iterator_warning_is_printed_once_by_worker_0(tmp_path):
    rc, out, err = run_mpi(2, WARNED, timeout=80, args=[str(tmp_path)],
                           env={"GPUSTRAT_TIMEOUT": "30"})
    report = format_result(rc, out, err)
    assert rc == 0, report
    assert sorted(line for line in out.splitlines() if line.startswith("WARNED")) == \
        ["WARNED 0 1 1", "WARNED 1 0 0"], report
