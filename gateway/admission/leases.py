"""`Admission`, the one owner of whether a request is let on, and the `Lease` it hands
each request.

A lease is taken where the request is first judged (the protocol's hook or the
middleware at the HTTP edge, else the serving layer for WebSocket and arena turns) and
travels with it: the serving layer counts it in its model's queue (`reserve`, the
backstop), judges it fleet-wide unless the edge did, and settles it once: `published()`
when the request is in the stream (its entries then count until a stream state shows
it), or `refused()` when it never will be (not ahead of anyone); `release()` gives back
its place in the queue when it ends.
"""

from __future__ import annotations

import time
from contextlib import suppress
from typing import Any

from gateway.admission.calibrate import Calibration, Judged, LivedBatches
from gateway.admission.estimate import (
    Endings,
    Estimate,
    ModelQueue,
    Refusals,
    StreamState,
    backstop,
    combine,
    estimate,
    overloaded,
)
from gateway.admission.gate import EarlyGate
from gateway.admission.recent import FleetAdmissions, Judge
from gateway.metrics import METRICS
from gateway.settings import GatewaySettings
from runtime.background import Background
from runtime.redis import REDIS_DOWN

#: The fleet-wide entry of a request a lone gateway's gate admitted on its own: with no
#: peer alive, the gate sees every request the fleet-wide check would (its own), so
#: neither the check's Redis round trip nor news to peers is spent on it; it is recorded
#: among the fleet's recent admissions once published, off the request's path.
ALONE: tuple[str, str, int] = ("", "", 0)


class Lease:
    """One request's admission (see the module doc)."""

    def __init__(
        self, admission: Admission, model: str, tokens: int, member: str | None = None, judged: Judged | None = None
    ):
        self.admission, self.model, self.tokens = admission, model, tokens
        #: Its member in the early gate, when the gate let it through.
        self.member = member
        #: The estimate it was admitted by (margin aside), when one judged it: its real
        #: time, once it ends, teaches the model's margin (`ended`).
        self.judged = judged
        #: Its entry among the fleet's recent admissions once judged fleet-wide (ALONE: by
        #: a lone gateway's gate); None while it is not.
        self.entry: tuple[str, str, int] | None = None
        self.counted = False  # holds a place in its model's queue
        self.settled = False  # published() or refused() ran

    def reserve(self) -> None:
        """Count the request in its model's queue, past the backstop (`max_queue_per_model`
        requests in flight on this gateway): 429 there."""
        admission, model = self.admission, self.model
        if (queued := admission.in_flight.get(model, 0)) >= admission.settings.max_queue_per_model:
            METRICS.rejections.labels(reason="overloaded").inc()
            raise backstop(model, queued)
        admission.in_flight[model] = queued + 1
        METRICS.in_flight.labels(model).inc()
        self.counted = True
        if self.member is not None:  # the early gate counted it until now
            admission.gate.reserved(model, self.member)

    def release(self) -> None:
        """Give back its place in the queue (once)."""
        if self.counted:
            self.counted = False
            self.admission.in_flight[self.model] -= 1
            METRICS.in_flight.labels(self.model).dec()

    def ended(self, took_s: float, tokens: int, missed: bool, budget_s: float) -> None:
        """It ended `took_s` after admission with `tokens` generated (at its deadline of
        `budget_s` when `missed`): what its estimate needed is learned (`calibrate.Calibration`); a miss
        by what the tokens it made took."""
        self.admission.endings.add(self.model)
        self.admission.sample(self.model)
        if self.judged is not None:
            admission = self.admission
            overhead_s, shared = admission.settings.admission_overhead_s, admission.lived_batch(self.model, took_s)
            needed = self.judged.needed(took_s, tokens, overhead_s, budget_s, cut=missed, shared_batch=shared)
            admission.calibration.record(self.model, needed)
            self.judged = None  # once

    def published(self) -> None:
        """In the stream now: its entries are marked off the request's path (its first
        token need not wait for the Redis and NATS calls only admission's counting needs)."""
        if self._claim():
            self.admission.background.spawn(self._record(published=True))

    async def refused(self) -> None:
        """It will not be published from here (refused after admission, attached to an
        earlier request, or failed): not ahead of anyone, and no lesson for the margin."""
        self.judged = None
        if self._claim():
            await self._record(published=False)

    def refused_soon(self) -> None:
        """`refused`, from a callback (the protocol's)."""
        self.judged = None
        if self._claim():
            self.admission.background.spawn(self._record(published=False))

    def _claim(self) -> bool:
        claimed, self.settled = not self.settled, True
        return claimed

    async def _record(self, published: bool) -> None:
        gate, recent = self.admission.gate, self.admission.recent
        if self.member is not None:
            await (gate.published if published else gate.forget)(self.model, self.member)
        with suppress(*REDIS_DOWN):
            if self.entry is ALONE:
                if published and self.member is not None:
                    await recent.published_here(self.model, self.member, self.tokens)
            elif self.entry is not None:
                await recent.settle(*self.entry, published)


class Admission:
    """The gateway's admission: the requests in flight per model (the backstop), the
    fleet-wide check (`recent`) and the early gate (`gate`)."""

    def __init__(self, settings: GatewaySettings, pipeline: Any, recent: FleetAdmissions | None = None):
        """`pipeline`: the fleet as the heartbeats and the consumers' state say
        (`queue`, `context_len`, `stream_state`), and the NATS connection (`nc`)."""
        self.settings, self.pipeline = settings, pipeline
        self.in_flight: dict[str, int] = {}
        self.calibration = Calibration(settings.admission_margin)
        self.lived = LivedBatches()  # the batch each model's requests lived through (`lived_batch`)
        self.recent = recent or FleetAdmissions(
            pipeline.keys.redis, lambda: pipeline.stream_state, judging_redis=pipeline.admission_redis
        )
        self.endings = Endings()  # when the requests served here ended (`combine` takes them off)
        self.refusals = Refusals()  # what refused, in the log
        self.gate = EarlyGate(
            settings, pipeline, self.recent, self.in_flight, self.calibration, self.endings, self.refusals
        )
        self.background = Background()  # the leases' bookkeeping after a publish

    def batch_now(self, model: str) -> float | None:
        """The requests the workers holding the model run now (their heartbeats')."""
        q = self.pipeline.queue(model)
        return None if q.slots <= 0 else float(min(q.slots, max(1, len(q.ends) or q.requests)))

    def sample(self, model: str) -> None:
        """Keep the model's batch now among the lived ones (`LivedBatches`), every
        SAMPLE_EVERY_S at most: at each request judged and ended."""
        now = time.monotonic()
        if self.lived.due(model, now) and (batch := self.batch_now(model)) is not None:
            self.lived.add(model, now, batch)

    def lived_batch(self, model: str, took_s: float) -> float | None:
        """The batch a request that ends now, `took_s` after it was admitted, shared on
        average (`Judged.needed`'s `shared_batch`)."""
        now = time.monotonic()
        return self.lived.mean(model, now - took_s, now)

    async def start(self) -> None:
        await self.gate.start()

    async def stop(self) -> None:
        await self.gate.stop()

    def lease(self, model: str, tokens: int, edge: Lease | None = None) -> Lease:
        """The request's lease, counted in its model's queue from now (no await since the
        caller's checks, so a burst sees itself): `edge`'s when the HTTP edge judged it."""
        lease = edge if edge is not None and edge.model == model and not edge.counted else Lease(self, model, tokens)
        lease.reserve()
        self.sample(model)
        return lease

    def passed(self, model: str, tokens: int, member: str) -> Lease:
        """The lease of a request the early gate let through as `member`."""
        return Lease(self, model, tokens, member, self.gate.judged.pop(member, None))

    async def judged(self, lease: Lease, budget_s: float) -> None:
        """Judge the request fleet-wide, unless the edge did: 429 when the fleet cannot
        finish it within `budget_s`. Raises what Redis raises."""
        if lease.entry is None:
            lease.entry = await self.in_time(lease.model, lease.tokens, budget_s, lease)

    def judge(
        self, model: str, tokens: int, budget_s: float, workers: ModelQueue | None = None, lease: Lease | None = None
    ) -> Judge:
        """The fleet-wide check of one request (FleetAdmissions): the estimate when the
        fleet cannot finish it within `budget_s`, None to admit it (then `lease` keeps
        the estimate it was admitted by). `workers`: the workers' queue to judge with
        (the early gate's, so the two judge the same fleet and differ only in what the
        others admitted); else as the heartbeats say then. Step times are multiplied by
        the model's learned margin (`calibrate`)."""
        settings = self.settings

        def judge(stream: StreamState, n: int, ahead: int) -> Estimate | None:
            workers_now = workers or self.pipeline.queue(model)
            queue = combine(workers_now, stream, n, ahead, self.recent.mean_budget, self.endings, model)
            est = estimate(queue, tokens, settings.admission_overhead_s, self.calibration.margin(model))
            if est.finish_s > budget_s:
                self.refusals.say(model, est, tokens, budget_s)
                return est
            if lease is not None:
                lease.judged = est.judged()
            return None

        return judge

    async def in_time(
        self, model: str, tokens: int, budget_s: float, lease: Lease | None = None
    ) -> tuple[str, str, int]:
        """Refuse (429, Retry-After) a request the fleet cannot finish before its deadline;
        its entry among the fleet's recent admissions (see recent.py) when it can.

        The request is added to the fleet's recent admissions atomically with reading the
        others' (with every request waiting for the same check), so concurrent
        admissions on any gateway see each other."""
        member, refused = await self.recent.admit(model, tokens, self.judge(model, tokens, budget_s, lease=lease))
        if refused is None:
            return model, member, tokens
        METRICS.rejections.labels(reason="deadline_unreachable").inc()
        raise overloaded(model, refused, budget_s)
