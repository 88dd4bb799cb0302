"""The fleet-wide check: what every gateway admitted lately and the consumers' state
does not show yet, in Redis, judged in batches (`FleetAdmissions`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from events.models import DEFAULT_MAX_TOKENS, new_id
from gateway.admission.estimate import Estimate, StreamState
from runtime.background import Background
from runtime.redis import REDIS_DOWN

log = logging.getLogger(__name__)

# Every gateway's admissions of the last seconds, in one sorted set per model. The score
# is when the request became visible in the consumers' state: its publish (Redis's
# clock), or PENDING_S ahead while it is admitted and not yet published, so it counts
# until then. Adding a batch of them and reading those newer than the last stream state
# is one atomic step, so gateways admitting a burst together each see the others at once.
RECENT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local keep = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - keep)
local n, tokens = 0, 0
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')) do
  n = n + 1
  tokens = tokens + tonumber(string.match(m, ':(%d+)$'))
end
local score = now + tonumber(ARGV[3])
for i = 4, #ARGV do
  redis.call('ZADD', KEYS[1], score, ARGV[i])
end
redis.call('EXPIRE', KEYS[1], math.ceil(keep))
return {n, tokens}
"""
PUBLISHED = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], 'XX', tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
"""
#: A lone gateway's admission, recorded once published (none was added at admission):
#: peers that join later, and this gateway's own WebSocket and arena turns (judged by the
#: script above), count it until a stream state shows it.
PUBLISHED_HERE = """
local t = redis.call('TIME')
redis.call('ZADD', KEYS[1], tonumber(t[1]) + tonumber(t[2]) / 1000000, ARGV[1])
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2])))
"""
RECENT_KEY = "arena:admitted:{}"
#: An admitted request not yet published counts this long at most (one that never is,
#: and was not removed, lapses then).
PENDING_S = 5.0
#: Admissions published this long before the last stream state was read still count:
#: the clocks of gateways and Redis may differ by that much (one host, or NTP).
VISIBILITY_LAG_S = 0.05

#: (the stream state, requests and tokens admitted ahead and not visible in it) -> the
#: estimate when the request must be refused, None to admit it.
Judge = Callable[[StreamState, int, int], Estimate | None]


@dataclass
class _Waiting:
    tokens: int
    judge: Judge
    verdict: asyncio.Future
    at_once: Callable[[asyncio.Future], None] | None = None  # called as the verdict is set

    def settle(self, result: object = None, error: BaseException | None = None) -> None:
        if error is None:
            self.verdict.set_result(result)
        elif isinstance(error, Exception):
            self.verdict.set_exception(error)
        else:
            self.verdict.cancel()
        if self.at_once is not None:
            try:
                self.at_once(self.verdict)
            except Exception:
                log.exception("an admission verdict's callback failed")


class FleetAdmissions:
    """What every gateway admitted and the stream state does not show yet (it is read
    every fraction of a second, and a burst must see itself, on every gateway).

    The requests waiting to be judged are judged together: one Redis call adds them all
    and reads what the other gateways admitted, then each is judged in arrival order
    with the ones admitted before it. In a burst the refusals then leave after one round
    trip, not behind every earlier request's own call (and its wait for a connection)."""

    def __init__(self, redis, state: Callable[[], StreamState], judging_redis=None, keep_s: float = 10.0):
        self.redis, self.state, self.keep_s = redis, state, keep_s
        # The batch's call has a client of its own: it must not queue for a connection
        # behind the burst's other Redis calls.
        self.script = (judging_redis or redis).register_script(RECENT)
        self.publish_script = redis.register_script(PUBLISHED)
        self.publish_here_script = redis.register_script(PUBLISHED_HERE)
        self.mean_budget = float(DEFAULT_MAX_TOKENS)
        self._waiting: dict[str, list[_Waiting]] = {}
        self._judging: dict[str, asyncio.Task] = {}
        self._background = Background()

    def observe(self, tokens: int) -> None:
        """A request's token budget into the running mean: what each request ahead whose
        budget no heartbeat reported counts (`combine`)."""
        self.mean_budget = 0.95 * self.mean_budget + 0.05 * tokens

    async def admit(self, model: str, tokens: int, judge: Judge) -> tuple[str, Estimate | None]:
        """(its member, None) for a request admitted and recorded; (its member, the
        estimate) for one refused (not recorded). Raises what Redis raises."""
        return await self.submit(model, tokens, judge)

    def submit(
        self, model: str, tokens: int, judge: Judge, at_once: Callable[[asyncio.Future], None] | None = None
    ) -> asyncio.Future:
        """`admit`'s verdict as a future, for a caller that cannot await (a protocol);
        `at_once(verdict)` is called as soon as it is set, not a turn of the loop later
        as a done-callback would be (in a burst, a turn is many requests' work)."""
        self.observe(tokens)
        verdict = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(model, []).append(_Waiting(tokens, judge, verdict, at_once))
        if model not in self._judging:
            self._judging[model] = asyncio.create_task(self._judge_all(model))
        return verdict

    async def _judge_all(self, model: str) -> None:
        """Judges the waiting requests, a batch at a time, until none waits: one call out
        at a time, each batch judged with everything admitted before it."""
        try:
            while batch := self._waiting.pop(model, None):
                await self._judge(model, batch)
        except asyncio.CancelledError:  # shutting down: no verdict will come
            for w in self._waiting.pop(model, []):
                w.settle(error=asyncio.CancelledError())
            raise
        finally:
            del self._judging[model]

    async def _judge(self, model: str, batch: list[_Waiting]) -> None:
        stream = self.state()
        members = [f"{new_id()}:{w.tokens}" for w in batch]
        since = max(stream.read_at - VISIBILITY_LAG_S, 0.0)
        try:
            n, ahead = await self.script(
                keys=[RECENT_KEY.format(model)], args=[repr(since), self.keep_s, PENDING_S, *members]
            )
        except BaseException as exc:
            _fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        n, ahead = int(n), int(ahead)
        admitted, refused, dropped = [], [], []
        for member, w in zip(members, batch, strict=True):
            if w.verdict.done():  # its caller is gone: not ahead of anyone
                dropped.append(member)
            elif (est := w.judge(stream, n, ahead)) is None:
                n, ahead = n + 1, ahead + w.tokens
                admitted.append((w, member))
            else:
                refused.append((w, member, est))
                dropped.append(member)
        # Refusals first: their tasks wake first and answer before the admitted go on.
        for w, member, est in refused:
            w.settle((member.rpartition(":")[0], est))
        for w, member in admitted:
            w.settle((member.rpartition(":")[0], None))
        if dropped:
            self._background.spawn(self._drop(model, dropped))

    async def _drop(self, model: str, members: list[str]) -> None:
        with suppress(*REDIS_DOWN):  # they lapse after PENDING_S
            await self.redis.zrem(RECENT_KEY.format(model), *members)

    async def published(self, model: str, member: str, tokens: int) -> None:
        """The admission is published: it shows in stream states read from now on."""
        await self.publish_script(keys=[RECENT_KEY.format(model)], args=[f"{member}:{tokens}"])

    async def published_here(self, model: str, member: str, tokens: int) -> None:
        """A request admitted without the check (a lone gateway's), published: recorded now."""
        await self.publish_here_script(keys=[RECENT_KEY.format(model)], args=[f"{member}:{tokens}", self.keep_s])

    async def remove(self, model: str, member: str, tokens: int) -> None:
        await self.redis.zrem(RECENT_KEY.format(model), f"{member}:{tokens}")

    async def settle(self, model: str, member: str, tokens: int, published: bool) -> None:
        """An admission published (`published`), or that never will be (removed)."""
        await (self.published if published else self.remove)(model, member, tokens)


def _fail(batch: list[_Waiting], exc: BaseException) -> None:
    """Every request of a batch whose check failed gets `exc` (but one whose caller is gone)."""
    for w in batch:
        if not w.verdict.done():
            w.settle(error=exc)
