"""What the filter needs from a trained classifier stage, whatever its kind (pure types).

The kinds behind it: the character model (classifier.py), the word stage (words.py), the
fine-tuned encoder (encoder.py) and a guard model the operator brings (guard.py);
loader.py reads any of them from its artifact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["Classifier", "ClassifierScore"]


@dataclass(frozen=True)
class ClassifierScore:
    """Probability that a prompt is an attack, and the n-grams that pushed it most."""

    score: float
    features: tuple[tuple[str, float], ...] = ()  # (n-gram, contribution to the logit), largest first
    logit: float | None = None  # the score's logit (None: a guard model); the ensemble calibrates it


class Classifier(Protocol):
    """What the filter needs from a trained classifier."""

    version: str  # names the artifact; recorded on every event
    threshold: float  # the artifact's own threshold on ``score``
    blocking: bool  # True when scoring is slow enough to belong off the event loop

    def score(self, text: str, explain: int = 0) -> ClassifierScore:
        """Score one prompt; with ``explain`` > 0, also its top features."""
        ...
