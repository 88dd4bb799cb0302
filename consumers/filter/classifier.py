"""The character stage: a linear model over hashed n-grams and hand-written cues (``.npz``,
written by ``arena filter-train``), scored with numpy, explained by its top contributions;
loaded (loader.py) with ``allow_pickle=False``, so a tampered file cannot run code.

Artifact layout (``.npz``): ``weights`` (float32: one per hashed feature, then one
per cue when ``meta["cues"]`` is present), ``bias`` (float32, one value),
``meta`` (UTF-8 JSON as uint8: format, feature version, hash bits, n-gram orders,
cue version and names, memory settings, threshold, version, training report) and,
when ``meta["memory"]`` is present, the known-attack memory (memory.py):
``memory_sketches`` (uint32, attacks x 32) and ``memory_sizes`` (uint8).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.cues import CUE_NAMES, CUES_VERSION, cue_tokens, cue_vector
from consumers.filter.features import FEATURES_VERSION, Features, featurize, featurize_views, gram_text
from consumers.filter.interface import ClassifierScore
from consumers.filter.memory import Memory, shingles

__all__ = ["ARTIFACT_FORMAT", "DEFAULT_ARTIFACT", "LinearClassifier", "load_linear", "save_linear"]

ARTIFACT_FORMAT = "arenaflow-prompt-classifier/1"  # v1 layout; the cue weights extend ``weights``
DEFAULT_ARTIFACT = Path(__file__).resolve().parent / "artifacts" / "prompt-classifier.npz"


class LinearClassifier:
    """A linear score over the views of a prompt (train.py): hashed character n-grams,
    hashed word n-grams and the hand-written cues (cues.py); probability = sigmoid.

    ``meta["views"]`` names the views in the order of the weight vector. Artifacts
    without it (v3) have one n-gram view of the orders in their metadata. With a
    ``memory`` (v6), the known-attack memory's logit is added.
    """

    blocking = False

    def __init__(
        self,
        weights: np.ndarray,
        bias: float,
        meta: dict[str, Any],
        memory: Memory | None = None,
        benign_reference: np.ndarray | None = None,
    ):
        if meta.get("features") != FEATURES_VERSION:
            raise ValueError(
                f"artifact features {meta.get('features')!r} differ from this code's {FEATURES_VERSION!r}; "
                "retrain with `arena filter-train`"
            )
        self.views = tuple(meta.get("views", ("ngrams",)))
        if "cues" in self.views:
            cues = meta.get("cues", {})
            if cues.get("version") != CUES_VERSION or tuple(cues.get("names", ())) != CUE_NAMES:
                raise ValueError(
                    f"artifact cues {cues.get('version')!r} differ from this code's {CUES_VERSION!r}; "
                    "retrain with `arena filter-train`"
                )
        n = 1 << meta["bits"]
        widths = [len(CUE_NAMES) if v == "cues" else n for v in self.views]
        if len(weights) != sum(widths) or not set(self.views) <= {"ngrams", "chars", "words", "cues"}:
            raise ValueError(f"artifact has {len(weights)} weights, expected {sum(widths)} for views {self.views}")
        weights = weights.astype(np.float32, copy=False)
        offsets = np.cumsum([0, *widths])
        self.view_weights = {v: weights[offsets[i] : offsets[i + 1]] for i, v in enumerate(self.views)}
        self.weights = weights
        self.bias = float(bias)
        self.meta = meta
        self.bits = int(meta["bits"])
        self.char_orders = tuple(meta["char_orders"])
        self.word_orders = tuple(meta["word_orders"])
        self.threshold = float(meta["threshold"])
        self.version = str(meta["version"])
        self.memory = memory
        self.benign_reference = benign_reference  # sorted held-out benign logits (ensemble.py), when stored

    def _features(self, text: str) -> list[Features]:
        if "words" not in self.views:
            orders = self.word_orders if self.views[0] == "ngrams" else ()
            return [featurize(text, self.bits, self.char_orders, orders)]
        return list(featurize_views(text, self.bits, self.char_orders, self.word_orders))

    def logit(self, text: str) -> tuple[float, list[Features], np.ndarray | None, float]:
        """The score's logit, each n-gram view's features, the cue vector (None without cues),
        and the memory's part of the logit (0 without a memory)."""
        feats = self._features(text)
        z = self.bias
        for view, f in zip(self.views, feats, strict=False):
            if len(f.index):
                # add.reduce is what .sum() runs, without its Python wrapper; math.sqrt equals np.sqrt
                z += float(np.add.reduce(self.view_weights[view][f.index])) / math.sqrt(len(f.index))
        cues, remembered = None, 0.0
        words = cue_tokens(feats[0].text) if "cues" in self.views or self.memory is not None else None
        if "cues" in self.views:
            cues = cue_vector(feats[0].text, text, words)
            z += float(cues @ self.view_weights["cues"])
        if self.memory is not None and words is not None:
            remembered = self.memory.logit(shingles(words))
            z += remembered
        return z, feats, cues, remembered

    def score(self, text: str, explain: int = 0, towards_attack: bool | None = None) -> ClassifierScore:
        """The prompt's score; with ``explain``, its top contributions towards the side that decided
        (``towards_attack`` overrides the side: a stage summing this one decides elsewhere)."""
        z, feats, cues, remembered = self.logit(text)
        prob = float(1.0 / (1.0 + np.exp(-z)))
        if explain <= 0:
            return ClassifierScore(round(prob, 6), logit=z)
        # every feature's contribution to the logit, only when explaining (few, flagged prompts)
        parts = [
            self.view_weights[view][f.index].astype(np.float64) / np.sqrt(max(len(f.index), 1))
            for view, f in zip(self.views, feats, strict=False)
        ]
        if cues is not None:
            parts.append(cues * self.view_weights["cues"])
        parts.append(np.array([remembered]))  # last: the memory (0 without one)
        values = np.concatenate(parts)
        # the side that decided: features towards "attack" when flagged, else towards "benign"
        attack = prob >= self.threshold if towards_attack is None else towards_attack
        order = np.argsort(-values if attack else values, kind="stable")[:explain]
        top = tuple((self._name(feats, int(i)), round(float(values[i]), 4)) for i in order if values[i] != 0)
        return ClassifierScore(round(prob, 6), top, z)

    def _name(self, feats: list[Features], i: int) -> str:
        """The text of contribution ``i``: an n-gram of one of the views, a cue's name, or the memory."""
        for f in feats:
            if i < len(f.index):
                return gram_text(f, int(f.index[i]))
            i -= len(f.index)
        if "cues" in self.views:
            if i < len(CUE_NAMES):
                return f"cue:{CUE_NAMES[i]}"
            i -= len(CUE_NAMES)
        return "memory:known_attack"


def save_linear(
    path: str | Path,
    weights: np.ndarray,
    bias: float,
    meta: dict[str, Any],
    memory: Memory | None = None,
    benign_reference: np.ndarray | None = None,
) -> None:
    """Write an artifact that :func:`load_classifier` reads without unpickling (``benign_reference``:
    the held-out benign logits an ensemble calibrates the stage with)."""
    # the metadata names a memory exactly when the arrays are stored
    meta = {k: v for k, v in meta.items() if k != "memory"}
    if memory is not None:
        meta["memory"] = memory.meta()
    payload = np.frombuffer(json.dumps({"format": ARTIFACT_FORMAT, **meta}, sort_keys=True).encode(), dtype=np.uint8)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, Any] = {
        "weights": weights.astype(np.float32),
        "bias": np.array([bias], dtype=np.float32),
        "meta": payload,
        **(memory.arrays() if memory is not None else {}),
    }
    if benign_reference is not None:
        arrays["benign_reference"] = np.sort(benign_reference).astype(np.float32)
    with open(path, "wb") as f:
        np.savez_compressed(f, **arrays)


def load_linear(z: Any, meta: dict[str, Any]) -> LinearClassifier:
    """The character model from an opened artifact (loader.load_stage dispatches on its format)."""
    memory = Memory.load(z, meta["memory"]) if "memory" in meta else None
    reference = np.asarray(z["benign_reference"], dtype=np.float64) if "benign_reference" in z else None
    return LinearClassifier(z["weights"], float(z["bias"][0]), meta, memory, reference)
