"""Keeping who is who secret (pure logic): voter pseudonyms, side conversation ids,
scrubbing model names out of anything sent before the vote, and finding answers that
name their own model."""

from __future__ import annotations

import re
from collections.abc import Iterable

from gateway.keyed import keyed

SIDES = ("a", "b")


def voter_pseudonym(key: bytes, api_key: str | None, address: str | None) -> str:
    """The same voter gets the same pseudonym; the raw key or address is never kept."""
    who = f"key:{api_key}" if api_key else f"ip:{address or 'unknown'}"
    return "v-" + keyed(key, "voter", who)[:24]


def side_conv_id(key: bytes, battle_id: str, side: str) -> str:
    """Each side's conversation id, derived from the battle with a secret key: a client
    that knows the battle cannot find (or attach to) a side's requests through /v1 or /chat."""
    return "bc-" + keyed(key, "conv", battle_id, side)[:32]


def neutral_name(side: str) -> str:
    return f"model_{side}"


def name_pattern(name: str) -> re.Pattern:
    # "stories-260k" also matches "Stories 260K" and "stories_260k".
    parts = [re.escape(p) for p in re.split(r"[\s_\-./:]+", name) if p]
    return re.compile(r"[\s_\-./:]*".join(parts), re.IGNORECASE)


def scrub(text: str, names: Iterable[str]) -> str:
    """`text` with every model name replaced (longest first, so a variant's name goes whole)."""
    for name in sorted(set(names), key=len, reverse=True):
        text = name_pattern(name).sub("[model]", text)
    return text


def names_itself(answer: str, model: str, base: str | None = None) -> bool:
    """True when an answer names its own model (or the model it is a variant of)."""
    return any(name_pattern(n).search(answer) for n in (model, base) if n)
