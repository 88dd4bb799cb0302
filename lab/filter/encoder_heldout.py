"""The encoder's held-out rows read with the lexical stages: the cascade's figures on attack families never seen.

The shipped encoder never trained on its held-out rows (train_encoder.holdout: a third of the
attack families whole, a fifth of every other family and label). Here the character stage is
trained by the shipped recipe (train.py, dev families weighing ``DEV_WEIGHT``) on the encoder's
training rows, so both stages score the same unseen rows, and each reading is set at thresholds
from the held-out benign rows alone:

* the rules, each stage alone at 0.3% of benign, the rules or the character stage (the filter
  served without the encoder);
* the served cascade: the rules, or the character stage at 0.15%, or the encoder at 0.15% on
  the prompts the lexical stage leaves undecided (calibrated character score at least ``band``,
  or ``long_chars`` characters and more): the manifest's union-bound point;
* both at one common benign quantile (the largest calibrated score, 0.3%).

Mean catch over the attack families held out whole (the ``loso_attack`` question), and over the
fifth of the others (in distribution). Prints a table; ``--out`` writes the figures as JSON.

    python -m lab.filter.encoder_heldout [--encoder DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.classifier import DEFAULT_ARTIFACT, LinearClassifier
from consumers.filter.ensemble import below_share
from consumers.filter.loader import load_stage
from lab.filter import heldout
from lab.filter.corpus import Row, load_rows
from lab.filter.train import DEV_FILE, TRAIN_FILE, rules_flag, train
from lab.filter.train_encoder import EncoderOptions, holdout

FP_CAP = 0.003
NAMES = ("rules", "chars", "encoder", "rules+chars", "cascade", "common_quantile")


def chars_logits(fit_rows: list[Row], dev_families: set[str], texts: list[str]) -> np.ndarray:
    """The character stage's logits on ``texts``, trained by the shipped recipe on ``fit_rows`` only."""
    rows = [r for r in fit_rows if r.family not in dev_families]
    dev = [r for r in fit_rows if r.family in dev_families]
    t = train(rows, dev=dev, train_on_dev=True, evaluate_heldout=False, log=lambda _: None)
    clf = LinearClassifier(t.weights, t.bias, t.meta, t.memory)
    return np.array([clf.logit(x)[0] for x in texts])


def tables(
    z: dict[str, np.ndarray],
    y: np.ndarray,
    fam: np.ndarray,
    rules: np.ndarray,
    lengths: np.ndarray,
    band: float = 0.5,
    long_chars: int = 1000,
) -> dict[str, np.ndarray]:
    """Each reading's flags on the held-out rows (see the module docstring)."""
    out = {"rules": rules}
    for name, s in z.items():
        out[name] = s >= heldout.threshold_at(s[~y], FP_CAP)
    out["rules+chars"] = rules | out["chars"]  # the filter served before the encoder
    half = {n: heldout.threshold_at(s[~y], FP_CAP / 2) for n, s in z.items()}
    calibrated = below_share(np.sort(z["chars"][~y]), z["chars"])
    undecided = (calibrated >= band) | (lengths >= long_chars)
    lexical = rules | (z["chars"] >= half["chars"])
    out["cascade"] = lexical | (undecided & (z["encoder"] >= half["encoder"]))
    both = np.max([below_share(np.sort(s[~y]), s) for s in z.values()], axis=0)
    out["common_quantile"] = rules | (both >= heldout.threshold_at(both[~y], FP_CAP))
    out["_undecided"] = undecided & ~lexical
    return out


def summary(flag: np.ndarray, y: np.ndarray, fam: np.ndarray, families: set[str]) -> dict[str, Any]:
    per = {str(f): float(flag[y & (fam == f)].mean()) for f in sorted(families)}
    return {"families": per, "mean_catch": float(np.mean(list(per.values()))), "fp": float(flag[~y].mean())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--encoder", type=Path, default=DEFAULT_ARTIFACT.with_name("prompt-encoder"))
    p.add_argument("--band", type=float, default=0.5, help="the cascade band (FilterConfig.cascade_band)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    encoder = load_stage(args.encoder)
    options = EncoderOptions(**{k: v for k, v in encoder.meta["report"]["options"].items()})  # type: ignore[attr-defined]
    train_rows, dev_rows = load_rows(TRAIN_FILE), load_rows(DEV_FILE)
    rows = [*train_rows, *dev_rows]
    held, unseen = holdout(rows, options)
    idx = np.flatnonzero(held)
    texts = [rows[j].text for j in idx]
    start = time.perf_counter()
    print(f"{len(idx)} held-out rows; attack families never seen: {', '.join(sorted(unseen))}", flush=True)
    z = {"chars": chars_logits([rows[j] for j in np.flatnonzero(~held)], {r.family for r in dev_rows}, texts)}
    print(f"character stage trained on the encoder's training rows and scored, {time.perf_counter() - start:.0f} s")
    z["encoder"] = np.array(encoder.logits(texts))  # type: ignore[attr-defined]
    print(f"encoder scored, {time.perf_counter() - start:.0f} s", flush=True)
    y = np.array([rows[j].attack for j in idx])
    fam = np.array([rows[j].family for j in idx])
    flags = tables(z, y, fam, rules_flag([rows[j] for j in idx]), np.array([len(t) for t in texts]), args.band)
    seen = set(fam[y]) - unseen
    result = {
        "unseen": {n: summary(flags[n], y, fam, unseen) for n in NAMES},
        "in_distribution": {n: summary(flags[n], y, fam, seen) for n in NAMES},
        "encoder_share": float(flags["_undecided"].mean()),
        "band": args.band,
        "encoder_version": encoder.version,
    }
    print(f"{'attack family held out whole':<55}" + "".join(f"{n:>16}" for n in NAMES))
    for f in sorted(unseen):
        print(f"{f[:55]:<55}" + "".join(f"{100 * result['unseen'][n]['families'][f]:15.1f}%" for n in NAMES))
    for key, title in (("unseen", "mean, families never seen"), ("in_distribution", "mean, a fifth of the others")):
        print(f"{title:<55}" + "".join(f"{100 * result[key][n]['mean_catch']:15.1f}%" for n in NAMES))
    print(f"{'held-out benign flagged':<55}" + "".join(f"{100 * result['unseen'][n]['fp']:15.2f}%" for n in NAMES))
    print(f"share of held-out rows the encoder scores in the cascade: {100 * result['encoder_share']:.1f}%")
    rules = flags["rules"]
    for band in (0.0, 0.25, 0.5, 0.75, 0.9):
        other = tables(z, y, fam, rules, np.array([len(t) for t in texts]), band)
        unseen_mean = summary(other["cascade"], y, fam, unseen)
        result.setdefault("bands", {})[band] = unseen_mean | {"encoder_share": float(other["_undecided"].mean())}
        print(
            f"  cascade band {band:.2f}: families never seen {100 * unseen_mean['mean_catch']:.1f}%,"
            f" benign flagged {100 * unseen_mean['fp']:.2f}%, encoder scores {100 * other['_undecided'].mean():.1f}%"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
