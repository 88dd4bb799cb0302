"""The trained classifier stage: load an artifact, score a prompt, explain the score.

Two kinds of artifact sit behind one small interface (:class:`Classifier`):

* a linear model over hashed n-grams (``.npz``, written by ``arena filter-train``),
  scored with numpy; loaded with ``allow_pickle=False``, so a tampered file
  cannot run code;
* a Hugging Face sequence-classification checkpoint directory (a guard model
  the operator brings), run through transformers (:mod:`consumers.filter.guard`).

Artifact layout (``.npz``): ``weights`` (float32, one per hashed feature),
``bias`` (float32, one value) and ``meta`` (UTF-8 JSON as uint8: format,
feature version, hash bits, n-gram orders, threshold, version, training report).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from consumers.filter.features import FEATURES_VERSION, featurize, gram_text

__all__ = [
    "ARTIFACT_FORMAT",
    "DEFAULT_ARTIFACT",
    "Classifier",
    "ClassifierScore",
    "LinearClassifier",
    "load_classifier",
    "save_linear",
]

ARTIFACT_FORMAT = "arenaflow-prompt-classifier/1"
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "prompt-classifier.npz"


@dataclass(frozen=True)
class ClassifierScore:
    """Probability that a prompt is an attack, and the n-grams that pushed it most."""

    score: float
    features: tuple[tuple[str, float], ...] = ()  # (n-gram, contribution to the logit), largest first


class Classifier(Protocol):
    """What the filter needs from a trained classifier."""

    version: str  # names the artifact; recorded on every event
    threshold: float  # the artifact's own threshold on ``score``
    blocking: bool  # True when scoring is slow enough to belong off the event loop

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        """Score one prompt; with ``explain`` > 0, also its top features."""
        ...


class LinearClassifier:
    """Logistic regression over binary, L2-normalized hashed n-grams (features.py)."""

    blocking = False

    def __init__(self, weights: np.ndarray, bias: float, meta: dict[str, Any]):
        if meta.get("features") != FEATURES_VERSION:
            raise ValueError(
                f"artifact features {meta.get('features')!r} differ from this code's {FEATURES_VERSION!r}; "
                "retrain with `arena filter-train`"
            )
        if len(weights) != 1 << meta["bits"]:
            raise ValueError(f"artifact has {len(weights)} weights, expected 2**{meta['bits']}")
        self.weights = weights.astype(np.float32, copy=False)
        self.bias = float(bias)
        self.meta = meta
        self.bits = int(meta["bits"])
        self.char_orders = tuple(meta["char_orders"])
        self.word_orders = tuple(meta["word_orders"])
        self.threshold = float(meta["threshold"])
        self.version = str(meta["version"])

    def logit(self, text: str) -> tuple[float, Any]:
        f = featurize(text, self.bits, self.char_orders, self.word_orders)
        if not len(f.index):
            return self.bias, f
        return self.bias + float(self.weights[f.index].sum()) / np.sqrt(len(f.index)), f

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        z, f = self.logit(text)
        prob = float(1.0 / (1.0 + np.exp(-z)))
        if explain <= 0 or not len(f.index):
            return ClassifierScore(round(prob, 6))
        contrib = self.weights[f.index] / np.sqrt(len(f.index))
        # the side that decided: features towards "attack" when flagged, else towards "benign"
        order = np.argsort(-contrib if prob >= self.threshold else contrib)[:explain]
        top = tuple((gram_text(f, int(f.index[i])), round(float(contrib[i]), 4)) for i in order)
        return ClassifierScore(round(prob, 6), top)


def save_linear(path: str | Path, weights: np.ndarray, bias: float, meta: dict[str, Any]) -> None:
    """Write an artifact that :func:`load_classifier` reads without unpickling."""
    payload = np.frombuffer(json.dumps({"format": ARTIFACT_FORMAT, **meta}, sort_keys=True).encode(), dtype=np.uint8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez_compressed(
            f, weights=weights.astype(np.float32), bias=np.array([bias], dtype=np.float32), meta=payload
        )


def _load_linear(path: Path) -> LinearClassifier:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes().decode())
        if meta.get("format") != ARTIFACT_FORMAT:
            raise ValueError(f"{path}: not a prompt classifier artifact (format {meta.get('format')!r})")
        return LinearClassifier(z["weights"], float(z["bias"][0]), meta)


def load_classifier(path: str | Path, attack_label: str | None = None) -> Classifier:
    """A linear ``.npz`` artifact, or a Hugging Face checkpoint directory (has config.json)."""
    p = Path(path)
    if p.is_dir():
        from consumers.filter.guard import GuardModel  # noqa: PLC0415 - torch only when a guard is configured

        return GuardModel(p, attack_label)
    if not p.is_file():
        raise FileNotFoundError(f"classifier artifact {p} not found; train one with `arena filter-train`")
    return _load_linear(p)
