"""Deadline-aware admission (pure logic): would a new request finish before its deadline?

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

import math
import time
from collections import deque
from dataclasses import dataclass

from events.models import DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class ModelQueue:
    """A model's fleet-wide queue, as the gateway sees it now."""

    slots: int  # requests decoded at once (sum of max batch sizes of the workers holding it)
    requests: int  # ahead of a new request: running, waiting, and still in the stream
    tokens: int  # their remaining token budgets
    step_s: float | None  # decode step time at a small batch (None: never measured)
    full_step_s: float | None  # ... at a batch of half the slots or more


@dataclass(frozen=True)
class Estimate:
    finish_s: float  # from now until the request's last token, at worst
    wait_s: float  # of which waiting for a slot


@dataclass(frozen=True)
class StreamState:
    """The consumers' state, read from JetStream (every gateway reads the same)."""

    ahead: int = 0  # not yet held by a worker: being filtered, or waiting to be pulled
    held: int = 0  # delivered to inference workers and not yet acked (every model's)
    read_at: float = 0.0


def combine(
    workers: ModelQueue, stream: StreamState, local_requests: int, local_tokens: int, mean_budget: float
) -> ModelQueue:
    """The queue a new request joins: the stream's requests (fresh, counted by the
    consumers' state), the workers' token budgets and step times (heartbeats, up to a
    beat old), and what this gateway admitted since the stream state was read. Requests
    whose budgets no heartbeat reported yet count `mean_budget` tokens each."""
    held = max(stream.held, workers.requests)
    requests = stream.ahead + held + local_requests
    unknown = max(0, requests - workers.requests - local_requests)
    tokens = workers.tokens + local_tokens + round(unknown * mean_budget)
    return ModelQueue(workers.slots, requests, tokens, workers.step_s, workers.full_step_s)


def step_at(q: ModelQueue, batch: int) -> float | None:
    """Step time at a batch size: from the small-batch time up to the near-full one,
    linearly, reached at half the slots (where near-full measurements start)."""
    small = q.step_s if q.step_s is not None else q.full_step_s
    full = q.full_step_s if q.full_step_s is not None else small
    if small is None or full is None:
        return None
    half = max(2, q.slots // 2)
    share = min(1.0, max(0.0, (batch - 1) / (half - 1)))
    return max(small, small + (full - small) * share)


def estimate(q: ModelQueue, budget: int, overhead_s: float, margin: float = 1.0) -> Estimate | None:
    """When a request of `budget` tokens would finish; None when nothing was measured yet."""
    if q.slots <= 0:
        return None
    batch = min(q.slots, q.requests + 1)
    step = step_at(q, batch)
    if step is None:
        return None
    step *= margin
    beyond = q.requests + 1 - q.slots  # requests that must end before this one gets a slot
    wait_s = 0.0
    if beyond > 0 and q.requests:
        mean_tokens = q.tokens / q.requests
        wait_s = math.ceil(beyond / q.slots) * mean_tokens * step
    return Estimate(overhead_s + wait_s + budget * step, wait_s)


def retry_after_s(est: Estimate, deadline_s: float) -> int:
    """Whole seconds until the work ahead would have drained enough to fit (at least 1)."""
    return max(1, math.ceil(est.finish_s - deadline_s))


class LocalAdmissions:
    """What this gateway admitted lately: the stream state, read every fraction of a
    second, does not show those yet, and a burst must see itself."""

    def __init__(self, keep_s: float = 10.0):
        self.keep_s = keep_s
        self.recent: dict[str, deque[tuple[float, int]]] = {}
        self.mean_budget = float(DEFAULT_MAX_TOKENS)

    def admitted(self, model: str, tokens: int, now: float | None = None) -> None:
        self.recent.setdefault(model, deque()).append((now or time.time(), tokens))
        self.mean_budget = 0.95 * self.mean_budget + 0.05 * tokens

    def queue(self, model: str, workers: ModelQueue, stream: StreamState) -> ModelQueue:
        """The model's queue with this gateway's admissions since `stream` was read."""
        recent = self.recent.setdefault(model, deque())
        horizon = max(stream.read_at, time.time() - self.keep_s)
        while recent and recent[0][0] < horizon:
            recent.popleft()
        return combine(workers, stream, len(recent), sum(t for _, t in recent), self.mean_budget)
