"""The model history folded beside the leaderboard: entries, withdrawals, owners, replay."""

from __future__ import annotations

import pytest

from consumers.leaderboard.projection import VoteProjection
from events import decode, encode, subjects
from events.battles import BattleStarted, ModelReinstated, ModelWithdrawn, VoteCast, VoteInvalidated
from infra.arena_cli import project

pytestmark = pytest.mark.timeout(30)


def started(bid, a, b, owner_a="acme", owner_b="acme"):
    return BattleStarted(
        battle_id=bid,
        voter="v",
        model_a=a,
        model_b=b,
        swapped=False,
        policy_version="p",
        pair_probability=1.0,
        owner_a=owner_a,
        owner_b=owner_b,
    )


def battle(bid, a, b, choice="a", owner_b="acme"):
    return [started(bid, a, b, owner_b=owner_b), VoteCast(battle_id=bid, choice=choice, model_a=a, model_b=b)]


def arena_events() -> list[tuple[int, object]]:
    """acme enters m1 and two variants, zed one model; acme withdraws m3; an imported vote
    brings in a model with no owner; one vote does not count."""
    events = [
        *battle("b1", "m1", "m2"),
        *battle("b2", "m2", "m3", "b"),
        *battle("b3", "m3", "z1", owner_b="zed"),
        VoteInvalidated(battle_id="b3", reason="identity_leak", detector="identity_leak"),
        ModelWithdrawn(model="m3", reason="private test over", owner="acme"),
        VoteCast(battle_id="imp-1", choice="tie", model_a="m1", model_b="old", imported=True),
        *battle("b4", "m1", "z1", owner_b="zed"),
    ]
    return list(enumerate(events, 1))


def test_a_withdrawn_model_stays_listed_with_its_votes_and_owner_counts():
    history = project(arena_events()).model_history()
    rows = {m["model"]: m for m in history["models"]}
    assert [m["model"] for m in history["models"]] == ["m1", "m2", "m3", "z1", "old"]  # in the order they entered
    m3 = rows["m3"]
    assert (m3["status"], m3["votes"], m3["battles"], m3["reason"], m3["changed_seq"]) == (
        "withdrawn",
        1,  # b2 counts, b3 was invalidated
        2,
        "private test over",
        8,
    )
    assert rows["old"]["owner"] is None and rows["old"]["battles"] == 0 and rows["old"]["votes"] == 1
    assert rows["m1"]["votes"] == 3 and rows["z1"]["votes"] == 1 and rows["m1"]["entered_seq"] == 1
    assert history["owners"] == [
        {"owner": "acme", "variants": 3, "active": 2, "withdrawn": 1},
        {"owner": None, "variants": 1, "active": 1, "withdrawn": 0},
        {"owner": "zed", "variants": 1, "active": 1, "withdrawn": 0},
    ]


def test_a_reinstated_model_is_active_again_and_each_change_is_its_own_fact():
    events = arena_events()
    again = ModelReinstated(model="m3", reason="mistake", owner="acme", revision=1)
    p = project([*events, (len(events) + 1, again)])
    m3 = next(m for m in p.model_history()["models"] if m["model"] == "m3")
    assert m3["status"] == "active" and m3["reason"] == "mistake" and p.history.models["m3"].changes == 2
    first = ModelWithdrawn(model="m3", reason="x", revision=0)
    assert len({first.dedupe_key(), ModelWithdrawn(model="m3", reason="x", revision=2).dedupe_key()}) == 2


def test_the_history_and_the_board_replay_exactly_at_every_past_sequence():
    events = arena_events()
    live = VoteProjection(project([]).config)
    for seq, event in events:
        live.apply(event, seq)
        replayed = project(events[:seq])
        assert replayed.model_history() == live.model_history()
        assert replayed.leaderboard()["digest"] == live.leaderboard()["digest"]
    # A withdrawal changes the history, never a rating: the model keeps its votes on the board.
    before, after = project(events[:7]), project(events[:8])
    assert before.model_history()["digest"] != after.model_history()["digest"]
    assert before.leaderboard()["digest"] == after.leaderboard()["digest"]
    assert "m3" in {r["model"] for r in after.leaderboard()["rows"]}


def test_model_events_have_a_subject_of_their_own_and_old_battles_decode():
    dotted = ModelWithdrawn(model="llama-3.1-8b", reason="r")
    subject = subjects.subject_for(dotted)
    assert subject.startswith("arena.battle.model.withdrawn.") and len(subject.split(".")) == 5
    assert subjects.is_valid_token(subject.split(".")[-1])
    assert subjects.subject_for(ModelWithdrawn(model="m1", reason="r")) == "arena.battle.model.withdrawn.m1"
    assert decode(encode(dotted)) == dotted
    # A BattleStarted stored before owners existed decodes with none.
    stored = started("b0", "m1", "m2").model_dump(mode="json", exclude={"owner_a", "owner_b"})
    old = decode(stored)
    assert old.owner_a is None and old.owner_b is None
    p = project([(1, old)])
    assert p.model_history()["owners"] == [{"owner": None, "variants": 2, "active": 2, "withdrawn": 0}]


async def test_the_leaderboard_command_with_no_votes_says_so(monkeypatch, capsys):
    from infra import arena_cli

    async def no_events(js, upto=None):
        return []

    monkeypatch.setattr(arena_cli, "battle_events", no_events)
    assert await arena_cli.leaderboard(None, None, False) == 0
    assert capsys.readouterr().out == "seq 0  no votes yet: play a battle at /arena\n"
    assert await arena_cli.leaderboard(None, None, False, style_control=True) == 0
    out = capsys.readouterr().out
    assert out == "style-controlled  seq 0  no votes with style counts yet: play a battle at /arena\n"
