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

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gateway.admission.calibrate import Judged
from gateway.errors import APIError
from runtime.steps import shared_batch, step_time, stretch, too_long_alone

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
    alone_step_s: float | None = None  # the fastest worker's step with one request (None: not measured)
    small_batch: int | None = None  # the batch step_s was measured at (None: 1)
    prefill_share: float = 0.0  # of recent step time, newcomers' prefills' (the busiest worker's)
    heard_at: float = 0.0  # the newest of the heartbeats it sums
    recent_running: int = 0  # the busiest batch of the last PEAK_WINDOW_S (the workers' sum)
    ends: tuple[int, ...] = ()  # the running requests' token budgets left, fewest first (empty: unknown)
    mean_running: float | None = None  # requests running at once over PEAK_WINDOW_S, time-weighted (None: unsaid)

    def window_batch(self) -> int:
        """The batch the requests of the last PEAK_WINDOW_S shared: the mean of those
        running (the workers' sum), or, from workers that do not report it, the busiest."""
        return self.recent_running if self.mean_running is None else round(self.mean_running)

    def life_batch(self, budget: int) -> int:
        """The batch a request of `budget` tokens admitted now shares its steps with, on
        average over them: itself and, at each of its steps, those running now that are
        still running then (their budgets left, `ends`) or the window's mean where more
        (arrivals keep the batch at its mean: `window_batch`), the requests queued beside
        them counted throughout. Judged at the batch it joins, a turn arriving at a
        moment's cluster of Poisson arrivals (18 running, 9 on average) was refused at
        2 requests/s, estimated at 15.1 s where the server answered every turn by 8 s.
        Without the budgets left, or from workers that do not report the mean: the
        batch it joins, or the window's (its mean and itself; else its busiest) where more."""
        if self.mean_running is None or not self.ends or budget <= 0:
            return max(self.requests + 1, self.window_batch() + (self.mean_running is not None))
        queued = max(0, self.requests - min(len(self.ends), self.slots))
        return shared_batch(self.ends, queued, self.mean_running, budget, max(self.slots, self.requests + 1))


@dataclass(frozen=True)
class Estimate:
    finish_s: float  # from now until the request's last token, at worst
    wait_s: float  # of which waiting for a slot
    step_s: float = 0.0  # the step time its tokens were counted at (margin included)
    margin: float = 1.0  # the margin step times were multiplied by
    batch: int = 0  # the batch its steps were judged at
    stretch: float = 1.0  # what others' prefills stretched its steps by
    #: The figures it was judged by (the step line of its queue then, stretched, margin
    #: aside), for a batch: what calibration reads at the batch it really shared.
    line: Callable[[float], float | None] | None = field(default=None, compare=False, repr=False)

    def parts(self, budget: int) -> str:
        """The estimate's inputs in words, for a log line: what refused a request."""
        decode = self.step_s / (self.margin * self.stretch) if self.step_s else 0.0
        return (
            f"{self.finish_s:.1f} s: {self.wait_s:.1f} s waiting, {budget} tokens x {self.step_s * 1000:.0f} ms "
            f"(decode {decode * 1000:.0f} ms at batch {self.batch}, x{self.stretch:.2f} prefills, "
            f"x{self.margin:.2f} margin)"
        )

    def judged(self) -> Judged:
        """The estimate's parts, margin aside: what calibration compares the request's
        real time with (`calibrate.Judged`)."""
        return Judged(self.wait_s / self.margin, self.step_s / self.margin, self.margin, self.line)


@dataclass(frozen=True)
class StreamState:
    """The consumers' state, read from JetStream (every gateway reads the same)."""

    ahead: int = 0  # not yet held by a worker: being filtered, or waiting to be pulled
    held: int = 0  # delivered to inference workers and not yet acked (every model's)
    read_at: float = 0.0  # when the read began: what was published before is in it


class Endings:
    """When the requests this gateway served ended, by model. A request that ended after
    both the newest heartbeat and the stream state was read is still in both: `combine`
    takes it off (a client sending its next request as the last one ends would otherwise
    find it still queued for up to a beat, and a long answer refused with 429 on an idle
    fleet)."""

    def __init__(self) -> None:
        self.at: dict[str, deque[float]] = {}

    def add(self, model: str, now: float | None = None) -> None:
        self.at.setdefault(model, deque(maxlen=1024)).append(now or time.time())

    def since(self, model: str, since: float) -> int:
        """How many ended after `since`: from the newest back (they are kept in order), so
        an admission reads only the few since the last heartbeat, not the whole history."""
        ended = 0
        for t in reversed(self.at.get(model, ())):
            if t <= since:
                break
            ended += 1
        return ended


class Refusals:
    """Says in the log what refused a request (`Estimate.parts`), at most once every
    EVERY_S per model: in a burst, hundreds are refused by the same figures."""

    EVERY_S = 1.0

    def __init__(self) -> None:
        self.said_at: dict[str, float] = {}

    def say(self, model: str, est: Estimate, budget: int, budget_s: float) -> None:
        now = time.monotonic()
        if now - self.said_at.get(model, -math.inf) < self.EVERY_S:
            return
        self.said_at[model] = now
        log.info("refused: %s over %g s", est.parts(budget), budget_s, extra={"model": model})


def combine(
    workers: ModelQueue,
    stream: StreamState,
    local_requests: int,
    local_tokens: int,
    mean_budget: float,
    endings: Endings | None = None,
    model: str = "",
) -> ModelQueue:
    """The queue a new request joins: the stream's requests (counted by the consumers'
    state when it was read), the admissions not visible in it yet (`local_*`: every
    gateway's), and the workers' token budgets and step times (heartbeats, up to a beat
    old). A heartbeat newer than the stream state may already hold some of those recent
    admissions: they are counted once (the workers never hold more than all of them).
    Requests whose budgets no heartbeat reported count `mean_budget` tokens each. Less
    the requests that ended since both were read (`endings`, this gateway's)."""
    requests = max(stream.ahead + stream.held + local_requests, workers.requests)
    known, known_tokens = workers.requests + local_requests, workers.tokens + local_tokens
    if known > requests:  # some recent admissions are in the heartbeat already
        tokens = round(known_tokens * requests / known)
    else:
        tokens = known_tokens + round((requests - known) * mean_budget)
    ends = workers.ends
    if endings is not None and requests and (ended := endings.since(model, max(workers.heard_at, stream.read_at))):
        left = max(0, requests - ended)
        tokens, requests = round(tokens * left / requests), left
        ends = ends[ended:]  # those that ended had the fewest tokens left
    return replace(workers, requests=requests, tokens=tokens, ends=ends)


def slot_wait(q: ModelQueue) -> float | None:
    """Steps until a request joining the queue now gets a slot: the requests queued ahead of
    it (beyond the running ones, `q.ends`) take the slots as they free, fewest tokens left
    first, each with the mean budget of those queued; None when the running ones' budgets
    are unknown. Counted as the mean of all the budgets left, a request one beyond the
    slots waited as long as the running requests' mean (32 of 64 tokens at llama.cpp's 32
    slots), where the first slot frees after the fewest (a token or two under arrivals),
    and was refused at every moment a server at capacity held one more request than slots."""
    if not q.ends:
        return None
    running = q.ends[: q.slots]
    queued = max(0, q.requests - len(running))
    each = max(0, q.tokens - sum(running)) / queued if queued else 0.0
    free = (0,) * (q.slots - len(running)) + running  # when each slot frees, soonest first
    rounds, k = divmod(queued, q.slots)
    return free[k] + rounds * each


def step_at(q: ModelQueue, batch: float) -> float | None:
    """Step time at a batch size (`runtime.steps.step_time`, from the heartbeats' figures)."""
    return step_time(q.step_s, q.full_step_s, q.full_batch, q.slots, batch, q.small_batch)


#: An idle fleet whose step times are older than this is probed with one request instead
#: of judged by them: a slow spell measured once must not refuse everything forever.
STALE_S = 10.0


def estimate(
    q: ModelQueue,
    budget: int,
    overhead_s: float,
    margin: float = 1.0,
    now: float | None = None,
) -> Estimate:
    """When a request of `budget` tokens would finish. Without step times (nothing
    measured yet, or an idle fleet with stale measurements) only the fixed overhead is
    counted: the request is let through, unless its deadline is shorter than that."""
    probe = Estimate(overhead_s, 0.0)  # what is known without step times: the fixed overhead
    if q.slots <= 0:  # no worker reported a load for the model yet (it has not run)
        return probe
    if q.requests == 0 and (now or time.time()) - q.measured_at > STALE_S:
        return probe
    # An idle fleet is judged without the margin: refused there, a request would never
    # run, and nothing would refresh the measurements that refused it; nor is anyone
    # arriving beside it there, whose prefills would stretch its steps.
    prefills = stretch(q.prefill_share, q.measured_at, now or time.time()) if q.requests else 1.0
    if not q.requests:
        margin = 1.0
    # The batch its tokens will share, on average over them (`ModelQueue.life_batch`).
    batch = min(q.slots, q.life_batch(budget))
    # Alone, a request steps as fast as requests alone do (the median step at batch 1),
    # the figure `never` judges it by: an idle fleet refuses with 429 only what a retry
    # could get, never a request that a 400 would have told to change.
    step = q.alone_step_s if batch == 1 and q.alone_step_s is not None else step_at(q, batch)
    if step is None:  # nothing measured yet: one wave of slots goes, the rest waits for figures
        return probe if q.requests < q.slots else Estimate(math.inf, math.inf)
    step *= prefills * margin
    beyond = q.requests + 1 - q.slots  # requests that must end before this one gets a slot
    wait_s = 0.0
    if beyond > 0 and q.requests:
        if (steps := slot_wait(q)) is None:
            steps = math.ceil(beyond / q.slots) * q.tokens / q.requests
        wait_s = steps * step
    return Estimate(
        overhead_s + wait_s + budget * step,
        wait_s,
        step,
        margin,
        batch,
        prefills,
        lambda shared: None if (at := step_at(q, min(q.slots, shared))) is None else at * prefills,
    )


def alone_s(q: ModelQueue, budget: int, overhead_s: float) -> float | None:
    """How long a request of `budget` tokens takes with nothing else to run, on the
    fastest worker holding the model (its median step with one request in the batch),
    the fixed overhead included; None until measured. Judged without the margin, and
    never stale (a worker's speed alone does not drift with the load), unlike `estimate`."""
    return None if q.alone_step_s is None else overhead_s + budget * q.alone_step_s


def never(q: ModelQueue, budget: int, budget_s: float, overhead_s: float) -> bool:
    """True for a request that cannot finish within `budget_s` at any load: its deadline
    is shorter than the fixed overhead, or its tokens take longer even alone."""
    alone = alone_s(q, budget, overhead_s)
    return budget_s < overhead_s or (alone is not None and alone > budget_s)


def too_slow(
    model: str, q: ModelQueue, field: str, budget: int, budget_s: float, max_deadline_s: float, overhead_s: float
) -> APIError | None:
    """The 400 for a request that can never finish within its deadline (`never`):
    retrying it cannot succeed, so no 429. It names the field to change: `deadline_s`
    when even one token would not fit, else the token budget's `field`. None when it can."""
    if not never(q, budget, budget_s, overhead_s):
        return None
    step = q.alone_step_s or 0.0
    per_token = f" and about {step * 1000:.0f} ms a token" if step else ""
    if budget_s < overhead_s + step:
        return APIError(
            400,
            f"deadline_s: {budget_s:g} s is too short for model '{model}': a request spends about {overhead_s:g} s "
            f"outside decoding{per_token} (ARENA_ADMISSION_OVERHEAD_S); ask for at least "
            f"{overhead_s + budget * step:.1f} s",
            "deadline_too_short",
            "deadline_s",
        )
    message = too_long_alone(field, model, budget, q.alone_step_s, budget_s, overhead_s, max_deadline_s)
    assert message is not None  # never(), with even one token fitting
    return APIError(400, message, "deadline_too_short", field)


def retry_after_s(est: Estimate, deadline_s: float) -> int:
    """Whole seconds until the work ahead would have drained enough to fit (at least 1)."""
    return 1 if math.isinf(est.finish_s) else max(1, math.ceil(est.finish_s - deadline_s))


def overloaded(model: str, est: Estimate, budget_s: float) -> APIError:
    """The 429 admission answers for a request the fleet cannot finish within `budget_s`."""
    return APIError(
        429,
        f"model '{model}' cannot answer within {budget_s:g} s now (estimated {est.finish_s:.1f} s); retry later"
        if not math.isinf(est.finish_s)
        else f"model '{model}' is being measured; retry shortly",
        "overloaded",
        None,
        headers={"Retry-After": str(retry_after_s(est, budget_s))},
    )


def backstop(model: str, queued: int) -> APIError:
    """The 429 past the hard cap of requests in flight per model and gateway."""
    return APIError(
        429,
        f"model '{model}' has {queued} requests queued; retry later",
        "overloaded",
        None,
        headers={"Retry-After": "1"},
    )
