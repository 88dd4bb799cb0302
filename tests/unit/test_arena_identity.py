"""Pseudonyms, side conversation ids, scrubbing and the identity-leak check; battle events."""

from __future__ import annotations

import pytest

from events import decode, encode
from events.battles import BattleStarted, BattleTurn, VoteCast, VoteInvalidated, battle_filter
from events.subjects import subject_for
from gateway.arena.identity import names_itself, scrub, side_conv_id, voter_pseudonym

pytestmark = pytest.mark.timeout(30)

KEY = b"k" * 32


def test_pseudonym_is_stable_keyed_and_never_the_raw_value():
    p = voter_pseudonym(KEY, None, "10.1.2.3")
    assert p == voter_pseudonym(KEY, None, "10.1.2.3") != voter_pseudonym(b"other", None, "10.1.2.3")
    assert "10.1.2.3" not in p and voter_pseudonym(KEY, "sk-1", "10.1.2.3") != p
    assert "sk-1" not in voter_pseudonym(KEY, "sk-1", None)


def test_side_conversations_differ_and_are_valid_subject_tokens():
    a, b = side_conv_id(KEY, "battle-xyz", "a"), side_conv_id(KEY, "battle-xyz", "b")
    assert a != b and "xyz" not in a
    from events.subjects import is_valid_token

    assert is_valid_token(a) and is_valid_token(b)


def test_scrub_removes_every_spelling_of_a_name_longest_first():
    text = "model 'stories-260k-creative' is busy; Stories 260K too"
    out = scrub(text, ["stories-260k", "stories-260k-creative"])
    assert "stories" not in out.lower() and "creative" not in out


def test_an_answer_naming_its_own_model_is_a_leak():
    assert names_itself("Hi, I am Stories_260k, a model.", "stories-260k")
    assert names_itself("I am stories-260k", "stories-260k-creative", base="stories-260k")
    assert not names_itself("Once upon a time there was a dog.", "stories-260k")


def test_battle_events_round_trip_on_their_subjects_with_one_vote_per_battle():
    started = BattleStarted(
        battle_id="b1",
        voter="v-x",
        model_a="m1",
        model_b="m2",
        swapped=False,
        policy_version="p",
        pair_probability=0.5,
    )
    turn = BattleTurn(battle_id="b1", turn_id=1, request_a="r1", request_b="r2", conv_a="c1", conv_b="c2")
    vote = VoteCast(battle_id="b1", choice="tie", model_a="m1", model_b="m2")
    again = VoteCast(battle_id="b1", choice="a", model_a="m1", model_b="m2")
    bad = VoteInvalidated(battle_id="b1", reason="identity_leak", detector="answer_names_model")
    for e in (started, turn, vote, bad):
        assert decode(encode(e)) == e
        assert subject_for(e).startswith("arena.battle.") and subject_for(e).endswith(".b1")
    assert vote.dedupe_key() == again.dedupe_key() == "battle:b1:vote.cast"
    assert turn.dedupe_key() == "battle:b1:turn:1"
    assert battle_filter("b1") == "arena.battle.*.b1"
