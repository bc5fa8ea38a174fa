"""gs.function's decorator on CPU: tf.function's spellings, the function called at every
call, and the trace cache's rules (what is a new trace)."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.data import TensorSpec
from gpustrat.function import CaptureError


def test_the_decorator_with_and_without_arguments_and_as_a_call():
    calls = []

    @gs.function
    def a(x):
        calls.append("a")
        return x + 1

    @gs.function(reduce_retracing=True, autograph=False)
    def b(x):
        calls.append("b")
        return x * 2

    c = gs.function(lambda x: x - 1, capture=False)
    assert a(1) == 2 and b(3) == 6 and c(5) == 4
    assert a(1) == 2                       # called again: the Python runs every time
    assert calls == ["a", "b", "a"]
    assert a.python_function(4) == 5 and a.__name__ == "a"
    assert "gs.function a" in repr(a)


def test_jit_compile_and_bad_options_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="no XLA compiler"):
        gs.function(lambda x: x, jit_compile=True)
    gs.function(lambda x: x, jit_compile=False)          # accepted, changes nothing
    with pytest.raises(ValueError, match="capture="):
        gs.function(lambda x: x, capture="yes")
    with pytest.raises(ValueError, match="warmup_steps"):
        gs.function(lambda x: x, warmup_steps=0)
    with pytest.raises(TypeError, match="decorates a callable"):
        gs.function(3)
    with pytest.raises(NotImplementedError, match="concrete"):
        gs.function(lambda x: x).get_concrete_function(1)


def test_a_new_python_value_is_a_new_trace_and_arrays_are_keyed_by_shape_and_dtype():
    f = gs.function(lambda x, k=1: x * k)
    f(np.ones(3), k=2)
    f(np.zeros(3), k=2)                 # other values, same shape and dtype
    assert f.experimental_get_tracing_count() == 1
    f(np.ones(3), k=3)                  # a new Python value
    assert f.experimental_get_tracing_count() == 2
    f(np.ones(4), k=3)                  # a new shape
    f(np.ones(4, np.float32), k=3)      # a new dtype
    assert f.experimental_get_tracing_count() == 4
    f([np.ones(4), 1.0])                # a new structure
    f([np.ones(4), 1.0])
    assert f.experimental_get_tracing_count() == 5
    f(np.ones(4), k=np.float32(3))      # a NumPy scalar is a value, as a Python one
    f(np.ones(4), k=np.float32(3))
    f(np.ones(4), k=np.float32(4))
    assert f.experimental_get_tracing_count() == 7


def test_distributed_values_are_keyed_by_their_components_shapes_and_devices():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        f = gs.function(lambda v: s.run(lambda u: u + 1, args=(v,)))
        make = s.experimental_distribute_values_from_function
        f(make(lambda ctx: np.full(2, float(ctx.replica_id_in_sync_group))))
        out = f(make(lambda ctx: np.full(2, 5.0)))
        assert f.experimental_get_tracing_count() == 1
        assert [list(c) for c in s.experimental_local_results(out)] == [[6, 6], [6, 6]]
        f(make(lambda ctx: np.full(3, 5.0)))
        assert f.experimental_get_tracing_count() == 2
    finally:
        s.close()


def test_reduce_retracing_relaxes_a_second_shape_into_one_trace():
    f = gs.function(lambda x: x.sum(), reduce_retracing=True)
    for n in (3, 4, 5, 6):
        assert f(np.ones((n, 2))) == 2 * n
    assert f.experimental_get_tracing_count() == 2     # (3, 2), then (None, 2)
    f(np.ones((2, 3)))
    assert f.experimental_get_tracing_count() == 3     # the second dim differs too
    g = gs.function(lambda x: x.sum())
    for n in (3, 4, 5):
        g(np.ones((n, 2)))
    assert g.experimental_get_tracing_count() == 3


def test_an_input_signature_is_one_trace_and_checks_the_arguments():
    f = gs.function(lambda x: x * 2, input_signature=[TensorSpec((None, 2), np.float32)])
    f(np.ones((3, 2), np.float32))
    f(np.ones((7, 2), np.float32))
    assert f.experimental_get_tracing_count() == 1
    with pytest.raises(TypeError, match="does not match its input_signature"):
        f(np.ones((3, 3), np.float32))
    with pytest.raises(TypeError, match="does not match"):
        f(np.ones((3, 2), np.float64))
    with pytest.raises(TypeError, match="1 arguments"):
        f(np.ones((3, 2), np.float32), 1)
    with pytest.raises(TypeError, match="shape and a dtype"):
        gs.function(lambda x: x, input_signature=[3])


def test_methods_get_a_function_and_a_trace_cache_per_instance():
    class Model:
        def __init__(self, k):
            self.k = k

        @gs.function
        def __call__(self, x):
            return x * self.k
    a, b = Model(2), Model(3)
    assert a(np.ones(2))[0] == 2 and b(np.ones(2))[0] == 3
    a(np.ones(2))
    assert type(a).__call__.__get__(a).experimental_get_tracing_count() == 1
    assert Model.__call__.__get__(a) is Model.__call__.__get__(a)


def test_capture_true_on_cpu_devices_or_without_a_strategy_is_refused():
    assert gs.function.CaptureError is CaptureError
    f = gs.function(lambda x: x + 1, capture=True)
    f(1)
    f(1)
    with pytest.raises(CaptureError, match="0 strategies"):
        f(1)
    s = gs.MirroredStrategy(["cpu:0"])
    try:
        g = gs.function(lambda v: s.run(lambda u: u + 1, args=(v,)), capture=True,
                        warmup_steps=1)
        g(np.ones(2))
        with pytest.raises(CaptureError, match="CPU devices"):
            g(np.ones(2))
    finally:
        s.close()


def test_the_readme_port_keeps_its_decorator():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        with s.scope():
            w = gs.Variable(np.zeros(2, np.float32))
            opt = gs.optimizers.SGD(0.1, momentum=0.9)

        def train_step(x):
            opt.apply_gradients([(x.sum(axis=0), w)])
            return x.sum()

        @gs.function
        def distributed_train_step(inputs):
            per_replica = s.run(train_step, args=(inputs,))
            return s.reduce(gs.ReduceOp.SUM, per_replica, axis=None)
        ds = gs.data.Dataset.from_tensor_slices(np.ones((8, 2), np.float32)).batch(4)
        losses = [float(distributed_train_step(b)) for b in s.experimental_distribute_dataset(ds)]
        assert losses == [8.0, 8.0]
        np.testing.assert_allclose(w.numpy(), [-0.4 - 0.4 * 1.9] * 2, rtol=1e-6)
    finally:
        s.close()


def test_a_decorated_replica_function_runs_in_every_replica_and_meets_in_collectives():
    s = gs.MirroredStrategy(["cpu:0", "cpu:1"])
    try:
        @gs.function
        def replica_fn(v):
            return gs.get_replica_context().all_reduce("sum", v)
        for _ in range(4):
            x = s.experimental_distribute_values_from_function(
                lambda ctx: np.full(2, 1.0 + ctx.replica_id_in_sync_group) * 100)
            out = s.run(replica_fn, args=(x,))
            assert [list(c) for c in s.experimental_local_results(out)] == [[300.0] * 2] * 2
    finally:
        s.close()
