"""The prompt filter's entry points: one prompt, or the user turns of a chat.

The consumer calls :func:`inspect_messages`; everything here is pure, so the
handler stays a few lines and tests need no broker.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from consumers.filter.config import DEFAULT, FilterConfig
from consumers.filter.ensemble import Ensemble
from consumers.filter.interface import Classifier
from consumers.filter.sanitize import sanitize, skeleton
from consumers.filter.scoring import Action, decide, score
from consumers.filter.stage import SINGLE, ClassifierOutcome, run_stages, strongest

__all__ = ["FilterVerdict", "deciding", "inspect_messages", "inspect_prompt"]


@dataclass(frozen=True)
class FilterVerdict:
    """What the filter decided about one user prompt."""

    action: Action
    text: str  # the text to send to the model (cleaned when sanitized)
    score: float  # injection score in [0, 1]
    reasons: tuple[str, ...]  # stable codes, e.g. "role_marker:system", "jailbreak:persona"
    edits: tuple[str, ...]  # what sanitizing changed, e.g. "removed control token <|im_start|>"
    classifier: ClassifierOutcome | None = None  # the deciding classifier stage, when one ran
    rules_action: Action | None = None  # what the rules alone decided (None: the same as ``action``)
    stages: tuple[ClassifierOutcome, ...] = ()  # every classifier stage (one, or an ensemble's)


def inspect_prompt(
    text: str, config: FilterConfig = DEFAULT, classifier: Classifier | Ensemble | None = None
) -> FilterVerdict:
    """Score one prompt, sanitize it if configured, and decide what to do with it.

    The classifier stage (when given) runs after the sanitizer and reads the
    original text's skeleton, so markers the sanitizer removes still count.
    """
    if len(text) > config.max_prompt_chars:
        return FilterVerdict("reject", text, 1.0, ("too_long",), ())
    cleaned = sanitize(text, config.strip_all_invisible, config.max_sanitize_rounds)
    value, reasons = score(skeleton(text), text, cleaned.reasons)
    if not cleaned.stable:
        # Tokens nested so deep that removal keeps exposing new ones: no honest
        # prompt looks like that, and a half-cleaned text must not go through.
        return FilterVerdict("reject", text, 1.0, (*reasons, "nested_markup"), cleaned.edits)
    threshold = math.inf if config.mode == "sanitize-only" else config.reject_threshold
    out_text, edits = (cleaned.text, cleaned.edits) if config.sanitize else (text, ())
    action = decide(value, out_text != text, threshold)
    rules_action = action
    stages = run_stages(text, classifier, config, action == "reject") if classifier is not None else ()
    enforced = [o.stage for o in stages if o.enforced]
    if enforced and action != "reject":
        # "classifier" as before, and the stage(s) that rejected: the event says which
        named = tuple(f"classifier:{s}" for s in enforced if s != SINGLE)
        action, reasons = "reject", (*reasons, "classifier", *named)
    outcome = strongest(list(stages))
    changed = rules_action if rules_action != action else None  # None: the rules decided
    return FilterVerdict(action, out_text, value, reasons, edits, outcome, changed, stages)


def inspect_messages(
    messages: list[dict[str, Any]], config: FilterConfig = DEFAULT, classifier: Classifier | Ensemble | None = None
) -> tuple[list[dict[str, Any]], list[FilterVerdict], Action]:
    """Filter the user turns of an OpenAI-style chat.

    Only ``role == "user"`` messages with string content are inspected: the
    operator's system prompt and earlier assistant turns are trusted as given
    (the caller decides what it passes). Returns the messages with cleaned user
    text (other messages are the same objects), one verdict per user message in
    order, and the overall action: "reject" if any user message is rejected,
    else "sanitized" if any was changed, else "pass".
    """
    cleaned: list[dict[str, Any]] = []
    verdicts: list[FilterVerdict] = []
    for message in messages:
        content = message.get("content")
        if message.get("role") != "user" or content is None:
            cleaned.append(message)
            continue
        if isinstance(content, str):
            verdict = inspect_prompt(content, config, classifier)
            new_content: Any = verdict.text
        else:
            verdict, new_content = _inspect_parts(content, config, classifier)
        verdicts.append(verdict)
        cleaned.append({**message, "content": new_content} if new_content != content else message)
    actions = {v.action for v in verdicts}
    overall: Action = "reject" if "reject" in actions else "sanitized" if "sanitized" in actions else "pass"
    return cleaned, verdicts, overall


def _inspect_parts(
    parts: list[Any], config: FilterConfig, classifier: Classifier | Ensemble | None
) -> tuple[FilterVerdict, list[Any]]:
    """A content list (``[{"type": "text", "text": ...}, ...]``): every text part is a prompt.

    The parts' verdicts merge into one: the worst action, the highest score.
    """
    order = {"pass": 0, "sanitized": 1, "reject": 2}
    verdicts, new_parts = [], []
    for part in parts:
        if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
            v = inspect_prompt(part["text"], config, classifier)
            verdicts.append(v)
            new_parts.append({**part, "text": v.text} if v.text != part["text"] else part)
        else:
            new_parts.append(part)
    if not verdicts:
        return FilterVerdict("pass", "", 0.0, (), ()), new_parts
    merged = FilterVerdict(
        action=max((v.action for v in verdicts), key=order.__getitem__),
        text="\n".join(v.text for v in verdicts),
        score=max(v.score for v in verdicts),
        reasons=tuple(dict.fromkeys(r for v in verdicts for r in v.reasons)),
        edits=tuple(e for v in verdicts for e in v.edits),
        classifier=strongest([v.classifier for v in verdicts]),
        stages=deciding(verdicts).stages,
    )
    return merged, new_parts


def deciding(verdicts: list[FilterVerdict]) -> FilterVerdict:
    """The verdict whose classifier outcome decides (stage.strongest): its stages go on the event."""
    best = strongest([v.classifier for v in verdicts])
    return next((v for v in verdicts if best is not None and v.classifier is best), verdicts[0])
