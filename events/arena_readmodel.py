"""The arena's Redis read model: a contract between the leaderboard consumer (writer)
and the gateway (reader), like the subjects.

Key layout:
  arena:leaderboard      JSON of the current leaderboard: {seq, digest, total_votes,
                         computed_at, min_votes, style_control, rows: [{model, rating, ci_low,
                         ci_high, rank, votes, provisional, elo}]}; `seq` is the stream
                         sequence it was computed at
  arena:leaderboard:style
                         the style-controlled board, the same shape plus style_coefficients
                         {length, header, list, bold}
  arena:secret           random key of the voter pseudonyms and side conversation ids
                         (shared by every gateway; created by the first one)
"""

from __future__ import annotations

import json
import secrets

from redis.asyncio import Redis

LEADERBOARD = "arena:leaderboard"
SECRET = "arena:secret"


def leaderboard_key(view: str = "raw") -> str:
    """The key of one view of the leaderboard ("raw", "style")."""
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
