"""Style control: Bradley–Terry with the answers' style as covariates, as LMArena computes it.

Transcribes FastChat's `fastchat/serve/monitor/rating_systems.py` (`preprocess_for_style`,
`fit_contextual_bt`, `compute_style_control`, `compute_bootstrap_style_control`):

* per battle, four style counts per side from its `conv_metadata` (answer tokens,
  markdown headers, list items, bold spans; a dict of counts is summed, as
  `extract_style_feature` does);
* the feature is (a - b) / (a + b + 1), z-scored over the battles (numpy's population std);
* logit P(a wins) = ln10·(θ_a - θ_b) + features·γ, ties as half a win, negative
  log-likelihood plus 0.25·‖(θ, γ)‖² (FastChat's `reg=0.5` with its `half_reg`);
* ratings 1000 + 400·θ on the leaderboard's gauge; γ are the style coefficients.

FastChat minimizes with L-BFGS-B (gtol 1e-6, at most 100 iterations); this fits the same
strictly convex objective with Newton's method to machine precision, so the two agree to
FastChat's tolerance (tests/unit/test_leaderboard_style.py runs FastChat's formulas on
the same battles). One deviation: a feature that is constant over the battles (no answer
had a header, say) has std 0, which makes FastChat's features NaN; here it is set to 0,
so it explains nothing and its coefficient is 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from consumers.leaderboard.bradley_terry import POINTS_PER_NAT, STEP_TOL, FitDidNotConverge, Gauge, _sigmoid

STYLE_FEATURES = ("length", "header", "list", "bold")
"""The coefficients' names, in FastChat's `STYLE_CONTROL_ELEMENTS_V1` order."""
STYLE_ELEMENTS = (
    "sum_assistant_a_tokens",
    "header_count_a",
    "list_count_a",
    "bold_count_a",
    "sum_assistant_b_tokens",
    "header_count_b",
    "list_count_b",
    "bold_count_b",
)
"""The `conv_metadata` keys read, side a then side b (FastChat's `STYLE_CONTROL_ELEMENTS_V1`)."""
STYLE_REG = 0.5
"""FastChat's `reg`: the penalty is (reg/2)·‖params‖², its gradient reg·params."""
ALPHA = math.log(10.0)


class StyleMetadataError(ValueError):
    """A `conv_metadata` without the counts style control needs."""


def style_count(meta: Mapping[str, object], key: str) -> float:
    """One count of `conv_metadata` (a dict of counts is summed, as FastChat's `extract_style_feature`)."""
    value = meta.get(key)
    if isinstance(value, Mapping):
        value = sum(value.values()) if all(_is_count(v) for v in value.values()) else value
    if not _is_count(value):
        raise StyleMetadataError(f"conv_metadata.{key}: expected a count or a dict of counts, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _is_count(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value) and value >= 0


def style_counts(meta: Mapping[str, object]) -> tuple[float, ...]:
    """The eight counts of `STYLE_ELEMENTS` from one battle's `conv_metadata`."""
    return tuple(style_count(meta, key) for key in STYLE_ELEMENTS)


def style_features(counts: np.ndarray) -> np.ndarray:
    """(battles, 8) counts -> (battles, 4) features: (a - b) / (a + b + 1), z-scored per column."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, 2 * len(STYLE_FEATURES))
    a, b = counts[:, : len(STYLE_FEATURES)], counts[:, len(STYLE_FEATURES) :]
    diff = (a - b) / (a + b + 1.0)
    mean, std = diff.mean(axis=0), diff.std(axis=0)
    # A constant column carries nothing (FastChat divides by 0 here and gets NaN).
    return np.divide(diff - mean, std, out=np.zeros_like(diff), where=std > 0)


@dataclass(frozen=True, eq=False)
class StyleBattles:
    """Battles with style features, ready to fit: `a`, `b` index `models`, `y` is a's score."""

    models: tuple[str, ...]
    a: np.ndarray = field(repr=False)
    b: np.ndarray = field(repr=False)
    y: np.ndarray = field(repr=False)
    features: np.ndarray = field(repr=False)

    @classmethod
    def build(
        cls, model_a: Sequence[str], model_b: Sequence[str], scores: Sequence[float], counts: Sequence[Sequence[float]]
    ) -> StyleBattles:
        models = tuple(sorted(set(model_a) | set(model_b)))
        idx = {m: i for i, m in enumerate(models)}
        return cls(
            models,
            np.array([idx[m] for m in model_a], dtype=np.int64),
            np.array([idx[m] for m in model_b], dtype=np.int64),
            np.asarray(scores, dtype=np.float64),
            style_features(np.asarray(counts, dtype=np.float64)),
        )

    def __len__(self) -> int:
        return len(self.y)

    def votes_per_model(self) -> dict[str, int]:
        n = np.bincount(self.a, minlength=len(self.models)) + np.bincount(self.b, minlength=len(self.models))
        return {m: int(v) for m, v in zip(self.models, n, strict=True)}


@dataclass(frozen=True, eq=False)
class StyleFit:
    """A penalized maximum-likelihood fit: θ (log10 units) per model, γ per style feature."""

    battles: StyleBattles
    theta: np.ndarray = field(repr=False)
    gamma: np.ndarray = field(repr=False)
    gauge: Gauge
    reg: float
    iterations: int
    """Newton steps taken."""

    @property
    def models(self) -> tuple[str, ...]:
        return self.battles.models

    @property
    def ratings(self) -> np.ndarray:
        """Points on `gauge` (it maps natural-log strengths, θ·ln 10)."""
        return self.gauge.ratings(self.models, self.theta * ALPHA)

    @property
    def coefficients(self) -> dict[str, float]:
        """Logit change per standard deviation of each feature, in `STYLE_FEATURES` order."""
        return {name: float(g) for name, g in zip(STYLE_FEATURES, self.gamma, strict=True)}


def _probs(x: np.ndarray, battles: StyleBattles) -> np.ndarray:
    return _sigmoid(ALPHA * (x[battles.a] - x[battles.b]) + battles.features @ x[len(battles.models) :])


def _objective(x: np.ndarray, battles: StyleBattles, w: np.ndarray, reg: float) -> float:
    z = ALPHA * (x[battles.a] - x[battles.b]) + battles.features @ x[len(battles.models) :]
    nll = w @ (battles.y * np.logaddexp(0.0, -z) + (1.0 - battles.y) * np.logaddexp(0.0, z))
    return float(nll + 0.5 * reg * (x @ x))


def _curvature(battles: StyleBattles, v: np.ndarray) -> np.ndarray:
    """Σ_n v_n s_n s_nᵀ with s_n = (ln10·(e_a - e_b), features_n): the Hessian's shape, per battle weight v."""
    m, k = len(battles.models), battles.features.shape[1]
    out = np.zeros((m + k, m + k))
    lo, hi = np.minimum(battles.a, battles.b), np.maximum(battles.a, battles.b)
    pair_w = np.bincount(lo * m + hi, v, m * m).reshape(m, m)
    lap = -(pair_w + pair_w.T)
    lap[np.diag_indices(m)] = pair_w.sum(axis=0) + pair_w.sum(axis=1)
    out[:m, :m] = ALPHA**2 * lap
    vf = v[:, None] * battles.features
    cross = np.stack([np.bincount(battles.a, vf[:, j], m) - np.bincount(battles.b, vf[:, j], m) for j in range(k)], 1)
    out[:m, m:] = ALPHA * cross
    out[m:, :m] = ALPHA * cross.T
    out[m:, m:] = battles.features.T @ vf
    return out


def _grad_hessian(x: np.ndarray, battles: StyleBattles, w: np.ndarray, reg: float) -> tuple[np.ndarray, np.ndarray]:
    m = len(battles.models)
    p = _probs(x, battles)
    err = w * (battles.y - p)
    grad = reg * x
    grad[:m] += ALPHA * (np.bincount(battles.b, err, m) - np.bincount(battles.a, err, m))
    grad[m:] -= battles.features.T @ err
    return grad, _curvature(battles, w * p * (1.0 - p)) + reg * np.eye(len(x))


def fit_style_control(
    battles: StyleBattles,
    *,
    gauge: Gauge | None = None,
    reg: float = STYLE_REG,
    weights: np.ndarray | None = None,
    init: np.ndarray | None = None,
    tol: float = 1e-10,
    max_iter: int = 100,
) -> StyleFit:
    """Minimize FastChat's contextual Bradley–Terry objective by damped Newton's method.

    `weights` counts each battle (a bootstrap resample); `init` warm-starts from earlier
    params (θ then γ). The penalty makes the objective strictly convex, so the optimum is
    unique and finite even for a model that never lost.
    """
    if reg <= 0:
        raise ValueError("reg must be > 0: the style fit needs its penalty to be identified")
    gauge = gauge or Gauge()
    gauge.projection(battles.models)
    m, k = len(battles.models), battles.features.shape[1]
    w = np.ones(len(battles)) if weights is None else np.asarray(weights, dtype=np.float64)
    x = np.zeros(m + k) if init is None else np.array(init, dtype=np.float64)
    per_vote = max(float(w.sum()), 1.0)
    fval = _objective(x, battles, w, reg)
    for iteration in range(1, max_iter + 1):
        grad, hess = _grad_hessian(x, battles, w, reg)
        step = np.linalg.solve(hess, grad)
        grad_norm = float(np.abs(grad).max(initial=0.0)) / per_vote
        if grad_norm <= tol and float(np.abs(step).max(initial=0.0)) <= STEP_TOL:
            x = x - step
            return StyleFit(battles, x[:m], x[m:], gauge, reg, iteration)
        x, fval = _line_search(x, step, grad, fval, battles, w, reg)
    raise FitDidNotConverge(f"style fit: gradient per vote {grad_norm:.3g} > {tol:g} after {max_iter} Newton steps")


def _line_search(x, step, grad, fval, battles, w, reg) -> tuple[np.ndarray, float]:
    slope, t = float(grad @ step), 1.0
    while True:
        candidate = x - t * step
        fnew = _objective(candidate, battles, w, reg)
        if fnew <= fval - 1e-4 * t * slope or fnew - fval <= 1e-13 * abs(fval) or t < 1e-8:
            return candidate, fnew
        t *= 0.5


def style_bootstrap_ratings(fit: StyleFit, rounds: int = 100, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Ratings and coefficients refitted on `rounds` resamples of the battles with replacement
    (FastChat's `compute_bootstrap_style_control`; features are not re-standardized), from a
    seeded generator. Shapes (rounds, models) and (rounds, features)."""
    n, m = len(fit.battles), len(fit.models)
    rng = np.random.default_rng(seed)
    init = np.concatenate([fit.theta, fit.gamma])
    ratings, gammas = np.empty((rounds, m)), np.empty((rounds, len(fit.gamma)))
    for r in range(rounds):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(np.float64)
        boot = fit_style_control(fit.battles, gauge=fit.gauge, reg=fit.reg, weights=w, init=init)
        ratings[r], gammas[r] = boot.ratings, boot.gamma
    return ratings, gammas


def style_sandwich_cov(fit: StyleFit) -> tuple[np.ndarray, np.ndarray]:
    """(robust H⁻¹GH⁻¹, model-based H⁻¹) covariances of the ratings in points², on the gauge."""
    battles, m = fit.battles, len(fit.models)
    x = np.concatenate([fit.theta, fit.gamma])
    p = _probs(x, battles)
    bread = np.linalg.inv(_curvature(battles, p * (1.0 - p)) + fit.reg * np.eye(len(x)))
    robust = bread @ _curvature(battles, (battles.y - p) ** 2) @ bread
    proj = fit.gauge.projection(fit.models) * (POINTS_PER_NAT * ALPHA)
    return proj @ robust[:m, :m] @ proj.T, proj @ bread[:m, :m] @ proj.T
