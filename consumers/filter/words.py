"""The word stage: TF-IDF of hashed word n-grams and a logistic regression, scored with numpy.

A second lexical view beside the character model (classifier.py), trained on the same
rows: the character n-grams see the surface of an attack (spelling, obfuscation,
templates), the words see its phrasing, and the two miss different families.

Features: the word 1-``max``-grams of the classifier's normalized text (features.py:
the skeleton, folded and lower-cased; words are runs of word characters), hashed into
``2**bits`` buckets. Each prompt's vector is scikit-learn's ``TfidfTransformer`` with
``sublinear_tf=True`` and its default smoothed IDF, reproduced here in numpy:

    value[f] = (1 + ln count[f]) * idf[f],  idf[f] = ln((1 + n) / (1 + df[f])) + 1,

then L2-normalized, where ``df`` counts the training prompts holding bucket ``f`` and
``n`` is their number. The logit is ``b + w . value``; the score is its sigmoid (a
ranking score; the ensemble calibrates it on held-out benign prompts, ensemble.py).

Artifact (``.npz``, loaded with ``allow_pickle=False``): ``weights`` (float32, one per
bucket), ``bias``, ``df`` (uint32, one per bucket), ``benign_reference`` (float32: the
sorted leave-one-source-out logits of the benign training prompts, the calibration) and
``meta`` (UTF-8 JSON as uint8: format, feature version, bits, orders, threshold,
version, training report).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.features import FEATURES_VERSION, Features, featurize, gram_text
from consumers.filter.interface import ClassifierScore

__all__ = ["BITS", "ORDERS", "WORDS_FORMAT", "WordClassifier", "save_words", "tf_idf"]

WORDS_FORMAT = "arenaflow-word-tfidf/1"
BITS = 18  # 2^20 measured 1.5 points better held out alone, at a 4.5 MB artifact (1.1 MB here)
ORDERS = (1, 2, 3, 4)


def idf_of(df: np.ndarray, n: int) -> np.ndarray:
    """scikit-learn's smoothed IDF (TfidfTransformer(smooth_idf=True)), float64."""
    return np.log((1.0 + n) / (1.0 + df.astype(np.float64))) + 1.0


def tf_idf(features: Features, idf: np.ndarray) -> np.ndarray:
    """The L2-normalized sublinear TF-IDF values of ``features.index`` (float64)."""
    if not len(features.index):
        return np.zeros(0)
    assert features.counts is not None
    values = (1.0 + np.log(features.counts)) * idf[features.index]
    return values / math.sqrt(float(values @ values))


class WordClassifier:
    """The word stage behind the :class:`~consumers.filter.classifier.Classifier` interface."""

    blocking = False

    def __init__(
        self,
        weights: np.ndarray,
        bias: float,
        df: np.ndarray,
        meta: dict[str, Any],
        benign_reference: np.ndarray | None = None,
    ):
        if meta.get("features") != FEATURES_VERSION:
            raise ValueError(
                f"artifact features {meta.get('features')!r} differ from this code's {FEATURES_VERSION!r}; "
                "retrain with `arena filter-train`"
            )
        self.bits = int(meta["bits"])
        if len(weights) != 1 << self.bits or len(df) != len(weights):
            raise ValueError(f"word artifact has {len(weights)} weights and {len(df)} df for {self.bits} bits")
        self.orders = tuple(int(k) for k in meta["word_orders"])
        self.weights = weights.astype(np.float64)
        self.bias = float(bias)
        self.idf = idf_of(df, int(meta["documents"]))
        self.meta = meta
        self.threshold = float(meta["threshold"])
        self.version = str(meta["version"])
        self.benign_reference = benign_reference

    def logit(self, text: str) -> tuple[float, Features, np.ndarray]:
        """The logit, the prompt's features and their TF-IDF values."""
        feats = featurize(text, self.bits, (), self.orders)
        values = tf_idf(feats, self.idf)
        return self.bias + float(self.weights[feats.index] @ values), feats, values

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        z, feats, values = self.logit(text)
        prob = float(1.0 / (1.0 + np.exp(-z)))
        if explain <= 0:
            return ClassifierScore(round(prob, 6), logit=z)
        parts = self.weights[feats.index] * values
        order = np.argsort(-parts if prob >= self.threshold else parts, kind="stable")[:explain]
        top = tuple((gram_text(feats, int(feats.index[i])), round(float(parts[i]), 4)) for i in order if parts[i])
        return ClassifierScore(round(prob, 6), top, z)


def save_words(
    path: str | Path,
    weights: np.ndarray,
    bias: float,
    df: np.ndarray,
    meta: dict[str, Any],
    benign_reference: np.ndarray | None = None,
) -> None:
    """Write a word-stage artifact that classifier.load_classifier reads without unpickling."""
    payload = np.frombuffer(json.dumps({"format": WORDS_FORMAT, **meta}, sort_keys=True).encode(), dtype=np.uint8)
    arrays: dict[str, Any] = {
        "weights": weights.astype(np.float32),
        "bias": np.array([bias], dtype=np.float32),
        "df": df.astype(np.uint32),
        "meta": payload,
    }
    if benign_reference is not None:
        arrays["benign_reference"] = np.sort(benign_reference).astype(np.float32)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_words(z: Any, meta: dict[str, Any]) -> WordClassifier:
    """A word stage from an opened artifact (classifier.load_classifier dispatches on its format)."""
    reference = np.asarray(z["benign_reference"], dtype=np.float64) if "benign_reference" in z else None
    return WordClassifier(z["weights"], float(z["bias"][0]), np.asarray(z["df"]), meta, reference)
