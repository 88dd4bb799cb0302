"""The classifier stages' verdicts on one prompt, under the deployment's modes (pure).

One classifier (an artifact or a guard model) is one stage, ``classifier``, enforced
in mode ``block``. An ensemble (ensemble.py) has named stages: each is enforced only
when the mode is ``block`` and the config's stage mode is ``block`` (``stage_modes``
over ``DEFAULT_STAGE_MODES``); any other stage runs in ``shadow`` (scored, recorded on the event,
counted, never blocking), so a new stage is watched before it can reject anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumers.filter.config import FilterConfig
from consumers.filter.ensemble import Ensemble, Member
from consumers.filter.interface import Classifier

__all__ = ["ClassifierOutcome", "classify", "run_stages", "strongest", "undecided"]

SINGLE = "classifier"  # the stage name of a lone classifier


@dataclass(frozen=True)
class ClassifierOutcome:
    """What one classifier stage said about one prompt and whether that counted."""

    version: str
    score: float
    threshold: float
    flagged: bool  # score >= threshold
    enforced: bool  # flagged and the modes let the stage reject
    features: tuple[tuple[str, float], ...]
    stage: str = SINGLE
    mode: str = "block"  # the stage's own mode: block or shadow
    benign_tail: float | None = None  # share of held-out benign prompts scoring at least this (ensembles)


def classify(text: str, classifier: Classifier, config: FilterConfig) -> ClassifierOutcome:
    """Score ``text`` with one classifier; only mode ``block`` turns a flag into a rejection."""
    threshold = config.classifier_threshold if config.classifier_threshold is not None else classifier.threshold
    return _outcome(text, classifier, threshold, config)


def _outcome(
    text: str, classifier: Classifier, threshold: float, config: FilterConfig, member: Member | None = None
) -> ClassifierOutcome:
    result = classifier.score(text)
    flagged = result.score >= threshold
    tail = member.benign_tail(result.logit) if member is not None and result.logit is not None else None
    if flagged and config.classifier_explain and getattr(classifier, "explains", True):
        # explaining costs a quarter of the scoring time: pay it only for the few flagged prompts
        result = classifier.score(text, config.classifier_explain)
    stage, mode = (SINGLE, "block") if member is None else (member.name, config.stage_mode(member.name))
    enforced = flagged and config.mode == "block" and mode == "block"
    return ClassifierOutcome(
        classifier.version,
        result.score,
        threshold,
        flagged,
        enforced,
        result.features,
        stage,
        mode,
        None if tail is None else round(tail, 6),
    )


def run_stages(
    text: str, classifier: Classifier | Ensemble, config: FilterConfig, decided: bool = False
) -> tuple[ClassifierOutcome, ...]:
    """Every stage's outcome on ``text``: one for a lone classifier, one per stage of an ensemble,
    each at the threshold of the ensemble's operating point for the stages the config enforces.

    A cascade stage (the encoder) runs after the lexical ones, only on what they leave undecided
    (:func:`undecided`); ``decided``: the rules already reject the prompt."""
    if not isinstance(classifier, Ensemble):
        return (classify(text, classifier, config),)
    blocking = {m.name for m in classifier.members if config.stage_mode(m.name) == "block"}
    thresholds = classifier.thresholds(blocking)
    outcomes: list[ClassifierOutcome] = []
    for m in classifier.members:
        if getattr(m.classifier, "cascade", False) and not undecided(text, outcomes, decided, config):
            continue
        outcomes.append(
            _outcome(text, m.classifier, config.stage_thresholds.get(m.name, thresholds[m.name]), config, m)
        )
    return tuple(outcomes)


def undecided(text: str, lexical: list[ClassifierOutcome], decided: bool, config: FilterConfig) -> bool:
    """Whether a cascade stage must look at ``text``: not when the rules or an enforced lexical stage
    already reject it, nor when every lexical stage ranks it below ``config.cascade_band`` of benign
    prompts (sure enough it is benign), unless it is long (``cascade_long_chars``: one attack
    paragraph weighs little in a long prompt's n-grams)."""
    if decided or any(o.enforced for o in lexical):
        return False
    if len(text) >= config.cascade_long_chars:
        return True
    tails = [o.benign_tail for o in lexical if o.benign_tail is not None]
    return not tails or 1.0 - min(tails) >= config.cascade_band


def strongest(outcomes: list[ClassifierOutcome | None]) -> ClassifierOutcome | None:
    """The outcome that decides a chat's verdict: an enforced flag first, then a flag, then the highest score."""
    present = [o for o in outcomes if o is not None]
    return max(present, key=lambda o: (o.enforced, o.flagged, o.score)) if present else None
