"""The classifier stage's verdict on one prompt, under the deployment's mode (pure)."""

from __future__ import annotations

from dataclasses import dataclass

from consumers.filter.classifier import Classifier
from consumers.filter.config import FilterConfig

__all__ = ["ClassifierOutcome", "classify"]


@dataclass(frozen=True)
class ClassifierOutcome:
    """What the classifier said about one prompt and whether that counted."""

    version: str
    score: float
    threshold: float
    flagged: bool  # score >= threshold
    enforced: bool  # flagged and the mode lets the classifier reject
    features: tuple[tuple[str, float], ...]


def classify(text: str, classifier: Classifier, config: FilterConfig) -> ClassifierOutcome:
    """Score ``text``; only mode ``block`` turns a flag into a rejection."""
    threshold = config.classifier_threshold if config.classifier_threshold is not None else classifier.threshold
    result = classifier.score(text)
    flagged = result.score >= threshold
    if flagged and config.classifier_explain:
        # explaining costs a quarter of the scoring time: pay it only for the few flagged prompts
        result = classifier.score(text, config.classifier_explain)
    return ClassifierOutcome(
        classifier.version, result.score, threshold, flagged, flagged and config.mode == "block", result.features
    )


def strongest(outcomes: list[ClassifierOutcome | None]) -> ClassifierOutcome | None:
    """The outcome with the highest score: it is the one that decides a chat's verdict."""
    present = [o for o in outcomes if o is not None]
    return max(present, key=lambda o: o.score) if present else None
