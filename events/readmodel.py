"""The Redis read model: a contract between processes, like the subjects.

Delivery writes the results from the output events (only its Redis user may:
infra/redis_auth.py); the gateway reads them, and writes the pending records and owners.
Every key has a TTL (`result_ttl_s`); the stream stays the truth, Redis only answers fast.

Key layout:
  arena:result:{request_id}      the request's terminal event, as JSON (the first one wins)
  arena:pending:{request_id}     JSON {conv_id, turn_id, model, deadline_at}: the request was
                                 accepted, so an id without a result is pending, not unknown
  arena:owner:{kind}:{id}        the principal that created a request (`req`) or conversation
                                 (`conv`); the gateway writes it, recovery restores `req` ones
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

RESULT = "arena:result:{}"
PENDING = "arena:pending:{}"
OWNER = "arena:owner:{}:{}"


class ReadModel:
    def __init__(self, redis: Redis, ttl_s: int = 1800):
        self.redis = redis
        self.ttl_s = ttl_s

    async def save_result(self, request_id: str, payload: bytes) -> bool:
        """Keep the first terminal event of a request; later ones are duplicates."""
        return bool(await self.redis.set(RESULT.format(request_id), payload, nx=True, ex=self.ttl_s))

    async def get_result(self, request_id: str) -> bytes | None:
        raw = await self.redis.get(RESULT.format(request_id))
        return raw.encode() if isinstance(raw, str) else raw

    async def record_pending(self, request_id: str, conv_id: str, turn_id: int, model: str, deadline_at: float) -> None:
        """Remember an accepted request; the first record of an id holds (a retry keeps it)."""
        body = {"conv_id": conv_id, "turn_id": turn_id, "model": model, "deadline_at": deadline_at}
        await self.redis.set(PENDING.format(request_id), json.dumps(body), nx=True, ex=self.ttl_s)

    async def restore_owner(self, request_id: str, principal: str) -> None:
        """Ownership of a request rebuilt from its ChatRequested (the first record holds)."""
        await self.redis.set(OWNER.format("req", request_id), principal, nx=True, ex=self.ttl_s)

    async def pending(self, request_id: str) -> dict | None:
        """The record of an accepted request, or None for an id never accepted (or expired)."""
        raw = await self.redis.get(PENDING.format(request_id))
        return json.loads(raw) if raw else None
