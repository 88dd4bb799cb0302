"""Deadline-aware admission: would a new request finish before its deadline?

The queue a model has is the fleet's, not one gateway's: the inference heartbeats say
what each worker holds (running and waiting requests, their remaining token budgets) and
how long its decode steps take; JetStream's consumer state says how many requests are
still in the stream ahead of the workers (filter and inference consumers); and this
gateway adds what it admitted since that state was read. Every gateway reads the same
state, so adding gateways does not multiply the queue.

Continuous batching serves `slots` requests at once (the workers' batch sizes): a new
request waits for the work ahead of it beyond those slots to drain, then decodes its own
token budget, one token per step. Budgets are upper bounds (a request may stop
early), so the estimate errs towards refusing: an admitted request must be served within
its deadline, and a refused one is told when to retry.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

from events.models import DEFAULT_MAX_TOKENS, new_id
from runtime.background import Background
from runtime.redis import REDIS_DOWN
from runtime.steps import step_time

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelQueue:
    """A model's fleet-wide queue, as the gateway sees it now."""

    slots: int  # requests decoded at once (sum of max batch sizes of the workers holding it)
    requests: int  # ahead of a new request: running, waiting, and still in the stream
    tokens: int  # their remaining token budgets
    step_s: float | None  # decode step time at a small batch (None: never measured)
    full_step_s: float | None  # ... at a batch of half the slots or more
    measured_at: float = 0.0  # when the newest of those steps ran
    full_batch: int | None = None  # the batch full_step_s was measured at (None: all the slots)


@dataclass(frozen=True)
class Estimate:
    finish_s: float  # from now until the request's last token, at worst
    wait_s: float  # of which waiting for a slot


@dataclass(frozen=True)
class StreamState:
    """The consumers' state, read from JetStream (every gateway reads the same)."""

    ahead: int = 0  # not yet held by a worker: being filtered, or waiting to be pulled
    held: int = 0  # delivered to inference workers and not yet acked (every model's)
    read_at: float = 0.0  # when the read began: what was published before is in it


def combine(
    workers: ModelQueue, stream: StreamState, local_requests: int, local_tokens: int, mean_budget: float
) -> ModelQueue:
    """The queue a new request joins: the stream's requests (counted by the consumers'
    state when it was read), the admissions not visible in it yet (`local_*`: every
    gateway's), and the workers' token budgets and step times (heartbeats, up to a beat
    old). A heartbeat newer than the stream state may already hold some of those recent
    admissions: they are counted once (the workers never hold more than all of them).
    Requests whose budgets no heartbeat reported count `mean_budget` tokens each."""
    requests = max(stream.ahead + stream.held + local_requests, workers.requests)
    known, known_tokens = workers.requests + local_requests, workers.tokens + local_tokens
    if known > requests:  # some recent admissions are in the heartbeat already
        tokens = round(known_tokens * requests / known)
    else:
        tokens = known_tokens + round((requests - known) * mean_budget)
    return ModelQueue(
        workers.slots, requests, tokens, workers.step_s, workers.full_step_s, workers.measured_at, workers.full_batch
    )


def step_at(q: ModelQueue, batch: int) -> float | None:
    """Step time at a batch size (`runtime.steps.step_time`, from the heartbeats' figures)."""
    return step_time(q.step_s, q.full_step_s, q.full_batch, q.slots, batch)


#: An idle fleet whose step times are older than this is probed with one request instead
#: of judged by them: a slow spell measured once must not refuse everything forever.
STALE_S = 10.0


def estimate(q: ModelQueue, budget: int, overhead_s: float, margin: float = 1.0, now: float | None = None) -> Estimate:
    """When a request of `budget` tokens would finish. Without step times (nothing
    measured yet, or an idle fleet with stale measurements) only the fixed overhead is
    counted: the request is let through, unless its deadline is shorter than that."""
    probe = Estimate(overhead_s, 0.0)  # what is known without step times: the fixed overhead
    if q.slots <= 0:  # no worker reported a load for the model yet (it has not run)
        return probe
    if q.requests == 0 and (now or time.time()) - q.measured_at > STALE_S:
        return probe
    batch = min(q.slots, q.requests + 1)
    step = step_at(q, batch)
    if step is None:  # nothing measured yet: one wave of slots goes, the rest waits for figures
        return probe if q.requests < q.slots else Estimate(math.inf, math.inf)
    # An idle fleet is judged without the margin: refused there, a request would never
    # run, and nothing would refresh the measurements that refused it.
    step *= margin if q.requests else 1.0
    beyond = q.requests + 1 - q.slots  # requests that must end before this one gets a slot
    wait_s = 0.0
    if beyond > 0 and q.requests:
        mean_tokens = q.tokens / q.requests
        wait_s = math.ceil(beyond / q.slots) * mean_tokens * step
    return Estimate(overhead_s + wait_s + budget * step, wait_s)


def retry_after_s(est: Estimate, deadline_s: float) -> int:
    """Whole seconds until the work ahead would have drained enough to fit (at least 1)."""
    return 1 if math.isinf(est.finish_s) else max(1, math.ceil(est.finish_s - deadline_s))


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
            for w in batch:
                if not w.verdict.done():
                    w.settle(error=exc)
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
