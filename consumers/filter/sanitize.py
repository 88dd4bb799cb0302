"""Normalization and sanitizing of user prompt text (pure functions, no broker).

Matching runs on a *skeleton* of the text: invisible and combining characters
dropped, each remaining character folded by NFKC, a look-alike map and
lower-casing, one character for one. The output keeps the user's own
characters: only the spans a rule matched are cut out of the original text, so
a benign prompt with superscripts, fullwidth CJK punctuation or pasted
zero-width spaces is sent exactly as written.

Rules (docs/filter.md gives the reasoning):

* bidi controls and Unicode tag characters are always removed; zero-width
  characters only where they split a word (or everywhere with
  ``strip_all_invisible``);
* chat-template control tokens of common model families are removed;
* role markers at line starts ("System:", "### Assistant", "[system]",
  '{"role": "system", ...') are removed when they pose as a privileged turn:
  followed by instruction-like text, or part of a transcript that the whole
  message is written as. A story line "System: online" is left alone.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["Finding", "SanitizeResult", "Skeleton", "find_all", "sanitize", "skeleton"]

# --- characters ---------------------------------------------------------------

_BIDI = "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
_TAGS = "\U000e0000-\U000e007f"  # invisible ASCII copies: "ASCII smuggling"
_ZERO_WIDTH = "\u00ad\u180e\u200b-\u200d\u2060-\u2064\ufeff"
_COMBINING = "\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe00-\ufe0f\ufe20-\ufe2f"

_ALWAYS_REMOVE = re.compile(f"[{_BIDI}{_TAGS}]+")
_ZERO_WIDTH_RUN = re.compile(f"[{_ZERO_WIDTH}]+")
_INVISIBLE_ONLY = re.compile(f"[{_BIDI}{_TAGS}{_ZERO_WIDTH}]+")
_IGNORABLE = re.compile(f"[{_BIDI}{_TAGS}{_ZERO_WIDTH}{_COMBINING}]")

# Look-alikes that NFKC leaves alone: Cyrillic and Greek letters shaped like
# Latin ones, and punctuation shaped like the delimiters of markers and tokens.
# Line separators fold to "\n" so that "line start" means the same everywhere.
_CONFUSABLES = {
    src: dst
    for pairs in (
        "аa сc ԁd еe һh іi јj ӏl оo рp ԛq ѕs уy хx ԝw ѵv тt мm кk нh вb "
        "АA ВB СC ЕE НH ІI ЈJ КK МM ОO РP ЅS ТT ХX ҮY ԜW",
        "αa εe ιi κk νv οo ρp τt υu χx γy ΑA ΒB ΕE ΖZ ΗH ΙI ΚK ΜM ΝN ΟO ΡP ΤT ΥY ΧX",
        "ıi ɡg ɑa ϲc ϳj ‹< ›> 〈< 〉> ∣| ǀ| │| ∶: ꞉: ˸: ‘' ’' ‛' ′' “\" ”\" „\" ″\"",
    )
    for pair in pairs.split()
    for src, dst in [(pair[0], pair[1])]
} | dict.fromkeys("\r\u2028\u2029\x85\x0b\x0c", "\n")


class _FoldTable(dict):
    """str.translate table, filled lazily: NFKC, look-alikes, lower case, 1:1."""

    def __missing__(self, cp: int) -> str:
        ch = chr(cp)
        out = unicodedata.normalize("NFKC", ch)
        if len(out) != 1:  # ligatures etc.: keep 1:1 so offsets map back
            out = ch
        out = _CONFUSABLES.get(out, out)
        low = out.lower()
        if len(low) == 1:
            out = low
        self[cp] = out
        return out


_FOLD = _FoldTable()


@dataclass(frozen=True)
class Skeleton:
    """Folded text for matching, with the map back to the original offsets."""

    text: str
    index: list[int] | None  # skeleton position -> original position; None: identity

    def span(self, start: int, end: int) -> tuple[int, int]:
        if self.index is None:
            return start, end
        if start >= end:
            pos = self.index[start] if start < len(self.index) else (self.index[-1] + 1 if self.index else 0)
            return pos, pos
        return self.index[start], self.index[end - 1] + 1


@lru_cache(maxsize=16)  # sanitizing and scoring both fold the same text
def skeleton(text: str) -> Skeleton:
    """Fold ``text`` for matching (see module docstring)."""
    if text.isascii():
        low = text.lower()
        return Skeleton(low.translate(_FOLD) if "\r" in low or "\x0b" in low or "\x0c" in low else low, None)
    if not _IGNORABLE.search(text):
        return Skeleton(text.translate(_FOLD), None)
    # the kept positions are the ranges between the (few) ignorable characters: no per-character loop
    index: list[int] = []
    kept = 0
    for m in _IGNORABLE.finditer(text):
        index.extend(range(kept, m.start()))
        kept = m.end()
    index.extend(range(kept, len(text)))
    return Skeleton(_IGNORABLE.sub("", text).translate(_FOLD), index)


# --- findings -------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """One span of the original text that sanitizing removes."""

    start: int
    end: int
    reason: str  # stable code, e.g. "control_token", "role_marker:system"
    what: str  # human-readable, e.g. "control token <|im_start|>"


def _invisible(text: str, strip_all: bool) -> list[Finding]:
    if text.isascii():
        return []
    found = [
        Finding(m.start(), m.end(), "invisible:bidi_or_tag", f"{m.end() - m.start()} bidi/tag character(s)")
        for m in _ALWAYS_REMOVE.finditer(text)
    ]
    for m in _ZERO_WIDTH_RUN.finditer(text):
        before = text[m.start() - 1].translate(_FOLD) if m.start() else ""
        after = text[m.end()].translate(_FOLD) if m.end() < len(text) else ""
        # Only a run between two letters/digits can hide a keyword from a
        # reader; the stray U+200B of pasted math sits next to spaces.
        splits_word = before.isascii() and before.isalnum() and after.isascii() and after.isalnum()
        if strip_all or splits_word:
            found.append(
                Finding(m.start(), m.end(), "invisible:zero_width", f"{m.end() - m.start()} zero-width character(s)")
            )
    return found


_SEP = r"[\s_▁\-]*"


def _words(*names: str) -> str:
    return "|".join(_SEP.join(n.split()) for n in names)


_ROLE_CLASSES = {
    "system": (
        "system prompt",
        "system message",
        "system",
        "sys",
        "developer",
        "operator",
        "admin",
        "administrator",
        "root",
    ),
    "assistant": ("assistant", "chatbot", "chatgpt", "gpt-4", "gpt", "ai", "bot", "model", "claude", "llama"),
    "tool": ("tool", "function", "ipython", "observation"),
    "user": ("user", "human"),
}


def _key(name: str) -> str:
    return re.sub(_SEP, "", name)


_ROLE_OF = {_key(name): cls for cls, names in _ROLE_CLASSES.items() for name in names}
_ROLE = "(?:" + _words(*sorted((n for ns in _ROLE_CLASSES.values() for n in ns), key=len, reverse=True)) + ")"
_PIPE_NAMES = _words(
    "im start",
    "im end",
    "im sep",
    "system",
    "user",
    "assistant",
    "end of text",
    "endoftext",
    "begin of text",
    "start header id",
    "end header id",
    "eot id",
    "eom id",
    "begin of sentence",
    "end of sentence",
    "start",
    "end",
    "message",
    "channel",
    "return",
    "call",
    "python tag",
)
_STRONG_TOKEN = (
    r"<\|[a-z0-9_▁.\-]{1,40}\|>"  # any <|name|>: ChatML, Llama 3, Phi, Command R, DeepSeek
    rf"|<\s*\|\s*(?:{_PIPE_NAMES})\s*\|\s*>"  # spaced variants of known names
    r"|\[\s*/?\s*inst\s*\]|<<\s*/?\s*sys\s*>>"  # Llama 2 / Mistral
    rf"|\[\s*/?\s*(?:{_words('system prompt', 'available tools', 'tool calls', 'tool results')})\s*\]"
    rf"|<\s*/?\s*(?:{_words('start of turn', 'end of turn')})\s*>"  # Gemma
    r"|<\s*(?:bos|eos)\s*>"
)
# Llama's BOS/EOS are also HTML strikethrough tags: removed only next to a strong token.
_WEAK_TOKEN = r"<\s*/?\s*s\s*>"
# A run of tokens, with the role name that follows a turn opener ("<|im_start|>system").
_OPENER = rf"(?:{_STRONG_TOKEN})(?:[ \t]*{_ROLE}\b[ \t]*:?)?"
# Every run starts with "<" or "[": the lookahead rejects other positions at once (the
# optional leading weak tokens leave re no prefix to scan for), a third of the time.
_TOKEN_RUN = re.compile(rf"(?=[<\[])(?:(?:{_WEAK_TOKEN})\s*)*{_OPENER}(?:\s*(?:{_WEAK_TOKEN}|{_OPENER}))*")


def _show(span: str) -> str:
    span = span.strip()
    return span if span.isprintable() else repr(span)


def _tokens(sk: Skeleton, original: str) -> list[Finding]:
    if "<" not in sk.text and "[" not in sk.text:  # every token starts with one
        return []
    out = []
    for m in _TOKEN_RUN.finditer(sk.text):
        start, end = sk.span(m.start(), m.end())
        out.append(Finding(start, end, "control_token", f"removed control token {_show(original[start:end])}"))
    return out


_B = r"(?:\*\*|__)"  # markdown bold around a label
_MARKER = re.compile(
    r"^[ \t]*(?:>[ \t]*)?(?:-[ \t]+)?"
    rf"(?:\[\s*(?P<r1>{_ROLE})\s*\](?:[ \t]*:)?"  # [system]
    rf"|<\s*(?P<r2>{_ROLE})\s*>"  # <system>
    rf"|\#{{1,6}}[ \t]*(?P<r3>{_ROLE})[ \t]*:?[ \t]*(?=\n|$)"  # ### System
    rf"|(?:\#{{1,6}}[ \t]*)?{_B}?(?P<r4>{_ROLE})[ \t]*{_B}?[ \t]*:(?:[ \t]*{_B})?"  # System: / **System:**
    r")[ \t]*",
    re.M,
)
_JSON_ROLE = re.compile(
    rf"""^[ \t]*\{{\s*["']role["']\s*:\s*["'](?P<r5>{_ROLE})["']\s*,?(?:\s*["']content["']\s*:)?[ \t]*""", re.M
)
_INSTRUCTION = re.compile(
    r"\b(?:ignore|disregard|forget|override|bypass|obey|comply|must|shall|always|never|do not|don't|dont"
    r"|from now on|respond|reply|answer|act as|pretend|follow|instructions?|rules|mode|enabled?|activated?"
    r"|unrestricted|unfiltered|uncensored|jailbr\w*|restrictions?|polic(?:y|ies)|guidelines|filters?"
    r"|censor\w*|safety|allowed|permitted|authori[sz]ed|priority|the user"
    # "you are" / "you have" only when they (re)define who the model is or what it must do:
    # a game or transcript line such as "System: You are low on fuel" keeps its label.
    r"|you are (?:now|no longer|not|an?|the|my|going to|to|free|allowed|able|permitted|in (?:dan|developer))"
    r"|you (?:must|will|should|shall|can|may|have to|need|no longer|now))\b"
)
_PRIMING = re.compile(
    r"(?:sure|certainly|of course|absolutely|okay|ok|yes|alright|understood|here (?:is|are)|here's"
    r"|i (?:will|can|am|understand)|i'll|i'm|as (?:an? )?(?:unfiltered|uncensored|dan|aim|jailbroken)|step 1)\b"
)
_PERSONA = re.compile(
    r"\b(?:unfiltered|uncensored|unrestricted|jailbr\w*|developer mode|dan|no (?:restrictions|limits|rules|filters))\b"
)
_FENCE = re.compile(r"^[ \t]*```", re.M)


@dataclass(frozen=True)
class _Marker:
    start: int  # skeleton offsets
    end: int
    role: str  # role class
    body: str  # skeleton text of the turn's first non-empty line


def _body(text: str, end: int) -> str:
    rest = text[end : end + 300]
    line, _, more = rest.partition("\n")
    if line.strip():
        return line
    return more.lstrip().partition("\n")[0]


def _marker(text: str, m: re.Match, group: str) -> _Marker:
    start = m.start() + len(m.group(0)) - len(m.group(0).lstrip(" \t"))
    return _Marker(start, m.end(), _ROLE_OF[_key(m.group(group))], _body(text, m.end()))


def _markers(sk: Skeleton) -> list[_Marker]:
    text = sk.text
    found = []
    for m in _MARKER.finditer(text):
        found.append(_marker(text, m, next(g for g in ("r1", "r2", "r3", "r4") if m.group(g))))
    fences = None
    for m in _JSON_ROLE.finditer(text):
        fences = fences if fences is not None else [f.start() for f in _FENCE.finditer(text)]
        before = text[: m.start()].rstrip()
        in_code = sum(f < m.start() for f in fences) % 2 == 1
        # A message object inside a list, call or assignment is code, not a fake turn.
        if in_code or (before and before[-1] in "[,(=:"):
            continue
        found.append(_marker(text, m, "r5"))
    return sorted(found, key=lambda mk: mk.start)


def _poses_as_privileged(mk: _Marker) -> bool:
    if mk.role in ("system", "tool"):
        return bool(_INSTRUCTION.search(mk.body))
    if mk.role == "assistant":
        return bool(_PRIMING.match(mk.body.lstrip(" \t*\"'"))) or bool(_PERSONA.search(mk.body))
    return False


def _role_markers(sk: Skeleton, original: str) -> list[Finding]:
    marks = _markers(sk)
    if not marks:
        return []
    roles = {mk.role for mk in marks}
    # A turn sequence with a system or tool turn is a fake conversation; one
    # privileged turn posing with instructions or a primed answer is enough
    # too. Then every marker goes, user turns included: they belong to the fake.
    fake_dialogue = len(marks) >= 2 and len(roles) >= 2 and roles & {"system", "tool"}
    if not (fake_dialogue or any(_poses_as_privileged(mk) for mk in marks)):
        return []
    out = []
    for mk in marks:
        start, end = sk.span(mk.start, mk.end)
        out.append(Finding(start, end, f"role_marker:{mk.role}", f"removed role marker {_show(original[start:end])}"))
    return out


def find_all(text: str, strip_all_invisible: bool = False) -> list[Finding]:
    """Everything one sanitizing round would remove from ``text``, in text order."""
    sk = skeleton(text)
    found = _invisible(text, strip_all_invisible) + _tokens(sk, text) + _role_markers(sk, text)
    return sorted(found, key=lambda f: (f.start, f.end))


def _cut(text: str, findings: list[Finding]) -> str:
    spans: list[list[int]] = []
    for f in findings:
        if spans and f.start <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], f.end)
        else:
            spans.append([f.start, f.end])
    parts, pos = [], 0
    for start, end in spans:
        parts.append(text[pos:start])
        left, right = text[start - 1 : start], text[end : end + 1]
        # Joining two words would make a new word ("Hi<|x|>there"); keep a space.
        if left.isalnum() and right.isalnum() and not _INVISIBLE_ONLY.fullmatch(text[start:end]):
            parts.append(" ")
        pos = end
    parts.append(text[pos:])
    return "".join(parts)


@dataclass(frozen=True)
class SanitizeResult:
    """Outcome of :func:`sanitize`."""

    text: str
    edits: tuple[str, ...]  # what was removed, in order, human-readable
    reasons: tuple[str, ...]  # distinct reason codes of the removals
    stable: bool  # False: still changing after max_rounds (deliberate nesting)


def sanitize(text: str, strip_all_invisible: bool = False, max_rounds: int = 6) -> SanitizeResult:
    """Remove control tokens, fake role markers and hiding characters.

    Repeats until nothing changes, since a removal can join the halves of a new
    token; the result is then a fixed point (sanitizing it again changes nothing).
    """
    edits: list[str] = []
    reasons: dict[str, None] = {}
    for _ in range(max_rounds):
        found = find_all(text, strip_all_invisible)
        if not found:
            return SanitizeResult(text, tuple(edits), tuple(reasons), True)
        edits.extend(f.what if f.what.startswith("removed") else f"removed {f.what}" for f in found)
        reasons.update(dict.fromkeys(f.reason for f in found))
        text = _cut(text, found)
    stable = not find_all(text, strip_all_invisible)
    return SanitizeResult(text, tuple(edits), tuple(reasons), stable)
