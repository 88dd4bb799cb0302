"""Bring-your-own guard model: a Hugging Face sequence-classification checkpoint.

The operator names a local checkpoint directory (config.json, weights and a
tokenizer); nothing is downloaded. The attack probability is the softmax mass
of the label that means "attack": ``attack_label`` when given, else the first
label whose name says injection/jailbreak/unsafe, else label 1.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

from consumers.filter.interface import ClassifierScore

__all__ = ["GuardModel"]

_ATTACK_NAME = re.compile(r"inject|jailbreak|attack|unsafe|malicious|harmful", re.I)


class GuardModel:
    """A transformers classifier behind the :class:`~consumers.filter.classifier.Classifier` interface."""

    blocking = True  # a forward pass takes milliseconds: the consumer runs it in a worker thread
    threshold = 0.5
    explains = False  # no n-gram explanation: a flagged prompt is not scored again to explain it

    def __init__(self, path: Path, attack_label: str | None = None, max_tokens: int = 512):
        import torch  # noqa: PLC0415
        from transformers import AutoModelForSequenceClassification, AutoTokenizer  # noqa: PLC0415

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
        # never past the model's position table: longer prompts are cut, not crashed on
        self.max_tokens = min(max_tokens, getattr(self.model.config, "max_position_embeddings", max_tokens))
        self.attack_index = _attack_index(self.model.config.id2label, attack_label)
        digest = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:8]
        self.version = f"hf:{path.name}:{digest}"

    @property
    def labels(self) -> dict[int, str]:
        return dict(self.model.config.id2label)

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        batch = self.tokenizer(text, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        with self._torch.inference_mode():
            logits = self.model(**batch).logits[0]
        prob = float(logits.float().softmax(-1)[self.attack_index])
        return ClassifierScore(round(prob, 6))  # a guard model gives no n-gram explanation


def _attack_index(id2label: dict, attack_label: str | None) -> int:
    names = {int(i): str(n) for i, n in id2label.items()}
    if attack_label is not None:
        for i, n in names.items():
            if n == attack_label:
                return i
        raise ValueError(f"guard model has no label {attack_label!r}; its labels are {sorted(names.values())}")
    for i, n in sorted(names.items()):
        if _ATTACK_NAME.search(n):
            return i
    if len(names) < 2:
        raise ValueError("guard model has one label; set guard_attack_label to name the attack label")
    return 1
