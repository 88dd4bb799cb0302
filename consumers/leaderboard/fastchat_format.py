"""FastChat's clean-battle JSON (`clean_battle_data.py` output) to vote records and back.

A file is a JSON list of objects with `model_a`, `model_b` and `winner` in `model_a`,
`model_b`, `tie`, `tie (bothbad)`; `tstamp` (number), `judge` (string) and `conv_metadata`
(an object: the answer tokens and markdown counts style control reads) are kept when
present, every other field (conversations, language, anony, ...) is ignored.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path

from consumers.leaderboard.style_control import STYLE_ELEMENTS, StyleMetadataError, style_count
from consumers.leaderboard.votes import Outcome, Vote, check_vote

WINNER_TO_OUTCOME: dict[str, Outcome] = {"model_a": "a", "model_b": "b", "tie": "tie", "tie (bothbad)": "both_bad"}
OUTCOME_TO_WINNER: dict[str, str] = {o: w for w, o in WINNER_TO_OUTCOME.items()}


class BattleFormatError(ValueError):
    """A battle that cannot be read, with its position in the list and the field at fault."""

    def __init__(self, index: int, field: str, message: str) -> None:
        self.index, self.field = index, field
        super().__init__(f"battle {index}: field {field!r}: {message}")


def _vote(index: int, row: object) -> Vote:
    if not isinstance(row, dict):
        raise BattleFormatError(index, "*", f"expected an object, got {type(row).__name__}")
    for name in ("model_a", "model_b", "winner"):
        if name not in row:
            raise BattleFormatError(index, name, "missing")
    for name in ("model_a", "model_b"):
        if not isinstance(row[name], str) or not row[name]:
            raise BattleFormatError(index, name, f"expected a non-empty string, got {row[name]!r}")
    winner = row["winner"]
    if winner not in WINNER_TO_OUTCOME:
        raise BattleFormatError(index, "winner", f"{winner!r} is not one of {list(WINNER_TO_OUTCOME)}")
    tstamp = row.get("tstamp")
    if tstamp is not None and (
        isinstance(tstamp, bool) or not isinstance(tstamp, int | float) or not math.isfinite(tstamp)
    ):
        raise BattleFormatError(index, "tstamp", f"expected a finite number, got {tstamp!r}")
    judge = row.get("judge")
    if judge is not None and not isinstance(judge, str):
        raise BattleFormatError(index, "judge", f"expected a string, got {judge!r}")
    try:
        check_vote(row["model_a"], row["model_b"], WINNER_TO_OUTCOME[winner])
    except ValueError as exc:
        raise BattleFormatError(index, "model_b", str(exc)) from None
    return Vote(row["model_a"], row["model_b"], WINNER_TO_OUTCOME[winner], tstamp, judge, _metadata(index, row))


def _metadata(index: int, row: dict) -> dict | None:
    meta = row.get("conv_metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise BattleFormatError(index, "conv_metadata", f"expected an object, got {type(meta).__name__}")
    try:  # an older file may carry some or none of the style counts: those present must be counts
        for key in STYLE_ELEMENTS:
            if key in meta:
                style_count(meta, key)
    except StyleMetadataError as exc:
        raise BattleFormatError(index, "conv_metadata", str(exc)) from None
    return meta


def battles_to_votes(battles: object) -> list[Vote]:
    """Vote records from parsed clean-battle JSON; raises `BattleFormatError` on the first bad row."""
    if not isinstance(battles, list):
        raise BattleFormatError(-1, "*", f"expected a JSON list of battles, got {type(battles).__name__}")
    return [_vote(index, row) for index, row in enumerate(battles)]


def votes_to_battles(votes: Iterable[Vote]) -> list[dict[str, object]]:
    """Clean-battle objects for `votes`; `tstamp`, `judge` and `conv_metadata` only where the vote has them."""
    out: list[dict[str, object]] = []
    for v in votes:
        row: dict[str, object] = {"model_a": v.model_a, "model_b": v.model_b, "winner": OUTCOME_TO_WINNER[v.outcome]}
        if v.tstamp is not None:
            row["tstamp"] = v.tstamp
        if v.judge is not None:
            row["judge"] = v.judge
        if v.conv_metadata is not None:
            row["conv_metadata"] = dict(v.conv_metadata)
        out.append(row)
    return out


def load_battles(path: str | Path) -> list[Vote]:
    """Read a clean-battle JSON file."""
    with Path(path).open(encoding="utf-8") as f:
        return battles_to_votes(json.load(f))


def dump_battles(votes: Iterable[Vote], path: str | Path) -> None:
    """Write votes as a clean-battle JSON file (indented like FastChat's)."""
    with Path(path).open("w", encoding="utf-8") as f:
        json.dump(votes_to_battles(votes), f, indent=2, ensure_ascii=False)
        f.write("\n")
