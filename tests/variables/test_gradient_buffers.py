"""``Optimizer.gradient_buffers``: gradients written into views of the fusion buffer are
reduced in place (no packing), give the same weights as gradient arrays, hold the summed
gradient after the step, and a gradient kept across steps is never overwritten."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs
from gpustrat.collectives import fusion
from training_cases import OPTIMIZERS, reference, train

RTOL, ATOL = 2e-5, 2e-6


@pytest.mark.parametrize("which", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 2, 3])
def test_buffers_train_to_the_numpy_weights(which, n):
    strategy = gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    try:
        ws, bs, iterations = train(strategy, which, buffers=True)
    finally:
        strategy.close()
    w_ref, b_ref, steps = reference(which)
    assert iterations == steps
    tol = dict(rtol=2e-2, atol=2e-3) if which.endswith("float16") else \
        dict(rtol=RTOL, atol=ATOL)
    for c in ws:
        np.testing.assert_allclose(c, w_ref, err_msg=f"{which}, {n} replicas", **tol)
    for c in bs:
        np.testing.assert_allclose(c, b_ref, err_msg=f"{which}, {n} replicas", **tol)


def _model(strategy, shapes=((3,), (2, 2)), dtypes=(np.float32, np.float32), lr=1.0,
           **kw):
    with strategy.scope():
        vs = [gs.Variable(np.zeros(s, d), name=f"v{j}")
              for j, (s, d) in enumerate(zip(shapes, dtypes))]
        opt = gs.optimizers.SGD(lr, **kw)
    return vs, opt


def _fill(bufs, replica):
    for j, b in enumerate(bufs):
        b[...] = (replica + 1) * (j + 1)


def test_buffers_are_views_of_one_buffer_handed_out_again_each_step(two):
    vs, opt = _model(two)
    seen = {0: [], 1: []}

    def step():
        r = gs.get_replica_context().replica_id_in_sync_group
        bufs = opt.gradient_buffers(vs)
        _fill(bufs, r)
        opt.apply_gradients(zip(bufs, vs))
        seen[r].append(([id(b) for b in bufs], bufs[0].base is None, id(bufs[0].base),
                        [(b.shape, b.dtype) for b in bufs]))

    for _ in range(5):
        two.run(step)
    for r in range(2):
        assert seen[r][0][1]           # the first step (which makes the plan): arrays
        warm = seen[r][1:]
        assert len({tuple(ids) for ids, _, _, _ in warm}) == 1
        assert len({base for _, _, base, _ in warm}) == 1 and not warm[0][1]
        assert warm[0][3] == [((3,), np.dtype(np.float32)), ((2, 2), np.dtype(np.float32))]
    assert seen[0][1][2] != seen[1][1][2]   # one buffer per replica
    # SGD(1.0) of the summed gradients (1 + 2) * (j + 1) over 5 steps.
    for j, v in enumerate(vs):
        for c in two.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -15.0 * (j + 1))


def test_the_step_packs_nothing_from_buffers(two, monkeypatch):
    vs, opt = _model(two)
    packed = []
    real = fusion._pack_host
    monkeypatch.setattr(fusion, "_pack_host", lambda t, out: packed.append(1) or real(t, out))

    def step(use_buffers):
        bufs = opt.gradient_buffers(vs) if use_buffers else \
            [np.empty(v.shape, np.float32) for v in vs]
        _fill(bufs, 0)
        opt.apply_gradients(zip(bufs, vs))

    two.run(step, args=(True,))    # the first step makes the plan
    packed.clear()
    for _ in range(3):
        two.run(step, args=(True,))
    assert packed == []
    two.run(step, args=(False,))
    assert packed == [1, 1]        # gradient arrays: one packing per replica


def test_after_the_step_the_buffers_hold_the_summed_gradient(two):
    vs, opt = _model(two)
    after = {}

    def step():
        r = gs.get_replica_context().replica_id_in_sync_group
        bufs = opt.gradient_buffers(vs)
        _fill(bufs, r)
        opt.apply_gradients(zip(bufs, vs))
        after[r] = [b.copy() for b in bufs]

    two.run(step)
    two.run(step)
    for r in range(2):
        for j, b in enumerate(after[r]):
            np.testing.assert_array_equal(b, 3.0 * (j + 1))


@pytest.mark.parametrize("keep", ["array", "view", "list"])
def test_a_gradient_kept_across_steps_is_never_overwritten(two, keep):
    vs, opt = _model(two)
    kept, bases = [], []

    def step(k):
        r = gs.get_replica_context().replica_id_in_sync_group
        bufs = opt.gradient_buffers(vs)
        for b in bufs:
            b[...] = 10 * k + r
        opt.apply_gradients(zip(bufs, vs))
        if r == 0:
            bases.append(id(bufs[0].base))
            if k == 2:
                kept.append({"array": bufs[0], "view": bufs[0][:2], "list": bufs}[keep])

    for k in range(1, 6):
        two.run(step, args=(k,))
    held = np.asarray(kept[0] if keep != "list" else kept[0][0])
    np.testing.assert_array_equal(held, 41.0)       # step 2's sum: 20 + 21
    # Step 3 made new buffers (step 2's are held); from then on they are reused.
    assert bases[1] != bases[2] and bases[2] == bases[3] == bases[4]
    expected = -sum(20 * k + 1 for k in range(1, 6))
    for v in vs:
        for c in two.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), expected)
    kept.clear()
    two.run(step, args=(6,))
    assert bases[5] == bases[4]


def test_skip_gradients_aggregation_takes_the_buffers_as_summed(two):
    vs, opt = _model(two)
    after = []

    def step():
        bufs = opt.gradient_buffers(vs)
        for b in bufs:
            b[...] = 2.0          # already summed: every replica passes the same
        opt.apply_gradients(zip(bufs, vs), skip_gradients_aggregation=True)
        after.append(float(bufs[0].reshape(-1)[0]))

    for _ in range(3):
        two.run(step)
    assert after == [2.0] * 6
    for v in vs:
        for c in two.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -6.0)


def test_several_dtypes_hand_out_new_arrays_each_call(two):
    vs, opt = _model(two, dtypes=(np.float32, np.float64))
    seen = []

    def step():
        r = gs.get_replica_context().replica_id_in_sync_group
        bufs = opt.gradient_buffers(vs)
        _fill(bufs, r)
        opt.apply_gradients(zip(bufs, vs))
        if r == 0:
            seen.append([(b.base is None, b.dtype) for b in bufs])

    two.run(step)
    two.run(step)
    assert seen[1] == [(True, np.dtype(np.float32)), (True, np.dtype(np.float64))]
    for j, v in enumerate(vs):
        for c in two.experimental_local_results(v):
            np.testing.assert_array_equal(np.asarray(c), -6.0 * (j + 1))


def test_buffers_passed_for_other_variables_are_ordinary_gradients(two):
    vs, opt = _model(two, shapes=((3,), (3,)))

    def step(swap):
        bufs = opt.gradient_buffers(vs)
        _fill(bufs, 0)                           # 1 for v0, 2 for v1
        opt.apply_gradients(zip(bufs, vs[::-1] if swap else vs))

    two.run(step, args=(False,))
    two.run(step, args=(True,))                  # v1 gets 1 + 1, v0 gets 2 + 2
    np.testing.assert_array_equal(np.asarray(vs[0]), -2.0 - 4.0)
    np.testing.assert_array_equal(np.asarray(vs[1]), -4.0 - 2.0)


def test_cross_replica_buffers_are_the_first_replicas_and_apply_as_given():
    strategy = gs.MirroredStrategy(["cpu:0"])
    try:
        vs, opt = _model(strategy, momentum=0.5)
        for k in range(3):
            with strategy.scope():
                bufs = opt.gradient_buffers(vs)
                _fill(bufs, 0)
                opt.apply_gradients(zip(bufs, vs))
        # momentum 0.5: m = -1, -1.5, -1.75 times the gradient; w = their sum.
        for j, v in enumerate(vs):
            np.testing.assert_allclose(np.asarray(v), -4.25 * (j + 1))
    finally:
        strategy.close()


def test_bad_variables_are_refused(two):
    vs, opt = _model(two)
    with pytest.raises(TypeError, match="no variables"):
        opt.gradient_buffers([])
    with pytest.raises(TypeError, match="gs.Variable"):
        opt.gradient_buffers([np.zeros(3, np.float32)])


def test_buffers_of_another_strategys_variables_are_refused(two, three):
    vs, opt = _model(two)

    def step():
        bufs = opt.gradient_buffers(vs)
        _fill(bufs, 0)
        opt.apply_gradients(zip(bufs, vs))

    two.run(step)
    with pytest.raises(ValueError, match="belong to"):
        three.run(lambda: opt.gradient_buffers(vs))
