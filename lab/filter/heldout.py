"""Held-out evaluation protocols for the classifier stage (used by `arena filter-train`).

Every protocol takes a feature matrix, labels, the source family of every row and
a ``fit(x, y, sample_weight) -> score(x)`` function, and returns out-of-sample
scores (logits; higher means attack):

* :func:`loso_scores`, leave-one-source-out: each family (attack or benign) is
  scored by a model that never saw it. A benign family that is held out is a new
  language or task, which is a question about benign drift as much as about attacks;
* :func:`loso_attack_scores`, attack families held out: each attack family is scored
  by a model trained on every other attack family and on the benign data, less one
  stratified benign fold that is scored for the threshold. This is the question
  "does the filter catch an attack family it has never seen" at a benign false
  positive rate measured on prompts it did not train on;
* :func:`kfold_scores`, in-distribution: stratified k-fold, strata = family x label;
  with ``folded``, only those rows are split (the dev file: each dev fold is scored by a
  model trained on the whole train file and the other dev folds);
* :func:`dev_split`, the dev-split tables: the classifier alone, and the whole filter
  (rules, then classifier), each at a threshold flagging at most the cap of the
  held-out benign dev rows, pooled over folds.

:func:`family_weights` balances training: each class weighs half, and within a class
every family weighs the same, so one large collection's style (1,200 SAP personas,
1,460 awesome-chatgpt-prompts) does not decide what "attack" and "benign" look like.
Every protocol takes ``boost``, families weighing more than the others (the dev
file's, when the shipped model trains on it), and passes it to every fit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "Fit",
    "attack_folds",
    "dev_split",
    "family_weights",
    "kfold_scores",
    "loso_attack_scores",
    "loso_scores",
    "nested_benign_fp",
    "table",
    "threshold_at",
]

# fit(x, y, sample_weight) -> a scoring function over rows of x
Fit = Callable[[Any, np.ndarray, np.ndarray], Callable[[Any], np.ndarray]]


def family_weights(
    y: np.ndarray, families: np.ndarray, balance: str = "family", boost: Mapping[str, float] | None = None
) -> np.ndarray:
    """Sample weights averaging 1: each class half; within a class, per family (``family``) or per row
    (``row``), a family named in ``boost`` weighing that many times as much as it would."""
    w = np.ones(len(y))
    for cls in (True, False):
        sel = y == cls
        if not sel.any():
            continue
        if balance == "family":
            fams = np.unique(families[sel])
            for fam in fams:
                s = sel & (families == fam)
                w[s] = 1.0 / (len(fams) * s.sum())
        else:
            w[sel] = 1.0 / sel.sum()
        if boost:
            w[sel] *= np.array([boost.get(str(f), 1.0) for f in families[sel]])
            w[sel] /= w[sel].sum()
    return w * len(y) / w.sum()


def _fit_on(fit: Fit, x, y, families, rows: np.ndarray, balance: str, boost: Mapping[str, float] | None = None):
    return fit(x[rows], y[rows], family_weights(y[rows], families[rows], balance, boost))


def loso_scores(
    x, y: np.ndarray, families: np.ndarray, fit: Fit, balance: str = "family", boost: Mapping[str, float] | None = None
) -> np.ndarray:
    """Each row's score from a model that never saw the row's family."""
    out = np.zeros(len(y))
    for fam in np.unique(families):
        held = families == fam
        out[held] = _fit_on(fit, x, y, families, np.flatnonzero(~held), balance, boost)(x[held])
    return out


def benign_folds(y: np.ndarray, families: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Fold number of every benign row (stratified by family); -1 for attacks."""
    rng = np.random.default_rng(seed)
    fold = np.full(len(y), -1)
    for fam in np.unique(families[~y]):
        idx = np.flatnonzero(~y & (families == fam))
        fold[idx[rng.permutation(len(idx))]] = np.arange(len(idx)) % k
    return fold


def attack_folds(y: np.ndarray, families: np.ndarray, k: int = 5, seed: int = 0):
    """The folds of :func:`loso_attack_scores`: for attack family ``i`` (sorted), its attack rows and
    benign fold ``i mod k`` (masks), held out together."""
    fold = benign_folds(y, families, k, seed)
    for i, fam in enumerate(np.unique(families[y])):
        yield fam, y & (families == fam), fold == i % k


def loso_attack_scores(
    x,
    y: np.ndarray,
    families: np.ndarray,
    fit: Fit,
    balance: str = "family",
    k: int = 5,
    seed: int = 0,
    boost: Mapping[str, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Attack rows scored with their family held out, and the benign scores that set the threshold.

    Attack family ``i`` is held out together with benign fold ``i mod k``; the
    returned benign scores pool every held-out fold (a benign row is scored by
    each model that left its fold out, so it may appear more than once).
    """
    attack_scores = np.full(len(y), np.nan)
    benign: list[np.ndarray] = []
    for _, held_attack, held_benign in attack_folds(y, families, k, seed):
        score = _fit_on(fit, x, y, families, np.flatnonzero(~held_attack & ~held_benign), balance, boost)
        attack_scores[held_attack] = score(x[held_attack])
        benign.append(score(x[held_benign]))
    return attack_scores, np.concatenate(benign)


def kfold_scores(
    x,
    y: np.ndarray,
    families: np.ndarray,
    fit: Fit,
    balance: str = "family",
    k: int = 5,
    seed: int = 0,
    folded: np.ndarray | None = None,
    boost: Mapping[str, float] | None = None,
):
    """Out-of-fold scores of a k-fold split stratified by family and label.

    With ``folded`` (a boolean mask), only those rows are split and scored; every other
    row is in every fold's training set and gets NaN.
    """
    from sklearn.model_selection import StratifiedKFold  # noqa: PLC0415

    split = np.flatnonzero(folded) if folded is not None else np.arange(len(y))
    strata = np.array([f"{f}|{a}" for f, a in zip(families[split], y[split], strict=True)])
    _, counts = np.unique(strata, return_counts=True)
    if counts.min() < k:  # tiny strata (a 3-prompt family): fold by label only
        strata = y[split]
    fixed = np.setdiff1d(np.arange(len(y)), split)
    out = np.full(len(y), np.nan)
    for train, test in StratifiedKFold(k, shuffle=True, random_state=seed).split(np.zeros(len(split)), strata):
        held = split[test]
        out[held] = _fit_on(fit, x, y, families, np.concatenate([fixed, split[train]]), balance, boost)(x[held])
    return out


def dev_split(
    scores: np.ndarray,
    y: np.ndarray,
    families: np.ndarray,
    rules: np.ndarray,
    fp_cap: float,
    prob: Callable[[float], float],
) -> dict[str, Any]:
    """The classifier alone and the whole filter on out-of-fold dev scores, each at its own threshold.

    ``rules``: the rules flagged the row (rejected or altered it). The whole filter flags a
    row the rules flagged or the classifier scores at or above the threshold, so its
    threshold is the lowest keeping the *filter's* benign flags within ``fp_cap``.
    """
    whole = np.where(rules, np.inf, scores)
    return {
        "classifier": table(scores, y, families, threshold_at(scores[~y], fp_cap), prob),
        "filter": table(whole, y, families, threshold_at(whole[~y], fp_cap), prob),
    }


def threshold_at(benign_scores: np.ndarray, fp_cap: float) -> float:
    """Lowest threshold (score >= t flags) flagging at most ``fp_cap`` of the benign scores."""
    ordered = np.sort(benign_scores)[::-1]
    allowed = int(np.floor(fp_cap * len(ordered)))
    if allowed >= len(ordered):
        return float(ordered[-1])
    return float(np.nextafter(ordered[allowed], np.inf))  # just above the first benign score not allowed


def table(scores: np.ndarray, y: np.ndarray, families: np.ndarray, t: float, prob: Callable[[float], float]):
    """Per family: attacks and share caught, benign and share flagged, at threshold ``t``; means and pooled."""
    scored = ~np.isnan(scores)
    flagged = scores >= t
    per: dict[str, dict[str, Any]] = {}
    for fam in np.unique(families[scored]):
        sel = scored & (families == fam)
        n_att, n_ben = int((sel & y).sum()), int((sel & ~y).sum())
        per[str(fam)] = {
            "attacks": n_att,
            "caught": float(flagged[sel & y].mean()) if n_att else None,
            "benign": n_ben,
            "fp": float(flagged[sel & ~y].mean()) if n_ben else None,
        }
    catches = [v["caught"] for v in per.values() if v["caught"] is not None]
    attacks, benign = scored & y, scored & ~y
    return {
        "threshold": prob(t),
        "families": per,
        "mean_catch": float(np.mean(catches)) if catches else None,
        "pooled_catch": float(flagged[attacks].mean()) if attacks.any() else None,
        "fp": float(flagged[benign].mean()) if benign.any() else None,
    }


def nested_benign_fp(scores: np.ndarray, y: np.ndarray, families: np.ndarray, fp_cap: float) -> dict[str, Any]:
    """Each benign family's flagged share at a threshold set on the *other* benign families' scores.

    The pooled LOSO threshold is set on every held-out benign score, so its 0.3% holds by
    construction. This asks the deployment question instead: a benign population that
    played no part in choosing the threshold, how much of it is flagged?
    """
    per: dict[str, float] = {}
    for fam in np.unique(families[~y]):
        mine = ~y & (families == fam)
        t = threshold_at(scores[~y & ~mine], fp_cap)
        per[str(fam)] = float((scores[mine] >= t).mean())
    return {"families": per, "mean": float(np.mean(list(per.values()))) if per else None}
