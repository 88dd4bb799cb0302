"""The gateway's own Redis keys (shared by every gateway process; no consumer reads them).

Key layout (all with the read model's TTL):
  arena:idem:{key}               JSON {request_id, body_hash}: the request an idempotency key is bound to
  arena:seed:{conv_id}:{turn_id} the sampling seed of a conversation turn
  arena:holder:{request_id}      the WebSocket session that last followed the request; a session
                                 that lost its client cancels the request only if no other
                                 session resumed it since
  arena:owner:req:{request_id}   the principal that created the request (gateway/access.py)
  arena:owner:conv:{conv_id}     the principal that started the conversation (the first one wins)

Besides: the rate limits' buckets (gateway/ratelimit.py, BUCKETS) and the fleet's recent
admissions (gateway/admission/recent.py, RECENT_KEY). The gateway's Redis user may write these
keys and no other (infra/redis_auth.py).

Idempotency keys are stored under the caller's principal: two callers using the same
key never meet.
"""

from __future__ import annotations

import json

from redis.asyncio import Redis

from events.readmodel import OWNER

IDEM = "arena:idem:{}"
SEED = "arena:seed:{}:{}"
HOLDER = "arena:holder:{}"


class GatewayKeys:
    def __init__(self, redis: Redis, ttl_s: int = 1800):
        self.redis = redis
        self.ttl_s = ttl_s

    async def claim_key(self, key: str, request_id: str, body_hash: str) -> dict:
        """Bind an idempotency key to a request; returns the binding that holds (ours or an earlier one)."""
        mine = {"request_id": request_id, "body_hash": body_hash}
        if await self.redis.set(IDEM.format(key), json.dumps(mine), nx=True, ex=self.ttl_s):
            return mine
        held = await self.redis.get(IDEM.format(key))
        return json.loads(held) if held else mine

    async def release_key(self, key: str, request_id: str) -> None:
        """Unbind a key whose request was never published, so a retry runs anew."""
        held = await self.redis.get(IDEM.format(key))
        if held and json.loads(held).get("request_id") == request_id:
            await self.redis.delete(IDEM.format(key))

    async def seed_for(self, conv_id: str, turn_id: int, proposed: int) -> int:
        """The turn's seed: the first one stored wins, so a recomputed turn samples the same."""
        key = SEED.format(conv_id, turn_id)
        await self.redis.set(key, proposed, nx=True, ex=self.ttl_s)
        value = await self.redis.get(key)
        return int(value) if value is not None else proposed

    async def hold(self, request_id: str, holder: str) -> None:
        await self.redis.set(HOLDER.format(request_id), holder, ex=self.ttl_s)

    async def holder(self, request_id: str) -> str | None:
        raw = await self.redis.get(HOLDER.format(request_id))
        return raw.decode() if isinstance(raw, bytes) else raw

    async def bind_owner(self, request_id: str, conv_id: str, principal: str) -> str:
        """Record the request's principal and claim the conversation for it (the first
        claim holds); returns the conversation's owner, in one round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.set(OWNER.format("req", request_id), principal, ex=self.ttl_s)
            pipe.set(OWNER.format("conv", conv_id), principal, nx=True, ex=self.ttl_s)
            pipe.get(OWNER.format("conv", conv_id))
            *_, owner = await pipe.execute()
        return owner.decode() if isinstance(owner, bytes) else owner

    async def owner(self, kind: str, ident: str) -> str | None:
        """The principal that created a request (`req`) or a conversation (`conv`)."""
        raw = await self.redis.get(OWNER.format(kind, ident))
        return raw.decode() if isinstance(raw, bytes) else raw
