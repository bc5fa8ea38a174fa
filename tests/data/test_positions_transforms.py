"""Positions of window, scan, group_by_window, bucket_by_sequence_length, rebatch,
unique, ignore_errors and sample/choose_from_datasets: saved at the start, inside a
buffer, window or group, at the end and inside a repeat, then restored into a fresh
pipeline, the rest is what the uninterrupted iterator gives."""

import os
import sys

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from state_util import canon, resume_everywhere, roundtrip, state_bytes  # noqa: E402


def test_window_resumes_inside_a_window_and_its_overlap():
    def build():
        pairs = Dataset.from_tensor_slices((np.arange(11), np.arange(11) * 10))
        return pairs.window(4, shift=2, stride=1).flat_map(
            lambda a, b: Dataset.zip((a.batch(4), b.batch(4)))).repeat(2)
    full, states = resume_everywhere(build)
    assert len(full) == 12 and full[1] == canon((np.arange(2, 6), np.arange(2, 6) * 10))
    # Inside a window: the flat_map's open slot holds the window, saved as its elements.
    slot = states[1]["position"]["input"]["slots"][0]
    assert slot is not None and "__gpustrat_element__" in slot["element"]


@pytest.mark.parametrize("drop", [False, True])
def test_windows_waiting_in_a_prefetch_buffer_are_saved(drop):
    def build():
        return Dataset.range(13).window(3, shift=2, stride=2, drop_remainder=drop).prefetch(
            4).flat_map(lambda w: w.batch(3))
    resume_everywhere(build)


def test_empty_windows_have_a_spec():
    # The spec of a flat_map over windows of an empty input: the function is called with
    # an empty window, not with zeros.
    ds = Dataset.range(0).window(2).flat_map(lambda w: w.batch(5))
    assert ds.element_spec == gs.data.TensorSpec((None,), np.int64)
    assert list(ds) == []


def test_scan_saves_its_state_value():
    def step(state, x):
        total, names = state
        return (total + x, names + b"x"), (total, names)

    def build():
        return Dataset.range(9).scan((np.int64(0), b""), step)
    full, states = resume_everywhere(build)
    assert [canon(v) for v in states[4]["position"]["value"]] == [canon(np.int64(6)),
                                                                 canon(b"xxxx")]


def test_group_by_window_resumes_with_open_groups_and_inside_a_window():
    def build():
        return Dataset.range(20).shuffle(7, seed=4).group_by_window(
            lambda x: x % 3, lambda k, w: w.batch(2).map(lambda v, k=k: v * 10 + k),
            window_size_func=lambda k: k + 2)
    full, states = resume_everywhere(build)
    groups = [len(s["position"]["groups"]) for s in states]
    current = [s["position"]["current"] is not None for s in states]
    assert max(groups) >= 2 and any(current)
    assert sorted(int(v) // 10 for batch in [np.asarray(f[0][0][1]) for f in full]
                  for v in batch) == list(range(20))


def test_bucket_by_sequence_length_resumes_with_open_buckets():
    lengths = [3, 1, 6, 2, 7, 4, 0, 5, 8, 2, 3, 9, 1]

    def build():
        return Dataset.from_tensor_slices(np.array(lengths)).map(
            lambda n: np.arange(int(n))).bucket_by_sequence_length(
            lambda x: len(x), [3, 6], [2, 2, 3], padded_shapes=[None])
    full, states = resume_everywhere(build)
    assert max(len(s["position"]["groups"]) for s in states) >= 2
    assert sum(len(f[0][0][1]) for f in full) == len(lengths)


def test_rebatch_resumes_with_rows_of_a_batch_pending():
    def build():
        return Dataset.range(23).batch(5).rebatch([3, 0, 4]).repeat(2)
    full, states = resume_everywhere(build)
    assert any(s["position"]["input"]["pending"] for s in states if s["position"]["input"])


def test_rebatch_of_strings_saves_the_rows_pending(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"".join(f"line {i}\n".encode() for i in range(11)))

    def build():
        return gs.data.TextLineDataset([str(path)]).batch(4).rebatch(3)
    resume_everywhere(build)


def test_unique_state_grows_with_the_distinct_elements():
    def build():
        return Dataset.range(40).map(lambda x: (x * 7) % 13).unique()
    full, states = resume_everywhere(build)
    assert len(full) == 13
    for k, s in enumerate(states):
        seen = sum(len(a) for a in s["position"]["scalars"]) + len(s["position"]["other"])
        assert seen == min(k, 13) or k >= 13 and seen == 13
    big = iter(Dataset.range(10 ** 5).map(lambda x: x % 5000).unique())
    for _ in range(5000):
        next(big)
    assert 5000 * 8 <= state_bytes(big.get_state()) < 5000 * 8 + 4096


@pytest.mark.parametrize("batched", [False, True])
def test_unique_of_slices_resumes_at_the_index(batched):
    data = np.array([5, 1, 5, 2, 1, 9, 2, 7, 7, 3])

    def build():
        ds = Dataset.from_tensor_slices(data).unique()
        return ds.batch(2) if batched else ds
    full, states = resume_everywhere(build)
    assert states[2]["position"] == {"pos": 2}


def test_unique_strings_resume():
    def build():
        return Dataset.from_tensor_slices(np.array([b"a", b"b", b"a", b"c", b"b", b"d"],
                                                   dtype=object)).map(lambda s: s).unique()
    resume_everywhere(build, [b"a", b"b", b"c", b"d"])


def test_ignore_errors_resumes_between_dropped_elements():
    def check(x):
        if x % 3 == 1:
            raise ValueError(f"bad {x}")
        return x

    def build():
        return Dataset.range(14).map(check, num_parallel_calls=3).filter(
            lambda x: 10 // int(x % 5) > 0).ignore_errors().repeat(2)
    # The map fails on 1, 4, 7, 10, 13, the filter on 0, 5, 10.
    resume_everywhere(build, [2, 3, 6, 8, 9, 11, 12] * 2)


class Faulty:
    """An iterator class that raises at element 4 (the end of its input, under
    ignore_errors), with a saveable position."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.i == 4:
            raise OSError("the source broke")
        self.i += 1
        return np.int64(self.i)

    def get_state(self):
        return self.i

    def set_state(self, state):
        self.i = int(state)


def test_ignore_errors_position_after_the_input_ended_with_an_error():
    def build():
        return Dataset.from_generator(Faulty, output_signature=gs.data.TensorSpec(
            (), np.int64)).ignore_errors()
    resume_everywhere(build, [1, 2, 3, 4])
    it = iter(build())
    assert [int(x) for x in it] == [1, 2, 3, 4]   # the fifth next met the error
    state = roundtrip(it.get_state())
    assert state["position"] == {"ended": True}
    restored = iter(build())
    restored.set_state(state)
    assert list(restored) == []


def test_ignore_errors_has_a_spec_when_the_first_element_fails():
    def check(x):
        if x == 0:
            raise ValueError("the first element is bad")
        return x * 2
    ds = Dataset.range(5).map(check).ignore_errors()
    assert ds.element_spec == gs.data.TensorSpec((), np.int64)
    assert [int(x) for x in ds] == [2, 4, 6, 8]


@pytest.mark.parametrize("stop", [False, True])
def test_sample_from_datasets_resumes_with_the_generator_state(stop):
    def build(seed=3):
        return Dataset.sample_from_datasets(
            [Dataset.range(30).shuffle(8, seed=1), Dataset.range(100, 106),
             Dataset.range(200, 240).filter(lambda x: x % 2 == 0)],
            weights=[0.5, 0.2, 0.3], seed=seed, stop_on_empty_dataset=stop).repeat(2)
    full, states = resume_everywhere(build)
    # Inputs not read yet are saved as None; one that ended is inactive.
    assert sum(x is not None for x in states[1]["position"]["input"]["inputs"]) == 1
    assert any(not all(s["position"]["input"]["active"]) for s in states
               if s["position"]["input"] is not None) or stop


def test_unseeded_sampling_resumes_with_the_saved_seed():
    datasets = [Dataset.range(20), Dataset.range(50, 70)]
    ds = Dataset.sample_from_datasets(datasets, seed=None).repeat(2)
    it = iter(ds)
    head = [int(next(it)) for _ in range(25)]
    state = roundtrip(it.get_state())
    rest = [int(x) for x in it]
    restored = iter(Dataset.sample_from_datasets(datasets, seed=None).repeat(2))
    restored.set_state(state)
    assert [int(x) for x in restored] == rest
    assert sorted(head + rest) == sorted(list(range(20)) * 2 + list(range(50, 70)) * 2)


def test_sampling_with_a_dataset_of_weights_resumes():
    def build():
        weights = Dataset.range(100).map(lambda i: np.array([i % 3, 1.0], np.float64))
        return Dataset.sample_from_datasets([Dataset.range(40), Dataset.range(500, 540)],
                                            weights=weights, seed=7)
    resume_everywhere(build)


@pytest.mark.parametrize("stop", [False, True])
def test_choose_from_datasets_resumes(stop):
    def build():
        choice = Dataset.range(40).map(lambda i: np.int64((i * 5) % 3))
        return Dataset.choose_from_datasets(
            [Dataset.range(10), Dataset.range(100, 103), Dataset.range(200, 230)], choice,
            stop_on_empty_dataset=stop)
    resume_everywhere(build)


@pytest.mark.parametrize("replicas", [1, 2])
def test_distributed_iterator_over_these_transformations_resumes(tmp_path, replicas):
    def build():
        a = Dataset.range(40).shuffle(9, seed=2).cache().window(3, shift=2).flat_map(
            lambda w: w.batch(3).map(lambda v: v.sum()))
        b = Dataset.range(1000, 1030).scan(np.int64(0), lambda s, x: (s + 1, x + s)).unique()
        mixed = Dataset.sample_from_datasets([a, b], seed=5).group_by_window(
            lambda x: x % 2, lambda k, w: w.batch(3), window_size=3)
        return mixed.rebatch(4, drop_remainder=True).prefetch(2)

    def steps(strategy, it, k=None):
        out = []
        for x in it:
            out.append([np.asarray(p).tolist()
                        for p in strategy.experimental_local_results(x)])
            if len(out) == k:
                break
        return out
    devices = [f"cpu:{i}" for i in range(replicas)]
    s = gs.MirroredStrategy(devices)
    full = steps(s, iter(s.experimental_distribute_dataset(build())))
    assert len(full) >= 10
    it = iter(s.experimental_distribute_dataset(build()))
    head = steps(s, it, 5)
    path = gs.train.Checkpoint(input=it).save(str(tmp_path / "ck"))
    s2 = gs.MirroredStrategy(devices)
    it2 = iter(s2.experimental_distribute_dataset(build()))
    gs.train.Checkpoint(input=it2).restore(path)
    assert head + steps(s2, it2) == full


def test_group_by_window_over_unsaveable_windows_iterates_but_refuses_to_save():
    def gen():
        yield from range(2)

    def reduce(key, window):
        return Dataset.from_generator(gen, output_signature=gs.data.TensorSpec((), np.int64))
    ds = Dataset.range(6).group_by_window(lambda x: x % 2, reduce, window_size=3)
    assert [int(x) for x in ds] == [0, 1, 0, 1]
    it = iter(ds)
    assert it.get_state()["position"]["current"] is None   # no window open yet
    next(it)
    with pytest.raises(ValueError, match=r"group_by_window: a dataset that reduce_func "
                                         r"returned cannot save its position: "
                                         r"from_generator\(gen\)"):
        it.get_state()
