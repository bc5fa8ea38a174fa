"""TensorFlow names under ``gs``, ``gs.distribute`` and ``gs.data``: the ones gpustrat
has are there (``gs.TensorSpec`` is ``tf.TensorSpec``), and reading one it has elsewhere
or not at all is an AttributeError that says where it lives, or that it has none."""

from __future__ import annotations

import pytest

import gpustrat as gs
from gpustrat import _porting


def test_tensor_spec_is_at_the_top_level_as_in_tensorflow():
    assert gs.TensorSpec is gs.data.TensorSpec
    assert "TensorSpec" in dir(gs)
    spec = gs.TensorSpec((None, 3), "float32")
    assert spec.shape == (None, 3)


@pytest.mark.parametrize("expr,where", [
    ("gs.GradientTape", "TensorFlow's tf.GradientTape has no counterpart in gpustrat"),
    ("gs.constant", "for TensorFlow's tf.constant: use np.asarray"),
    ("gs.keras", "optimizers are gs.optimizers"),
    ("gs.distribute.TPUStrategy", "tf.distribute.TPUStrategy has no counterpart"),
    ("gs.distribute.NcclAllReduce", "has no counterpart"),
    ("gs.distribute.ParameterServerStrategy",
     "gs.distribute.experimental.ParameterServerStrategy"),
    ("gs.distribute.experimental.CentralStorageStrategy", "has no counterpart"),
    ("gs.data.Iterator", "gs.data.DatasetIterator"),
    ("gs.data.FixedLengthRecordDataset", "has no counterpart"),
    ("gs.zeros", "for TensorFlow's tf.zeros: use np.zeros"),
    ("gs.reduce_max", "use np.max"),
    ("gs.concat", "use np.concatenate"),
    ("gs.uint8", "use np.uint8"),
    ("gs.bfloat16", "NumPy has no bfloat16"),
    ("gs.summary", "has no counterpart"),
    ("gs.saved_model", "gs.train.Checkpoint"),
    ("gs.losses", "gs.nn"),
    ("gs.distribute.experimental.PreemptionCheckpointHandler", "CheckpointManager"),
    ("gs.distribute.experimental.CollectiveHints", "GPUSTRAT_FUSION_BUCKET_BYTES"),
])
def test_a_tensorflow_name_says_where_it_lives_or_that_it_has_none(expr, where):
    with pytest.raises(AttributeError, match="has no attribute") as e:
        eval(expr)  # noqa: S307
    assert where in str(e.value) and "docs/porting.md" in str(e.value), str(e.value)


def test_other_names_get_the_plain_error_and_hasattr_works():
    for module in (gs, gs.distribute, gs.data):
        with pytest.raises(AttributeError) as e:
            module.no_such_name  # noqa: B018
        assert str(e.value) == f"module {module.__name__!r} has no attribute 'no_such_name'"
        assert not hasattr(module, "GradientTape")
    from gpustrat.data import sources  # submodules still import through the hook
    assert sources.SequenceGenerator is gs.data.SequenceGenerator


def test_every_listed_name_is_really_missing_and_every_pointer_exists():
    import gpustrat.distribute.experimental as dx
    modules = {"gpustrat": gs, "gpustrat.distribute": gs.distribute,
               "gpustrat.distribute.experimental": dx, "gpustrat.data": gs.data}
    for module, names in _porting.WHERE.items():
        for name in names:
            assert not hasattr(modules[module], name), (module, name)
    # The gpustrat names the hints point to exist.
    assert gs.distribute.experimental.ParameterServerStrategy and gs.data.DatasetIterator
    assert gs.data.STRING is not None and gs.data.TFRecordWriter and gs.Mirrored
    assert gs.nn.compute_average_loss and gs.nn.scale_regularization_loss
    assert gs.train.CheckpointManager.restore_or_initialize
    from gpustrat.collectives import fusion
    assert "GPUSTRAT_FUSION_BUCKET_BYTES" in fusion.__doc__
    # Every NumPy spelling a hint gives exists.
    import numpy as np
    for name in _porting._NUMPY_DTYPES + _porting._NUMPY_FUNCTIONS:
        spelled = _porting.WHERE["gpustrat"][name].removeprefix("use ")
        if spelled.startswith("np.") and "(" not in spelled and " " not in spelled:
            assert hasattr(np, spelled[3:]), (name, spelled)
