"""Style control: known answers against FastChat's own formulas, run here on the same battles.

`fastchat_*` below transcribe fastchat/serve/monitor/rating_systems.py (lm-sys/FastChat:
`preprocess_for_style`, `contextual_bt_loss_and_grad`, `fit_contextual_bt`,
`scale_and_offset`, `compute_style_control`) with pandas' factorize and map replaced by
plain Python; the arithmetic, the optimizer and its options are FastChat's.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pytest
from scipy.optimize import minimize
from scipy.special import expit

from consumers.leaderboard.style_control import (
    STYLE_ELEMENTS,
    StyleBattles,
    StyleMetadataError,
    fit_style_control,
    style_bootstrap_ratings,
    style_counts,
    style_features,
    style_sandwich_cov,
)

pytestmark = pytest.mark.timeout(60)

WINNER_SCORE = {"model_a": 1.0, "model_b": 0.0, "tie": 0.5, "tie (bothbad)": 0.5}


# ---- FastChat, transcribed ----------------------------------------------------------


def fastchat_preprocess_for_style(battles: list[dict]):
    models: list[str] = []  # pd.factorize(pd.concat([model_a, model_b])): order of first appearance
    for name in [b["model_a"] for b in battles] + [b["model_b"] for b in battles]:
        if name not in models:
            models.append(name)
    matchups = np.array([[models.index(b["model_a"]), models.index(b["model_b"])] for b in battles])
    outcomes = np.full(len(battles), 0.5)
    outcomes[[b["winner"] == "model_a" for b in battles]] = 1.0
    outcomes[[b["winner"] == "model_b" for b in battles]] = 0.0
    n, k = len(battles), len(STYLE_ELEMENTS) // 2

    def extract_style_feature(x, feature):
        val = x[feature]
        if isinstance(val, int):
            return val
        return sum(val.values())

    style_vector = np.zeros(shape=(2 * k, n), dtype=np.int32)
    for idx, element in enumerate(STYLE_ELEMENTS):
        style_vector[idx, :] = [partial(extract_style_feature, feature=element)(b["conv_metadata"]) for b in battles]
    style_diff = (style_vector[:k] - style_vector[k:]).astype(float)
    style_sum = (style_vector[:k] + style_vector[k:]).astype(float) + np.ones(style_diff.shape)
    apply_ratio = np.flatnonzero([1, 1, 1, 1])
    style_diff[apply_ratio] /= style_sum[apply_ratio]
    style_mean = np.mean(style_diff, axis=1)
    style_std = np.std(style_diff, axis=1)
    features = ((style_diff - style_mean[:, np.newaxis]) / style_std[:, np.newaxis]).T
    return matchups, features, outcomes, models


DIFF_MASK = np.array([1.0, -1.0], dtype=np.float64)


def fastchat_contextual_bt_loss_and_grad(
    params, n_competitors, matchups, features, outcomes, alpha=1.0, reg=1.0, half_reg=0.5
):
    reg_loss = half_reg * np.inner(params, params)
    ratings = params[:n_competitors]
    feature_params = params[n_competitors:]
    matchup_ratings = ratings[matchups]
    bt_logits = alpha * (matchup_ratings[:, 0] - matchup_ratings[:, 1])
    context_logits = np.dot(features, feature_params)
    probs = expit(bt_logits + context_logits)
    loss = -(np.log(probs) * outcomes + np.log(1.0 - probs) * (1.0 - outcomes)).sum() + reg_loss
    error = outcomes - probs
    grad = reg * params
    matchups_grads = -alpha * error
    np.add.at(grad[:n_competitors], matchups[:, [0, 1]], matchups_grads[:, None] * DIFF_MASK)
    grad[n_competitors:] -= np.dot(features.T, error)
    return loss, grad


ALPHA = math.log(10.0)


def fastchat_fit_contextual_bt(matchups, features, outcomes, models, alpha=ALPHA, reg=0.5, tol=1e-6, **opt):
    n_features, n_models = features.shape[1], len(models)
    result = minimize(
        fun=fastchat_contextual_bt_loss_and_grad,
        x0=np.zeros(n_models + n_features, dtype=np.float64),
        args=(n_models, matchups, features, outcomes, alpha, reg, reg / 2.0),
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 100, "gtol": tol, **opt},  # FastChat also passes disp=False, deprecated in SciPy 1.17
    )
    return result["x"]


def fastchat_compute_style_control(battles, tol=1e-6, **opt):
    matchups, features, outcomes, models = fastchat_preprocess_for_style(battles)
    params = fastchat_fit_contextual_bt(matchups, features, outcomes, models, tol=tol, **opt)
    ratings = params[: len(models)] * 400.0 + 1000.0  # scale_and_offset, no mixtral in these battles
    return dict(zip(models, ratings.tolist(), strict=True)), params[len(models) :]


# ---- battles with a known style effect ----------------------------------------------


def style_battles(n: int, seed: int) -> list[dict]:
    """Clean-battle rows whose winner depends on rating and on length and bold (FastChat's layout)."""
    rng = np.random.default_rng(seed)
    true = {"m0": 1150.0, "m1": 1080.0, "m2": 1000.0, "m3": 960.0, "m4": 900.0}
    verbose = {"m0": 300, "m1": 900, "m2": 500, "m3": 1200, "m4": 200}
    names = sorted(true)
    rows = []
    for _ in range(n):
        a, b = rng.choice(len(names), 2, replace=False)
        ma, mb = names[a], names[b]
        meta = {"sum_user_tokens": int(rng.integers(5, 50)), "turns": 1}
        for side, m in (("a", ma), ("b", mb)):
            meta[f"sum_assistant_{side}_tokens"] = int(rng.poisson(verbose[m]))
            meta[f"header_count_{side}"] = {f"h{i}": int(rng.poisson(0.3)) for i in range(1, 7)}
            meta[f"list_count_{side}"] = {"ordered": int(rng.poisson(1)), "unordered": int(rng.poisson(2))}
            meta[f"bold_count_{side}"] = {"**": int(rng.poisson(1.5)), "__": 0}
        la, lb = meta["sum_assistant_a_tokens"], meta["sum_assistant_b_tokens"]
        logit = math.log(10) * (true[ma] - true[mb]) / 400 + 1.5 * (la - lb) / (la + lb + 1)
        u = rng.random()
        winner = "tie" if u < 0.08 else ("model_a" if rng.random() < expit(logit) else "model_b")
        rows.append({"model_a": ma, "model_b": mb, "winner": winner, "conv_metadata": meta})
    return rows


def ours(battles: list[dict]) -> StyleBattles:
    return StyleBattles.build(
        [b["model_a"] for b in battles],
        [b["model_b"] for b in battles],
        [WINNER_SCORE[b["winner"]] for b in battles],
        [style_counts(b["conv_metadata"]) for b in battles],
    )


def test_features_equal_fastchat_preprocess_for_style() -> None:
    battles = style_battles(400, seed=1)
    _, expected, outcomes, _ = fastchat_preprocess_for_style(battles)
    data = ours(battles)
    np.testing.assert_allclose(data.features, expected, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(data.y, outcomes)
    assert np.allclose(data.features.mean(axis=0), 0) and np.allclose(data.features.std(axis=0), 1)


def test_fit_equals_fastchat_compute_style_control() -> None:
    battles = style_battles(3000, seed=2)
    fit = fit_style_control(ours(battles))
    mine = dict(zip(fit.models, fit.ratings.tolist(), strict=True))
    # FastChat's own options (L-BFGS-B, gtol 1e-6, at most 100 iterations): equal to its tolerance.
    theirs, coef = fastchat_compute_style_control(battles)
    for m, r in theirs.items():
        assert mine[m] == pytest.approx(r, abs=0.05), m
    np.testing.assert_allclose(fit.gamma, coef, atol=1e-3)
    # Run to convergence, the same optimum to far below a rating point.
    theirs, coef = fastchat_compute_style_control(battles, tol=1e-12, maxiter=10_000, ftol=1e-15)
    for m, r in theirs.items():
        assert mine[m] == pytest.approx(r, abs=1e-4), m
    np.testing.assert_allclose(fit.gamma, coef, atol=1e-6)
    # The effect planted in the data is found: longer answers win; mean rating 1000 (the penalty centres θ).
    assert fit.coefficients["length"] > 0.3 and abs(fit.coefficients["header"]) < 0.15
    assert list(fit.coefficients) == ["length", "header", "list", "bold"]
    assert np.mean(fit.ratings) == pytest.approx(1000.0, abs=1e-6)


def test_style_control_reorders_a_model_that_wins_on_length() -> None:
    battles = style_battles(3000, seed=3)
    fit = fit_style_control(ours(battles))
    r = dict(zip(fit.models, fit.ratings.tolist(), strict=True))
    # m3 writes the longest answers: its raw win rate flatters it, the style fit takes that out.
    raw = fit_style_control(StyleBattles(ours(battles).models, *_no_style(ours(battles))))
    raw_r = dict(zip(raw.models, raw.ratings.tolist(), strict=True))
    assert raw_r["m3"] - r["m3"] > 20 and r["m4"] - raw_r["m4"] > 20


def _no_style(d: StyleBattles):
    return d.a, d.b, d.y, np.zeros_like(d.features)


def test_bootstrap_and_sandwich_intervals_agree_and_cover() -> None:
    battles = style_battles(2000, seed=4)
    fit = fit_style_control(ours(battles))
    boot, gammas = style_bootstrap_ratings(fit, rounds=200, seed=1)
    robust, model_based = style_sandwich_cov(fit)
    boot_sd, sand_sd = boot.std(axis=0), np.sqrt(np.diag(robust))
    assert np.all(np.abs(boot_sd / sand_sd - 1) < 0.25)
    assert np.all(np.abs(np.sqrt(np.diag(model_based)) / sand_sd - 1) < 0.25)
    assert gammas.shape == (200, 4)
    np.testing.assert_allclose(gammas.mean(axis=0), fit.gamma, atol=3 * gammas.std(axis=0).max() / math.sqrt(200))
    same, _ = style_bootstrap_ratings(fit, rounds=200, seed=1)
    np.testing.assert_array_equal(boot, same)  # seeded: the same figures on a rerun


def test_constant_feature_and_bad_metadata() -> None:
    counts = np.array([[10, 0, 0, 0, 20, 0, 0, 0], [30, 0, 0, 0, 5, 0, 0, 0]])
    feats = style_features(counts)
    assert np.all(feats[:, 1:] == 0) and np.all(np.isfinite(feats))  # no headers anywhere: 0, not NaN
    meta = style_battles(1, seed=0)[0]["conv_metadata"]
    assert len(style_counts(meta)) == 8
    with pytest.raises(StyleMetadataError, match="bold_count_b"):
        style_counts({**meta, "bold_count_b": "many"})
    with pytest.raises(StyleMetadataError, match="sum_assistant_a_tokens"):
        style_counts({k: v for k, v in meta.items() if k != "sum_assistant_a_tokens"})


def test_a_model_that_never_lost_stays_finite() -> None:
    battles = style_battles(300, seed=5)
    battles += [{**battles[0], "model_a": "new", "model_b": "m2", "winner": "model_a"} for _ in range(3)]
    fit = fit_style_control(ours(battles))
    r = dict(zip(fit.models, fit.ratings.tolist(), strict=True))
    assert math.isfinite(r["new"]) and r["new"] < 1700
