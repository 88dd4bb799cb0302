"""Bradley–Terry by maximum likelihood on a count table, with 95% intervals two ways.

Model: P(i beats j) = 1 / (1 + 10^((R_j - R_i)/400)), R = offset + 400·θ, θ in log10
units as FastChat's `compute_mle_elo` (SCALE=400, BASE=10, INIT_RATING=1000). Internally
the fit works in natural-log strengths β = θ·ln 10, where P = sigmoid(β_i - β_j).
A tie or both_bad is half a win each way (outcome 0.5), as FastChat and arena-rank do.

Only rating differences are identified; the `Gauge` fixes the level: mean rating 1000 by
default, or a named anchor model at a given rating.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from consumers.leaderboard.votes import OUTCOME_SCORE, CountTable

SCALE = 400.0
BASE = 10.0
POINTS_PER_NAT = SCALE / math.log(BASE)
"""Rating points per unit of natural-log strength."""
FASTCHAT_PRIOR_L2 = 0.5 / math.log(BASE) ** 2
"""FastChat's style-fit penalty (0.25·θ², θ in log10 units) on natural-log strengths: 0.5·l2·β²."""
STEP_TOL = 1e-8
"""Newton step (natural-log units, ~2e-6 points) below which the next step is the last."""


class FitDidNotConverge(RuntimeError):
    """Newton's method did not reach the gradient tolerance within max_iter."""


@dataclass(frozen=True)
class Gauge:
    """Where the ratings sit: only differences are estimated, the gauge fixes the level."""

    rating: float = 1000.0
    """Mean rating over all models, or the anchor's rating when `anchor` is set."""
    anchor: str | None = None
    """A model held at `rating`; the others are placed relative to it."""

    def projection(self, models: tuple[str, ...]) -> np.ndarray:
        """Linear map from any θ to this gauge's θ - reference (applied to estimates and covariances)."""
        n = len(models)
        if self.anchor is None:
            return np.eye(n) - np.full((n, n), 1.0 / max(n, 1))
        if self.anchor not in models:
            raise ValueError(f"anchor model {self.anchor!r} has no votes; models are {list(models)}")
        proj = np.eye(n)
        proj[:, models.index(self.anchor)] -= 1.0
        return proj

    def ratings(self, models: tuple[str, ...], beta: np.ndarray) -> np.ndarray:
        """Ratings in points for natural-log strengths `beta` (any row-stack of them)."""
        return self.rating + POINTS_PER_NAT * (beta @ self.projection(models).T)


@dataclass(frozen=True, eq=False)
class BradleyTerryFit:
    """A maximum-likelihood fit: strengths, the gauge they are reported in, and how it converged."""

    table: CountTable
    beta: np.ndarray = field(repr=False)
    """Natural-log strengths, mean zero (the optimizer's own gauge)."""
    gauge: Gauge
    l2: float
    iterations: int
    grad_norm: float
    """Max |gradient| of the penalized log-likelihood per vote before the last Newton step."""

    @property
    def models(self) -> tuple[str, ...]:
        return self.table.models

    @property
    def theta(self) -> np.ndarray:
        """Strengths in log10 units, mean zero (FastChat's coefficients)."""
        return self.beta / math.log(BASE)

    @property
    def ratings(self) -> np.ndarray:
        """Ratings in points on `gauge`, in `models` order."""
        return self.gauge.ratings(self.models, self.beta)

    def rating(self, model: str) -> float:
        return float(self.ratings[self.models.index(model)])

    def strengths(self) -> dict[str, float]:
        """Bradley–Terry strengths 10^θ normalized to geometric mean 1."""
        return {m: float(s) for m, s in zip(self.models, np.exp(self.beta - self.beta.mean()), strict=True)}


@dataclass(frozen=True, eq=False)
class Intervals:
    """Two-sided intervals for each model's rating, in points, in `models` order."""

    method: str
    level: float
    low: np.ndarray = field(repr=False)
    high: np.ndarray = field(repr=False)


def _pair_data(table: CountTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    counts = table.counts.astype(np.float64)
    return table.pairs[:, 0], table.pairs[:, 1], counts.sum(axis=1), counts @ OUTCOME_SCORE


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


def _objective(beta: np.ndarray, i: np.ndarray, j: np.ndarray, n: np.ndarray, s: np.ndarray, l2: float) -> float:
    """Negative log-likelihood plus the L2 term."""
    z = beta[i] - beta[j]
    nll = s @ np.logaddexp(0.0, -z) + (n - s) @ np.logaddexp(0.0, z)
    return float(nll + 0.5 * l2 * beta @ beta)


def _laplacian(i: np.ndarray, j: np.ndarray, w: np.ndarray, size: int) -> np.ndarray:
    """Σ_pairs w (e_i - e_j)(e_i - e_j)ᵀ; pairs are unique, so off-diagonals can be assigned."""
    mat = np.zeros((size, size))
    mat[i, j] = -w
    mat[j, i] = -w
    mat[np.diag_indices(size)] = np.bincount(i, w, size) + np.bincount(j, w, size)
    return mat


def _gauge_fixed(hessian: np.ndarray) -> np.ndarray:
    # The likelihood is flat along the all-ones direction; adding c·11ᵀ makes the matrix
    # invertible without changing it on the mean-zero subspace the solution lives in.
    size = max(len(hessian), 1)
    return hessian + np.full(hessian.shape, max(np.trace(hessian) / size, 1.0) / size)


def _initial(table: CountTable, init: np.ndarray | Mapping[str, float] | None) -> np.ndarray:
    if init is None:
        beta = np.zeros(len(table.models))
    elif isinstance(init, Mapping):
        beta = np.array([float(init.get(m, 0.0)) for m in table.models])
    else:
        beta = np.array(init, dtype=np.float64)
        if beta.shape != (len(table.models),):
            raise ValueError(f"init has shape {beta.shape}, expected ({len(table.models)},)")
    return beta - beta.mean() if beta.size else beta


def fit_bradley_terry(
    table: CountTable,
    *,
    gauge: Gauge | None = None,
    l2: float = 1e-6,
    tol: float = 1e-10,
    max_iter: int = 100,
    init: np.ndarray | Mapping[str, float] | None = None,
) -> BradleyTerryFit:
    """Maximum-likelihood Bradley–Terry strengths by damped Newton's method.

    `l2` (natural-log units, absolute) keeps strengths finite for a model that never lost
    or a comparison graph in pieces; on connected data its effect is of order l2 / votes.
    Stops when the max |gradient| per vote is below `tol` and the Newton step is below
    `STEP_TOL`, after taking that step. `init` warm-starts from
    earlier natural-log strengths (an array in `table.models` order, or by model name).
    """
    gauge = gauge or Gauge()
    gauge.projection(table.models)  # fail early on an unknown anchor
    size = len(table.models)
    i, j, n, s = _pair_data(table)
    per_vote = max(float(n.sum()), 1.0)
    beta = _initial(table, init)
    if size == 0:
        return BradleyTerryFit(table, beta, gauge, l2, 0, 0.0)
    fval = _objective(beta, i, j, n, s, l2)
    for iteration in range(1, max_iter + 1):
        p = _sigmoid(beta[i] - beta[j])
        resid = s - n * p
        grad = np.bincount(j, resid, size) - np.bincount(i, resid, size) + l2 * beta
        grad_norm = float(np.abs(grad).max(initial=0.0)) / per_vote
        hessian = _laplacian(i, j, n * p * (1.0 - p), size) + l2 * np.eye(size)
        step = np.linalg.solve(_gauge_fixed(hessian), grad)
        step -= step.mean()
        if grad_norm <= tol and float(np.abs(step).max(initial=0.0)) <= STEP_TOL:
            # Newton converges quadratically: this last full step leaves an error far below
            # the digest's rounding, so warm and cold starts round to the same figures.
            return BradleyTerryFit(table, beta - step, gauge, l2, iteration, grad_norm)
        beta, fval = _line_search(beta, step, grad, fval, (i, j, n, s, l2))
    raise FitDidNotConverge(f"gradient per vote {grad_norm:.3g} > {tol:g} after {max_iter} Newton steps")


def _line_search(
    beta: np.ndarray, step: np.ndarray, grad: np.ndarray, fval: float, args: tuple
) -> tuple[np.ndarray, float]:
    """Backtracking (Armijo) along the Newton step; near the optimum the full step is taken."""
    slope = float(grad @ step)
    t = 1.0
    while True:
        candidate = beta - t * step
        fnew = _objective(candidate, *args)
        # The second test accepts changes lost in rounding, where Armijo cannot tell.
        if fnew <= fval - 1e-4 * t * slope or fnew - fval <= 1e-13 * abs(fval) or t < 1e-8:
            return candidate, fnew
        t *= 0.5


def sandwich_intervals(fit: BradleyTerryFit, level: float = 0.95) -> Intervals:
    """Normal intervals from the robust (sandwich) covariance H⁻¹ G H⁻¹, as arena-rank does.

    H is the Hessian of the penalized negative log-likelihood, G the sum over votes of the
    outer products of per-vote scores; both are taken per cell of the count table, so the
    cost does not grow with the number of votes. The covariance is mapped to the gauge, so
    an anchor gets a zero-width interval and the others carry their uncertainty relative to it.
    """
    table = fit.table
    size = len(table.models)
    i, j, n, _ = _pair_data(table)
    p = _sigmoid(fit.beta[i] - fit.beta[j])
    score_sq = (table.counts * (OUTCOME_SCORE[None, :] - p[:, None]) ** 2).sum(axis=1)
    hessian = _laplacian(i, j, n * p * (1.0 - p), size) + fit.l2 * np.eye(size)
    bread = np.linalg.inv(_gauge_fixed(hessian))
    cov = bread @ _laplacian(i, j, score_sq, size) @ bread
    proj = fit.gauge.projection(table.models)
    var = np.clip(np.diag(proj @ cov @ proj.T), 0.0, None)
    half = NormalDist().inv_cdf(0.5 + level / 2.0) * POINTS_PER_NAT * np.sqrt(var)
    ratings = fit.ratings
    return Intervals("sandwich", level, ratings - half, ratings + half)


def model_based_sd(fit: BradleyTerryFit) -> np.ndarray:
    """Standard deviation of each rating in points from H⁻¹, the inverse Hessian of the
    penalized negative log-likelihood (the Laplace approximation under the L2 prior), on the gauge.

    On separated data (a model that won every vote) the sandwich's meat, the squared score
    (y - p)², goes to zero with the fitted probabilities, and so does its interval; H⁻¹
    stays as wide as the prior and the few votes allow."""
    table = fit.table
    i, j, n, _ = _pair_data(table)
    p = _sigmoid(fit.beta[i] - fit.beta[j])
    hessian = _laplacian(i, j, n * p * (1.0 - p), len(table.models)) + fit.l2 * np.eye(len(table.models))
    proj = fit.gauge.projection(table.models)
    cov = proj @ np.linalg.inv(_gauge_fixed(hessian)) @ proj.T
    return POINTS_PER_NAT * np.sqrt(np.clip(np.diag(cov), 0.0, None))


def floored(iv: Intervals, ratings: np.ndarray, sd: np.ndarray) -> Intervals:
    """`iv` widened where needed so each bound is at least z·sd from the rating."""
    half = NormalDist().inv_cdf(0.5 + iv.level / 2.0) * sd
    return Intervals(iv.method, iv.level, np.minimum(iv.low, ratings - half), np.maximum(iv.high, ratings + half))


def bootstrap_ratings(fit: BradleyTerryFit, rounds: int = 100, seed: int = 0) -> np.ndarray:
    """Ratings refitted on `rounds` multinomial resamples of the count table, shape (rounds, models).

    Resampling the cells with probabilities count / total is resampling the votes with
    replacement (FastChat's bootstrap) without materializing them. Each refit is
    warm-started from the full fit.
    """
    table = fit.table
    flat = table.counts.ravel()
    total = int(flat.sum())
    rng = np.random.default_rng(seed)
    if total == 0:
        return np.tile(fit.ratings, (rounds, 1))
    draws = rng.multinomial(total, flat / total, size=rounds)
    out = np.empty((rounds, len(table.models)))
    for r in range(rounds):
        resample = table.with_counts(draws[r].reshape(table.counts.shape))
        out[r] = fit_bradley_terry(resample, gauge=fit.gauge, l2=fit.l2, init=fit.beta).ratings
    return out


def bootstrap_intervals(fit: BradleyTerryFit, rounds: int = 100, seed: int = 0, level: float = 0.95) -> Intervals:
    """Percentile intervals over `bootstrap_ratings`; the point estimate stays the full fit's."""
    samples = bootstrap_ratings(fit, rounds, seed)
    low, high = np.quantile(samples, [(1.0 - level) / 2.0, (1.0 + level) / 2.0], axis=0)
    return Intervals("bootstrap", level, low, high)
