"""The vote rules: FastChat's consensus test transcribed and compared, the word list, the
prompt key, and the counters on fakeredis (the real stack: tests/e2e/test_arena_integrity.py)."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import fakeredis
import numpy as np
import pytest

from gateway.arena.integrity import (
    IDENTITY_WORDS,
    Integrity,
    IntegrityConfig,
    VoterRecord,
    consensus_factors,
    identity_leak,
    pair_counts,
    pair_score,
    prompt_key,
)

pytestmark = pytest.mark.timeout(30)


def fastchat_outlier_detect(battles: list[dict], max_vote=100, alpha=0.05) -> dict[str, int]:
    """elo_analysis.py `get_model_pair_stats` + `outlier_detect` (randomized=False), pandas
    replaced by lists: bad user -> the vote count at which it was flagged."""
    stats: dict[tuple, dict] = {}
    for row in battles:
        pair = tuple(sorted([row["model_a"], row["model_b"]]))
        s = stats.setdefault(pair, {"win": 0, "loss": 0, "tie": 0})
        if row["winner"] in ["tie", "tie (bothbad)"]:
            s["tie"] += 1
        elif (row["winner"] == "model_a" and row["model_a"] == min(pair)) or (
            row["winner"] == "model_b" and row["model_b"] == min(pair)
        ):
            s["win"] += 1
        else:
            s["loss"] += 1
    counts: dict[str, int] = {}
    for row in battles:
        counts[row["judge"]] = counts.get(row["judge"], 0) + 1
    bad = {}
    for user in [u for u, n in counts.items() if n >= 5]:
        p_upper: list[float] = []
        p_lower: list[float] = []
        for row in [b for b in battles if b["judge"] == user]:
            if len(p_upper) >= max_vote:
                break
            model_pair = tuple(sorted([row["model_a"], row["model_b"]]))
            if row["winner"] in ["tie", "tie (bothbad)"]:
                vote = 0.5
            elif (row["winner"] == "model_a" and row["model_a"] == model_pair[0]) or (
                row["winner"] == "model_b" and row["model_b"] == model_pair[0]
            ):
                vote = 1
            else:
                vote = 0
            st = stats[model_pair]
            ratings = np.array([1] * st["win"] + [0] * st["loss"])
            with np.errstate(divide="ignore"):
                p_upper += [(ratings <= vote).mean()]
                p_lower += [(ratings >= vote).mean()]
                m_upper = np.prod(1 / (2 * np.array(p_upper)))
                m_lower = np.prod(1 / (2 * np.array(p_lower)))
            if (m_upper > 1 / alpha) or (m_lower > 1 / alpha):
                bad[user] = len(p_upper)
                break
    return bad


def crowd(seed: int, honest: int = 30, adversarial: int = 4, votes: int = 25) -> list[dict]:
    rng = np.random.default_rng(seed)
    true = {"m0": 1250.0, "m1": 1100.0, "m2": 1000.0, "m3": 850.0}
    names = sorted(true)
    rows = []
    users = [(f"honest{k}", False) for k in range(honest)] + [(f"bot{k}", True) for k in range(adversarial)]
    for _ in range(votes):
        for user, against in users:
            a, b = rng.choice(len(names), 2, replace=False)
            p = 1 / (1 + 10 ** ((true[names[b]] - true[names[a]]) / 400))
            if rng.random() < 0.1:
                winner = "tie"
            else:
                a_wins = rng.random() < (1 - p if against else p)
                winner = "model_a" if a_wins else "model_b"
            rows.append({"model_a": names[a], "model_b": names[b], "winner": winner, "judge": user})
    return rows


def test_consensus_test_flags_the_voters_fastchat_flags() -> None:
    battles = crowd(seed=3)
    expected = fastchat_outlier_detect(battles)
    assert {u for u in expected if u.startswith("bot")} == {"bot0", "bot1", "bot2", "bot3"}
    totals: dict[tuple, list[int]] = {}
    for row in battles:
        pair, score = pair_score(row["model_a"], row["model_b"], CHOICE[row["winner"]])
        totals.setdefault(pair, [0, 0])
        totals[pair][0] += score == 1.0
        totals[pair][1] += score == 0.0
    cfg = IntegrityConfig(consensus_min_pair_votes=0)
    got = {}
    for user in {r["judge"] for r in battles}:
        rec = VoterRecord()
        for row in [b for b in battles if b["judge"] == user]:
            pair, score = pair_score(row["model_a"], row["model_b"], CHOICE[row["winner"]])
            wins, losses = totals[pair]
            if rec.add(score, wins - (score == 1.0), losses - (score == 0.0), cfg):  # add() counts this vote back
                got[user] = rec.votes
                break
            if rec.crossed:  # FastChat reports the vote it crossed at; it flags users with >= 5 votes
                got[user] = rec.votes
                break
    assert got == expected


CHOICE = {"model_a": "a", "model_b": "b", "tie": "tie", "tie (bothbad)": "both_bad"}


def test_consensus_factors_are_one_over_twice_the_tail() -> None:
    # 9 wins, 1 loss for the pair's first model: a vote for it is expected, one against is not.
    assert consensus_factors(1.0, 9, 1) == (0.5, pytest.approx(1 / 1.8))
    assert consensus_factors(0.0, 9, 1) == (5.0, 0.5)
    assert consensus_factors(0.5, 10, 0) == (math.inf, 0.5)  # FastChat's numpy gives inf too
    assert consensus_factors(1.0, 0, 0) == (1.0, 1.0)
    assert pair_score("zeta", "alpha", "a") == (("alpha", "zeta"), 0.0)
    assert pair_score("alpha", "zeta", "both_bad") == (("alpha", "zeta"), 0.5)


def test_identity_words_and_arena_names() -> None:
    assert "claude" in IDENTITY_WORDS and "01.ai" in IDENTITY_WORDS and len(IDENTITY_WORDS) == 33
    names = {"stories-260k", "lily"}
    assert identity_leak({"a": ["I was trained by OpenAI."], "b": []}, names) == (
        "identity_leak: side a's answer in turn 0 names 'openai'"
    )
    assert "'stories-260k'" in identity_leak({"a": ["fine"], "b": ["ok", "I am Stories 260K"]}, names)
    assert "turn 1" in identity_leak({"a": [], "b": ["ok", "I am Stories 260K"]}, names)
    assert "'lily'" in identity_leak({"a": ["A girl named Lily."], "b": []}, names)
    assert identity_leak({"a": ["A dog ran."], "b": ["The sun."]}, names) is None


def test_prompt_key_is_fastchats_dedup_text() -> None:
    assert prompt_key(["hi", "more"]) == prompt_key(["hi", "more"]) != prompt_key(["hi more"])
    long = "x" * 20000
    assert prompt_key([long]) == prompt_key([long[:10000]])  # FastChat keeps the first 10,000 characters


@pytest.fixture
def integrity():
    return Integrity(fakeredis.FakeAsyncRedis(), IntegrityConfig(min_dwell_s=2.0, daily_cap=3, prompt_cap=2))


async def test_counters_cap_a_prompt_and_a_day(integrity) -> None:
    now = datetime(2025, 5, 1, 12, tzinfo=UTC)
    decide = integrity.tally
    rules = []
    for k in range(3):
        d = await decide(battle_id=f"p{k}", voter="v1", score=1.0, pair_counts=(0, 0), prompts=["same"], now=now)
        rules.append(d.rule)
    assert rules == [None, None, "duplicate_prompt"]
    d = await decide(battle_id="q", voter="v1", score=1.0, pair_counts=(0, 0), prompts=["other"], now=now)
    assert d.rule is None  # the voter's third counted vote today
    d = await decide(battle_id="r", voter="v1", score=1.0, pair_counts=(0, 0), prompts=["third"], now=now)
    assert d.rule == "daily_cap" and "3 counted votes today" in d.reason
    tomorrow = datetime(2025, 5, 2, 0, 1, tzinfo=UTC)
    d = await decide(battle_id="s", voter="v1", score=1.0, pair_counts=(0, 0), prompts=["third"], now=tomorrow)
    assert d.rule is None
    assert integrity.first(None, 0.4).rule == "min_dwell" and integrity.first(None, 2.5) is None
    assert integrity.first("identity_leak: x", 9).rule == "identity_leak"


async def test_a_flagged_voter_takes_its_earlier_votes_along() -> None:
    integrity = Integrity(fakeredis.FakeAsyncRedis(), IntegrityConfig())
    now = datetime(2025, 5, 1, 12, tzinfo=UTC)
    decisions = []
    for k in range(6):  # against a pair its first model won 40 of 42 times
        prompts = [f"prompt {k}"]
        decisions.append(
            await integrity.tally(
                battle_id=f"b{k}", voter="bot", score=0.0, pair_counts=(40, 2), prompts=prompts, now=now
            )
        )
    assert [d.rule for d in decisions[:4]] == [None, None, None, None]
    assert decisions[4].rule == "anti_consensus" and decisions[4].also == ("b0", "b1", "b2", "b3")
    assert decisions[5].rule == "anti_consensus" and decisions[5].also == ()
    honest = [
        await integrity.tally(
            battle_id=f"h{k}", voter="fan", score=1.0, pair_counts=(40, 2), prompts=[f"h{k}"], now=now
        )
        for k in range(6)
    ]
    assert all(d.rule is None for d in honest)  # with the consensus: never flagged
    assert pair_counts({"pairs": [["a", "b", 4, 1]]}, ("a", "b")) == (4, 1) and pair_counts(None, ("a", "b")) == (0, 0)
