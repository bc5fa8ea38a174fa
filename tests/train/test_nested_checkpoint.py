"""Nested checkpoints: Checkpoints inside Checkpoints, dicts, lists and tuples of savable
objects, and plain model objects, saved under path-like keys and restored by structure."""

import json
import logging

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import Dataset


class Dense:
    def __init__(self, n_in, n_out, seed):
        rng = np.random.default_rng(seed)
        self.kernel = gs.Variable(rng.standard_normal((n_in, n_out)).astype(np.float32))
        self.bias = gs.Variable(np.zeros(n_out, np.float32))
        self.activation = np.tanh          # not savable: not part of the graph
        self.units = n_out                 # a plain object's number: not saved


class Model:
    def __init__(self, seed=0, depth=2):
        self.layers = [Dense(3, 3, seed + i) for i in range(depth)]
        self.scale = gs.Variable(np.float32(1.5 + seed))
        self.name = "mlp"
        self.parent = self                 # a cycle
        self.tied = self.layers[0].kernel  # the same variable again: saved once
        self.log = logging.getLogger("gpustrat")   # the standard library's: not followed
        self.strategy = gs.get_strategy()          # gpustrat's, not savable: not followed


def values(model):
    return [v.numpy().copy() for layer in model.layers for v in (layer.kernel, layer.bias)] \
        + [model.scale.numpy().copy()]


def keys_of(path):
    index = json.load(open(path + ".index"))
    return sorted(index["objects"]), index["per_worker_objects"]


def test_plain_objects_containers_and_nested_checkpoints_save_under_path_keys(tmp_path):
    model = Model(seed=0)
    opt = gs.optimizers.SGD(0.1)
    it = iter(Dataset.range(10).batch(2))
    next(it)
    extra = gs.Variable(np.arange(4, dtype=np.float64))
    ck = gs.train.Checkpoint(model=model, inner=gs.train.Checkpoint(opt=opt, step=4),
                             heads={"a/b": extra, "it": it}, pair=(gs.Variable(2.0),))
    path = ck.write(str(tmp_path / "ck"))
    shared, per_worker = keys_of(path)
    assert shared == ["heads/a%2Fb", "inner/opt", "inner/step", "model/layers/0/bias",
                      "model/layers/0/kernel", "model/layers/1/bias",
                      "model/layers/1/kernel", "model/scale", "pair/0"]
    assert per_worker == ["heads/it"]

    saved = values(model)
    fresh = Model(seed=7)
    it2 = iter(Dataset.range(10).batch(2))
    extra2, pair2 = gs.Variable(np.zeros(4)), gs.Variable(0.0)
    inner2 = gs.train.Checkpoint(opt=gs.optimizers.SGD(0.1), step=0)
    ck2 = gs.train.Checkpoint(model=fresh, inner=inner2, heads={"a/b": extra2, "it": it2},
                              pair=(pair2,))
    ck2.restore(path).assert_consumed()
    for a, b in zip(values(fresh), saved):
        np.testing.assert_array_equal(a, b)
    assert fresh.tied is fresh.layers[0].kernel
    assert inner2.step == 4 and float(pair2.numpy()) == 2.0
    np.testing.assert_array_equal(extra2.numpy(), np.arange(4))
    assert next(it2).tolist() == [2, 3]


def test_restoring_into_a_superset_or_subset_names_the_keys(tmp_path):
    model = Model(seed=1, depth=2)
    path = gs.train.Checkpoint(model=model).write(str(tmp_path / "ck"))
    bigger = Model(seed=9, depth=3)
    status = gs.train.Checkpoint(model=bigger).restore(path)
    # As TensorFlow: what the checkpoint has is restored, the rest stays as it was.
    np.testing.assert_array_equal(bigger.layers[1].kernel.numpy(),
                                  model.layers[1].kernel.numpy())
    with pytest.raises(AssertionError, match=r"not in the checkpoint \['model/layers/2/"
                                             r"kernel', 'model/layers/2/bias'\]"):
        status.assert_consumed()
    with pytest.raises(AssertionError, match="model/layers/2/kernel"):
        status.assert_existing_objects_matched()
    smaller = Model(seed=9, depth=1)
    status = gs.train.Checkpoint(model=smaller).restore(path)
    status.assert_existing_objects_matched()      # every object of smaller was restored
    np.testing.assert_array_equal(smaller.scale.numpy(), model.scale.numpy())
    with pytest.raises(AssertionError, match=r"saved objects not restored \['model/layers"
                                             r"/1/bias', 'model/layers/1/kernel'\]"):
        status.assert_consumed()


def test_another_kind_at_a_key_is_an_error_that_restores_nothing(tmp_path):
    w, v = gs.Variable(np.ones(2, np.float32)), gs.Variable(np.ones(3, np.float32))
    path = gs.train.Checkpoint(net={"v": v, "w": w}).write(str(tmp_path / "ck"))
    v2 = gs.Variable(np.zeros(3, np.float32))
    ck = gs.train.Checkpoint(net={"v": v2, "w": gs.optimizers.Adam(0.1)})
    with pytest.raises(ValueError, match=r"key 'net/w' holds a variable, but this "
                                         r"Checkpoint has an object's shared state.*Adam"):
        ck.restore(path)
    np.testing.assert_array_equal(v2.numpy(), [0, 0, 0])   # nothing restored
    ck = gs.train.Checkpoint(net={"v": v2, "w": gs.Variable(np.zeros(5, np.float32))})
    with pytest.raises(ValueError, match=r"variable 'net/w' has shape \(5,\), the "
                                         r"checkpoint holds shape \(2,\)"):
        ck.restore(path)
    np.testing.assert_array_equal(v2.numpy(), [0, 0, 0])


def test_an_optimizer_or_metric_of_another_class_is_an_error_that_restores_nothing(
        tmp_path):
    # Adam's state used to be taken by an SGD with momentum without a word: its
    # iterations restored, its moments dropped, its momentum left at zero.
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    with s.scope():
        w = gs.Variable(np.ones(3, np.float32), name="w")
        adam, mean = gs.optimizers.Adam(0.1), gs.metrics.Mean()
    s.run(lambda: adam.apply_gradients([(np.ones(3, np.float32), w)]))
    mean.update_state(np.float32(4))
    path = gs.train.Checkpoint(w=w, opt=adam, m=mean).write(str(tmp_path / "ck"))
    with s.scope():
        w2 = gs.Variable(np.zeros(3, np.float32), name="w")
        sgd, acc = gs.optimizers.SGD(0.1, momentum=0.9), gs.metrics.Sum()
    with pytest.raises(ValueError, match=r"key 'opt' holds state saved from class Adam, "
                                         r"but this Checkpoint has class SGD there.*nothing "
                                         r"was restored: restore into an object of class "
                                         r"Adam \(or a subclass\)"):
        gs.train.Checkpoint(w=w2, opt=sgd).restore(path)
    with pytest.raises(ValueError, match=r"key 'm' holds state saved from class Mean, but "
                                         r"this Checkpoint has class Sum"):
        gs.train.Checkpoint(w=w2, m=acc).restore(path)
    np.testing.assert_array_equal(w2.numpy(), [0, 0, 0])     # nothing restored
    assert int(sgd.iterations) == 0
    # A subclass takes its base's state (AdamW keeps Adam's moments).
    with s.scope():
        adamw = gs.optimizers.AdamW(0.1)
    with s.scope():
        mean2 = gs.metrics.Mean()
    gs.train.Checkpoint(w=w2, opt=adamw, m=mean2).restore(path).assert_consumed()
    assert float(mean2.result()) == 4.0
    assert int(adamw.iterations) == 1
    np.testing.assert_array_equal(w2.numpy(), w.numpy())


def test_containers_and_objects_without_savables_are_errors():
    with pytest.raises(TypeError, match=r"'lrs' \(list\) holds no savable"):
        gs.train.Checkpoint(lrs=[0.1, 0.2]).write("/nonexistent/never")

    class Empty:
        pass
    with pytest.raises(TypeError, match=r"'cfg' \(Empty\) holds no savable"):
        gs.train.Checkpoint(cfg=Empty()).write("/nonexistent/never")
    with pytest.raises(TypeError, match="cannot save ds=RangeDataset"):
        gs.train.Checkpoint(ds=Dataset.range(3))
    with pytest.raises(TypeError, match="cannot save log=Logger"):
        gs.train.Checkpoint(log=logging.getLogger("gpustrat"))


def test_an_object_shared_between_entries_is_saved_once(tmp_path):
    w = gs.Variable(np.arange(3, dtype=np.float32))
    ck = gs.train.Checkpoint(a={"w": w}, b=[w])
    path = ck.write(str(tmp_path / "ck"))
    assert keys_of(path)[0] == ["a/w"]
    w.assign(np.zeros(3, np.float32))
    ck.restore(path).assert_consumed()
    np.testing.assert_array_equal(w.numpy(), [0, 1, 2])
