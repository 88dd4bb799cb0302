"""Held-out evaluation protocols of the classifier stage, on a small synthetic corpus."""

from __future__ import annotations

import numpy as np
import pytest

from lab.filter import heldout

pytestmark = pytest.mark.timeout(60)


def _corpus():
    # 3 attack families and 2 benign families; feature 0 marks attacks, feature 1 is family noise
    rng = np.random.default_rng(0)
    fams = np.array(["a1"] * 30 + ["a2"] * 10 + ["a3"] * 5 + ["b1"] * 40 + ["b2"] * 20)
    y = np.array([f.startswith("a") for f in fams])
    x = np.c_[y + rng.normal(0, 0.3, len(y)), rng.normal(0, 1, len(y))]
    return x, y, fams


def _fit(x, y, w):
    from sklearn.linear_model import LogisticRegression

    m = LogisticRegression(random_state=0).fit(x, y, sample_weight=w)
    return m.decision_function


def test_family_weights_balance_classes_and_families():
    _, y, fams = _corpus()
    w = heldout.family_weights(y, fams)
    assert w.mean() == pytest.approx(1.0)
    assert w[y].sum() == pytest.approx(w[~y].sum())
    assert w[fams == "a1"].sum() == pytest.approx(w[fams == "a3"].sum())  # 30 rows weigh as much as 5
    per_row = heldout.family_weights(y, fams, "row")
    assert np.allclose(per_row[y], per_row[y][0])  # per row: every attack weighs the same


def test_attack_families_held_out_score_every_attack_and_pool_benign_folds():
    x, y, fams = _corpus()
    att, ben = heldout.loso_attack_scores(x, y, fams, _fit, k=3)
    assert not np.isnan(att[y]).any() and np.isnan(att[~y]).all()
    assert len(ben) == (~y).sum()  # 3 attack families, 3 folds: every benign row scored once
    t = heldout.threshold_at(ben, 0.05)
    report = heldout.table(att, y, fams, t, float)
    assert set(report["families"]) == {"a1", "a2", "a3"} and report["mean_catch"] > 0.9


def test_loso_and_kfold_score_every_row():
    x, y, fams = _corpus()
    loso = heldout.loso_scores(x, y, fams, _fit)
    kf = heldout.kfold_scores(x, y, fams, _fit, k=3)
    assert loso.shape == kf.shape == y.shape
    assert (loso[y].mean() > loso[~y].mean()) and (kf[y].mean() > kf[~y].mean())


def test_kfold_over_a_subset_trains_every_fold_on_the_rest():
    x, y, fams = _corpus()
    folded = np.isin(fams, ["a2", "b2"])  # a dev file: only its rows are folded and scored
    seen = []

    def fit(xs, ys, w):
        seen.append(len(ys))
        return _fit(xs, ys, w)

    kf = heldout.kfold_scores(x, y, fams, fit, k=5, folded=folded)
    assert not np.isnan(kf[folded]).any() and np.isnan(kf[~folded]).all()
    # each fold trains on every unfolded row and four fifths of the folded ones
    assert seen == [(~folded).sum() + folded.sum() * 4 // 5] * 5


def test_dev_split_sets_the_filter_threshold_with_the_rules_flags_counted():
    y = np.array([True] * 10 + [False] * 100)
    fams = np.array(["a"] * 10 + ["b"] * 100)
    scores = np.r_[np.linspace(1, 2, 10), np.linspace(0, 1, 100)]
    rules = np.zeros(110, dtype=bool)
    rules[[0, 10]] = True  # the rules catch one attack and flag one benign row
    split = heldout.dev_split(scores, y, fams, rules, 0.02, float)
    assert split["classifier"]["fp"] == 0.02 and split["classifier"]["mean_catch"] == 1.0
    # one of the two benign rows allowed is spent by the rules: the classifier may add only one more
    assert split["filter"]["fp"] == 0.02 and split["filter"]["threshold"] > split["classifier"]["threshold"]


def test_threshold_caps_benign_flags():
    benign = np.arange(1000.0)
    t = heldout.threshold_at(benign, 0.003)
    assert (benign >= t).sum() == 3


def test_nested_benign_fp_sets_each_family_threshold_without_it():
    y = np.array([False] * 200 + [True] * 5)
    fams = np.array(["b1"] * 100 + ["b2"] * 100 + ["a"] * 5)
    scores = np.r_[np.zeros(100), np.linspace(0, 1, 100), np.ones(5)]  # b2 sits higher than b1
    nested = heldout.nested_benign_fp(scores, y, fams, 0.01)
    # b1 alone sets b2's threshold just above 0: nearly all of b2 is flagged; b2's threshold spares b1
    assert nested["families"]["b2"] > 0.9 and nested["families"]["b1"] == 0.0
    assert nested["mean"] == pytest.approx((nested["families"]["b1"] + nested["families"]["b2"]) / 2)
