"""Every held-out protocol for one stage, and the tables of one stage or of an ensemble.

:func:`run` scores a stage under every protocol of heldout.py (the same folds for
every stage: families, seeded benign folds and a seeded k-fold), so the rows of two
stages' :class:`HeldOut` line up and an ensemble can be measured from them without
training anything again. :func:`tables` turns one or more stages' held-out scores
into the report `arena filter-train` records and `arena filter-eval` prints.

An ensemble's score is calibrated on benign data only (ensemble.py): each stage's
score becomes its share of the protocol's held-out benign scores below it, and the
ensemble's score is the largest of these over its stages, so it flags a prompt that
any stage ranks above the same benign quantile. The threshold is then the lowest
flagging at most the cap of those held-out benign prompts, as for one stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from consumers.filter.ensemble import below_share
from lab.filter import heldout

__all__ = ["DevRows", "HeldOut", "Setup", "evaluate", "run", "tables"]

DEV_FOLDS = 5


@dataclass(frozen=True)
class DevRows:
    """The dev file as the protocols need it."""

    x: Any  # its rows' features, in this stage's form
    y: np.ndarray
    families: np.ndarray
    rules: np.ndarray  # the rules (no classifier) reject or alter the row
    in_training: bool  # the stage's training rows end with these rows


@dataclass(frozen=True)
class Setup:
    """What every stage shares when it runs the protocols: the rows' labels and families, the
    sample weighting, the folds' seed, the dev file, the benign cap, the progress log."""

    y: np.ndarray
    families: np.ndarray
    balance: str
    seed: int
    boost: dict[str, float] | None
    dev: DevRows | None
    fp_cap: float
    log: Callable[[str], None] = print


@dataclass(frozen=True)
class HeldOut:
    """One stage's out-of-sample logits under every protocol (rows aligned across stages)."""

    loso: np.ndarray  # every row, its family held out
    attack: np.ndarray  # attack rows, their family held out (benign benign rows NaN)
    attack_benign: np.ndarray  # the held-out benign folds of the attack protocol, pooled
    kfold: np.ndarray  # every row, in-distribution k-fold
    dev: np.ndarray | None = None  # the dev rows, dev k-fold (the train file in every fold)
    dev_final: np.ndarray | None = None  # the dev rows by the final model, when it did not train on them


def run(
    x,
    y: np.ndarray,
    families: np.ndarray,
    fit: heldout.Fit,
    *,
    balance: str,
    seed: int,
    boost: dict[str, float] | None = None,
    dev: DevRows | None = None,
    final: Callable[[Any], np.ndarray] | None = None,
    stack: Callable[[Any, Any], Any] | None = None,
    log: Callable[[str], None] = print,
) -> HeldOut:
    """Every protocol's held-out scores of the stage that ``fit`` trains. ``stack(a, b)`` joins
    two feature sets (the dev rows after the training rows, when the stage did not train on them)."""
    log(f"  leave-one-source-out over {len(set(families))} families ...")
    loso = heldout.loso_scores(x, y, families, fit, balance, boost)
    log(f"  attack families held out ({len(set(families[y]))}), benign always trained on (one fold held out) ...")
    att, ben = heldout.loso_attack_scores(x, y, families, fit, balance, seed=seed, boost=boost)
    log("  in-distribution 5-fold ...")
    kf = heldout.kfold_scores(x, y, families, fit, balance, seed=seed, boost=boost)
    if dev is None:
        return HeldOut(loso, att, ben, kf)
    n = len(dev.y)
    if not dev.in_training:
        assert stack is not None
        x, y, families = stack(x, dev.x), np.r_[y, dev.y], np.r_[families, dev.families]
    folded = np.arange(len(y)) >= len(y) - n
    log(f"  dev split in distribution: {DEV_FOLDS}-fold over the dev file, the train file in every fold ...")
    dev_kf = heldout.kfold_scores(x, y, families, fit, balance, k=DEV_FOLDS, seed=seed, folded=folded, boost=boost)
    dev_final = final(dev.x) if final is not None and not dev.in_training else None
    return HeldOut(loso, att, ben, kf, dev_kf[folded], dev_final)


def evaluate(
    x,
    fit: heldout.Fit,
    setup: Setup,
    final: Callable[[Any], np.ndarray] | None,
    stack: Callable[[Any, Any], Any],
) -> tuple[HeldOut, dict[str, Any], float]:
    """:func:`run` and :func:`tables` for one stage: its held-out scores, report and LOSO threshold
    (``final``, the shipped model's scoring, is read only for dev rows it did not train on)."""
    s = setup
    held = run(
        x,
        s.y,
        s.families,
        fit,
        balance=s.balance,
        seed=s.seed,
        boost=s.boost,
        dev=s.dev,
        final=final,
        stack=stack,
        log=s.log,
    )
    report, t = tables([held], s.y, s.families, s.fp_cap, s.dev)
    return held, report, t


def _sigmoid(z: float) -> float:
    return float(1.0 / (1.0 + np.exp(-z)))


def _quantile(t: float) -> float:
    return float(t)


def _combined(scores: Sequence[np.ndarray], references: Sequence[np.ndarray]) -> np.ndarray:
    """The ensemble's calibrated score: the largest share of a stage's benign references below the row's score."""
    out = np.full(len(scores[0]), np.nan)
    for z, ref in zip(scores, references, strict=True):
        share = below_share(np.sort(ref), np.nan_to_num(z, nan=-np.inf))
        out = np.fmax(out, np.where(np.isnan(z), np.nan, share))
    return out


def tables(
    stages: Sequence[HeldOut],
    y: np.ndarray,
    families: np.ndarray,
    fp_cap: float,
    dev: DevRows | None = None,
) -> tuple[dict[str, Any], float]:
    """The report of one stage (logits; thresholds as sigmoids) or of the ensemble of several
    (calibrated scores; thresholds as benign quantiles), and the shipped (LOSO) threshold."""
    prob: Callable[[float], float]
    if len(stages) == 1:
        (h,) = stages
        loso, att, ben, kf, prob = h.loso, h.attack, h.attack_benign, h.kfold, _sigmoid

        def combine(pick: Callable[[HeldOut], np.ndarray], ref: Callable[[HeldOut], np.ndarray]) -> np.ndarray:
            return pick(h)
    else:
        prob = _quantile

        def combine(pick: Callable[[HeldOut], np.ndarray], ref: Callable[[HeldOut], np.ndarray]) -> np.ndarray:
            return _combined([pick(s) for s in stages], [ref(s) for s in stages])

        def loso_ref(s: HeldOut) -> np.ndarray:
            return s.loso[~y]

        def attack_ref(s: HeldOut) -> np.ndarray:
            return s.attack_benign

        loso = combine(lambda s: s.loso, loso_ref)
        att, ben = combine(lambda s: s.attack, attack_ref), combine(lambda s: s.attack_benign, attack_ref)
        kf = combine(lambda s: s.kfold, lambda s: s.kfold[~y])
    report: dict[str, Any] = {}
    t = heldout.threshold_at(loso[~y], fp_cap)
    report["loso"] = heldout.table(loso, y, families, t, prob)
    report["loso"]["nested_benign_fp"] = heldout.nested_benign_fp(loso, y, families, fp_cap)
    t_att = heldout.threshold_at(ben, fp_cap)
    report["loso_attack"] = heldout.table(att, y, families, t_att, prob)
    report["loso_attack"]["fp"] = float((ben >= t_att).mean())
    report["in_distribution"] = heldout.table(kf, y, families, heldout.threshold_at(kf[~y], fp_cap), prob)
    if dev is not None and all(s.dev is not None for s in stages):
        report.update(_dev_tables(stages, combine, y, dev, (t, t_att), fp_cap, prob))
    return report, t


def _dev_tables(stages, combine, y, dev: DevRows, thresholds, fp_cap, prob) -> dict[str, Any]:
    """The dev split in distribution, and the dev file at the LOSO and attack-held-out thresholds."""
    yd, fd = dev.y, dev.families
    kf = combine(lambda s: s.dev, lambda s: s.dev[~yd])
    by_final = not dev.in_training and all(s.dev_final is not None for s in stages)

    def pick(s: HeldOut) -> np.ndarray:
        scores = s.dev_final if by_final else s.dev
        assert scores is not None
        return scores

    # the dev file against a protocol's threshold: each stage calibrated on that protocol's benign references
    at_loso = combine(pick, lambda s: s.loso[~y])
    at_attack = combine(pick, lambda s: s.attack_benign)
    t, t_att = thresholds
    return {
        "dev_split": heldout.dev_split(kf, yd, fd, dev.rules, fp_cap, prob),
        "dev": heldout.table(at_loso, yd, fd, t, prob),
        "dev_at_attack_threshold": heldout.table(at_attack, yd, fd, t_att, prob),
        "dev_scored_by": "final model" if by_final else "dev k-fold models",
    }
