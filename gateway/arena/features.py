"""What a vote records about the answers' style (pure logic, no numpy): FastChat's
`conv_metadata` layout, so a live battle and an imported clean-battle row feed style
control the same way.

The markdown counts transcribe FastChat's `count_markdown_elements` and
`get_element_counts` (fastchat/serve/monitor/add_markdown_info.py): a side's answers are
joined with newlines and its code blocks are taken out first (FastChat removes what is
between the fences and leaves the fences, and so does this). Token counts come from the
model's own tokenizer: the `completion_tokens` inference reported for each answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from events.models import ChatCompleted, Terminal

#: A turn's two terminal events, side a's and side b's (None while a side runs).
Answers = tuple[Terminal | None, Terminal | None]

CODE_BLOCK = re.compile("```([^`]*)```")
_HEADERS = {f"h{n}": re.compile(rf"^#{{{n}}}\s", re.MULTILINE) for n in range(1, 7)}
_ORDERED = re.compile(r"^\s*\d+\.\s", re.MULTILINE)
_UNORDERED = re.compile(r"^\s*[-*+]\s", re.MULTILINE)
_BOLD_STARS = re.compile(r"\*\*[^*\n]+\*\*")
_BOLD_UNDERSCORES = re.compile(r"__[^_\n]+__")


def without_code(answer: str) -> str:
    for block in CODE_BLOCK.findall(answer):
        answer = answer.replace(block, "")
    return answer


def markdown_counts(text: str, side: str) -> dict[str, dict[str, int]]:
    """FastChat's `count_markdown_elements(text, suffix="_" + side)` on text without its code."""
    text = without_code(text)
    return {
        f"header_count_{side}": {h: len(p.findall(text)) for h, p in _HEADERS.items()},
        f"list_count_{side}": {"ordered": len(_ORDERED.findall(text)), "unordered": len(_UNORDERED.findall(text))},
        f"bold_count_{side}": {"**": len(_BOLD_STARS.findall(text)), "__": len(_BOLD_UNDERSCORES.findall(text))},
    }


def conv_metadata(answers: Mapping[str, Sequence[str]], tokens: Mapping[str, int]) -> dict:
    """A battle's `conv_metadata`: per side ("a", "b") its answers in turn order and their tokens."""
    meta: dict = {"turns": len(answers["a"])}
    for side in ("a", "b"):
        meta[f"sum_assistant_{side}_tokens"] = tokens[side]
        meta.update(markdown_counts("\n".join(answers[side]), side))
    return meta


def whole_turns(answers: Sequence[Answers]) -> list[tuple[ChatCompleted, ChatCompleted]]:
    """The turns both sides answered, in order: a turn one side did not finish is no part
    of the battle (it was sent again, and neither side's conversation keeps it)."""
    return [(a, b) for a, b in answers if isinstance(a, ChatCompleted) and isinstance(b, ChatCompleted)]


def answer_texts(answers: Sequence[Answers]) -> dict[str, list[str]]:
    """Each side's answers of the turns both sides answered, in turn order, from each
    turn's (side a, side b) terminal events."""
    whole = whole_turns(answers)
    return {"a": [a.text for a, _ in whole], "b": [b.text for _, b in whole]}


def style_of(answers: Sequence[Answers]) -> dict:
    """The battle's `conv_metadata` from the turns both sides answered (a turn cut off counts for nothing)."""
    whole = whole_turns(answers)
    tokens = {side: sum(t[i].usage.completion_tokens for t in whole) for i, side in enumerate(("a", "b"))}
    return conv_metadata(answer_texts(answers), tokens)
