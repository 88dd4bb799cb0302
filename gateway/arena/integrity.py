"""Which votes count: FastChat's clean-battle and vote-analysis rules, decided at the vote.

Each rule that takes a vote out publishes a `VoteInvalidated` whose `detector` is the
rule's name, so the stream says why a vote did not count and the leaderboard replays
it. Rules, in the order they are tried (the first that applies decides):

* `identity_leak`: an answer names a model or a maker: FastChat's `IDENTITY_WORDS`
  (clean_battle_data.py, lower-cased substrings) or any model served in the arena;
* `min_dwell`: the vote came sooner after both answers finished than a person could
  read them (`arena_min_dwell_s`; 0 turns it off);
* `anti_consensus`: the voter votes against the consensus more than chance allows
  (FastChat's `outlier_detect` in elo_analysis.py: the product of 1/(2p) over the
  voter's votes past 1/alpha = 20); once flagged, the voter's earlier votes go too;
* `duplicate_prompt`: the prompt already has `arena_prompt_cap` counted votes (FastChat's
  deduplication.py samples the most frequent prompts down to the cap);
* `daily_cap`: the voter already has `arena_daily_vote_cap` counted votes today, UTC
  (FastChat's `limit_user_votes`: the first N per judge per day).

The pure parts (the word list, the consensus test's factors, the prompt key) are here;
`Integrity` keeps the counters the rules need in Redis (layout in events/arena_readmodel.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from redis.asyncio import Redis

from events import arena_readmodel as keys
from gateway.arena.identity import name_pattern

IDENTITY_WORDS = tuple(
    w.lower()
    for w in (
        "vicuna", "lmsys", "koala", "uc berkeley", "open assistant", "laion", "chatglm", "chatgpt", "gpt-4",
        "openai", "anthropic", "claude", "bard", "palm", "lamda", "google", "gemini", "llama", "qianwan", "qwen",
        "alibaba", "mistral", "zhipu", "KEG lab", "01.AI", "AI2", "Tülu", "Tulu", "deepseek", "hermes", "cohere",
        "DBRX", "databricks",
    )
)  # fmt: skip
"""FastChat's clean_battle_data.py `IDENTITY_WORDS`, lower-cased as it does."""
RULES = ("identity_leak", "min_dwell", "anti_consensus", "duplicate_prompt", "daily_cap")


def identity_leak(answers: Mapping[str, Sequence[str]], names: Iterable[str]) -> str | None:
    """Why the battle is de-anonymized (a side's answer names a model or maker), else None."""
    patterns = [(n, name_pattern(n)) for n in sorted(set(names), key=len, reverse=True)]
    for side, texts in answers.items():
        for turn, text in enumerate(texts):
            low = text.lower()
            word = next((w for w in IDENTITY_WORDS if w in low), None)
            word = word or next((n for n, p in patterns if p.search(text)), None)
            if word:
                return f"identity_leak: side {side}'s answer in turn {turn} names {word!r}"
    return None


def prompt_key(prompts: Sequence[str]) -> str:
    """FastChat's deduplication key (the user turns, each + newline, first 10,000 characters), hashed."""
    text = "".join(f"{p}\n" for p in prompts)[:10000]
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def consensus_factors(score: float, wins: int, losses: int) -> tuple[float, float]:
    """One vote's factors (1/(2 p_upper), 1/(2 p_lower)) in FastChat's `outlier_detect`.

    `score` is the vote from the pair's first model's side (1, 0.5 or 0); `wins` and
    `losses` are that model's decisive votes against the other (ties left out, as FastChat
    does), this vote included. p_upper = P(r <= vote), p_lower = P(r >= vote) over those
    votes as 1s and 0s. A p of 0 gives an infinite factor, as FastChat's numpy does.
    """
    n = wins + losses
    if n == 0:  # no decisive vote: FastChat's mean of nothing is NaN and never flags; no evidence here
        return 1.0, 1.0
    p_upper = (losses + (wins if score >= 1 else 0)) / n
    p_lower = (wins + (losses if score <= 0 else 0)) / n
    return (math.inf if p_upper == 0 else 1 / (2 * p_upper)), (math.inf if p_lower == 0 else 1 / (2 * p_lower))


def pair_score(model_a: str, model_b: str, choice: str) -> tuple[tuple[str, str], float]:
    """The sorted pair and the vote's score from its first model's side (FastChat's `vote`)."""
    pair = (model_a, model_b) if model_a < model_b else (model_b, model_a)
    if choice in ("tie", "both_bad"):
        return pair, 0.5
    winner = model_a if choice == "a" else model_b
    return pair, 1.0 if winner == pair[0] else 0.0


@dataclass(frozen=True)
class IntegrityConfig:
    min_dwell_s: float = 0.0
    daily_cap: int = 200
    prompt_cap: int = 25
    consensus_alpha: float = 0.05
    """Flag past 1/alpha (FastChat: 0.05, so 20)."""
    consensus_min_votes: int = 5
    """FastChat checks only voters with at least this many votes."""
    consensus_max_votes: int = 100
    """... and only their first this many."""
    consensus_min_pair_votes: int = 10
    """A pair with fewer decisive votes than this carries no consensus yet (not in FastChat:
    its pairs have thousands; in a small arena one vote would make p 0 and flag a voter)."""


@dataclass
class VoterRecord:
    """The consensus test's running state for one voter (JSON in Redis)."""

    votes: int = 0
    m_upper: float = 1.0
    m_lower: float = 1.0
    crossed: bool = False
    flagged: bool = False
    battles: list[str] = field(default_factory=list)
    """Battles whose vote counted so far (taken out when the voter is flagged)."""

    def add(self, score: float, wins: int, losses: int, cfg: IntegrityConfig) -> bool:
        """Fold one vote in, given its pair's decisive votes before it; True once the voter is flagged."""
        if not self.flagged and self.votes < cfg.consensus_max_votes:
            self.votes += 1
            if wins + losses >= cfg.consensus_min_pair_votes:
                # FastChat's pair statistics are over every battle, this vote's included.
                up, lo = consensus_factors(score, wins + (score == 1.0), losses + (score == 0.0))
                self.m_upper, self.m_lower = self.m_upper * up, self.m_lower * lo
            self.crossed = self.crossed or max(self.m_upper, self.m_lower) > 1 / cfg.consensus_alpha
            self.flagged = self.crossed and self.votes >= cfg.consensus_min_votes
        return self.flagged


@dataclass(frozen=True)
class Decision:
    rule: str | None
    reason: str = ""
    also: tuple[str, ...] = ()
    """Earlier battles of the voter that stop counting with this decision (anti_consensus)."""


@dataclass
class Integrity:
    redis: Redis
    config: IntegrityConfig

    async def voter(self, voter: str) -> VoterRecord:
        raw = await self.redis.get(keys.integrity_voter(voter))
        return VoterRecord(**json.loads(raw)) if raw else VoterRecord()

    def first(self, leak: str | None, dwell_s: float) -> Decision | None:
        """The rules that need no state: an identity leak, a vote cast too soon."""
        if leak:
            return Decision("identity_leak", leak)
        if dwell_s < self.config.min_dwell_s:
            return Decision("min_dwell", f"min_dwell: voted {dwell_s:.2f} s after both answers finished")
        return None

    async def tally(
        self, *, battle_id: str, voter: str, score: float, pair_counts: tuple[int, int], prompts: Sequence[str],
        now: datetime,
    ) -> Decision:  # fmt: skip
        """The rules over the voter's and the prompt's history, in order; counts the vote when none applies."""
        cfg = self.config
        rec = await self.voter(voter)
        flagged = rec.add(score, *pair_counts, cfg)
        prompt = keys.integrity_prompt(prompt_key(prompts))
        daily = keys.integrity_daily(voter, now.astimezone(UTC).strftime("%Y-%m-%d"))
        decision = Decision(None)
        if flagged:
            m = max(rec.m_upper, rec.m_lower)
            limit = 1 / cfg.consensus_alpha
            reason = f"anti_consensus: the voter's product of 1/(2p) over {rec.votes} votes is {m:.3g} > {limit:g}"
            decision, rec.battles = Decision("anti_consensus", reason, tuple(rec.battles)), []
        elif int(await self.redis.get(prompt) or 0) >= cfg.prompt_cap:
            decision = Decision("duplicate_prompt", f"duplicate_prompt: this prompt has {cfg.prompt_cap} counted votes")
        elif int(await self.redis.get(daily) or 0) >= cfg.daily_cap:
            decision = Decision("daily_cap", f"daily_cap: the voter has {cfg.daily_cap} counted votes today (UTC)")
        else:
            for key, ttl in ((prompt, keys.INTEGRITY_PROMPT_TTL_S), (daily, keys.INTEGRITY_DAILY_TTL_S)):
                await self.redis.incr(key)
                await self.redis.expire(key, ttl)
            rec.battles.append(battle_id)
        await self.redis.set(keys.integrity_voter(voter), json.dumps(rec.__dict__))
        return decision


def pair_counts(board: Mapping | None, pair: tuple[str, str]) -> tuple[int, int]:
    """(wins, losses) of the pair's first model in the stored board's `pairs`, (0, 0) if absent."""
    for x, y, wins, losses, *_ in (board or {}).get("pairs", ()):
        if (x, y) == pair:
            return int(wins), int(losses)
    return 0, 0
