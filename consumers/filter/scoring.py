"""Injection scoring and the pass / sanitize / reject decision (pure functions).

Each rule that fires contributes a weight; the score is their noisy-OR,
``1 - prod(1 - w)``, so it stays in [0, 1], grows with independent evidence, and
no single weak cue can reach the reject threshold alone. The weights were set
by judgement before any measurement (they say how sure one cue makes us); only
the reject threshold was chosen on data (docs/filter.md).
"""

from __future__ import annotations

import re
import string
from typing import Literal

from consumers.filter.sanitize import Skeleton

__all__ = ["RULE_WEIGHTS", "decide", "gibberish", "score", "suffix_shape"]

Action = Literal["pass", "sanitized", "reject"]

#: Weight of each reason code; sanitizing findings are scored too.
RULE_WEIGHTS: dict[str, float] = {
    "control_token": 0.5,
    "role_marker:system": 0.5,
    "role_marker:tool": 0.5,
    "role_marker:assistant": 0.4,
    "role_marker:user": 0.1,
    "invisible:bidi_or_tag": 0.3,
    "invisible:zero_width": 0.2,
    "obfuscation:mixed_script": 0.3,
    "jailbreak:ignore_previous": 0.7,
    "jailbreak:ignore_ethics": 0.5,
    "jailbreak:persona": 0.5,
    "jailbreak:no_refusal": 0.5,
    "jailbreak:prefill": 0.4,
    "jailbreak:hypothetical": 0.2,
}

# Phrases of published jailbreak styles, matched on the folded skeleton.
_JAILBREAK = {
    "jailbreak:ignore_previous": (
        r"\b(?:ignore|disregard|forget|override|bypass)\b[^.\n]{0,40}?\b(?:previous|prior|above|earlier|preceding"
        r"|all|any|your|the|system)\b[^.\n]{0,30}?\b(?:instructions?|prompts?|rules|directions|guidelines"
        r"|restrictions|programming|constraints|polic(?:y|ies)|directives?)\b"
    ),
    "jailbreak:ignore_ethics": (
        r"\b(?:ignor\w*|disregard\w*|without|regardless of|set aside)\b[^.\n]{0,30}?\b(?:moral|ethical|legal)"
        r"\w*\b[^.\n]{0,20}?\b(?:implications|considerations|concerns|guidelines|constraints|boundaries)"
    ),
    "jailbreak:persona": (
        r"\b(?:do anything now|developer mode|jailbr(?:oken|eak)|unfiltered and amoral|amoral|dan mode"
        r"|(?:no|any|without) (?:ethical|moral) (?:or moral )?(?:guidelines|principles|boundaries|restrictions)"
        r"|stay in character|never break character)\b"
    ),
    "jailbreak:no_refusal": (
        r"\b(?:never (?:ever )?(?:refuse|say no|start your response with)"
        r"|(?:do not|don't|never|will not|won't|should not|shouldn't) (?:apologi[sz]e|refuse|contain \W*i'm sorry"
        r"|include (?:any )?(?:warnings|disclaimers|caveats))"
        r"|without (?:any )?(?:warnings|disclaimers|caveats|refusals?))"
    ),
    "jailbreak:prefill": (
        r"\b(?:(?:start|begin) (?:your|the) (?:response|reply|answer|output) (?:with|using|by saying)"
        r"|respond (?:only )?with \W*sure)"
    ),
    "jailbreak:hypothetical": (
        r"\b(?:for (?:purely )?educational (?:and research )?purposes|purely (?:hypothetical\w*|for fictional purposes)"
        r"|entirely hypothetical\w*|fictional purposes)"
    ),
}
# Strings one of which every match of a pattern contains: a substring test is far
# cheaper than a regex scan, and most prompts contain none of them.
_NEEDS = {
    "jailbreak:ignore_previous": ("ignor", "disregard", "forget", "override", "bypass"),
    "jailbreak:ignore_ethics": ("moral", "ethical", "legal"),
    "jailbreak:persona": (
        "anything now",
        "developer mode",
        "jailbr",
        "amoral",
        "dan mode",
        "ethical",
        "moral",
        "character",
    ),
    # the text around the alternation's end, not its common words ("not " is in most long prompts)
    "jailbreak:no_refusal": ("never ", " apologi", " refuse", " contain ", " include ", "without "),
    "jailbreak:prefill": (
        "start your ",
        "start the ",
        "begin your ",
        "begin the ",
        "respond with ",
        "respond only with ",
    ),
    "jailbreak:hypothetical": ("educational", "hypothetical", "fictional"),
}
# The letters every match of a pattern starts with. A pattern that opens with \b and an
# alternation gives re no prefix to scan for, so it tries every position: a lookahead
# on the first letter rejects most positions at once (a third to a half of the time at
# 4,000 characters) and matches exactly the same.
_FIRST = {
    "jailbreak:ignore_previous": "idfob",
    "jailbreak:ignore_ethics": "idwrs",
    "jailbreak:persona": "djuanws",
    "jailbreak:no_refusal": "ndws",
    "jailbreak:prefill": "sbr",
    "jailbreak:hypothetical": "fpe",
}
_JAILBREAK_RE = {code: (re.compile(f"(?=[{_FIRST[code]}])" + p), _NEEDS[code]) for code, p in _JAILBREAK.items()}
_NON_LATIN_LETTER = re.compile(r"[\u0370-\u03ff\u0400-\u04ff]")

_MIXED_SCRIPT = re.compile(r"\b(?=\w*[a-zA-Z])(?=\w*[\u0370-\u03ff\u0400-\u04ff])\w+\b")
_SYMBOLS = set("{}[]()<>|\\$^~=`\"'*#@&;")
_GLUED = re.compile(r"[a-z][A-Z]|[A-Za-z]\d[A-Za-z]|[({\[][({\[]|[)}\]][({\[.]")
_CLOSE = {")": "(", "]": "[", "}": "{"}
_BRACKET_RE = re.compile(r"[()\[\]{}]")
# Kinds of evidence that the text is code or LaTeX, where glued symbols are normal.
_CODE = re.compile(
    r";[ \t]*(?:$|\\n)|==|->|\breturn\b|\bdef |#include|\bimport\b|\\n|\\section|\\label"
    r"|\bint \w+\s*[=(;]|:\s*np\.|\bprint\(|\bconsole\.",
    re.M,
)


def _unbalanced(tail: str) -> int:
    """Closing brackets without their opener, plus openers never closed."""
    brackets = _BRACKET_RE.findall(tail)
    if not brackets:
        return 0
    stack: list[str] = []
    unbalanced = 0
    for c in brackets:
        if c not in _CLOSE:
            stack.append(c)
        elif stack and stack[-1] == _CLOSE[c]:
            stack.pop()
        else:
            unbalanced += 1
    return unbalanced + len(stack)


def _last_line(text: str) -> str:
    """The last line (its last 1,000 characters): where an optimized suffix sits."""
    return text[-1000:].rstrip().rpartition("\n")[2]


def _tail(text: str) -> str:
    """The end of the last line, whose words the suffix heuristic reads."""
    return _last_line(text)[-240:]


_DROP_SYMBOLS = str.maketrans("", "", "".join(_SYMBOLS))
# a symbol, or what _GLUED finds without one: no match means no odd word
_MAYBE_ODD = re.compile("[" + re.escape("".join(sorted(_SYMBOLS))) + "]|[a-z][A-Z]|[A-Za-z]\\d[A-Za-z]")
_DROP_ASCII_LETTERS = str.maketrans("", "", string.ascii_letters)


# a quoted list item ("'Quagmire',", '"b"]'): symbols around a plain word, not glued inside it
_QUOTED_ITEM = re.compile(r"""[\[(]?(['"])[A-Za-z][a-z]*\1[,;\])]*""")


def _odd(w: str) -> bool:
    """A word fragment glued to symbols or to another word ("ToS'.", "(.umerate((quantity|_{]", "summarText")."""
    if w.isalpha():  # most words: odd only when glued, which needs a lower then an upper case letter
        return len(w) > 3 and not (w.islower() or w.isupper() or w.istitle()) and bool(_GLUED.search(w))
    symbols = len(w) - len(w.translate(_DROP_SYMBOLS))
    letters = len(w) - len(w.translate(_DROP_ASCII_LETTERS)) if w.isascii() else sum(map(str.isalpha, w))
    return bool(letters) and (symbols >= 2 or (bool(symbols or letters > 3) and bool(_GLUED.search(w))))


def gibberish(text: str) -> float:
    """How much the last line of ``text`` looks like an optimized adversarial suffix.

    GCG-style suffixes are word fragments glued to stray brackets and markup
    ("trunc {\\}/ST] Title summar ToS'. (.umerate((quantity|_{]"), usually
    with unbalanced brackets; prose rarely has both, and text showing two kinds
    of code evidence is let off. Returns 0..0.8.
    """
    line = _last_line(text)
    # brackets over the whole line: a list opened before the tail and closed in it is balanced
    unbalanced = _unbalanced(line)  # cheap, and zero for most prompts: test it first
    if not unbalanced:
        return 0.0
    words = line[-240:].split()[-24:]
    if len(words) < 6:
        return 0.0
    odd = sum(1 for w in words if not _QUOTED_ITEM.fullmatch(w) and _odd(w))
    if odd < 3:
        return 0.0
    if len({m.group(0).strip() for m in _CODE.finditer(text)}) >= 2:
        return 0.0
    return min(0.8, 0.15 * odd + 0.1 * min(unbalanced, 3))


def suffix_shape(text: str) -> tuple[float, float]:
    """The suffix heuristic's two signals as numbers, without its gates (cues for the classifier):
    the share of odd words among the last line's last 24 words (of at least 6), and its
    unbalanced brackets (at most 3) over 3."""
    tail = _tail(text)
    if not _MAYBE_ODD.search(tail):  # prose: no symbol (so no bracket) and nothing glued
        return 0.0, 0.0
    words = tail.split()[-24:]
    return sum(map(_odd, words)) / max(len(words), 6), min(_unbalanced(tail), 3) / 3


def score(sk: Skeleton, original: str, found: tuple[str, ...] = ()) -> tuple[float, tuple[str, ...]]:
    """Injection score in [0, 1] and its reason codes.

    ``found`` are the reason codes of sanitizing findings; ``original`` is the
    unfolded text (the suffix heuristic needs its case and brackets).
    """
    reasons = dict.fromkeys(found)
    text = sk.text
    for code, (pattern, needs) in _JAILBREAK_RE.items():
        if any(word in text for word in needs) and pattern.search(text):
            reasons[code] = None
    if not original.isascii() and _NON_LATIN_LETTER.search(original) and _MIXED_SCRIPT.search(original):
        reasons["obfuscation:mixed_script"] = None
    keep = 1.0
    for code in reasons:
        keep *= 1.0 - RULE_WEIGHTS.get(code, 0.0)
    suffix = gibberish(original)
    if suffix:
        reasons["adversarial_suffix"] = None
        keep *= 1.0 - suffix
    return round(1.0 - keep, 4), tuple(reasons)


def decide(score_: float, changed: bool, reject_threshold: float) -> Action:
    """Reject at or above the threshold; else "sanitized" if the text changed."""
    if score_ >= reject_threshold:
        return "reject"
    return "sanitized" if changed else "pass"
