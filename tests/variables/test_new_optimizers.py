"""Lion, Ftrl, Lamb and Adafactor against Keras 3's own cases (keras/src/optimizers/
{lion,ftrl,lamb,adafactor}_test.py: each test names the Keras test its values come
from), without a strategy and on 2 replicas (each replica given half the gradient, so
that their sum is Keras's)."""

from __future__ import annotations

import numpy as np
import pytest

import gpustrat as gs

O = gs.optimizers


def run(n, make, init, grads_list, dtype=np.float32):
    """``init`` trained with each gradient of ``grads_list`` in turn; the values after
    each step (every replica's equal)."""
    s = None if n == 1 else gs.MirroredStrategy([f"cpu:{i}" for i in range(n)])
    scope = s.scope() if s is not None else _Nothing()
    with scope:
        v = gs.Variable(np.asarray(init, dtype))
        opt = make()
    out = []
    for g in grads_list:
        g = np.asarray(g, dtype) / n
        if s is None:
            opt.apply_gradients([(g, v)])
        else:
            s.run(lambda: opt.apply_gradients([(g, v)]))
            comps = [c.numpy() for c in s.experimental_local_results(v)]
            assert all(np.array_equal(c, comps[0]) for c in comps)
        out.append(np.asarray(v.numpy()))
    if s is not None:
        s.close()
    return out, opt


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


SINGLE = [
    ("LionTest.test_single_step", lambda: O.Lion(learning_rate=0.5), [1.0, 2.0, 3.0, 4.0],
     [0.5, 1.5, 2.5, 3.5]),
    ("FtrlTest.test_single_step", lambda: O.Ftrl(learning_rate=0.5), [1.0, 2.0, 3.0, 4.0],
     [0.2218, 1.3954, 2.3651, 2.8814]),
    ("LambTest.test_single_step", lambda: O.Lamb(learning_rate=0.5), [1.0, 2.0, 3.0, 4.0],
     [-0.3693, 0.6306, 1.6306, 2.6306]),
    ("AdafactorTest.test_single_step_1d", lambda: O.Adafactor(learning_rate=0.5),
     [1.0, 2.0, 3.0, 4.0], [-0.3693, 0.6307, 1.6307, 2.6307]),
    ("AdafactorTest.test_single_step_2d", lambda: O.Adafactor(learning_rate=0.5),
     [[1.0, 2.0], [3.0, 4.0]], [[0.7007, -0.0081], [1.2492, 3.4407]]),
]
GRADS = {"1d": [1.0, 6.0, 7.0, 2.0], "2d": [[1.0, 6.0], [7.0, 2.0]]}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", SINGLE, ids=[c[0] for c in SINGLE])
def test_single_step(case, n):
    _, make, init, want = case
    grads = GRADS["2d"] if np.ndim(init) == 2 else GRADS["1d"]
    got, _ = run(n, make, init, [grads])
    np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)


GOLDEN = [
    ("LionTest.test_correctness_with_golden", O.Lion,
     np.tile([[0.999], [0.998], [0.997], [0.996], [0.995]], (1, 10))),
    ("FtrlTest.test_correctness_with_golden", lambda: O.Ftrl(
        learning_rate=0.05, learning_rate_power=-0.2, initial_accumulator_value=0.4,
        l1_regularization_strength=0.05, l2_regularization_strength=0.15,
        l2_shrinkage_regularization_strength=0.01, beta=0.3),
     np.array([[0.0] * 10,
               [-0.0034, -0.0077, -0.0118, -0.0157, -0.0194, -0.023, -0.0263, -0.0294,
                -0.0325, -0.0354],
               [-0.0078, -0.0162, -0.0242, -0.0317, -0.0387, -0.0454, -0.0516, -0.0575,
                -0.0631, -0.0685],
               [-0.0121, -0.0246, -0.0363, -0.0472, -0.0573, -0.0668, -0.0757, -0.0842,
                -0.0922, -0.0999],
               [-0.0164, -0.0328, -0.0481, -0.0623, -0.0753, -0.0875, -0.099, -0.1098,
                -0.1201, -0.1299]])),
    ("LambTest.test_correctness_with_golden", O.Lamb,
     np.tile([[0.999], [0.9982], [0.9974], [0.9965], [0.9955]], (1, 10))),
    ("AdafactorTest.test_correctness_with_golden", lambda: O.Adafactor(
        learning_rate=0.5, beta_2_decay=-0.65, epsilon_1=1e-15, epsilon_2=1e-4,
        clip_threshold=0.9, relative_step=False),
     np.array([[0.55] * 10,
               [0.3031, 0.3026, 0.3025, 0.3024, 0.3024, 0.3024, 0.3024, 0.3024, 0.3024,
                0.3024],
               [0.1671, 0.1665, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663,
                0.1663],
               [0.0923, 0.0916, 0.0915, 0.0914, 0.0914, 0.0914, 0.0914, 0.0914, 0.0914,
                0.0914],
               [0.0554, 0.0548, 0.0546, 0.0546, 0.0546, 0.0546, 0.0546, 0.0545, 0.0545,
                0.0545]])),
]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("case", GOLDEN, ids=[c[0] for c in GOLDEN])
def test_correctness_with_golden(case, n):
    _, make, golden = case
    grads = [np.full(10, 0.01)] + [np.arange(0.1, 1.1, 0.1)] * 4
    got, _ = run(n, make, np.ones(10), grads, dtype=np.float64)
    for i in range(5):
        np.testing.assert_allclose(got[i], golden[i], rtol=5e-4, atol=5e-4)


@pytest.mark.parametrize("name", ["Lion", "Lamb", "Adafactor"])
def test_weight_decay(name):                    # *Test.test_weight_decay
    cls = getattr(O, name)
    v1 = gs.Variable(np.float32(2.0), name="v1")
    v2 = gs.Variable(np.float32(2.0), name="exclude")
    cls(learning_rate=1.0, weight_decay=0.004).apply_gradients([(np.float32(0), v1)])
    opt = cls(learning_rate=1.0, weight_decay=0.004, exclude_from_weight_decay=["exclude"])
    opt.apply_gradients([(np.float32(0), v1), (np.float32(0), v2)])
    # Keras's third optimizer excludes a variable by object; here by its name.
    v3 = gs.Variable(np.float32(2.0), name="v3")
    cls(learning_rate=1.0, weight_decay=0.004, exclude_from_weight_decay=["v3"]
        ).apply_gradients([(np.float32(0), v1), (np.float32(0), v3)])
    assert float(v3.numpy()) == pytest.approx(2.0, abs=1e-6)
    assert float(v1.numpy()) == pytest.approx(1.9760959, abs=1e-6)
    assert float(v2.numpy()) == pytest.approx(2.0, abs=1e-6)


def test_slots_configs_and_arguments():
    # *Test.test_config (serialization), FtrlTest.test_invalid_*, LionTest's beta_1.
    assert O.Lion().slot_names == ("momentum",)
    assert O.Ftrl().slot_names == ("accumulator", "linear")
    assert O.Lamb().slot_names == ("momentum", "velocity")
    ada = O.Adafactor(learning_rate=0.5, beta_2_decay=-0.65, epsilon_1=1e-15,
                      epsilon_2=1e-4, clip_threshold=0.9, relative_step=False)
    w = gs.Variable(np.ones((3, 4, 5), np.float32), name="w")
    ada.apply_gradients([(np.ones((3, 4, 5), np.float32), w)])
    assert [ada.get_slot(w, s).shape for s in ("r", "c", "velocity")] == \
        [(3, 4), (3, 5), (3, 4, 5)]
    for opt in (O.Lion(0.01, beta_2=0.95), O.Ftrl(0.02, beta=0.1), O.Lamb(epsilon=1e-6),
                ada):
        config = opt.get_config()
        assert type(opt).from_config(config).get_config() == config
    for arg, bad, message in (
            ("initial_accumulator_value", -0.1, "`initial_accumulator_value` needs to be "
                                                "positive or zero"),
            ("learning_rate_power", 0.1, "`learning_rate_power` needs to be negative"),
            ("l1_regularization_strength", -0.1, "`l1_regularization_strength` needs"),
            ("l2_regularization_strength", -0.1, "`l2_regularization_strength` needs"),
            ("l2_shrinkage_regularization_strength", -0.1, "`l2_shrinkage_regularization")):
        with pytest.raises(ValueError, match=message):
            O.Ftrl(**{arg: bad})
    with pytest.raises(ValueError, match="degenerates to SignSGD"):
        O.Lion(beta_1=0.0)


def test_adafactor_slots_are_checkpointed(tmp_path):
    w = gs.Variable(np.ones((2, 3), np.float32), name="w")
    opt = O.Adafactor(0.1)
    opt.apply_gradients([(np.arange(6, dtype=np.float32).reshape(2, 3), w)])
    path = gs.train.Checkpoint(w=w, opt=opt).write(str(tmp_path / "c"))
    w2 = gs.Variable(np.ones((2, 3), np.float32), name="w")
    opt2 = O.Adafactor(0.1)
    gs.train.Checkpoint(w=w2, opt=opt2).restore(path)
    for o, v in ((opt, w), (opt2, w2)):
        o.apply_gradients([(np.full((2, 3), 0.5, np.float32), v)])
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
