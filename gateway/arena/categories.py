"""A battle's categories from its prompts: local, deterministic rules (pure logic, no model).

LMArena labels prompts with an LLM (FastChat's fastchat/serve/monitor/classify: its
"criteria_v0.1" for hard prompts, "math_v0.1", "creative_writing_v0.1", ...). Here each
category is a rule over the user's own words, so the same prompts always get the same
categories and a board per category replays exactly. The rules, `RULES_VERSION` 1:

* `coding`: a code fence, code-shaped lines, or programming words;
* `math`: arithmetic or an equation, LaTeX, or mathematical words;
* `creative_writing`: a request to write a story, poem, song, script, ...;
* `multi_turn`: more than one turn;
* `long_query`: the user's words run to 500 tokens or more (FastChat's "longer query":
  500 tiktoken tokens; counted here as words and punctuation marks);
* `hard_prompts`: at least 6 of FastChat's 7 criteria (specificity, domain knowledge,
  complexity, problem solving, creativity, technical accuracy, real-world application),
  each judged by a rule below instead of an LLM;
* a language (`english`, `chinese`, `spanish`, ...) for the first prompt: its script,
  and for Latin script the most frequent of a few stopword lists.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

RULES_VERSION = 1
LONG_QUERY_TOKENS = 500
HARD_CRITERIA = 6
TOPICS = ("coding", "math", "creative_writing", "multi_turn", "long_query", "hard_prompts")


def _words(*words: str) -> re.Pattern:
    return re.compile(r"\b(?:" + "|".join(words) + r")\b", re.IGNORECASE)


_CODE_FENCE = re.compile(r"```|^\s{4,}\S.*[;{}()]\s*$", re.MULTILINE)
_CODE_LINE = re.compile(r"^\s*(?:def |class |import |from \S+ import |#include|function |public |const |let |var )")
_CODE_WORDS = _words(
    r"python", r"javascript", r"typescript", r"java", r"c\+\+", r"rust", r"golang", r"sql", r"html", r"css",
    r"bash", r"regex", r"api", r"json", r"code", r"coding", r"program(?:ming)?", r"function", r"compile[rd]?",
    r"debug", r"bug", r"stack ?trace", r"exception", r"script", r"algorithm", r"git", r"docker", r"kubernetes",
)  # fmt: skip
_MATH_EXPR = re.compile(r"\d\s*[-+*/^×÷=]\s*\d|\\(?:frac|int|sum|sqrt)|\b[xyz]\s*[\^=]\s*\d|[∫∑√π≤≥]")
_MATH_WORDS = _words(
    r"solve", r"equation", r"integral", r"derivative", r"calculus", r"algebra", r"geometry", r"theorem",
    r"prove", r"proof", r"probability", r"matrix", r"vector", r"polynomial", r"prime", r"factorial",
    r"calculate", r"compute", r"percent(?:age)?", r"math(?:s|ematics)?",
)  # fmt: skip
_CREATIVE_ASK = re.compile(
    r"\b(?:write|compose|tell|create|draft)\b[^.?!\n]{0,40}\b(?:story|stories|poem|poetry|haiku|song|lyrics|"
    r"limerick|sonnet|tale|fable|script|screenplay|novel|fiction|dialogue|verse)\b",
    re.IGNORECASE,
)
_CREATIVE_WORDS = _words(r"once upon a time", r"imagine", r"fictional", r"role-?play", r"in the style of")
_TOKENS = re.compile(r"\w+|[^\w\s]")

_CRITERIA = {
    "specificity": _words(
        r"exactly", r"at least", r"at most", r"no more than", r"step[- ]by[- ]step", r"steps", r"list", r"table",
        r"format", r"json", r"bullet", r"\d+ (?:words|sentences|paragraphs|items|examples)", r"specific(?:ally)?",
    ),
    "domain_knowledge": _words(
        r"physics", r"chemistry", r"biology", r"medic(?:al|ine)", r"clinical", r"legal", r"law", r"contract",
        r"finance", r"financial", r"econom(?:y|ics)", r"statistic(?:s|al)", r"machine learning", r"neural",
        r"database", r"protocol", r"network", r"kernel", r"compiler", r"quantum", r"genetic", r"tax",
        r"accounting", r"engineering", r"architecture", r"theorem", r"molecule", r"enzyme", r"circuit",
    ),
    "complexity": re.compile(r"\?[^?]+\?|\b(?:and then|also|additionally|furthermore|then)\b|^\s*(?:\d+[.)]|[-*]) ",
                             re.IGNORECASE | re.MULTILINE),
    "problem_solving": _words(
        r"solve", r"calculate", r"design", r"optimi[sz]e", r"debug", r"prove", r"derive", r"implement", r"plan",
        r"analy[sz]e", r"figure out", r"how (?:would|can|do|should) (?:i|we|you)", r"fix", r"improve", r"compare",
    ),
    "creativity": _words(
        r"creative", r"novel", r"invent", r"imagine", r"story", r"poem", r"brainstorm", r"original", r"unique",
        r"design", r"come up with", r"ideas?",
    ),
    "technical_accuracy": _words(
        r"accurate", r"accuracy", r"precise", r"correct(?:ly)?", r"exact", r"rigorous", r"formula", r"algorithm",
        r"code", r"proof", r"calculate", r"equation", r"specification",
    ),
    "real_world": _words(
        r"my (?:company|team|boss|client|customer|business|project|job|work|startup|manager)", r"our",
        r"production", r"real[- ]world", r"customers?", r"clients?", r"business", r"in practice", r"i need",
        r"deadline", r"budget",
    ),
}  # fmt: skip

_SCRIPTS = (  # (Unicode name prefix, language)
    ("CJK UNIFIED", "chinese"), ("HIRAGANA", "japanese"), ("KATAKANA", "japanese"), ("HANGUL", "korean"),
    ("CYRILLIC", "russian"), ("ARABIC", "arabic"), ("DEVANAGARI", "hindi"), ("GREEK", "greek"),
    ("HEBREW", "hebrew"), ("THAI", "thai"),
)  # fmt: skip
_STOPWORDS = {
    "english": "the a an and is are was you of to in it that what how why this for with be on not can i there do",
    "spanish": "el la los las es de que y en un una por para con no como qué cómo lo se",
    "french": "le la les est et de des que en un une pour avec pas ce qui je vous",
    "german": "der die das und ist ich nicht ein eine zu mit von wie was für sie es",
    "portuguese": "o a os as é de que e em um uma para com não como você do da",
    "italian": "il lo la gli le è di che e un una per con non come sono del della",
}
_STOPSETS = {lang: set(words.split()) for lang, words in _STOPWORDS.items()}
LANGUAGES = (
    "english",
    "spanish",
    "french",
    "german",
    "portuguese",
    "italian",
    *dict.fromkeys(lang for _, lang in _SCRIPTS),
)
CATEGORIES = (*TOPICS, *LANGUAGES)
"""Every name `categorize` can return (the page's selector and `--category` choices)."""


def language(text: str) -> str | None:
    """The prompt's language by script, then by Latin stopwords; None when nothing decides."""
    counts: dict[str, int] = {}
    for ch in text:
        if ch.isalpha() and ord(ch) > 0x24F:
            name = unicodedata.name(ch, "")
            for prefix, lang in _SCRIPTS:
                if name.startswith(prefix):
                    counts[lang] = counts.get(lang, 0) + 1
    if counts:
        if counts.get("japanese") and counts.get("chinese"):  # kanji with kana is Japanese
            return "japanese"
        return max(sorted(counts), key=lambda lang: counts[lang])
    words = re.findall(r"[^\W\d_]+", text.lower())
    scores = {lang: sum(w in stop for w in words) for lang, stop in _STOPSETS.items()}
    best = max(scores, key=lambda lang: scores[lang])  # dict order breaks ties: english first
    return best if scores[best] > 0 else None


def hard_criteria(text: str) -> list[str]:
    """Which of FastChat's 7 hard-prompt criteria the prompt meets, by rule."""
    return [name for name, pattern in _CRITERIA.items() if pattern.search(text)]


def categorize(prompts: Sequence[str], turns: int | None = None) -> list[str]:
    """The categories of a battle whose user turns are `prompts` (sorted, no duplicates)."""
    text = "\n".join(prompts)
    found = set()
    code_line = any(_CODE_LINE.match(line) for line in text.splitlines())
    if code_line or _CODE_FENCE.search(text) or _CODE_WORDS.search(text):
        found.add("coding")
    if _MATH_EXPR.search(text) or _MATH_WORDS.search(text):
        found.add("math")
    if _CREATIVE_ASK.search(text) or _CREATIVE_WORDS.search(text):
        found.add("creative_writing")
    if (turns if turns is not None else len(prompts)) > 1:
        found.add("multi_turn")
    if len(_TOKENS.findall(text)) >= LONG_QUERY_TOKENS:
        found.add("long_query")
    if len(hard_criteria(text)) >= HARD_CRITERIA:
        found.add("hard_prompts")
    if prompts and (lang := language(prompts[0])):
        found.add(lang)
    return sorted(found)
