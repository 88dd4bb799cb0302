"""The encoder stage: all-MiniLM-L6-v2 fine-tuned on the task, served by ONNX Runtime (int8).

A learned view of a prompt beside the lexical ones: the character and word stages see
its surface and phrasing, the encoder its meaning, so a paraphrased attack whose words
the lexical stages never saw can still score high.

Long prompts are not cut to their first window: the text's tokens are split into windows
of ``max_tokens`` (with ``stride`` tokens of overlap), every window is scored, and the
prompt's logit is the largest (an attack hidden in the middle of a 10,000-character
prompt counts). Scoring is batched: concurrent calls (the filter's worker threads) are
gathered into one ONNX Runtime call (:class:`Batcher`).

Artifact: a directory (lab/filter/train_encoder.py writes it) holding ``model.onnx``
(input_ids, attention_mask -> one logit per window; weights dynamically quantized to
int8), ``tokenizer.json``, ``reference.npy`` (the sorted logits of held-out benign
prompts, the ensemble's calibration) and ``encoder.json`` (format, version, window,
threshold, the sha256 of every file, the training report). The version names the
model file's hash; a file whose hash differs from the metadata is refused.

The weights (23 MB) are not committed: the training run moves ``model.onnx`` into the
model cache (``$ARENA_MODEL_CACHE/prompt-encoder/<sha256>.onnx``, default
``~/.cache/arenaflow/models``), named by the hash ``encoder.json`` records, and the
loader reads it there; a ``model.onnx`` beside ``encoder.json`` (a run not yet moved)
is read first.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from consumers.filter.interface import ClassifierScore

__all__ = [
    "ENCODER_FORMAT",
    "Batcher",
    "EncoderClassifier",
    "artifact_file",
    "file_digest",
    "load_encoder",
    "stash_weights",
    "windows",
]

ENCODER_FORMAT = "arenaflow-prompt-encoder/1"
FILES = ("model.onnx", "tokenizer.json", "reference.npy")
#: The encoders' weights, outside the checkout, by sha256 (`arena filter-train --encoder` builds them).
WEIGHTS_CACHE = Path(os.environ.get("ARENA_MODEL_CACHE") or Path.home() / ".cache" / "arenaflow" / "models") / (
    "prompt-encoder"
)


def artifact_file(directory: Path, name: str, meta: dict[str, Any]) -> Path:
    """One of the artifact's files: ``model.onnx`` from the weights cache unless it is
    beside ``encoder.json``; the others beside it."""
    local = directory / name
    if name != "model.onnx" or local.is_file():
        return local
    return WEIGHTS_CACHE / f"{meta['sha256'][name]}.onnx"


def stash_weights(directory: Path, meta: dict[str, Any]) -> Path:
    """Moves a trained ``model.onnx`` into the weights cache, where the loader finds it."""
    target = WEIGHTS_CACHE / f"{meta['sha256']['model.onnx']}.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(directory / "model.onnx", target)
    return target


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def windows(ids: list[int], size: int, stride: int) -> list[list[int]]:
    """``ids`` cut into windows of at most ``size`` tokens, each overlapping the previous by ``stride``."""
    if len(ids) <= size:
        return [ids]
    step = size - stride
    starts = range(0, len(ids) - stride, step)
    return [ids[s : s + size] for s in starts]


class EncoderClassifier:
    """The encoder stage behind the :class:`~consumers.filter.interface.Classifier` interface."""

    blocking = True  # milliseconds of ONNX Runtime: the consumer scores in worker threads
    cascade = True  # scored only where the lexical stages are unsure (stage.run_stages)
    explains = False  # no n-gram explanation: a flagged prompt is not scored again to explain it

    def __init__(self, directory: Path, meta: dict[str, Any], threads: int = 1, max_batch: int = 32):
        import onnxruntime as ort  # noqa: PLC0415 - only a filter serving the encoder needs it
        from tokenizers import Tokenizer  # noqa: PLC0415

        self.meta = meta
        self.version = str(meta["version"])
        self.threshold = float(meta["threshold"])
        self.max_tokens = int(meta["max_tokens"])
        self.stride = int(meta["stride"])
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.cls_id, self.sep_id = int(meta["cls_id"]), int(meta["sep_id"])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self.session = ort.InferenceSession(
            str(artifact_file(directory, "model.onnx", meta)), options, providers=["CPUExecutionProvider"]
        )
        self.benign_reference = np.load(directory / "reference.npy", allow_pickle=False).astype(np.float64)
        self._batcher = Batcher(self.logits, max_batch)

    def tokens(self, text: str) -> list[list[int]]:
        """The prompt's windows, each with [CLS] and [SEP]."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [[self.cls_id, *w, self.sep_id] for w in windows(ids, self.max_tokens - 2, self.stride)]

    def logits(self, texts: list[str]) -> list[float]:
        """Each prompt's logit (its highest window's), from one batched run per length band."""
        chunks = [self.tokens(t) for t in texts]
        flat = [(i, w) for i, ws in enumerate(chunks) for w in ws]
        out = np.full(len(texts), -math.inf)
        # sorted by length, so padding stays small; at most 64 windows a run bounds memory
        flat.sort(key=lambda iw: len(iw[1]))
        for start in range(0, len(flat), 64):
            part = flat[start : start + 64]
            width = len(part[-1][1])
            ids = np.zeros((len(part), width), dtype=np.int64)
            mask = np.zeros((len(part), width), dtype=np.int64)
            for row, (_, w) in enumerate(part):
                ids[row, : len(w)] = w
                mask[row, : len(w)] = 1
            (z,) = self.session.run(None, {"input_ids": ids, "attention_mask": mask})
            for (i, _), value in zip(part, np.asarray(z).reshape(-1), strict=True):
                out[i] = max(out[i], float(value))
        return [float(v) for v in out]

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        z = self._batcher.logit(text)
        return ClassifierScore(round(float(1.0 / (1.0 + math.exp(-z))), 6), (), z)  # no n-gram explanation


class Batcher:
    """Gathers concurrent :meth:`logit` calls into one batched call: the first caller to find no
    batch running runs one with every prompt waiting (up to ``max_batch``); the others wait for it.
    A run that fails fails every call it held (each raises the error), never leaves one waiting."""

    def __init__(self, run, max_batch: int):
        self._run = run
        self._max = max_batch
        self._lock = threading.Condition()
        self._waiting: list[tuple[str, list[float | BaseException | None]]] = []
        self._busy = False
        self.batches = 0  # how many runs, and how many prompts they held (the benchmark reads them)
        self.prompts = 0

    def logit(self, text: str) -> float:
        slot: list[float | BaseException | None] = [None]
        with self._lock:
            self._waiting.append((text, slot))
            while slot[0] is None and self._busy:
                self._lock.wait()
            if slot[0] is None:
                self._busy = True
        if slot[0] is None:
            self._lead(slot)
        if isinstance(slot[0], BaseException):
            raise slot[0]
        assert slot[0] is not None
        return slot[0]

    def _lead(self, slot: list[float | BaseException | None]) -> None:
        """Run batches of the waiting calls until ``slot``'s own is done (it is in the first one or a later one)."""
        try:
            while slot[0] is None:
                with self._lock:
                    batch, self._waiting = self._waiting[: self._max], self._waiting[self._max :]
                values: list[float | BaseException]
                try:
                    values = list(self._run([t for t, _ in batch]))
                except Exception as exc:  # noqa: BLE001 - every caller in the batch gets the error
                    values = [exc] * len(batch)
                with self._lock:
                    for (_, s), v in zip(batch, values, strict=True):
                        s[0] = v
                    self.batches += 1
                    self.prompts += len(batch)
                    self._lock.notify_all()
        finally:
            with self._lock:
                self._busy = False
                self._lock.notify_all()


def load_encoder(directory: str | Path, threads: int = 1) -> EncoderClassifier:
    """The encoder stage from its artifact directory, its files checked against their recorded hashes."""
    d = Path(directory)
    meta = json.loads((d / "encoder.json").read_text(encoding="utf-8"))
    if meta.get("format") != ENCODER_FORMAT:
        raise ValueError(f"{d}: not a prompt encoder artifact (format {meta.get('format')!r})")
    for name in FILES:
        path = artifact_file(d, name, meta)
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: missing; the encoder's weights are built by `arena filter-train --encoder`"
            )
        if file_digest(path) != meta["sha256"][name]:
            raise ValueError(f"{path}: its hash differs from encoder.json's; retrain with `arena filter-train`")
    return EncoderClassifier(d, meta, threads)
