"""Training of the word stage (words.py): hashed word n-gram counts, TF-IDF, logistic regression.

The same rows and sample weights as the character stage (train.py: family-balanced,
the dev families boosted), and the same protocols (protocols.py), so the two stages'
held-out scores line up row by row and the ensemble is measured from them. Inside every
fold the IDF is fitted on that fold's training rows only, as the final model's is on all
of them: a held-out family's words never inform the weighting it is scored with.

scikit-learn does the fitting (``TfidfTransformer``, ``LogisticRegression``); serving
recomputes the same TF-IDF in numpy (words.tf_idf).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from consumers.filter.features import FEATURES_VERSION, featurize
from consumers.filter.words import BITS, ORDERS
from lab.filter import heldout, protocols
from lab.filter.corpus import Row

__all__ = ["TrainedWords", "WordFit", "fit", "fitter", "matrix", "meta", "train"]

C = 1.0  # chosen among 0.3, 1 and 10 on the ensemble's LOSO mean (docs/filter.md): optimistic by that choice


def matrix(rows: Sequence[Row], bits: int = BITS, orders: tuple[int, ...] = ORDERS):
    """CSR matrix of hashed word n-gram counts (the raw term frequencies), one row per prompt."""
    import scipy.sparse as sp  # noqa: PLC0415

    feats = [featurize(r.text, bits, (), orders) for r in rows]
    indptr = np.cumsum([0] + [len(f.index) for f in feats])
    index = np.concatenate([f.index for f in feats]) if feats else np.zeros(0, dtype=np.int64)
    counts = np.concatenate([f.counts for f in feats if f.counts is not None]) if feats else np.zeros(0)
    return sp.csr_matrix((counts.astype(np.float64), index, indptr), shape=(len(rows), 1 << bits))


@dataclass(frozen=True)
class WordFit:
    """A fitted word stage: logistic regression weights over TF-IDF values, and the IDF's counts."""

    weights: np.ndarray  # float32, one per bucket
    bias: float
    df: np.ndarray  # training prompts holding each bucket
    documents: int  # how many training prompts the IDF counted

    def logits(self, counts) -> np.ndarray:
        return np.asarray(_tfidf(counts, self.df, self.documents) @ self.weights.astype(np.float64)).ravel() + self.bias


def _tfidf(counts, df: np.ndarray, n: int):
    """scikit-learn's TfidfTransformer(sublinear_tf=True) with this IDF (the class, not refitted)."""
    from sklearn.feature_extraction.text import TfidfTransformer  # noqa: PLC0415

    t = TfidfTransformer(sublinear_tf=True)
    t.idf_ = np.log((1.0 + n) / (1.0 + df)) + 1.0
    return t.transform(counts)


def fit(counts, y: np.ndarray, c: float, seed: int, sample_weight: np.ndarray) -> WordFit:
    """The IDF of ``counts``' rows, then a logistic regression on their TF-IDF values."""
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415

    df = np.bincount(counts.indices, minlength=counts.shape[1]).astype(np.float64)
    n = counts.shape[0]
    model = LogisticRegression(C=c, solver="liblinear", dual=True, max_iter=1000, random_state=seed)
    model.fit(_tfidf(counts, df, n), y, sample_weight=sample_weight)
    return WordFit(model.coef_[0].astype(np.float32), float(model.intercept_[0]), df, n)


def fitter(c: float = C, seed: int = 0) -> heldout.Fit:
    def fit_rows(x, y, sample_weight) -> Callable[[Any], np.ndarray]:
        return fit(x, y, c, seed, sample_weight).logits

    return fit_rows


def meta(
    model: WordFit, bits: int, orders: tuple[int, ...], c: float, seed: int, threshold: float, report: dict
) -> dict[str, Any]:
    """The artifact's metadata; the version hashes the weights, the bias and the IDF's counts."""
    digest = hashlib.sha256(
        model.weights.tobytes() + np.float32(model.bias).tobytes() + model.df.astype(np.uint32).tobytes()
    ).hexdigest()[:12]
    return {
        "version": f"words{min(orders)}-{max(orders)}-tfidf-lr-{digest}",
        "features": FEATURES_VERSION,
        "bits": bits,
        "word_orders": list(orders),
        "documents": model.documents,
        "threshold": threshold,
        "model": {"family": "TF-IDF (sublinear tf, smoothed idf, l2) + LR (liblinear dual)", "C": c, "seed": seed},
        "report": report,
    }


@dataclass(frozen=True)
class TrainedWords:
    """What :func:`train` fits: the model, the artifact's metadata, the held-out scores (None without
    the protocols) and the benign logits that calibrate the stage (held out, or in sample)."""

    model: WordFit
    meta: dict[str, Any]
    heldout: protocols.HeldOut | None
    reference: np.ndarray


def train(
    fitted: Sequence[Row],
    y: np.ndarray,
    families: np.ndarray,
    boost: dict[str, float] | None,
    *,
    bits: int = BITS,
    orders: tuple[int, ...] = ORDERS,
    c: float = C,
    seed: int = 0,
    balance: str = "family",
    dev: protocols.DevRows | None = None,
    dev_texts: Sequence[Row] = (),
    evaluate_heldout: bool = True,
    fp_cap: float = 0.003,
    log: Callable[[str], None] = print,
) -> TrainedWords:
    """Fit the word stage on the rows the character stage fits (train.training_set), with the same
    sample weights; with ``evaluate_heldout``, every protocol too (``dev``: the dev file's labels and
    rules flags; ``dev_texts``: its rows, featurized here when the stage does not train on them)."""
    x = matrix(fitted, bits, orders)
    weights = heldout.family_weights(y, families, balance, boost)
    model = fit(x, y, c, seed, weights)
    report: dict[str, Any] = {"fp_cap": fp_cap, "rows": len(fitted), "attacks": int(y.sum()), "balance": balance}
    held = None
    if evaluate_heldout:
        if dev is not None:
            dev_x = x[len(fitted) - len(dev.y) :] if dev.in_training else matrix(dev_texts, bits, orders)
            dev = protocols.DevRows(dev_x, dev.y, dev.families, dev.rules, dev.in_training)
        setup = protocols.Setup(y, families, balance, seed, boost, dev, fp_cap, log)
        held, tables, t = protocols.evaluate(x, fitter(c, seed), setup, model.logits, _vstack)
        report.update(tables)
    else:
        t = heldout.threshold_at(model.logits(x)[~y], fp_cap)
    report["threshold_from"] = "loso" if evaluate_heldout else "in-sample"
    reference = held.loso[~y] if held is not None else model.logits(x)[~y]
    threshold = float(1.0 / (1.0 + np.exp(-t)))
    return TrainedWords(model, meta(model, bits, orders, c, seed, threshold, report), held, reference)


def _vstack(a, b):
    import scipy.sparse as sp  # noqa: PLC0415

    return sp.vstack([a, b], format="csr")
