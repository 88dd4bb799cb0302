"""`arena filter-train`: fit the classifier stage and measure it honestly.

Model: logistic regression (liblinear, dual, balanced class weights) over the
hashed n-grams of features.py. Training is deterministic for a seed: features
are hashes, and liblinear's coordinate order comes from ``random_state``.

Evaluation, written into the artifact's metadata and printed by `arena filter-eval`:

* leave-one-source-out (LOSO): for each source family, a model trained on all
  other families scores it. One threshold is then chosen on the pooled scores
  of benign prompts *of held-out sources* (each scored by a model that never saw
  its source) so that at most ``fp_cap`` of them are rejected; catch is reported
  per attack family at that threshold, and their mean;
* in-distribution: stratified k-fold over the training file, same threshold rule;
* the dev file (JailbreakBench attacks, arena-hard benign): the final model at the
  LOSO threshold, per family.

The shipped threshold is the LOSO one: the cap then holds for benign sources the
model has not seen, which is what production traffic is.

scikit-learn is needed here only; serving scores the saved weights with numpy.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.classifier import DEFAULT_ARTIFACT, save_linear
from consumers.filter.corpus import Row, load_rows
from consumers.filter.features import CHAR_ORDERS, FEATURES_VERSION, WORD_ORDERS, featurize

__all__ = ["fit", "loso_scores", "main", "matrix", "threshold_at", "train"]

FP_CAP = 0.003
TRAIN_FILE = Path(__file__).resolve().parents[3] / "shared/data/injection-train.jsonl"
DEV_FILE = TRAIN_FILE.with_name("injection-dev.jsonl")


def matrix(rows: Sequence[Row], bits: int, char_orders=CHAR_ORDERS, word_orders=WORD_ORDERS):
    """CSR matrix of binary, L2-normalized hashed n-grams, one row per prompt."""
    import scipy.sparse as sp  # noqa: PLC0415

    index = [featurize(r.text, bits, char_orders, word_orders).index for r in rows]
    indptr = np.cumsum([0] + [len(i) for i in index])
    data = np.concatenate([np.full(len(i), 1.0 / np.sqrt(max(len(i), 1))) for i in index])
    return sp.csr_matrix((data, np.concatenate(index), indptr), shape=(len(rows), 1 << bits))


def fit(x, y: np.ndarray, c: float, seed: int) -> tuple[np.ndarray, float]:
    """Weights and bias of a logistic regression; the same inputs and seed give the same weights."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

    # dual liblinear: fast when features far outnumber prompts, as here
    model = LogisticRegression(C=c, class_weight="balanced", solver="liblinear", dual=True, max_iter=500)
    model.set_params(random_state=seed)
    model.fit(x, y)
    return model.coef_[0].astype(np.float32), float(model.intercept_[0])


def _logits(x, w: np.ndarray, b: float) -> np.ndarray:
    return np.asarray(x @ w.astype(np.float64)).ravel() + b


def loso_scores(rows: Sequence[Row], x, y: np.ndarray, c: float, seed: int) -> np.ndarray:
    """Each row's logit from a model that never saw the row's source family."""
    families = np.array([r.family for r in rows])
    out = np.zeros(len(rows))
    for fam in sorted(set(families)):
        held = families == fam
        w, b = fit(x[~held], y[~held], c, seed)
        out[held] = _logits(x[held], w, b)
    return out


def kfold_scores(x, y: np.ndarray, c: float, seed: int, k: int = 5) -> np.ndarray:
    """Out-of-fold logits of a stratified k-fold split (in-distribution figure)."""
    from sklearn.model_selection import StratifiedKFold  # noqa: PLC0415

    out = np.zeros(len(y))
    for train_idx, test_idx in StratifiedKFold(k, shuffle=True, random_state=seed).split(np.zeros(len(y)), y):
        w, b = fit(x[train_idx], y[train_idx], c, seed)
        out[test_idx] = _logits(x[test_idx], w, b)
    return out


def threshold_at(benign_logits: np.ndarray, fp_cap: float) -> float:
    """Lowest logit threshold (score >= t flags) rejecting at most ``fp_cap`` of the benign prompts."""
    ordered = np.sort(benign_logits)[::-1]
    allowed = int(np.floor(fp_cap * len(ordered)))
    if allowed >= len(ordered):
        return float(ordered[-1])
    return float(np.nextafter(ordered[allowed], np.inf))  # just above the first benign prompt not allowed


def _table(rows: Sequence[Row], logits: np.ndarray, t: float) -> dict[str, Any]:
    families = np.array([r.family for r in rows])
    attack = np.array([r.attack for r in rows])
    flagged = logits >= t
    per = {}
    for fam in sorted(set(families)):
        sel = families == fam
        n_att, n_ben = int((sel & attack).sum()), int((sel & ~attack).sum())
        per[fam] = {
            "attacks": n_att,
            "caught": float(flagged[sel & attack].mean()) if n_att else None,
            "benign": n_ben,
            "fp": float(flagged[sel & ~attack].mean()) if n_ben else None,
        }
    catches = [v["caught"] for v in per.values() if v["caught"] is not None]
    return {
        "threshold": _prob(t),
        "families": per,
        "mean_catch": float(np.mean(catches)) if catches else None,
        "pooled_catch": float(flagged[attack].mean()) if attack.any() else None,
        "fp": float(flagged[~attack].mean()) if (~attack).any() else None,
    }


def _prob(logit: float) -> float:
    return float(1.0 / (1.0 + np.exp(-logit)))


def _logit(prob: float) -> float:
    return float(np.log(prob / (1.0 - prob)))


def train(
    rows: Sequence[Row],
    *,
    bits: int = 18,
    c: float = 1.0,
    seed: int = 0,
    evaluate: bool = True,
    dev: Sequence[Row] = (),
    fp_cap: float = FP_CAP,
    log: Callable[[str], None] = print,
) -> tuple[np.ndarray, float, dict[str, Any]]:
    """Fit on ``rows``; with ``evaluate``, also the LOSO / k-fold / dev figures. Returns weights, bias, meta."""
    y = np.array([r.attack for r in rows])
    x = matrix(rows, bits)
    w, b = fit(x, y, c, seed)
    report: dict[str, Any] = {"fp_cap": fp_cap, "rows": len(rows), "attacks": int(y.sum())}
    if evaluate:
        log(f"leave-one-source-out over {len({r.family for r in rows})} families ...")
        loso = loso_scores(rows, x, y, c, seed)
        t = threshold_at(loso[~y], fp_cap)
        report["loso"] = _table(rows, loso, t)
        log("in-distribution 5-fold ...")
        kf = kfold_scores(x, y, c, seed)
        report["in_distribution"] = _table(rows, kf, threshold_at(kf[~y], fp_cap))
        if dev:
            report["dev"] = _table(dev, _logits(matrix(dev, bits), w, b), t)
    else:  # quick runs (tests, small subsets): the in-sample threshold, marked as such
        t = threshold_at(_logits(x, w, b)[~y], fp_cap)
    report["threshold_from"] = "loso" if evaluate else "in-sample"
    digest = hashlib.sha256(w.tobytes() + np.float32(b).tobytes()).hexdigest()[:12]
    meta = {
        "version": f"ngram-lr-{digest}",
        "features": FEATURES_VERSION,
        "bits": bits,
        "char_orders": list(CHAR_ORDERS),
        "word_orders": list(WORD_ORDERS),
        "threshold": _prob(t),
        "model": {"family": "logistic regression, liblinear dual", "C": c, "seed": seed},
        "report": report,
    }
    return w, b, meta


def main(argv: list[str] | None = None) -> int:
    """``arena filter-train [--train FILE] [--dev FILE] [--out PATH] [--seed N] [--limit N] [--no-eval]``."""
    p = argparse.ArgumentParser(prog="arena filter-train", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", default=str(TRAIN_FILE), help="labelled JSONL: {text, label, source}")
    p.add_argument("--dev", default=str(DEV_FILE), help="extra test file reported per family ('' to skip)")
    p.add_argument("--out", default=str(DEFAULT_ARTIFACT), help="artifact path (.npz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bits", type=int, default=18, help="log2 of the hashed feature space")
    p.add_argument("--C", type=float, default=1.0, dest="c", help="inverse regularization strength")
    p.add_argument("--limit", type=int, default=None, help="at most N rows per source family (quick runs)")
    p.add_argument("--no-eval", action="store_true", help="skip LOSO/k-fold; threshold from the training rows")
    args = p.parse_args(argv)
    try:
        rows = load_rows(args.train, args.limit)
        dev = load_rows(args.dev, args.limit) if args.dev and Path(args.dev).is_file() and not args.no_eval else []
    except (OSError, ValueError, KeyError) as exc:
        print(f"filter-train: cannot read the corpus: {exc}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    w, b, meta = train(rows, bits=args.bits, c=args.c, seed=args.seed, evaluate=not args.no_eval, dev=dev)
    save_linear(args.out, w, b, meta)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB), version {meta['version']}, threshold {meta['threshold']:.4f}")
    print(f"trained on {len(rows)} rows in {time.perf_counter() - start:.0f} s; `arena filter-eval` prints the tables")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
