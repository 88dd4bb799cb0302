"""The Redis result store: terminal results, delivered-chunk marks, idempotency keys, seeds.

Key layout (all with a TTL):
  arena:result:{request_id}      the terminal event's JSON
  arena:chunk:{request_id}:{seq} set once a chunk was fanned out
  arena:idem:{key}               JSON {request_id, body_hash}
  arena:seed:{conv_id}:{turn_id} the sampling seed of a turn
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

RESULT = "arena:result:{}"
CHUNK = "arena:chunk:{}:{}"
IDEM = "arena:idem:{}"
SEED = "arena:seed:{}:{}"


class ResultStore:
    def __init__(self, redis: Redis, ttl_s: int = 1800):
        self.redis = redis
        self.ttl_s = ttl_s

    @classmethod
    def from_url(cls, url: str, ttl_s: int = 1800) -> ResultStore:
        return cls(Redis.from_url(url), ttl_s)

    async def mark_chunk(self, request_id: str, seq: int) -> bool:
        """True the first time a chunk is seen: only then is it delivered."""
        return bool(await self.redis.set(CHUNK.format(request_id, seq), 1, nx=True, ex=self.ttl_s))

    async def save_result(self, request_id: str, payload: bytes) -> bool:
        """Keep the first terminal event of a request; later ones are duplicates."""
        return bool(await self.redis.set(RESULT.format(request_id), payload, nx=True, ex=self.ttl_s))

    async def get_result(self, request_id: str) -> bytes | None:
        return await self.redis.get(RESULT.format(request_id))

    async def claim_key(self, key: str, request_id: str, body_hash: str) -> dict:
        """Bind an idempotency key to a request; returns the binding that holds (ours or an earlier one)."""
        mine = {"request_id": request_id, "body_hash": body_hash}
        if await self.redis.set(IDEM.format(key), json.dumps(mine), nx=True, ex=self.ttl_s):
            return mine
        held = await self.redis.get(IDEM.format(key))
        return json.loads(held) if held else mine

    async def seed_for(self, conv_id: str, turn_id: int, proposed: int) -> int:
        """The turn's seed: the first one stored wins, so a recomputed turn samples the same."""
        key = SEED.format(conv_id, turn_id)
        await self.redis.set(key, proposed, nx=True, ex=self.ttl_s)
        value = await self.redis.get(key)
        return int(value) if value is not None else proposed

    async def close(self) -> None:
        await self.redis.aclose()
