"""FastChat clean-battle JSON to vote records and back."""

from __future__ import annotations

import json
import re

import pytest

from consumers.leaderboard.fastchat_format import (
    BattleFormatError,
    battles_to_votes,
    dump_battles,
    load_battles,
    votes_to_battles,
)
from consumers.leaderboard.ratings import Vote

pytestmark = pytest.mark.timeout(10)

BATTLES = [
    {
        "question_id": "q1",
        "model_a": "vicuna-13b",
        "model_b": "koala-13b",
        "winner": "model_a",
        "judge": "arena_user_973",
        "conversation_a": [{"role": "user", "content": "hi"}],
        "anony": True,
        "language": "English",
        "tstamp": 1682351591.1322,
    },
    {"model_a": "koala-13b", "model_b": "alpaca-13b", "winner": "model_b", "tstamp": 1682351600},
    {
        "model_a": "alpaca-13b",
        "model_b": "vicuna-13b",
        "winner": "tie",
        "conv_metadata": {
            "sum_user_tokens": 12,
            "sum_assistant_a_tokens": 310,
            "sum_assistant_b_tokens": 95,
            "header_count_a": {"h1": 0, "h2": 2, "h3": 0, "h4": 0, "h5": 0, "h6": 0},
            "header_count_b": {"h1": 0, "h2": 0, "h3": 0, "h4": 0, "h5": 0, "h6": 0},
            "list_count_a": {"ordered": 3, "unordered": 4},
            "list_count_b": {"ordered": 0, "unordered": 0},
            "bold_count_a": {"**": 5, "__": 0},
            "bold_count_b": {"**": 0, "__": 0},
            "turns": 1,
        },
    },
    {"model_a": "vicuna-13b", "model_b": "alpaca-13b", "winner": "tie (bothbad)", "judge": "arena_user_1"},
]


def test_reads_outcomes_and_keeps_tstamp_and_judge() -> None:
    votes = battles_to_votes(BATTLES)
    assert [v.outcome for v in votes] == ["a", "b", "tie", "both_bad"]
    assert votes[0] == Vote("vicuna-13b", "koala-13b", "a", 1682351591.1322, "arena_user_973")
    assert votes[2].tstamp is None and votes[2].judge is None
    assert votes[2].conv_metadata == BATTLES[2]["conv_metadata"] and votes[0].conv_metadata is None
    swapped = votes[2].swapped().conv_metadata
    assert swapped is not None and swapped["sum_assistant_b_tokens"] == 310 and swapped["list_count_b"]["ordered"] == 3


def test_round_trip_through_a_file(tmp_path) -> None:
    path = tmp_path / "clean_battle.json"
    path.write_text(json.dumps(BATTLES))
    votes = load_battles(path)
    dump_battles(votes, tmp_path / "out.json")
    assert load_battles(tmp_path / "out.json") == votes
    kept = ("model_a", "model_b", "winner", "tstamp", "judge", "conv_metadata")
    assert votes_to_battles(votes) == [{k: b[k] for k in kept if k in b} for b in BATTLES]


@pytest.mark.parametrize(
    ("row", "field", "words"),
    [
        ({"model_b": "y", "winner": "model_a"}, "model_a", "missing"),
        ({"model_a": "x", "model_b": "", "winner": "model_a"}, "model_b", "non-empty string"),
        ({"model_a": "x", "model_b": 3, "winner": "model_a"}, "model_b", "non-empty string"),
        ({"model_a": "x", "model_b": "y", "winner": "tie(bothbad)"}, "winner", "'tie(bothbad)' is not one of"),
        ({"model_a": "x", "model_b": "y", "winner": "model_a", "tstamp": "noon"}, "tstamp", "finite number"),
        ({"model_a": "x", "model_b": "y", "winner": "model_a", "tstamp": True}, "tstamp", "finite number"),
        ({"model_a": "x", "model_b": "y", "winner": "model_a", "judge": 5}, "judge", "string"),
        ({"model_a": "x", "model_b": "x", "winner": "model_a"}, "model_b", "itself"),
        (["x", "y", "model_a"], "*", "expected an object"),
        ({"model_a": "x", "model_b": "y", "winner": "tie", "conv_metadata": [1]}, "conv_metadata", "an object"),
        (
            {"model_a": "x", "model_b": "y", "winner": "tie", "conv_metadata": {"bold_count_a": "lots"}},
            "conv_metadata",
            "bold_count_a",
        ),
    ],
)
def test_bad_rows_name_index_and_field(row: object, field: str, words: str) -> None:
    with pytest.raises(BattleFormatError, match=re.escape(words)) as info:
        battles_to_votes([BATTLES[0], row])
    assert info.value.index == 1 and info.value.field == field
    assert str(info.value).startswith(f"battle 1: field {field!r}")


def test_not_a_list_is_refused() -> None:
    with pytest.raises(BattleFormatError, match="JSON list"):
        battles_to_votes({"battles": BATTLES})
