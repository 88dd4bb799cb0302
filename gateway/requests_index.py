"""The gateway's own Redis records about requests it accepted (the results themselves are
kept by delivery in `consumers.delivery.store`).

Key layout (all with a TTL):
  arena:pending:{request_id}  JSON {conv_id, turn_id, model, deadline_at}: the request was
                              accepted, so an id without a result yet is pending, not unknown
  arena:holder:{request_id}   the WebSocket session that last followed the request; a
                              session that lost its client cancels the request only if no
                              other session resumed it since
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

PENDING = "arena:pending:{}"
HOLDER = "arena:holder:{}"


class RequestsIndex:
    def __init__(self, redis: Redis, ttl_s: int = 1800):
        self.redis = redis
        self.ttl_s = ttl_s

    async def record(self, request_id: str, conv_id: str, turn_id: int, model: str, deadline_at: float) -> None:
        """Remember an accepted request; the first record of an id holds (a retry keeps it)."""
        body = {"conv_id": conv_id, "turn_id": turn_id, "model": model, "deadline_at": deadline_at}
        await self.redis.set(PENDING.format(request_id), json.dumps(body), nx=True, ex=self.ttl_s)

    async def lookup(self, request_id: str) -> dict | None:
        """The record of an accepted request, or None for an id this gateway never accepted."""
        raw = await self.redis.get(PENDING.format(request_id))
        return json.loads(raw) if raw else None

    async def hold(self, request_id: str, holder: str) -> None:
        await self.redis.set(HOLDER.format(request_id), holder, ex=self.ttl_s)

    async def holder(self, request_id: str) -> str | None:
        raw = await self.redis.get(HOLDER.format(request_id))
        return raw.decode() if raw else None
