"""Variables against TensorFlow 2.21: every update kind, in both contexts, for each
aggregation and synchronization, on 2 and 4 logical CPU replicas (TensorFlow's values
were recorded from TF 2.21 and are hard-coded in ``tf_recorded_variables``)."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from tf_recorded_variables import TF_2_REPLICAS, TF_4_REPLICAS, TF_OTHER
from variable_cases import compare_all


@pytest.mark.parametrize("n, table", [(2, TF_2_REPLICAS), (4, TF_4_REPLICAS)])
def test_every_update_matches_tensorflow(n, table):
    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    try:
        bad = compare_all(strategy, table)
    finally:
        strategy.close()
    assert bad == []



def test_creation_defaults_match_tensorflow(two):
    with two.scope():
        auto = gs.Variable(1.0)
        on_read = gs.Variable(1.0, synchronization=gs.VariableSynchronization.ON_READ,
                              trainable=True)
    got = {"create/auto_default": [type(auto).__name__, auto.trainable,
                                   f"<dtype: '{auto.dtype}'>", auto.synchronization.name,
                                   auto.aggregation.name],
           "create/onread_trainable": [type(on_read).__name__, on_read.trainable,
                                       f"<dtype: '{on_read.dtype}'>",
                                       on_read.synchronization.name,
                                       on_read.aggregation.name]}
    for k, v in got.items():
        assert v == TF_OTHER[k]
    with pytest.raises(ValueError, match="synchronization NONE"):
        with two.scope():
            gs.Variable(1.0, synchronization="none")


@pytest.mark.parametrize("name, value", [("pyfloat", 1.5), ("pyint", 3),
                                         ("np64", np.float64(2.0)), ("list", [1, 2])])
def test_dtypes_match_tensorflow(two, name, value):
    with two.scope():
        v = gs.Variable(value)
    assert str(v.dtype) == TF_OTHER["dtype/" + name]
    plain = gs.Variable(value)          # outside any scope: the same rules
    assert str(plain.dtype) == TF_OTHER["dtype/" + name]


def test_bad_assignments_are_refused_as_tensorflow_does(two):
    with two.scope():
        v = gs.Variable([1.0, 2.0])
        vi = gs.Variable([1, 2])
        with pytest.raises(ValueError, match=r"shape \(2,\) got a value of shape \(3,\)"):
            v.assign([1.0, 2.0, 3.0])
        with pytest.raises(ValueError, match="do not broadcast"):
            v.assign(3.0)
        with pytest.raises(TypeError, match="dtype int32.*float64"):
            vi.assign([1.5, 2.5])
        v.assign(np.array([1, 2], np.int32))         # TF converts ints into a float variable
    assert [np.asarray(c).tolist() for c in two.experimental_local_results(v)] == \
        TF_OTHER["bad/int_into_float"][:2]
    assert v.dtype == np.float32
