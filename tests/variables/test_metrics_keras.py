"""The metrics against Keras 3's own cases (keras/src/metrics/accuracy_metrics_test.py
and confusion_metrics_test.py; each test names the Keras test its values come from),
plain, on 2 replicas (each replica updating with its half of the batch: the result is
the whole batch's) and in checkpoints; and the custom-metric subclassing API."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gpustrat as gs

M = gs.metrics


def on_two(two, make, y_true, y_pred, sample_weight=None):
    """``make()``'s result after each of 2 replicas updated with its half of the rows
    (an odd row count: the first replica takes one more)."""
    with two.scope():
        m = make()
    y_true, y_pred = np.asarray(y_true), np.asarray(y_pred)
    half = (len(y_pred) + 1) // 2

    def piece(x):
        if x is None:
            return None
        x = np.asarray(x)
        if x.ndim == 0 or len(x) != len(y_pred):
            return [x, x]
        return [x[:half], x[half:]]
    parts = [piece(y_true), piece(y_pred), piece(sample_weight)]
    values = two.experimental_distribute_values_from_function

    def fn(t, p, w=None):
        m.update_state(t, p, sample_weight=w)
    args = [values(lambda c, x=x: x[c.replica_id_in_sync_group]) for x in parts
            if x is not None]
    two.run(fn, args=tuple(args))
    return m.result()


def check(two, make, y_true, y_pred, want, sample_weight=None, rtol=1e-3, atol=1e-3):
    """Plain and on 2 replicas, ``make()`` on the batch gives ``want``."""
    m = make()
    m.update_state(y_true, y_pred, sample_weight=sample_weight)
    np.testing.assert_allclose(m.result(), want, rtol=rtol, atol=atol)
    np.testing.assert_allclose(on_two(two, make, y_true, y_pred, sample_weight), want,
                               rtol=rtol, atol=atol)


# --- accuracy_metrics_test.py ------------------------------------------------------------------

ACCURACY = [
    # (Keras test, metric, y_true, y_pred, sample_weight, result)
    ("AccuracyTest.test_unweighted", M.Accuracy, [[1], [2], [3], [4]], [[0], [2], [3], [4]],
     None, 0.75),
    ("AccuracyTest.test_weighted", M.Accuracy, [[1], [2], [3], [4]], [[0], [2], [3], [4]],
     [1, 1, 0, 0], 0.5),
    ("AccuracyTest.test_weighted_rank_1", M.Accuracy, [1, 2, 3, 4], [0, 2, 3, 4],
     [1, 1, 0, 0], 0.5),
    ("AccuracyTest.test_weighted_nd_weights", M.Accuracy, [[1, 2], [3, 4]],
     [[0, 2], [3, 4]], [[1, 0], [0, 1]], 0.5),
    ("BinaryAccuracyTest.test_unweighted", M.BinaryAccuracy, [[1], [1], [0], [0]],
     [[0.98], [1], [0], [0.6]], None, 0.75),
    ("BinaryAccuracyTest.test_unweighted (broadcasting)", M.BinaryAccuracy, [1, 1, 0, 0],
     [[0.98], [1], [0], [0.6]], None, 0.75),
    ("BinaryAccuracyTest.test_weighted", M.BinaryAccuracy, [[1], [1], [0], [0]],
     [[0.98], [1], [0], [0.6]], [1, 0, 0, 1], 0.5),
    ("BinaryAccuracyTest.test_weighted_rank_1", M.BinaryAccuracy, [1, 1, 0, 0],
     [0.98, 1, 0, 0.6], [1, 0, 0, 1], 0.5),
    ("BinaryAccuracyTest.test_weighted_nd_weights", M.BinaryAccuracy, [[1, 1], [0, 0]],
     [[0.98, 1], [0, 0.6]], [[1, 0], [0, 1]], 0.5),
    ("CategoricalAccuracyTest.test_unweighted", M.CategoricalAccuracy,
     [[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]], None, 0.5),
    ("CategoricalAccuracyTest.test_weighted", M.CategoricalAccuracy,
     [[0, 0, 1], [0, 1, 0]], [[0.1, 0.9, 0.8], [0.05, 0.95, 0]], [0.7, 0.3], 0.3),
    ("SparseCategoricalAccuracyTest.test_unweighted", M.SparseCategoricalAccuracy,
     [[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]], None, 0.5),
    ("SparseCategoricalAccuracyTest.test_weighted", M.SparseCategoricalAccuracy,
     [[2], [1]], [[0.1, 0.6, 0.3], [0.05, 0.95, 0]], [0.7, 0.3], 0.3),
    ("SparseCategoricalAccuracyTest.test_squeeze_y_true", M.SparseCategoricalAccuracy,
     [[0], [1], [2]], [[0.9, 0.05, 0.05], [0.05, 0.9, 0.05], [0.05, 0.05, 0.9]], None,
     1.0),
    ("SparseCategoricalAccuracyTest.test_cast_y_pred_dtype", M.SparseCategoricalAccuracy,
     np.array([0, 1], np.int64), np.array([[0.9, 0.1], [0.1, 0.9]], np.float32), None,
     1.0),
    ("SparseCategoricalAccuracyTest.test_cast_y_pred_to_match_y_true_dtype",
     M.SparseCategoricalAccuracy, np.array([0, 1, 2], np.int32),
     np.array([[0.9, 0.1, 0.0], [0.0, 0.9, 0.1], [0.1, 0.0, 0.9]]), None, 1.0),
    ("SparseCategoricalAccuracyTest.test_reshape_matches_to_original_y_true_shape",
     M.SparseCategoricalAccuracy, [[0], [1]], [[0.9, 0.1], [0.1, 0.9]], None, 1.0),
    ("SparseCategoricalAccuracyTest.test_matching_shapes_without_squeeze",
     M.SparseCategoricalAccuracy, np.array([2, 1, 0], np.int32),
     np.array([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]], np.float32), None, 1.0),
    ("TopKCategoricalAccuracyTest.test_unweighted", lambda: M.TopKCategoricalAccuracy(k=1),
     [[0, 0, 1], [0, 1, 0]], np.array([[0.1, 0.9, 0.8], [0.05, 0.95, 0]], np.float32),
     None, 0.5),
    ("TopKCategoricalAccuracyTest.test_weighted", lambda: M.TopKCategoricalAccuracy(k=1),
     [[0, 0, 1], [0, 1, 0]], np.array([[0.1, 0.9, 0.8], [0.05, 0.95, 0]], np.float32),
     [0.7, 0.3], 0.3),
    ("SparseTopKCategoricalAccuracyTest.test_unweighted",
     lambda: M.SparseTopKCategoricalAccuracy(k=1), [2, 1],
     np.array([[0.1, 0.9, 0.8], [0.05, 0.95, 0]], np.float32), None, 0.5),
    ("SparseTopKCategoricalAccuracyTest.test_weighted",
     lambda: M.SparseTopKCategoricalAccuracy(k=1), [2, 1],
     np.array([[0.1, 0.9, 0.8], [0.05, 0.95, 0]], np.float32), [0.7, 0.3], 0.3),
    ("SparseTopKCategoricalAccuracyTest.test_sparse_top_k_from_sorted_ids_unweighted",
     lambda: M.SparseTopKCategoricalAccuracy(k=1, from_sorted_ids=True), [2, 1],
     np.array([[1, 0, 3], [1, 2, 3]]), None, 0.5),
]


@pytest.mark.parametrize("case", ACCURACY, ids=[c[0] for c in ACCURACY])
def test_accuracy_cases(two, case):
    _, make, y_true, y_pred, weight, want = case
    check(two, make, np.asarray(y_true), np.asarray(y_pred), want,
          None if weight is None else np.asarray(weight))


def test_accuracy_broadcast_weights():   # Accuracy/BinaryAccuracy .test_weighted_nd_broadcast
    for make, y_pred, want in ((M.Accuracy, [[0, 2], [3, 4]], 0.5),
                               (M.BinaryAccuracy, [[0.98, 1], [0, 0.6]], 1.0)):
        m = make()
        y_true = [[1, 2], [3, 4]] if make is M.Accuracy else [[1, 1], [0, 0]]
        m.update_state(np.array(y_true), np.array(y_pred), sample_weight=np.array([[1, 0]]))
        np.testing.assert_allclose(m.result(), want, atol=1e-3)


def test_binary_accuracy_threshold():     # BinaryAccuracyTest.test_threshold
    y_true, y_pred = np.array([[1], [1], [0], [0]]), np.array([[0.98], [0.5], [0.1], [0.2]])
    for threshold, want in ((0.3, 1.0), (0.9, 0.75)):
        m = M.BinaryAccuracy(threshold=threshold)
        m.update_state(y_true, y_pred)
        assert float(m.result()) == pytest.approx(want)


@pytest.mark.parametrize("make, config", [
    (M.Accuracy, {"name": "accuracy", "dtype": "float32"}),
    (M.BinaryAccuracy, {"name": "binary_accuracy", "dtype": "float32", "threshold": 0.5}),
    (M.CategoricalAccuracy, {"name": "categorical_accuracy", "dtype": "float32"}),
    (M.SparseCategoricalAccuracy, {"name": "sparse_categorical_accuracy",
                                   "dtype": "float32"}),
    (lambda: M.TopKCategoricalAccuracy(k=1), {"name": "top_k_categorical_accuracy",
                                              "dtype": "float32", "k": 1}),
    (lambda: M.SparseTopKCategoricalAccuracy(k=1), {
        "name": "sparse_top_k_categorical_accuracy", "dtype": "float32", "k": 1}),
])
def test_accuracy_config(make, config):   # every *Test.test_config
    m = make()
    assert m.get_config() == config and len(m.variables) == 2
    again = type(m).from_config(m.get_config())
    assert again.get_config() == config and len(again.variables) == 2


# --- confusion_metrics_test.py: Precision and Recall ---------------------------------------

PRECISION_RECALL = [
    ("PrecisionTest.test_unweighted", M.Precision, [0, 1, 1, 0], [1, 0, 1, 0], None, 0.5),
    ("PrecisionTest.test_weighted", M.Precision, [[0, 1, 1, 0], [1, 0, 0, 1]],
     [[1, 0, 1, 0], [1, 0, 1, 0]], [[1, 2, 3, 4], [4, 3, 2, 1]], 7 / 10),
    ("PrecisionTest.test_div_by_zero", M.Precision, [0, 0, 0, 0], [0, 0, 0, 0], None, 0.0),
    ("PrecisionTest.test_unweighted_with_threshold",
     lambda: M.Precision(thresholds=[0.5, 0.7]), [0, 1, 1, 0], [1, 0, 0.6, 0], None,
     [0.5, 0.0]),
    ("PrecisionTest.test_weighted_with_threshold",
     lambda: M.Precision(thresholds=[0.5, 1.0]), [[0, 1], [1, 0]],
     np.array([[1, 0], [0.6, 0]], np.float32), [[4, 0], [3, 1]], [3 / 7, 0]),
    ("PrecisionTest.test_unweighted_top_k", lambda: M.Precision(top_k=3), [[0, 1, 1, 0, 0]],
     [[0.2, 0.1, 0.5, 0, 0.2]], None, 1 / 3),
    ("PrecisionTest.test_unweighted_class_id_multiclass", lambda: M.Precision(class_id=1),
     [[0, 0, 1], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1.0]],
     [[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8]],
     None, 1.0),
    ("PrecisionTest.test_unweighted_top_k_and_threshold",
     lambda: M.Precision(thresholds=0.7, top_k=2), [[0, 1, 1, 0, 1]],
     [[0.2, 0.8, 0.6, 0, 0.2]], None, 1.0),
    ("RecallTest.test_unweighted", M.Recall, [0, 1, 1, 0], [1, 0, 1, 0], None, 0.5),
    ("RecallTest.test_weighted", M.Recall, [[0, 1, 1, 0], [1, 0, 0, 1]],
     [[1, 0, 1, 0], [0, 1, 0, 1]], [[1, 2, 3, 4], [4, 3, 2, 1]], 4 / 10),
    ("RecallTest.test_div_by_zero", M.Recall, [0, 0, 0, 0], [0, 0, 0, 0], None, 0.0),
    ("RecallTest.test_unweighted_with_threshold", lambda: M.Recall(thresholds=[0.5, 0.7]),
     [0, 1, 1, 0], [1, 0, 0.6, 0], None, [0.5, 0.0]),
    ("RecallTest.test_weighted_with_threshold", lambda: M.Recall(thresholds=[0.5, 1.0]),
     [[0, 1], [1, 0]], np.array([[1, 0], [0.6, 0]], np.float32), [[1, 4], [3, 2]],
     [3 / 7, 0]),
    ("RecallTest.test_unweighted_top_k", lambda: M.Recall(top_k=3), [[0, 1, 1, 0, 0]],
     [[0.2, 0.1, 0.5, 0, 0.2]], None, 0.5),
    ("RecallTest.test_unweighted_class_id_multiclass", lambda: M.Recall(class_id=1),
     [[0, 0, 1], [1, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 1.0]],
     [[0.1, 0.2, 0.7], [0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.7, 0.2, 0.1], [0.1, 0.1, 0.8]],
     None, 1.0),
    ("RecallTest.test_unweighted_top_k_and_threshold",
     lambda: M.Recall(thresholds=0.7, top_k=2), [[1, 1, 1, 0, 1]],
     [[0.2, 0.8, 0.6, 0, 0.2]], None, 0.25),
]


@pytest.mark.parametrize("case", PRECISION_RECALL, ids=[c[0] for c in PRECISION_RECALL])
def test_precision_recall_cases(two, case):
    _, make, y_true, y_pred, weight, want = case
    check(two, make, np.asarray(y_true), np.asarray(y_pred), want,
          None if weight is None else np.asarray(weight))


def test_precision_recall_1d_top_k_and_weights():
    # PrecisionTest/RecallTest.test_unweighted_top_k on 1-d scores, .test_weighted_top_k
    # and .test_multiple_updates.
    for make, want in ((lambda: M.Precision(top_k=3), 1 / 3),
                       (lambda: M.Recall(top_k=3), 0.5)):
        m = make()
        assert float(m(np.array([0, 1, 1, 0, 0]), np.array([0.2, 0.1, 0.5, 0, 0.2]))) == \
            pytest.approx(want)
    for make, want in ((lambda: M.Precision(top_k=3), 13 / 17),
                       (lambda: M.Recall(top_k=3), 13 / 23)):
        m = make()
        m(np.array([[0, 1, 1, 0, 1]]), np.array([[0.2, 0.1, 0.4, 0, 0.2]]),
          sample_weight=np.array([[1, 4, 2, 3, 5]]))
        got = m(np.array([1, 0, 1, 1, 1]), np.array([0.2, 0.6, 0.4, 0.2, 0.2]),
                sample_weight=np.array(3))
        assert float(got) == pytest.approx(want)
    for make, weights in ((lambda: M.Precision(thresholds=[0.5, 1.0]), [[4, 0], [3, 1]]),
                          (lambda: M.Recall(thresholds=[0.5, 1.0]), [[1, 4], [3, 2]])):
        m = make()
        for _ in range(2):
            m.update_state(np.array([[0, 1], [1, 0]]),
                           np.array([[1, 0], [0.6, 0]], np.float32),
                           sample_weight=np.array(weights, np.float32))
        np.testing.assert_allclose(m.result(), [6 / 14, 0], atol=1e-6)


def test_precision_recall_state_and_errors():
    # PrecisionTest.test_config, .test_unweighted_class_id_should_throw_error_1d, and
    # the counts of .test_unweighted_top_k_and_threshold.
    p = M.Precision(name="my_precision", thresholds=[0.4, 0.9], top_k=15, class_id=12)
    assert [v.name for v in p.variables] == ["my_precision/true_positives",
                                             "my_precision/false_positives"]
    assert (p.thresholds, p.top_k, p.class_id) == ([0.4, 0.9], 15, 12)
    again = M.Precision.from_config(p.get_config())
    assert (again.name, again.thresholds, again.top_k, again.class_id) == \
        ("my_precision", [0.4, 0.9], 15, 12)
    with pytest.raises(ValueError, match=r"When class_id is provided, y_pred must be a 2D "
                                         r"array with shape \(num_samples, num_classes\)"):
        M.Recall(class_id=2)(np.array([0, 1, 1, 0, 0]), np.array([0.2, 0.1, 0.6, 0, 0.2]))
    r = M.Recall(thresholds=0.7, top_k=2)
    r(np.array([1, 1, 1, 0, 1]), np.array([0.2, 0.8, 0.6, 0, 0.2]))
    assert float(r.true_positives.numpy()[0]) == 1 and \
        float(r.false_negatives.numpy()[0]) == 3
    with pytest.raises(ValueError, match=r"threshold values must be in \[0, 1\]"):
        M.Precision(thresholds=[0.5, 1.5])


# --- confusion_metrics_test.py: AUCTest and MultiAUCTest -----------------------------------

Y_PRED = np.array([0, 0.5, 0.3, 0.9], np.float32)
Y_TRUE = np.array([0, 0, 1, 1])
WEIGHT = np.array([1, 2, 3, 4])
LOGITS = -np.log(1.0 / (Y_PRED + 1e-12) - 1.0)

AUC_CASES = [
    ("AUCTest.test_unweighted", dict(num_thresholds=3), Y_PRED, None, 0.75),
    ("AUCTest.test_unweighted_from_logits", dict(num_thresholds=3, from_logits=True),
     LOGITS, None, 0.75),
    ("AUCTest.test_manual_thresholds", dict(num_thresholds=2, thresholds=[0.5]), Y_PRED,
     None, 0.75),
    ("AUCTest.test_weighted_roc_interpolation", dict(num_thresholds=3), Y_PRED, WEIGHT,
     0.7855),
    ("AUCTest.test_weighted_roc_majoring", dict(num_thresholds=3,
                                                summation_method="majoring"),
     Y_PRED, WEIGHT, 1.0),
    ("AUCTest.test_weighted_roc_minoring", dict(num_thresholds=3,
                                                summation_method="minoring"),
     Y_PRED, WEIGHT, 0.571),
    ("AUCTest.test_weighted_pr_majoring", dict(num_thresholds=3, curve="PR",
                                               summation_method="majoring"),
     Y_PRED, WEIGHT, 0.429 + 0.571),
    ("AUCTest.test_weighted_pr_minoring", dict(num_thresholds=3, curve="PR",
                                               summation_method="minoring"),
     Y_PRED, WEIGHT, 0.7 * 0.429),
    ("AUCTest.test_weighted_pr_interpolation", dict(num_thresholds=3, curve="PR"), Y_PRED,
     WEIGHT, 2.416 / 7 + 4 / 7),
    ("AUCTest.test_weighted_pr_interpolation_negative_weights",
     dict(num_thresholds=3, curve="PR"), Y_PRED, -WEIGHT, 0.0),
    ("AUCTest.test_weighted_prgain_majoring", dict(num_thresholds=3, curve="PRGAIN",
                                                   summation_method="majoring"),
     Y_PRED, WEIGHT, 1.0),
    ("AUCTest.test_weighted_prgain_minoring", dict(num_thresholds=3, curve="PRGAIN",
                                                   summation_method="minoring"),
     Y_PRED, WEIGHT, 0.0),
    ("AUCTest.test_weighted_prgain_interpolation", dict(num_thresholds=3, curve="PRGAIN"),
     Y_PRED, WEIGHT, 0.5),
]


@pytest.mark.parametrize("case", AUC_CASES, ids=[c[0] for c in AUC_CASES])
def test_auc_cases(two, case):
    _, kwargs, y_pred, weight, want = case
    check(two, lambda: M.AUC(**kwargs), Y_TRUE, y_pred, want, weight)


def test_auc_all_correct_prgain_and_extra_dims(two):
    # AUCTest.test_unweighted_all_correct, .test_prgain_interpolation, .test_extra_dims.
    assert float(M.AUC()(Y_TRUE, Y_TRUE)) == 1.0
    check(two, lambda: M.AUC(num_thresholds=3, curve="PRGAIN"),
          np.array([0, 0, 0, 1, 0, 1, 0, 1, 1, 1]),
          np.array([0.1, 0.2, 0.3, 0.3, 0.4, 0.4, 0.6, 0.6, 0.8, 0.9]),
          0.666666 * 0.333333 + 0.333333 * 0.833333)
    logits = 1 / (1 + np.exp(np.array([[[-10.0, 10.0, -10.0], [10.0, -10.0, 10.0]],
                                       [[-12.0, 12.0, -12.0], [12.0, -12.0, 12.0]]],
                                      np.float32)))
    labels = np.array([[[1, 0, 0], [1, 0, 0]], [[0, 1, 1], [0, 1, 1]]], np.int64)
    assert float(M.AUC()(labels, logits)) == 0.5


def test_auc_arguments_and_config():
    # AUCTest.test_invalid_*, .test_manual_thresholds, .test_config_manual_thresholds.
    with pytest.raises(ValueError, match="Argument `num_thresholds` must be an integer > 1"):
        M.AUC(num_thresholds=1)
    with pytest.raises(ValueError, match='Invalid AUC curve value: "Invalid".'):
        M.AUC(curve="Invalid")
    with pytest.raises(ValueError, match='Invalid AUC summation method value: "Invalid".'):
        M.AUC(summation_method="Invalid")
    auc = M.AUC(num_thresholds=2, thresholds=[0.5], curve="PR", summation_method="majoring",
                name="auc_1")
    assert auc.num_thresholds == 3
    np.testing.assert_allclose(auc.thresholds, [0.0, 0.5, 1.0], atol=1e-6)
    config = auc.get_config()
    assert config["thresholds"] == [0.5] and config["curve"] == "PR"
    again = M.AUC.from_config(config)
    assert again.get_config() == config and len(again.variables) == 4
    assert M.AUC().variables[0].shape == (200,)


MULTI_PRED = np.array([[0, 0.5, 0.3, 0.9], [0.1, 0.2, 0.3, 0.4]], np.float32).T
MULTI_GOOD = np.array([[0, 0, 1, 1], [0, 0, 1, 1]]).T
MULTI_BAD = np.array([[0, 0, 1, 1], [1, 1, 0, 0]]).T

MULTI_CASES = [
    ("MultiAUCTest.test_unweighted", dict(num_thresholds=5, multi_label=True), MULTI_PRED,
     None, (0.875 + 1.0) / 2.0, 1e-3),
    ("MultiAUCTest.test_unweighted_from_logits",
     dict(num_thresholds=5, multi_label=True, from_logits=True),
     -np.log(1.0 / (MULTI_PRED + 1e-12) - 1.0), None, (0.875 + 1.0) / 2.0, 1e-3),
    ("MultiAUCTest.test_sample_weight_flat", dict(num_thresholds=5), MULTI_PRED,
     np.array([1, 2, 3, 4]), 1.0 - (0.3333 * (1.0 - 0.2857) / 2.0), 1e-3),
    ("MultiAUCTest.test_full_sample_weight_flat", dict(num_thresholds=5), MULTI_PRED,
     np.arange(8).reshape(4, 2), 1.0 - (0.3333 * (1.0 - 0.2727) / 2.0), 1e-3),
    ("MultiAUCTest.test_label_weights",
     dict(num_thresholds=5, multi_label=True, label_weights=[0.75, 0.25]), MULTI_PRED,
     None, (0.875 * 0.75 + 1.0 * 0.25), 1e-3),
    ("MultiAUCTest.test_label_weights_flat",
     dict(num_thresholds=5, label_weights=[0.75, 0.25]), MULTI_PRED, None,
     1.0 - ((1.0 - 0.375) * 0.375 / 2.0), 1e-2),
    ("MultiAUCTest.test_unweighted_flat", dict(num_thresholds=5), MULTI_PRED, None,
     1.0 - (3.0 / 32.0), 1e-3),
    ("MultiAUCTest.test_manual_thresholds",
     dict(num_thresholds=2, thresholds=[0.5], multi_label=True), MULTI_PRED, None,
     (0.75 + 0.5) / 2.0, 1e-3),
    ("MultiAUCTest.test_weighted_roc_interpolation", dict(num_thresholds=5, multi_label=True),
     MULTI_PRED, np.array([1, 2, 3, 4]), 1.0 - 0.5 * 0.43 * 0.67, 1e-1),
    ("MultiAUCTest.test_pr_interpolation_unweighted (good)",
     dict(num_thresholds=5, curve="PR", multi_label=True), MULTI_PRED, None,
     (0.91667 + 1.0) / 2.0, 1e-1),
]


@pytest.mark.parametrize("case", MULTI_CASES, ids=[c[0] for c in MULTI_CASES])
def test_multi_label_auc_cases(two, case):
    _, kwargs, y_pred, weight, want, rtol = case
    check(two, lambda: M.AUC(**kwargs), MULTI_GOOD, y_pred, want, weight, rtol=rtol)


def test_multi_label_auc_all_correct_and_reset():
    # MultiAUCTest.test_unweighted_all_correct(_flat), .test_pr_interpolation_unweighted
    # (bad, after good), .test_reset_state.
    assert float(M.AUC(multi_label=True)(MULTI_GOOD, MULTI_GOOD)) == 1.0
    assert float(M.AUC(multi_label=False)(MULTI_GOOD, MULTI_GOOD)) == 1.0
    auc = M.AUC(num_thresholds=5, curve="PR", multi_label=True)
    auc(MULTI_GOOD, MULTI_PRED)
    np.testing.assert_allclose(auc(MULTI_BAD, MULTI_PRED), (0.91667 + 0.5) / 2.0, rtol=1e-1)
    auc.reset_state()
    assert all(not v.numpy().any() for v in auc.variables)
    assert auc.variables[0].shape == (5, 2)


def test_confusion_metrics_in_checkpoints(tmp_path, two):
    with two.scope():
        auc = M.AUC(num_thresholds=5, multi_label=True)
        p = M.Precision(thresholds=[0.3, 0.6])
    two.run(lambda: (auc.update_state(MULTI_GOOD, MULTI_PRED),
                     p.update_state(MULTI_GOOD, MULTI_PRED)))
    path = gs.train.Checkpoint(auc=auc, p=p).write(str(tmp_path / "c"))
    auc2 = M.AUC(num_thresholds=5, multi_label=True)
    p2 = M.Precision(thresholds=[0.3, 0.6])
    gs.train.Checkpoint(auc=auc2, p=p2).restore(path)
    np.testing.assert_allclose(auc2.result(), auc.result())
    np.testing.assert_allclose(p2.result(), p.result())
    with pytest.raises(ValueError, match=r"shape \(5, 2\), this metric keeps float32 of "
                                         r"shape \(3, 2\)"):
        gs.train.Checkpoint(auc=M.AUC(num_thresholds=3, multi_label=True, num_labels=2),
                            p=p2).restore(path)


# --- MeanMetricWrapper and a metric of your own ------------------------------------------

def _mse(y_true, y_pred):
    return (np.asarray(y_true) - np.asarray(y_pred)) ** 2


def test_mean_metric_wrapper_of_a_function(two):
    # reduction_metrics_test.py MetricWrapperTest: the mean of an element-wise function
    # (each example counts the mean of its row), weighted per example or broadcast.
    y_true = np.array([[0, 1, 0, 1, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 0], [0, 0, 0, 0, 1]],
                      np.float32)
    y_pred = np.array([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 0], [1, 1, 1, 1, 1]],
                      np.float32)

    def make():
        return M.MeanMetricWrapper(fn=_mse, name="mse", dtype="float32")
    check(two, make, y_true, y_pred, 0.5, atol=1e-5)                        # unweighted
    check(two, make, y_true, y_pred, 0.54285, atol=1e-5,                    # weighted
          sample_weight=np.array([1.0, 1.5, 2.0, 2.5]))
    m = make()                                                              # broadcast
    m(y_true, y_pred, sample_weight=np.array([[1.0, 0.0, 0.5, 0.0, 1.0]]))
    np.testing.assert_allclose(m.result(), 0.45, atol=1e-5)
    again = M.MeanMetricWrapper.from_config(m.get_config())                # test_config
    assert again.name == "mse" and len(again.variables) == 2 and \
        "fn" in again.get_config()


class BinaryTruePositives(M.Metric):
    """The custom metric of Keras's Metric documentation."""

    def __init__(self, name="binary_true_positives", **kwargs):
        super().__init__(name=name, **kwargs)
        self.true_positives = self.add_variable(shape=(), initializer="zeros",
                                                name="true_positives")

    def update_state(self, y_true, y_pred, sample_weight=None):
        values = (np.asarray(y_true, bool) & np.asarray(y_pred, bool)).astype(self.dtype)
        if sample_weight is not None:
            values = values * np.asarray(sample_weight, self.dtype)
        self.true_positives.assign_add(values.sum(dtype=self.dtype))

    def result(self):
        return self.true_positives.numpy()


def test_a_metric_of_your_own(two, tmp_path):
    m = BinaryTruePositives()
    m.update_state(np.array([1, 1, 0, 1]), np.array([1, 0, 1, 1]))
    assert float(m.result()) == 2.0
    m.reset_state()
    assert float(m.result()) == 0.0 and m.get_config()["name"] == "binary_true_positives"
    with two.scope():
        m = BinaryTruePositives()
    values = two.experimental_distribute_values_from_function
    two.run(lambda t, p: m.update_state(t, p),
            args=(values(lambda c: np.array([1, 1]) if c.replica_id_in_sync_group else
                         np.array([0, 1])),
                  values(lambda c: np.array([1, 1]))))
    assert float(m.result()) == 3.0                  # summed over the replicas
    path = gs.train.Checkpoint(m=m).write(str(tmp_path / "c"))
    plain = BinaryTruePositives()
    gs.train.Checkpoint(m=plain).restore(path)
    assert float(plain.result()) == 3.0


def test_add_variable_shapes_initializers_and_aggregations(two):
    class Stats(M.Metric):
        def __init__(self):
            super().__init__(name="stats")
            self.hist = self.add_variable((3,), "ones", name="hist")
            self.mean = self.add_variable((), 5.0, aggregation="mean", name="mean")
            self.first = self.add_weight("first", (2,), "only_first_replica",
                                         lambda shape, dtype: np.arange(2, dtype=dtype))

        def update_state(self, x):
            self.hist.assign_add(np.asarray(x, np.float32))

        def result(self):
            return self.hist.numpy()

    with two.scope():
        s = Stats()
    assert s.hist.shape == (3,) and s.first.numpy().tolist() == [0.0, 1.0]
    two.run(lambda: s.update_state([1.0, 2.0, 3.0]))
    # Two replicas, each starting at ones (their sum: 2) plus [1, 2, 3] each.
    assert s.result().tolist() == [4.0, 6.0, 8.0]
    assert float(s.mean.numpy()) == 5.0
    s.reset_state()
    assert s.result().tolist() == [0.0, 0.0, 0.0] and float(s.mean.numpy()) == 0.0
    with pytest.raises(ValueError, match="aggregation 'max' is not one of"):
        M.Metric(name="x").add_variable((), aggregation="max")
    with pytest.raises(ValueError, match="initializer 'glorot' is not 'zeros' or 'ones'"):
        M.Metric(name="x").add_variable((2,), "glorot")
