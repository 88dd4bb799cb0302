"""The vote fold behind the live leaderboard and `arena leaderboard --at`; import and audit."""

from __future__ import annotations

import json

import pytest

from consumers.leaderboard.projection import VoteProjection
from consumers.leaderboard.ratings import build_style_leaderboard, compute_leaderboard
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


def styled(bid, a, b, choice, tokens_a, tokens_b):
    meta = {"sum_assistant_a_tokens": tokens_a, "sum_assistant_b_tokens": tokens_b, "turns": 1}
    for side in "ab":
        meta |= {f"header_count_{side}": {"h1": 0}, f"list_count_{side}": {"ordered": 0}, f"bold_count_{side}": 0}
    return VoteCast(battle_id=bid, choice=choice, model_a=a, model_b=b, conv_metadata=meta)


def test_style_board_from_events_matches_one_from_the_counted_votes():
    events = [styled(f"s{i}", f"m{i % 3}", f"m{(i + 1) % 3}", "ab"[i % 2], 10 + 7 * (i % 5), 30) for i in range(40)]
    events.append(vote("plain"))  # a vote with no style record: on the raw board only
    p = project(list(enumerate(events, 1)))
    style = p.style_leaderboard()
    assert style["style_control"] and style["total_votes"] == 40 and p.leaderboard()["total_votes"] == 41
    assert list(style["style_coefficients"]) == ["length", "header", "list", "bold"]
    assert style["style_coefficients"]["header"] == 0.0  # no answer had a header
    expected = build_style_leaderboard([v for v in p.counted() if v.conv_metadata], p.config)
    assert expected is not None and style["digest"] == expected.digest()
    p.apply(VoteInvalidated(battle_id="s3", reason="t", detector="t"), 50)
    assert p.style_leaderboard()["total_votes"] == 39
    assert project([(1, vote("x"))]).style_leaderboard() | {"computed_at": 0} == {
        "seq": 1,
        "total_votes": 0,
        "computed_at": 0,
        "min_votes": p.config.min_votes,
        "style_control": True,
        "style_coefficients": None,
        "digest": None,
        "rows": [],
    }


def test_a_board_per_category_replays_from_the_events():
    events = [
        VoteCast(
            battle_id=f"c{i}",
            choice="ab"[i % 2] if i % 3 else "a",
            model_a=f"m{i % 3}",
            model_b=f"m{(i + 1) % 3}",
            categories=["coding", "english"] if i % 2 else ["english"],
        )
        for i in range(30)
    ]
    p = project(list(enumerate(events, 1)))
    views = p.boards()
    assert views["raw"]["categories"] == {"coding": 15, "english": 30}
    coding = views["category:coding"]
    assert coding["category"] == "coding" and coding["total_votes"] == 15
    expected = compute_leaderboard([v for v in p.counted() if "coding" in v.categories], p.config)
    assert coding["digest"] == expected.digest()
    assert project(list(enumerate(events, 1))[:10]).category_leaderboard("coding")["total_votes"] == 5
    assert p.category_leaderboard("math") | {"computed_at": 0} == {
        **p.document(None),
        "computed_at": 0,
        "category": "math",
    }
