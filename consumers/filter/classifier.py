"""The trained classifier stage: load an artifact, score a prompt, explain the score.

Two kinds of artifact sit behind one small interface (:class:`Classifier`):

* a linear model over hashed n-grams and hand-written cues (``.npz``, written by
  ``arena filter-train``), scored with numpy; loaded with ``allow_pickle=False``,
  so a tampered file cannot run code;
* a Hugging Face sequence-classification checkpoint directory (a guard model
  the operator brings), run through transformers (:mod:`consumers.filter.guard`).

Artifact layout (``.npz``): ``weights`` (float32: one per hashed feature, then one
per cue when ``meta["cues"]`` is present), ``bias`` (float32, one value) and
``meta`` (UTF-8 JSON as uint8: format, feature version, hash bits, n-gram orders,
cue version and names, threshold, version, training report).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from consumers.filter.cues import CUE_NAMES, CUES_VERSION, cue_vector
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

ARTIFACT_FORMAT = "arenaflow-prompt-classifier/1"  # v1 layout; the cue weights extend ``weights``
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
    """A linear score over binary, L2-normalized hashed n-grams (features.py) and, when
    the artifact has them, the hand-written cues (cues.py); probability = sigmoid."""

    blocking = False

    def __init__(self, weights: np.ndarray, bias: float, meta: dict[str, Any]):
        if meta.get("features") != FEATURES_VERSION:
            raise ValueError(
                f"artifact features {meta.get('features')!r} differ from this code's {FEATURES_VERSION!r}; "
                "retrain with `arena filter-train`"
            )
        cues = meta.get("cues")
        if cues is not None and (cues.get("version") != CUES_VERSION or tuple(cues.get("names", ())) != CUE_NAMES):
            raise ValueError(
                f"artifact cues {cues.get('version')!r} differ from this code's {CUES_VERSION!r}; "
                "retrain with `arena filter-train`"
            )
        n_cues = len(CUE_NAMES) if cues is not None else 0
        if len(weights) != (1 << meta["bits"]) + n_cues:
            raise ValueError(f"artifact has {len(weights)} weights, expected 2**{meta['bits']} + {n_cues} cues")
        weights = weights.astype(np.float32, copy=False)
        self.weights = weights[: 1 << meta["bits"]]
        self.cue_weights = weights[1 << meta["bits"] :].astype(np.float64) if n_cues else None
        self.bias = float(bias)
        self.meta = meta
        self.bits = int(meta["bits"])
        self.char_orders = tuple(meta["char_orders"])
        self.word_orders = tuple(meta["word_orders"])
        self.threshold = float(meta["threshold"])
        self.version = str(meta["version"])

    def logit(self, text: str) -> tuple[float, Any, np.ndarray | None]:
        """The score's logit, the n-gram features, and each cue's contribution (None without cues)."""
        f = featurize(text, self.bits, self.char_orders, self.word_orders)
        z = self.bias
        if len(f.index):
            z += float(self.weights[f.index].sum()) / np.sqrt(len(f.index))
        cue_part = None
        if self.cue_weights is not None:
            cue_part = cue_vector(f.text, text) * self.cue_weights
            z += float(cue_part.sum())
        return z, f, cue_part

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        z, f, cue_part = self.logit(text)
        prob = float(1.0 / (1.0 + np.exp(-z)))
        if explain <= 0:
            return ClassifierScore(round(prob, 6))
        n = len(f.index)
        values = self.weights[f.index].astype(np.float64) / np.sqrt(max(n, 1))
        if cue_part is not None:
            values = np.concatenate([values, cue_part])
        # the side that decided: features towards "attack" when flagged, else towards "benign"
        order = np.argsort(-values if prob >= self.threshold else values, kind="stable")[:explain]
        top = tuple(
            (gram_text(f, int(f.index[i])) if i < n else f"cue:{CUE_NAMES[i - n]}", round(float(values[i]), 4))
            for i in order
            if values[i] != 0
        )
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
