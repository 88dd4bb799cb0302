"""The arena's Redis read model: a contract between the leaderboard consumer (writer)
and the gateway (reader), like the subjects.

Key layout:
  arena:leaderboard      JSON of the current leaderboard: {seq, digest, total_votes,
                         computed_at, min_votes, style_control, rows: [{model, rating, ci_low,
                         ci_high, rank, votes, provisional, elo}], pairs: [[x, y, x's wins,
                         x's losses, ties]], categories: {name: votes}}; `seq` is the stream
                         sequence it was computed at
  arena:leaderboard:style
                         the style-controlled board, the same shape plus style_coefficients
                         {length, header, list, bold}
  arena:leaderboard:category:<name>
                         the board of one category's votes (the board of all votes lists
                         the categories with votes under `categories`)
  arena:leaderboard:history
                         every model that ever entered: {seq, digest, models: [{model, owner,
                         status (active|withdrawn), votes, battles, entered_seq, entered_at,
                         last_battle_at, changed_seq, changed_at, reason}], owners: [{owner,
                         variants, active, withdrawn}]}; the gateway reads the withdrawn ones
                         out of its pairing
  arena:secret           random key of the voter pseudonyms and side conversation ids
                         (shared by every gateway; created by the first one)
  arena:integrity:prompt:<key>        counted votes of one prompt (FastChat's dedup key, hashed)
  arena:integrity:daily:<voter>:<day> counted votes of a voter on a UTC day
  arena:integrity:voter:<voter>       JSON of the voter's consensus test (gateway.arena.integrity.VoterRecord)
The counters are the gateway's working state for its vote rules; what they decided is
on the stream (`VoteInvalidated`), so losing them never changes a replayed board.
"""

from __future__ import annotations

import json
import secrets

from redis.asyncio import Redis

LEADERBOARD = "arena:leaderboard"
#: The view of the model history (`leaderboard_key(HISTORY)`).
HISTORY = "history"
SECRET = "arena:secret"
INTEGRITY = "arena:integrity"
INTEGRITY_PROMPT_TTL_S = 90 * 86400
INTEGRITY_DAILY_TTL_S = 2 * 86400


def integrity_prompt(key: str) -> str:
    return f"{INTEGRITY}:prompt:{key}"


def integrity_daily(voter: str, day: str) -> str:
    return f"{INTEGRITY}:daily:{voter}:{day}"


def integrity_voter(voter: str) -> str:
    return f"{INTEGRITY}:voter:{voter}"


def leaderboard_key(view: str = "raw") -> str:
    """The key of one view of the leaderboard ("raw", "style", "category:coding")."""
    return LEADERBOARD if view == "raw" else f"{LEADERBOARD}:{view}"


async def save_leaderboard(redis: Redis, board: dict, view: str = "raw") -> None:
    await redis.set(leaderboard_key(view), json.dumps(board, sort_keys=True))


async def load_leaderboard(redis: Redis, view: str = "raw") -> dict | None:
    raw = await redis.get(leaderboard_key(view))
    return json.loads(raw) if raw else None


async def arena_secret(redis: Redis) -> bytes:
    """The shared secret; the first gateway to ask creates it."""
    await redis.set(SECRET, secrets.token_hex(32), nx=True)
    raw = await redis.get(SECRET)
    assert raw is not None, "the secret was just set"
    return bytes.fromhex(raw.decode() if isinstance(raw, bytes) else raw)
