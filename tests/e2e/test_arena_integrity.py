"""The vote rules on the real stack: a flood of one prompt, a voter faster than reading,
a voter past the daily cap, a bot voting against the consensus. Each vote is cast, then
taken out by a `VoteInvalidated` naming its rule: on the voter's reveal, in `arena replay`,
`arena audit`, the gateway's metrics and the leaderboard (the identity leak:
tests/e2e/test_arena_battles.py -k named_its_own)."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from tests.conftest import REPO
from tests.e2e.test_arena_battles import START_S, arena_cmd, turn

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

DWELL_S = 1.0
PAIR = ("stories-260k", "stories-260k-creative")


@pytest.fixture(scope="module")
def arena(module_stack_factory):
    return module_stack_factory(
        ARENA_MODELS_CONFIG=REPO / "configs" / "stories-arena.yaml",
        ARENA_ARENA_WEIGHTS=json.dumps(dict.fromkeys(PAIR, 1)),  # one pair: the consensus below is about it
        ARENA_ARENA_MIN_DWELL_S=DWELL_S,
        ARENA_ARENA_PROMPT_CAP=2,
        ARENA_ARENA_DAILY_VOTE_CAP=4,
    ).start(timeout=START_S)


def start(client: httpx.Client) -> str:
    end = time.monotonic() + 30
    while (r := client.post("/arena/battles")).status_code == 503:  # the workers' heartbeats come in first
        assert time.monotonic() < end, r.text
        time.sleep(0.3)
    assert r.status_code == 201, r.text
    return r.json()["battle_id"]


def play(arena, voter: str, prompt: str, choice="a", wait_s: float = DWELL_S + 0.3, pick=None) -> dict:
    """One battle by `voter` (its address, through the proxy header uvicorn trusts from 127.0.0.1)."""
    with httpx.Client(base_url=arena.url, timeout=60, headers={"x-forwarded-for": voter}) as client:
        bid = start(client)
        turn(client, bid, prompt)
        time.sleep(wait_s)
        if pick is not None:
            choice = pick(bid)
        r = client.post(f"/arena/battles/{bid}/vote", json={"choice": choice})
        assert r.status_code == 200, r.text
        return r.json()


def metric(arena, rule: str) -> float:
    text = httpx.get(f"{arena.url}/metrics").text
    found = re.search(rf'^arena_votes_not_counted_total{{rule="{rule}"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def audit(arena) -> dict:
    done = arena_cmd(arena, "audit", "--json")
    return json.loads(done.stdout)["votes_not_counted"]


def replayed(arena, bid: str) -> str:
    return arena_cmd(arena, "replay", "--battle-id", bid).stdout


def test_a_flood_of_one_prompt_is_capped(arena):
    views = [play(arena, "10.0.0.1", "Tell me about a red ball") for _ in range(3)]
    assert [v["counted"] for v in views] == [True, True, False]
    assert views[2]["invalid_reason"].startswith("duplicate_prompt")
    assert play(arena, "10.0.0.1", "Tell me about a blue ball")["counted"] is True
    assert metric(arena, "duplicate_prompt") == 1.0
    assert audit(arena)["duplicate_prompt"] == [views[2]["battle_id"]]
    text = replayed(arena, views[2]["battle_id"])
    assert "vote.invalidated" in text and '"detector": "duplicate_prompt"' in text


def test_a_vote_faster_than_reading_does_not_count(arena):
    fast = play(arena, "10.0.0.2", "A bird sang", wait_s=0.0)
    assert fast["counted"] is False and fast["invalid_reason"].startswith("min_dwell: voted 0.")
    assert metric(arena, "min_dwell") == 1.0 and fast["battle_id"] in audit(arena)["min_dwell"]


def test_a_voter_past_the_daily_cap(arena):
    views = [play(arena, "10.0.0.3", f"Story number {k}") for k in range(5)]
    assert [v["counted"] for v in views] == [True] * 4 + [False]
    assert views[4]["invalid_reason"] == "daily_cap: the voter has 4 counted votes today (UTC)"
    assert audit(arena)["daily_cap"] == [views[4]["battle_id"]] and metric(arena, "daily_cap") == 1.0


def test_a_bot_voting_against_the_consensus_loses_all_its_votes(arena, tmp_path):
    # The crowd's consensus on the one pair: stories-260k won 58 of 60 (a FastChat file).
    rows = [
        {"model_a": PAIR[0], "model_b": PAIR[1], "winner": "model_a" if k >= 2 else "model_b", "tstamp": 1.7e9 + k}
        for k in range(60)
    ]
    (tmp_path / "crowd.json").write_text(json.dumps(rows))
    assert arena_cmd(arena, "battles", "import", str(tmp_path / "crowd.json")).returncode == 0
    end = time.monotonic() + 15
    while not any(p[:2] == list(PAIR) and p[2] >= 58 for p in board(arena).get("pairs", [])):
        assert time.monotonic() < end, board(arena)
        time.sleep(0.3)

    def underdog(bid: str) -> str:  # the bot knows who is who (as a classifier of styles would)
        started = next(json.loads(line) for line in replayed_json(arena, bid) if '"battle.started"' in line)
        return "a" if started["model_a"] == PAIR[1] else "b"

    before = board(arena)["total_votes"]
    views = [play(arena, "10.0.0.4", f"A tale of a cat, part {k}", pick=underdog) for k in range(5)]
    assert [v["counted"] for v in views] == [True] * 4 + [False]
    assert views[4]["invalid_reason"].startswith("anti_consensus: the voter's product of 1/(2p) over 5 votes")
    out = audit(arena)["anti_consensus"]
    assert sorted(out) == sorted(v["battle_id"] for v in views)  # its four earlier votes went with it
    assert metric(arena, "anti_consensus") == 5.0
    end = time.monotonic() + 15
    while board(arena)["total_votes"] != before:
        assert time.monotonic() < end, "the bot's votes are still on the leaderboard"
        time.sleep(0.3)
    text = replayed(arena, views[0]["battle_id"])
    assert '"detector": "anti_consensus"' in text
    honest = play(arena, "10.0.0.5", "A kind story", pick=lambda bid: "b" if underdog(bid) == "a" else "a")
    assert honest["counted"] is True


def board(arena) -> dict:
    return httpx.get(f"{arena.url}/arena/leaderboard").json() | raw_pairs(arena)


def raw_pairs(arena) -> dict:
    """The stored board's pairs (the gateway's view drops them): read through the CLI's projection."""
    done = arena_cmd(arena, "leaderboard", "--json")
    return {"pairs": json.loads(done.stdout).get("pairs", [])}


def replayed_json(arena, bid: str) -> list[str]:
    return arena_cmd(arena, "replay", "--battle-id", bid, "--json").stdout.splitlines()
