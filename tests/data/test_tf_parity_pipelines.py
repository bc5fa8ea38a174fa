"""padded_batch, rebatch, cache, sample/choose_from_datasets, zip of dicts, window,
group_by_window, bucket_by_sequence_length, scan, unique and ignore_errors compared
with real ``tf.data``.

Every expected value, element_spec, cardinality and error here was recorded by running
the same pipeline with TensorFlow 2.21 (``tensorflow-cpu``) and is hard-coded, so these
tests need no TensorFlow. Where gpustrat differs on purpose, the test says so.
"""

import logging
import os

import numpy as np
import pytest

from gpustrat.data import Dataset, TensorSpec
from gpustrat.data.windowing import DatasetSpec

I64, I32, F32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)


def vals(ds):
    def conv(x):
        if isinstance(x, dict):
            return {k: conv(v) for k, v in x.items()}
        if isinstance(x, tuple):
            return tuple(conv(v) for v in x)
        if isinstance(x, Dataset):
            return [conv(v) for v in x]
        return x.tolist() if hasattr(x, "tolist") else x
    return [conv(e) for e in ds]


def ragged(lengths, dtype=np.int64):
    """Elements ``[n]*n`` with the exact spec (None,), as TF's map of tf.fill gives."""
    return Dataset.from_generator(lambda: (np.full(n, n, dtype) for n in lengths),
                                  output_signature=TensorSpec((None,), dtype))


# --- padded_batch -------------------------------------------------------------------

def test_padded_batch_pads_to_the_batch_largest():
    # TF 2.21: range(1, 6).map(lambda x: tf.fill([x], x)).padded_batch(2): spec
    # (None, None), cardinality 3 (-2 here: a generator's count is unknown).
    ds = ragged(range(1, 6)).padded_batch(2)
    assert ds.element_spec == TensorSpec((None, None), I64)
    assert vals(ds) == [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]], [[5, 5, 5, 5, 5]]]
    assert Dataset.range(5).map(lambda x: x).padded_batch(2).cardinality() == 3
    drop = ragged(range(1, 6)).padded_batch(2, drop_remainder=True)
    # TF 2.21: spec (2, None); the last, short batch is dropped.
    assert drop.element_spec == TensorSpec((2, None), I64)
    assert vals(drop) == [[[1, 0], [2, 2]], [[3, 3, 3, 0], [4, 4, 4, 4]]]
    assert Dataset.range(5).map(lambda x: x).padded_batch(2, drop_remainder=True) \
        .cardinality() == 2


def test_padded_batch_padded_shapes_and_values():
    # TF 2.21: padded_shapes=[6], padding_values=-1: spec (None, 6).
    ds = ragged(range(1, 6)).padded_batch(2, padded_shapes=[6], padding_values=np.int64(-1))
    assert ds.element_spec == TensorSpec((None, 6), I64)
    assert vals(ds) == [[[1, -1, -1, -1, -1, -1], [2, 2, -1, -1, -1, -1]],
                        [[3, 3, 3, -1, -1, -1], [4, 4, 4, 4, -1, -1]],
                        [[5, 5, 5, 5, 5, -1]]]
    # TF 2.21: padded_shapes=[None] is the batch's largest, spec (None, None).
    ds = ragged(range(1, 6)).padded_batch(2, padded_shapes=[None])
    assert ds.element_spec == TensorSpec((None, None), I64)
    assert vals(ds)[1] == [[3, 3, 3, 0], [4, 4, 4, 4]]
    # TF 2.21: rank-2 elements padded to [None, 3]: spec (None, None, 3).
    two = Dataset.from_generator(lambda: (np.full((n, 2), n) for n in (1, 2, 3)),
                                 output_signature=TensorSpec((None, 2), I64))
    ds = two.padded_batch(2, padded_shapes=[None, 3])
    assert ds.element_spec == TensorSpec((None, None, 3), I64)
    assert vals(ds) == [[[[1, 1, 0], [0, 0, 0]], [[2, 2, 0], [2, 2, 0]]],
                        [[[3, 3, 0], [3, 3, 0], [3, 3, 0]]]]


def test_padded_batch_structures():
    # TF 2.21: tuple elements with padding_values=(9, 0.5): spec ((None, None) int64,
    # (None,) float32).
    tup = ragged((1, 2, 3)).map(lambda v: (v, np.float32(v[0])))
    ds = tup.padded_batch(2, padding_values=(np.int64(9), 0.5))
    assert ds.element_spec[1] == TensorSpec((None,), F32)
    assert vals(ds) == [([[1, 9], [2, 2]], [1.0, 2.0]), ([[3, 3, 3]], [3.0])]
    # TF 2.21: dict elements, padded_shapes={"a": [4], "b": []}: spec a (None, 4), b (None,).
    d = ragged((1, 2, 3)).map(lambda v: {"a": v, "b": v[0]})
    ds = d.padded_batch(2, padded_shapes={"a": [4], "b": []})
    assert ds.element_spec == {"a": TensorSpec((None, 4), I64), "b": TensorSpec((None,), I64)}
    assert vals(ds) == [{"a": [[1, 0, 0, 0], [2, 2, 0, 0]], "b": [1, 2]},
                        {"a": [[3, 3, 3, 0]], "b": [3]}]


def test_padded_batch_of_scalars_fixed_rows_and_strings():
    # TF 2.21: range(5).padded_batch(2) is batch(2): spec (None,), [[0 1] [2 3] [4]].
    ds = Dataset.range(5).padded_batch(2)
    assert ds.element_spec == TensorSpec((None,), I64)
    assert vals(ds) == [[0, 1], [2, 3], [4]] and ds.cardinality() == 3
    # TF 2.21: 6x2 rows, padded_batch(4): spec (None, 2); padded_shapes=[3]: (None, 3).
    rows = Dataset.from_tensor_slices(np.arange(12).reshape(6, 2))
    ds = rows.padded_batch(4)
    assert ds.element_spec == TensorSpec((None, 2), I64)
    assert vals(ds) == [[[0, 1], [2, 3], [4, 5], [6, 7]], [[8, 9], [10, 11]]]
    ds = rows.padded_batch(4, padded_shapes=[3])
    assert ds.element_spec == TensorSpec((None, 3), I64)
    assert vals(ds) == [[[0, 1, 0], [2, 3, 0], [4, 5, 0], [6, 7, 0]],
                        [[8, 9, 0], [10, 11, 0]]]
    # TF 2.21: strings pad with b"": [[b'a', b''], [b'b', b'b']].
    s = Dataset.from_generator(lambda: iter([[b"a"], [b"b", b"b"]]),
                               output_signature=TensorSpec((None,), object))
    assert vals(s.padded_batch(2)) == [[[b"a", b""], [b"b", b"b"]]]


def test_padded_batch_cardinality_of_infinite_input():
    # TF 2.21: range(3).repeat().map(fill).padded_batch(2).cardinality() == -1 and the
    # batches run on across epochs: [[0], [1]], [[2, 2], [0, 0]], [[1, 0], [2, 2]].
    ds = ragged((0, 1, 2)).repeat().padded_batch(2)
    assert ds.cardinality() == -1
    assert Dataset.range(3).repeat().padded_batch(2).cardinality() == -1
    out = []
    for b in ds:
        out.append(b.tolist())
        if len(out) == 3:
            break
    assert out == [[[0], [1]], [[2, 2], [0, 0]], [[1, 0], [2, 2]]]


def test_padded_batch_errors():
    # TF 2.21: padding to a smaller size fails at iteration (DataLossError "Attempted to
    # pad to a smaller size than the input element"); gpustrat raises ValueError.
    with pytest.raises(ValueError, match=r"larger than the padded shape \(3,\)"):
        list(ragged(range(1, 6)).padded_batch(2, padded_shapes=[3]))
    # TF 2.21: batch_size 0 is InvalidArgumentError; here ValueError naming it.
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        Dataset.range(3).padded_batch(0)
    # TF 2.21: ValueError "The padded shape (3, 3) is not compatible with the shape (None,)".
    with pytest.raises(ValueError, match=r"padded shape \(3, 3\) .* not compatible"):
        ragged((1, 2)).padded_batch(2, padded_shapes=[3, 3]).element_spec
    # TF 2.21: TypeError "padding_values values type float32 does not match type int64".
    with pytest.raises(TypeError, match="does not match the component dtype int64"):
        ragged((1, 2)).padded_batch(2, padding_values=1.5).element_spec
    # TF 2.21: TypeError "padded_batch is not supported for datasets of datasets".
    with pytest.raises(TypeError, match="not supported for datasets of datasets"):
        Dataset.range(4).window(2).padded_batch(2).element_spec


# --- rebatch ------------------------------------------------------------------------

@pytest.mark.parametrize("build,spec_dim,expected", [
    # All recorded from TF 2.21; the cardinality is -2 in every case.
    (lambda: Dataset.range(10).batch(4).rebatch(3), None,
     [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]),
    (lambda: Dataset.range(10).batch(4).rebatch(3, drop_remainder=True), 3,
     [[0, 1, 2], [3, 4, 5], [6, 7, 8]]),
    (lambda: Dataset.range(10).batch(4).rebatch([1, 2]), None,
     [[0], [1, 2], [3], [4, 5], [6], [7, 8], [9]]),
    (lambda: Dataset.range(10).batch(4).rebatch([1, 2], drop_remainder=True), None,
     [[0], [1, 2], [3], [4, 5], [6], [7, 8], [9]]),
    (lambda: Dataset.range(8).batch(4, drop_remainder=True).rebatch(2), 2,
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (lambda: Dataset.range(8).batch(4, drop_remainder=True).rebatch(3), None,
     [[0, 1, 2], [3, 4, 5], [6, 7]]),
    (lambda: Dataset.range(8).batch(4, drop_remainder=True).rebatch([2, 2]), 2,
     [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (lambda: Dataset.range(8).batch(4, drop_remainder=True).rebatch([1, 3]), None,
     [[0], [1, 2, 3], [4], [5, 6, 7]]),
    (lambda: Dataset.range(8).batch(4, drop_remainder=True).rebatch(4), 4,
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (lambda: Dataset.range(10).batch(3).rebatch(5), None,
     [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]),
    (lambda: Dataset.range(6).batch(2).rebatch([0, 2]), None,
     [[], [0, 1], [], [2, 3], [], [4, 5], []]),
])
def test_rebatch_as_tf(build, spec_dim, expected):
    ds = build()
    assert ds.element_spec == TensorSpec((spec_dim,), I64)
    assert ds.cardinality() == -2
    assert vals(ds) == expected


def test_rebatch_structures_and_rows():
    # TF 2.21: (x, [x, x]) batched by 3, rebatch(2): spec ((None,), (None, 2)).
    ds = Dataset.range(7).map(lambda x: (x, np.array([x, x]))).batch(3).rebatch(2)
    assert ds.element_spec == (TensorSpec((None,), I64), TensorSpec((None, 2), I64))
    assert vals(ds) == [([0, 1], [[0, 0], [1, 1]]), ([2, 3], [[2, 2], [3, 3]]),
                        ([4, 5], [[4, 4], [5, 5]]), ([6], [[6, 6]])]
    # TF 2.21: 10x2 rows batched by 4, rebatch(3): spec (None, 2).
    rows = Dataset.from_tensor_slices(np.arange(20).reshape(10, 2)).batch(4).rebatch(3)
    assert rows.element_spec == TensorSpec((None, 2), I64)
    assert vals(rows)[-1] == [[18, 19]] and len(vals(rows)) == 4


def test_rebatch_errors():
    # TF 2.21: scalars: ValueError at construction ("Expected a dataset whose elements
    # have rank >= 1"); rebatch(0) and an empty list never return (an endless loop of
    # empty batches, an IndexError); gpustrat refuses all three with a ValueError.
    with pytest.raises(ValueError, match=r"call \.batch\(batch_size\) before rebatch"):
        Dataset.range(3).rebatch(2).element_spec
    with pytest.raises(ValueError, match="at least one batch size must be positive"):
        Dataset.range(6).batch(2).rebatch(0)
    with pytest.raises(ValueError, match="non-empty list"):
        Dataset.range(6).batch(2).rebatch([])


# --- cache --------------------------------------------------------------------------

class Counting:
    def __init__(self, n=4):
        self.n, self.calls = n, []

    def dataset(self):
        def gen():
            for i in range(self.n):
                self.calls.append(i)
                yield i
        return Dataset.from_generator(gen, output_signature=TensorSpec((), I64))

    def take_calls(self):
        out, self.calls = self.calls, []
        return out


def test_memory_cache_as_tf():
    # TF 2.21: a generator's cache: card -2; range(5).cache() 5; an infinite input -1.
    src = Counting()
    c = src.dataset().cache()
    assert c.cardinality() == -2 and c.element_spec == TensorSpec((), I64)
    assert Dataset.range(5).cache().cardinality() == 5
    assert Dataset.range(5).repeat().cache().cardinality() == -1
    # TF 2.21: the first pass reads the input, the second only the cache.
    assert vals(c) == [0, 1, 2, 3] and src.take_calls() == [0, 1, 2, 3]
    assert vals(c) == [0, 1, 2, 3] and src.take_calls() == []


def test_partial_cache_is_discarded(caplog):
    # TF 2.21: an iteration stopped after 2 elements leaves no cache: the next pass
    # reads the input again (and fills the cache), the one after reads nothing.
    src = Counting()
    c = src.dataset().cache()
    it = iter(c)
    assert [int(next(it)), int(next(it))] == [0, 1]
    with caplog.at_level(logging.WARNING, logger="gpustrat"):
        it.close()
    assert "did not read the whole dataset" in caplog.text
    src.take_calls()
    assert vals(c) == [0, 1, 2, 3] and src.take_calls() == [0, 1, 2, 3]
    assert vals(c) == [0, 1, 2, 3] and src.take_calls() == []
    # TF 2.21: cache().take(2).repeat(3) reads the input every epoch.
    src2 = Counting()
    assert vals(src2.dataset().cache().take(2).repeat(3)) == [0, 1] * 3
    assert src2.take_calls() == [0, 1] * 3


def test_file_cache_as_tf(tmp_path):
    # TF 2.21: cache(path) fills files on the first pass; later passes, and other
    # datasets caching to the same path (even over another input), read the files.
    src = Counting()
    prefix = str(tmp_path / "c")
    fc = src.dataset().cache(prefix)
    assert vals(fc) == [0, 1, 2, 3] and src.take_calls() == [0, 1, 2, 3]
    assert os.listdir(tmp_path) == ["c.gpustrat-cache"]
    assert vals(fc) == [0, 1, 2, 3] and src.take_calls() == []
    assert vals(src.dataset().cache(prefix)) == [0, 1, 2, 3] and src.take_calls() == []
    assert vals(Dataset.range(10, 12).cache(prefix)) == [0, 1, 2, 3]
    # TF 2.21: a partial pass leaves no cache file (its temporary files are removed).
    part = src.dataset().cache(str(tmp_path / "p"))
    it = iter(part)
    next(it)
    it.close()
    assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache"]
    src.take_calls()
    assert vals(part) == [0, 1, 2, 3] and src.take_calls() == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["c.gpustrat-cache", "p.gpustrat-cache"]


def test_file_cache_errors(tmp_path):
    # TF 2.21: a second writer fails with AlreadyExistsError ("There appears to be a
    # concurrent caching iterator running - cache lockfile already exists"); a missing
    # folder with NotFoundError. gpustrat: FileExistsError / FileNotFoundError.
    q = Counting().dataset().cache(str(tmp_path / "q"))
    first = iter(q)
    next(first)
    with pytest.raises(FileExistsError, match="another iterator is writing the cache"):
        next(iter(q))
    first.close()
    assert vals(q) == [0, 1, 2, 3]
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        list(Dataset.range(3).cache(str(tmp_path / "nodir" / "sub" / "x")))
    assert not (tmp_path / "nodir").exists()


# --- sample_from_datasets / choose_from_datasets --------------------------------------

def test_sample_from_datasets_cardinality_and_weights():
    a, b = Dataset.range(0, 5), Dataset.range(100, 103)
    # TF 2.21: finite inputs: -2; an infinite input: -1.
    s = Dataset.sample_from_datasets([a, b], seed=1)
    assert s.cardinality() == -2 and s.element_spec == TensorSpec((), I64)
    assert sorted(vals(s)) == [0, 1, 2, 3, 4, 100, 101, 102]
    assert Dataset.sample_from_datasets([a.repeat(), b], seed=1).cardinality() == -1
    # TF 2.21: weight 0 leaves a dataset out when building: one left is that dataset
    # (cardinality 3), none left is empty (cardinality 0), a single dataset is itself.
    w = Dataset.sample_from_datasets([a, b], weights=[0., 1.], seed=1)
    assert w.cardinality() == 3 and vals(w) == [100, 101, 102]
    z = Dataset.sample_from_datasets([a, b], weights=[0., 0.], seed=1)
    assert z.cardinality() == 0 and vals(z) == []
    assert Dataset.sample_from_datasets([a], seed=1).cardinality() == 5
    # TF 2.21: a dataset of weights: [0, 1] three times then [1, 0] gives
    # [100, 101, 102, 0, 1, 2, 3, 4].
    wds = Dataset.from_tensor_slices(np.array([[0.0, 1.0]] * 3 + [[1.0, 0.0]] * 10))
    assert vals(Dataset.sample_from_datasets([a, b], weights=wds, seed=1)) == \
        [100, 101, 102, 0, 1, 2, 3, 4]


def test_sample_from_datasets_specs_and_errors():
    # TF 2.21: specs (2,) and (3,) merge to (None,).
    s = Dataset.sample_from_datasets([Dataset.from_tensors(np.array([1, 2], np.int32)),
                                      Dataset.from_tensors(np.array([1, 2, 3], np.int32))],
                                     seed=2)
    assert s.element_spec == TensorSpec((None,), I32)
    assert sorted(vals(s)) == [[1, 2], [1, 2, 3]]
    # TF 2.21: ValueError "`datasets` should not be empty"; ValueError for a weight
    # count that differs; TypeError for incompatible specs (int64 vs float32, int64 vs
    # int32).
    with pytest.raises(ValueError, match="datasets must not be empty"):
        Dataset.sample_from_datasets([])
    with pytest.raises(ValueError, match="has 1 entries for 2 datasets"):
        Dataset.sample_from_datasets([Dataset.range(2), Dataset.range(2)], weights=[1.])
    for other in (Dataset.from_tensors(np.float32(1)), Dataset.range(2, output_type=np.int32)):
        with pytest.raises(TypeError, match="element specs are incompatible"):
            list(Dataset.sample_from_datasets([Dataset.range(2), other], seed=1))
    # TF 2.21 samples on with a negative weight (its log is NaN); gpustrat refuses it.
    with pytest.raises(ValueError, match="finite and non-negative, got -1.0"):
        Dataset.sample_from_datasets([Dataset.range(2), Dataset.range(2)], weights=[-1., 1.])


CHOICES = [
    # (choices, stop_on_empty_dataset, TF 2.21's output) with a = range(5), b = 100..102
    ([0, 1, 1, 0, 1, 1, 0], True, [0, 100, 101, 1, 102]),
    ([1, 1, 1, 1, 0, 0], True, [100, 101, 102]),
    ([1, 1, 1, 1, 0, 0], False, [100, 101, 102, 0, 1]),
]


@pytest.mark.parametrize("choices,stop,expected", CHOICES)
def test_choose_from_datasets_as_tf(choices, stop, expected):
    a, b = Dataset.range(0, 5), Dataset.range(100, 103)
    ds = Dataset.choose_from_datasets([a, b], Dataset.from_tensor_slices(np.array(choices)),
                                      stop_on_empty_dataset=stop)
    assert ds.cardinality() == -2 and ds.element_spec == TensorSpec((), I64)
    assert vals(ds) == expected


def test_choose_from_datasets_cardinality_and_errors():
    a, b = Dataset.range(0, 5), Dataset.range(100, 103)
    # TF 2.21: -1 when a data input is infinite (whatever the choices), else -2, even
    # for an infinite choice dataset: range(2).repeat() gives [0, 100, 1, 101, 2, 102, 3].
    assert Dataset.choose_from_datasets([a.repeat(), b], Dataset.range(1).repeat()) \
        .cardinality() == -1
    alt = Dataset.choose_from_datasets([a, b], Dataset.range(2).repeat())
    assert alt.cardinality() == -2 and vals(alt) == [0, 100, 1, 101, 2, 102, 3]
    # TF 2.21: InvalidArgumentError "Selector index out of range: 2 >= 2" (and -1).
    for bad in (2, -1):
        with pytest.raises(ValueError, match=f"choice {bad} is out of range for 2 datasets"):
            list(Dataset.choose_from_datasets([a, b], Dataset.from_tensor_slices(
                np.array([0, bad]))))
    # TF 2.21: TypeError for int32 choices and for a list; ValueError for no datasets.
    with pytest.raises(TypeError, match="must be int64 scalars"):
        Dataset.choose_from_datasets([a, b], Dataset.range(2, output_type=np.int32))
    with pytest.raises(TypeError, match="choice_dataset must be a Dataset"):
        Dataset.choose_from_datasets([a, b], [0, 1])
    with pytest.raises(ValueError, match="datasets must not be empty"):
        Dataset.choose_from_datasets([], Dataset.range(2))


# --- zip of dicts and nested structures -------------------------------------------------

def test_zip_of_dicts_and_nested_structures():
    # TF 2.21: a dict keeps its key order in the spec and the elements; card 3.
    z = Dataset.zip({"y": Dataset.range(3), "x": Dataset.range(10, 15)})
    assert list(z.element_spec) == ["y", "x"] and z.cardinality() == 3
    assert vals(z) == [{"y": 0, "x": 10}, {"y": 1, "x": 11}, {"y": 2, "x": 12}]
    assert [list(e) for e in z] == [["y", "x"]] * 3
    # TF 2.21: a mapped function gets the dict as one argument: [10, 12, 14].
    assert vals(Dataset.zip({"x": Dataset.range(3), "y": Dataset.range(10, 15)})
                .map(lambda d: d["x"] + d["y"])) == [10, 12, 14]
    # TF 2.21: nested tuple/dict structure, cardinality the shortest (2).
    n = Dataset.zip((Dataset.range(3), {"a": Dataset.range(2),
                                        "b": (Dataset.range(4), Dataset.range(5))}))
    assert n.cardinality() == 2
    assert n.element_spec == (TensorSpec((), I64), {"a": TensorSpec((), I64),
                                                    "b": (TensorSpec((), I64),) * 2})
    assert vals(n) == [(0, {"a": 0, "b": (0, 0)}), (1, {"a": 1, "b": (1, 1)})]
    assert vals(Dataset.zip(datasets={"x": Dataset.range(3)})) == [{"x": 0}, {"x": 1},
                                                                   {"x": 2}]
    # TF 2.21: unknown with a filtered input, infinite when all are infinite.
    assert Dataset.zip({"x": Dataset.range(3).repeat(),
                        "y": Dataset.range(5).filter(lambda x: True)}).cardinality() == -2
    assert Dataset.zip({"x": Dataset.range(3).repeat(),
                        "y": Dataset.range(2).repeat()}).cardinality() == -1
    # TF 2.21: TypeError for a non-dataset leaf.
    with pytest.raises(TypeError, match="found int"):
        Dataset.zip((Dataset.range(3), 1))


# --- window -------------------------------------------------------------------------

WINDOWS = [
    # (size, shift, stride, drop_remainder, n, TF 2.21's windows, TF's cardinality)
    (3, None, 1, False, 7, [[0, 1, 2], [3, 4, 5], [6]], 3),
    (3, None, 1, True, 7, [[0, 1, 2], [3, 4, 5]], 2),
    (3, 2, 1, False, 7, [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6]], 4),
    (3, 2, 2, False, 7, [[0, 2, 4], [2, 4, 6], [4, 6], [6]], 4),
    (3, 2, 2, True, 7, [[0, 2, 4], [2, 4, 6]], 2),
    (2, 5, 1, False, 7, [[0, 1], [5, 6]], 2),
    (4, 3, 2, True, 10, [[0, 2, 4, 6], [3, 5, 7, 9]], 2),
    (2, None, 1, False, 0, [], 0),
]


@pytest.mark.parametrize("size,shift,stride,drop,n,expected,card", WINDOWS)
def test_window_as_tf(size, shift, stride, drop, n, expected, card):
    ds = Dataset.range(n).window(size, shift, stride, drop)
    assert ds.element_spec == DatasetSpec(TensorSpec((), I64))
    assert ds.cardinality() == card
    assert vals(ds) == expected
    if expected:
        assert next(iter(ds)).cardinality() == len(expected[0])


def test_window_structures_cardinality_and_flat_map():
    # TF 2.21: a tuple element gives a tuple of datasets; a dict a dict of datasets.
    t = Dataset.range(5).map(lambda x: (x, 2 * x)).window(2)
    assert t.element_spec == (DatasetSpec(TensorSpec((), I64)),) * 2
    assert vals(t) == [([0, 1], [0, 2]), ([2, 3], [4, 6]), ([4], [8])]
    d = Dataset.range(5).map(lambda x: {"a": x, "b": (x, x)}).window(2)
    assert vals(d)[-1] == {"a": [4], "b": ([4], [4])}
    # TF 2.21: infinite input: -1 with or without drop_remainder; filtered input: -2.
    assert Dataset.range(3).repeat().window(2).cardinality() == -1
    assert Dataset.range(3).repeat().window(2, drop_remainder=True).cardinality() == -1
    assert Dataset.range(10).filter(lambda x: True).window(4).cardinality() == -2
    # TF 2.21: flat_map over windows: spec (None,), [[0 1 2] [2 3 4] [4 5 6]].
    f = Dataset.range(7).window(3, 2, 1, True).flat_map(lambda w: w.batch(3))
    assert f.element_spec == TensorSpec((None,), I64)
    assert vals(f) == [[0, 1, 2], [2, 3, 4], [4, 5, 6]]
    z = Dataset.range(5).map(lambda x: (x, 2 * x)).window(2).flat_map(
        lambda a, b: Dataset.zip((a.batch(2), b.batch(2))))
    assert vals(z) == [([0, 1], [0, 2]), ([2, 3], [4, 6]), ([4], [8])]
    # TF 2.21: InvalidArgumentError "Window size/shift/stride must be greater than zero".
    for kwargs in ({"size": 0}, {"size": 2, "shift": 0}, {"size": 2, "stride": 0}):
        with pytest.raises(ValueError, match="must be positive, got 0"):
            Dataset.range(3).window(**kwargs)


# --- group_by_window / bucket_by_sequence_length ---------------------------------------

def test_group_by_window_as_tf():
    # TF 2.21: full windows as they fill, then the rest smallest key first.
    g = Dataset.range(10).group_by_window(lambda x: x % 3, lambda k, w: w.batch(2),
                                          window_size=2)
    assert g.element_spec == TensorSpec((None,), I64) and g.cardinality() == -2
    assert vals(g) == [[0, 3], [1, 4], [2, 5], [6, 9], [7], [8]]
    order = Dataset.from_tensor_slices(np.array([5, 1, 3, 7, 2, 9, 4])).group_by_window(
        lambda x: (10 - x) % 3, lambda k, w: w.batch(5), window_size=5)
    assert vals(order) == [[1, 7, 4], [3, 9], [5, 2]]
    neg = Dataset.range(5).group_by_window(lambda x: x - 2, lambda k, w: w.batch(9),
                                           window_size=9)
    assert vals(neg) == [[0], [1], [2], [3], [4]]
    # TF 2.21: the key reaches reduce_func; spec ((), (None,)).
    keyed = Dataset.range(7).group_by_window(
        lambda x: x % 2, lambda k, w: w.batch(3).map(lambda b: (k, b)), window_size=3)
    assert vals(keyed) == [(0, [0, 2, 4]), (1, [1, 3, 5]), (0, [6])]
    # TF 2.21: window_size_func(key) = key + 2.
    wsf = Dataset.range(10).group_by_window(lambda x: x % 2, lambda k, w: w.batch(10),
                                            window_size_func=lambda k: k + 2)
    assert vals(wsf) == [[0, 2], [1, 3, 5], [4, 6], [8], [7, 9]]
    # TF 2.21: reduce_func returning the window itself; tuples; drop_remainder's spec.
    assert vals(Dataset.range(5).group_by_window(lambda x: x % 2, lambda k, w: w,
                                                 window_size=2)) == [0, 2, 1, 3, 4]
    tup = Dataset.range(5).map(lambda x: (x, 2 * x))
    assert vals(tup.group_by_window(lambda a, b: a % 2, lambda k, w: w.batch(2),
                                    window_size=2)) == \
        [([0, 2], [0, 4]), ([1, 3], [2, 6]), ([4], [8])]
    fixed = tup.group_by_window(lambda a, b: a % 2,
                                lambda k, w: w.batch(2, drop_remainder=True), window_size=2)
    assert fixed.element_spec == (TensorSpec((2,), I64),) * 2
    assert vals(fixed) == [([0, 2], [0, 4]), ([1, 3], [2, 6])]
    # TF 2.21: an infinite input: cardinality -1.
    assert Dataset.range(3).repeat().group_by_window(lambda x: x, lambda k, w: w,
                                                     window_size=2).cardinality() == -1


def test_group_by_window_errors():
    # TF 2.21: ValueError "Either the `window_size` argument or the `window_size_func`
    # argument must be specified" (both, or neither); ValueError for a vector key;
    # TypeError when reduce_func returns no dataset; InvalidArgumentError "Window size
    # must be greater than zero, but got 0" at iteration.
    r = Dataset.range(3)
    with pytest.raises(ValueError, match="exactly one of window_size and window_size_func"):
        r.group_by_window(lambda x: x, lambda k, w: w, window_size=2,
                          window_size_func=lambda k: 2)
    with pytest.raises(ValueError, match="exactly one"):
        r.group_by_window(lambda x: x, lambda k, w: w)
    with pytest.raises(TypeError, match="must return an integer scalar"):
        list(r.group_by_window(lambda x: np.array([x, x]), lambda k, w: w, window_size=2))
    with pytest.raises(TypeError, match="reduce_func must return a Dataset, got int"):
        r.group_by_window(lambda x: x, lambda k, w: 1, window_size=2).element_spec
    with pytest.raises(ValueError, match="window_size must be positive, got 0"):
        r.group_by_window(lambda x: x, lambda k, w: w, window_size=0)
    with pytest.raises(ValueError, match="window size must be positive, got 0 for key 0"):
        list(r.group_by_window(lambda x: x, lambda k, w: w, window_size_func=lambda k: k))


SEQS = [1, 2, 3, 4, 5, 6, 1, 2]  # element i is [i] * SEQS[i]: [0], [1, 1], ..., [7, 7]


def seqs():
    return Dataset.from_generator(
        lambda: (np.full(n, i, np.int32) for i, n in enumerate(SEQS)),
        output_signature=TensorSpec((None,), I32))


def test_bucket_by_sequence_length_as_tf():
    # TF 2.21: boundaries [3, 5], batch sizes [2, 2, 2]: spec (None, None), card -2.
    bk = seqs().bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2])
    assert bk.element_spec == TensorSpec((None, None), I32) and bk.cardinality() == -2
    expected = [[[0, 0], [1, 1]], [[2, 2, 2, 0], [3, 3, 3, 3]],
                [[4, 4, 4, 4, 4, 0], [5, 5, 5, 5, 5, 5]], [[6, 0], [7, 7]]]
    assert vals(bk) == expected
    pad = seqs().bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2],
                                           padding_values=np.int32(-1))
    assert vals(pad)[0] == [[0, -1], [1, 1]]
    drop = seqs().bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2],
                                            drop_remainder=True)
    assert drop.element_spec == TensorSpec((None, None), I32) and vals(drop) == expected
    # TF 2.21: padded_shapes=[7]: spec (None, 7).
    p7 = seqs().bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2],
                                          padded_shapes=[7])
    assert p7.element_spec == TensorSpec((None, 7), I32)
    assert vals(p7)[0] == [[0, 0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]]
    # TF 2.21: pad_to_bucket_boundary pads to boundary - 1 (the first 4 elements).
    tb = seqs().take(4).bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2],
                                                  pad_to_bucket_boundary=True)
    assert tb.element_spec == TensorSpec((None, None), I32)
    assert vals(tb) == [[[0, 0], [1, 1]], [[2, 2, 2, 0], [3, 3, 3, 3]]]
    # TF 2.21: no_padding over range(9) (length = the value): spec (None,).
    nopad = Dataset.range(9).bucket_by_sequence_length(lambda x: x, [3, 5], [2, 2, 2],
                                                       no_padding=True)
    assert nopad.element_spec == TensorSpec((None,), I64)
    assert vals(nopad) == [[0, 1], [3, 4], [5, 6], [7, 8], [2]]
    # TF 2.21: dict elements.
    d = Dataset.from_generator(lambda: ({"s": np.full(n, n), "n": np.int64(n)}
                                        for n in range(1, 6)),
                               output_signature={"s": TensorSpec((None,), I64),
                                                 "n": TensorSpec((), I64)})
    bd = d.bucket_by_sequence_length(lambda e: e["n"], [3], [2, 2])
    assert bd.element_spec == {"s": TensorSpec((None, None), I64),
                               "n": TensorSpec((None,), I64)}
    assert vals(bd) == [{"s": [[1, 0], [2, 2]], "n": [1, 2]},
                        {"s": [[3, 3, 3, 0], [4, 4, 4, 4]], "n": [3, 4]},
                        {"s": [[5, 5, 5, 5, 5]], "n": [5]}]


def test_bucket_by_sequence_length_errors():
    # TF 2.21: ValueError "len(bucket_batch_sizes) must equal len(bucket_boundaries) + 1";
    # with pad_to_bucket_boundary an element past the last boundary fails at iteration
    # ("elements must have length < max(bucket_boundaries)"). TF accepts unsorted
    # boundaries (and buckets oddly); gpustrat refuses them.
    with pytest.raises(ValueError, match="2 batch sizes for 2 boundaries"):
        seqs().bucket_by_sequence_length(len, [3, 5], [2, 2])
    with pytest.raises(ValueError, match="shorter than the last boundary 5"):
        list(seqs().bucket_by_sequence_length(lambda x: len(x), [3, 5], [2, 2, 2],
                                              pad_to_bucket_boundary=True))
    with pytest.raises(ValueError, match="strictly increasing, got \\[5, 3\\]"):
        seqs().bucket_by_sequence_length(len, [5, 3], [2, 2, 2])


# --- scan ---------------------------------------------------------------------------

def test_scan_as_tf():
    # TF 2.21: running sum as the state, output state * 10: [0, 0, 10, 30, 60], card 5.
    s = Dataset.range(5).scan(np.int64(0), lambda st, x: (st + x, st * 10))
    assert s.element_spec == TensorSpec((), I64) and s.cardinality() == 5
    assert vals(s) == [0, 0, 10, 30, 60]
    t = Dataset.range(5).scan((np.int64(0), np.int64(1)),
                              lambda st, x: ((st[0] + x, st[1] * 2), (st[0], st[1])))
    assert vals(t) == [(0, 1), (0, 2), (1, 4), (3, 8), (6, 16)]
    d = Dataset.range(3).scan({"a": np.int64(0)}, lambda st, x: ({"a": st["a"] + x}, st["a"]))
    assert vals(d) == [0, 0, 1]
    # TF 2.21: a tuple element is passed as one argument.
    pairs = Dataset.range(3).map(lambda x: (x, x))
    assert vals(pairs.scan(np.int64(0), lambda st, ab: (st + ab[0], st))) == [0, 0, 1]
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        list(pairs.scan(np.int64(0), lambda st, a, b: (st + a, st)))
    # TF 2.21: the state's shape may change: [1, 2, 3].
    grow = Dataset.range(3).scan(np.array([0]), lambda st, x: (np.append(st, x), st.size))
    assert vals(grow) == [1, 2, 3]
    assert Dataset.range(3).repeat().scan(0, lambda st, x: (st, x)).cardinality() == -1
    assert vals(Dataset.range(5).scan(np.int64(0), lambda st, x: (st + x, st))) == \
        [0, 0, 1, 3, 6]


def test_scan_errors():
    # TF 2.21: TypeError "The element types for the new state must match the initial
    # state. Expected int64, got float32"; TypeError when scan_func returns 3 values.
    with pytest.raises(TypeError, match="expected int64, got float32"):
        list(Dataset.range(3).scan(np.int64(0), lambda st, x: (np.float32(st), x)))
    with pytest.raises(TypeError, match=r"must return a pair \(new_state, output\)"):
        list(Dataset.range(3).scan(np.int64(0), lambda st, x: (st, x, x)))


# --- unique -------------------------------------------------------------------------

def test_unique_as_tf():
    # TF 2.21: first occurrences in order, cardinality -2 (even for range and infinite).
    u = Dataset.from_tensor_slices(np.array([1, 2, 2, 3, 1, 5, 3])).unique()
    assert vals(u) == [1, 2, 3, 5] and u.cardinality() == -2
    assert u.element_spec == TensorSpec((), I64)
    assert vals(Dataset.from_tensor_slices(np.array([3, 3, 1], np.int32)).unique()) == [3, 1]
    assert vals(Dataset.from_tensor_slices(["a", "b", "a"]).unique()) == [b"a", b"b"]
    assert Dataset.range(3).unique().cardinality() == -2
    assert Dataset.range(3).repeat().unique().cardinality() == -2
    first3 = []
    for v in Dataset.range(3).repeat().unique():
        first3.append(int(v))
        if len(first3) == 3:
            break
    assert first3 == [0, 1, 2]
    # TF 2.21 builds unique() over vectors and yields [1 2] for [[1, 2]].
    assert vals(Dataset.from_tensor_slices(np.array([[1, 2], [1, 2]])).map(
        lambda v: v).unique()) == [[1, 2]]


def test_unique_errors():
    # TF 2.21: TypeError "does not support type float32 -- only int32, int64, and
    # string" (bool too); a tuple element: InvalidArgumentError "only supports inputs
    # with a single component". gpustrat: TypeError for both.
    with pytest.raises(TypeError, match="not float32"):
        Dataset.from_tensor_slices(np.array([1.0, 2.0], np.float32)).unique().element_spec
    with pytest.raises(TypeError, match="not bool"):
        list(Dataset.from_tensor_slices(np.array([True, False])).unique())
    with pytest.raises(TypeError, match="elements of one component"):
        list(Dataset.range(3).map(lambda x: (x, x)).unique())


# --- ignore_errors --------------------------------------------------------------------

def test_ignore_errors_as_tf():
    # TF 2.21: 1 / x with check_numerics over [1, 2, 0, 4]: [1.0, 0.5, 0.25], card -2.
    def inv(x):
        if x == 0:
            raise ZeroDivisionError("division by zero")
        return 1 / x
    ds = Dataset.from_tensor_slices(np.array([1., 2., 0., 4.], np.float32)).map(inv)
    with pytest.raises(ZeroDivisionError):
        list(ds)
    ok = ds.ignore_errors()
    assert vals(ok) == [1.0, 0.5, 0.25] and ok.cardinality() == -2
    assert vals(Dataset.range(3).ignore_errors()) == [0, 1, 2]
    assert Dataset.range(3).ignore_errors().cardinality() == -2
    assert vals(Dataset.range(3).ignore_errors(log_warning=True)) == [0, 1, 2]
