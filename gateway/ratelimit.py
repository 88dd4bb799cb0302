"""Per-key rate limits: two token buckets per principal (requests and tokens per
minute), in Redis, taken atomically by one Lua script, so every gateway shares them.

A request costs one request and its token budget (prompt characters / 4, a rough
token count, plus `max_tokens`), as OpenAI counts it. When either bucket lacks room,
neither is charged and the answer is 429 with `Retry-After`. Every answer carries
OpenAI's `x-ratelimit-*` headers, which clients read to pace themselves.

Key layout: arena:rl:{principal}:req and arena:rl:{principal}:tok, hashes {level, ts},
expiring once full again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, Field

from gateway.errors import APIError
from gateway.metrics import METRICS

BUCKETS = "arena:rl:{}:{}"

# Buckets refill continuously at limit/60 per second, up to the limit. Redis's clock
# (TIME) is the only clock, so gateways with skewed clocks agree.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function level(key, cap)
  if cap <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'level', 'ts')
  local lvl = tonumber(v[1]) or cap
  local ts = tonumber(v[2]) or now
  return math.min(cap, lvl + math.max(0, now - ts) * cap / 60)
end
local function store(key, cap, lvl)
  if cap <= 0 then return end
  redis.call('HSET', key, 'level', tostring(lvl), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((cap - lvl) * 60 / cap) + 1)
end
local rpm, tpm, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local r, k = level(KEYS[1], rpm), level(KEYS[2], tpm)
local ok = (rpm <= 0 or r >= 1) and (tpm <= 0 or k >= cost)
if ok then
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then k = k - cost end
  store(KEYS[1], rpm, r)
  store(KEYS[2], tpm, k)
end
return {ok and 1 or 0, tostring(r), tostring(k)}
"""


class Limits(BaseModel):
    """Requests and tokens per minute; 0 is unlimited."""

    rpm: int = Field(0, ge=0, description="Requests per minute.")
    tpm: int = Field(0, ge=0, description="Tokens (prompt + max_tokens) per minute.")

    @property
    def off(self) -> bool:
        return self.rpm == 0 and self.tpm == 0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    limits: Limits
    requests_left: float
    tokens_left: float
    cost: int

    def _refill_s(self, cap: int, level: float) -> float:
        return (cap - level) * 60 / cap if cap else 0.0

    def retry_after_s(self) -> int:
        waits = [0.0]
        if self.limits.rpm and self.requests_left < 1:
            waits.append((1 - self.requests_left) * 60 / self.limits.rpm)
        if self.limits.tpm and self.tokens_left < self.cost:
            waits.append((self.cost - self.tokens_left) * 60 / self.limits.tpm)
        return max(1, math.ceil(max(waits)))

    def headers(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, cap, left in (
            ("requests", self.limits.rpm, self.requests_left),
            ("tokens", self.limits.tpm, self.tokens_left),
        ):
            if cap:
                out[f"x-ratelimit-limit-{name}"] = str(cap)
                out[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(left)))
                out[f"x-ratelimit-reset-{name}"] = duration(self._refill_s(cap, left))
        return out


def duration(seconds: float) -> str:
    """OpenAI's reset format: '1s', '6m0s', '20ms'."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, secs = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def cost_of(prompt_chars: int, max_tokens: int) -> int:
    return math.ceil(prompt_chars / 4) + max_tokens


class RateLimiter:
    def __init__(self, redis):
        self.script = redis.register_script(TAKE)

    async def take(self, principal: str, limits: Limits, cost: int) -> Verdict | None:
        """Charge the principal's buckets; None when it has no limits. Raises 429 when
        either bucket lacks room (neither is then charged)."""
        if limits.off:
            return None
        keys = [BUCKETS.format(principal, "req"), BUCKETS.format(principal, "tok")]
        ok, requests_left, tokens_left = await self.script(keys=keys, args=[limits.rpm, limits.tpm, cost])
        verdict = Verdict(bool(int(ok)), limits, float(requests_left), float(tokens_left), cost)
        if not verdict.ok:
            METRICS.rejections.labels(reason="rate_limited").inc()
            which = "requests" if limits.rpm and verdict.requests_left < 1 else "tokens"
            raise APIError(
                429,
                f"rate limit reached for {which} per minute; retry after {verdict.retry_after_s()} s",
                "rate_limit_exceeded",
                headers={"Retry-After": str(verdict.retry_after_s()), **verdict.headers()},
            )
        return verdict
