"""The vote fold behind the live leaderboard and `arena leaderboard --at`; import and audit."""

from __future__ import annotations

import json

import pytest

from consumers.leaderboard.projection import VoteProjection
from consumers.leaderboard.ratings import compute_leaderboard
from events.battles import BattleStarted, VoteCast, VoteInvalidated, VoteReinstated
from infra.arena_cli import imported_votes, project
from infra.battle_audit import audit_battles

pytestmark = pytest.mark.timeout(30)


def vote(bid, a="m1", b="m2", choice="a"):
    return VoteCast(battle_id=bid, choice=choice, model_a=a, model_b=b)


def test_invalidated_votes_leave_and_reinstated_ones_come_back():
    events = [vote("b1"), vote("b2", choice="b"), vote("b3", "m2", "m3"), vote("b1", choice="b")]
    p = project(list(enumerate(events, 1)))
    assert p.leaderboard()["total_votes"] == 3  # a second vote of b1 is ignored
    p.apply(VoteInvalidated(battle_id="b2", reason="identity_leak", detector="t"), 5)
    without = p.leaderboard()
    expected = compute_leaderboard([v for v in p.counted()], p.config)
    assert without["total_votes"] == 2 and without["digest"] == expected.digest()
    p.apply(VoteReinstated(battle_id="b2", reason="ok", detector="operator"), 6)
    assert p.leaderboard()["total_votes"] == 3 and p.seq == 6


def test_same_events_same_digest_at_a_sequence():
    events = list(enumerate([vote(f"b{i}", choice="ab"[i % 2]) for i in range(20)], 1))
    live = VoteProjection(project([]).config)
    for seq, e in events[:12]:
        live.apply(e, seq)
    at_12 = live.leaderboard()
    assert project(events[:12]).leaderboard()["digest"] == at_12["digest"] and at_12["seq"] == 12


def test_import_marks_votes_and_audit_finds_orphans_and_doubles(tmp_path):
    path = tmp_path / "battles.json"
    path.write_text(json.dumps([{"model_a": "x", "model_b": "y", "winner": "tie (bothbad)", "tstamp": 1.7e9}]))
    [imp] = imported_votes(str(path))
    assert imp.imported and imp.choice == "both_bad" and imp.battle_id == imported_votes(str(path))[0].battle_id
    started = BattleStarted(
        battle_id="b1", voter="v", model_a="m1", model_b="m2", swapped=False, policy_version="p", pair_probability=1.0
    )
    report = audit_battles([started, vote("b1"), vote("b1"), vote("lost"), imp])
    assert report["votes_without_battle"] == ["lost"] and report["battles_with_several_votes"] == ["b1"]
