"""Early refusal: in a burst, the requests that cannot be answered in time are refused
before the admitted ones do their heavier work.

The event loop serves a burst in arrival order, stage by stage: without this, a request
refused by admission waits behind every earlier request's body validation, Redis calls
and publish, and its 429 leaves after about a second on a busy gateway. On the admission
routes (`POST /v1/chat/completions`, `POST /chat`), the gate reads the token budget and
deadline from the body itself as uvicorn's protocol reads it (`edge.refusal`), and

1. judges the request from what this process already knows, with no I/O: the fleet's
   queue (heartbeats, the consumers' state) plus the requests this gateway and its
   peers let through lately (peers tell each other on core NATS, `SUBJECT`); past the
   deadline, the protocol writes the whole 429 before any task runs;
2. holds a request it let through from its task (the task does no work) until the
   fleet-wide check answers (`Admission.judge` in `FleetAdmissions`: one Redis script
   for every request waiting, shared by all gateways); a refusal there is written by
   the protocol too, at once, so a burst split over several gateways is refused after
   one Redis round trip, not behind the admitted requests' validation and publish.

With several gateways, each reads its part of a burst before any peer's news of theirs
arrives; judged on its own passes alone, every gateway would let through the whole
room, and the fleet-wide check would refuse the excess only after its Redis round trip.
So each gate lets through, on its own, its *share* of the room: its own requests not yet
heard of by the peers count 1/share times (`Demand`: this gateway's requests over all
gateways' in the last few seconds, which peers report every second), as a lease of
capacity split by demand (Google's Doorman does the same for rate limits). A peer's news,
once here, replaces that assumption. Equal traffic gives equal shares; a gateway that
alone gets the traffic gets the whole room within the window; with no news, the room
is split evenly among the gateways heard from. A gateway with no peer alive (`ALONE`)
skips step 2 and the news: its gate sees what the check would, so the request goes on
with no Redis round trip before its publish.

`edge.EarlyAdmission` (middleware) does the same for a request the protocol did not
judge (the check with `Admission.in_time`, before any heavier step).

Refusals are the same 429 with Retry-After that admission gives elsewhere (WebSocket and
arena turns are judged by the serving layer alone). The request's `Lease` follows it:
its entries are marked when it is published and dropped when it is refused or fails.

(A window letting only a few admitted requests do their heavier steps at once was
tried: refusals came no sooner with two gateways, and admission slowed enough that
requests sent just before a Redis outage met it.)
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import suppress
from typing import Any

from events import subjects
from events.fleet import AdmissionState, GatewayAdmissions, GatewayDemand, decode_news, encode_news
from events.models import new_id
from gateway.admission import estimate
from gateway.admission.calibrate import Calibration, Judged
from gateway.admission.estimate import backstop, overloaded
from gateway.admission.recent import PENDING_S, VISIBILITY_LAG_S, FleetAdmissions
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.settings import GatewaySettings
from runtime.background import Background
from runtime.jetstream import NATS_DOWN

SUBJECT = subjects.GATEWAY_ADMITTED
#: With peers, the early gate judges with a margin this much wider than the fleet-wide
#: check's: its view (local, peers' news, heartbeats of the moment) differs a little from
#: the one the Redis-backed check sees a moment later, and a request near the limit had
#: better be refused at once than let on and refused there, behind the burst's work.
#: Alone, its verdict is the fleet's (no check follows), judged at the learned margin as
#: is: 10% wider there refused turns at 2 requests/s, below llama.cpp's knee, estimated
#: at 15.1-15.9 s where the server answered every turn by 11 s.
STRICTER = 1.1
#: Demand (requests judged) is compared over this many whole seconds before the current
#: one; peers report theirs every DEMAND_EVERY_S and are gone when silent PEER_SILENT_S.
DEMAND_WINDOW_S, DEMAND_EVERY_S, PEER_SILENT_S = 5, 1.0, 3.5


class Demand:
    """Requests judged per model, in one-second buckets."""

    def __init__(self) -> None:
        self.buckets: dict[str, dict[int, int]] = {}

    def count(self, model: str, now: float) -> None:
        buckets = self.buckets.setdefault(model, {})
        second = int(now)
        buckets[second] = buckets.get(second, 0) + 1

    def rates(self, now: float) -> dict[str, float]:
        """Requests per second over the window before the current second, per model."""
        second, rates = int(now), {}
        for model, buckets in self.buckets.items():
            for old in [s for s in buckets if s < second - DEMAND_WINDOW_S]:
                del buckets[old]
            rates[model] = sum(n for s, n in buckets.items() if s < second) / DEMAND_WINDOW_S
        return rates


def share(mine: float, theirs: list[float]) -> float:
    """This gateway's share of a model's room: its demand over every live gateway's; an
    even split without demand, and never under it (a gateway with little recent demand
    leaves its excess to the fleet-wide check rather than refuse what the fleet could serve)."""
    even = 1 / (1 + len(theirs))
    total = mine + sum(theirs)
    return even if total <= 0 else max(even, mine / total)


class EarlyGate:
    """What this gateway and its peers let through lately, per model, and the decision."""

    def __init__(
        self,
        settings: GatewaySettings,
        pipeline: Any,
        recent: FleetAdmissions,
        in_flight: dict[str, int],
        calibration: Calibration | None = None,
        endings: estimate.Endings | None = None,
        refusals: estimate.Refusals | None = None,
    ):
        """`pipeline`: the fleet as the heartbeats and the consumers' state say (`queue`,
        `context_len`, `stream_state`) and the NATS connection peers talk on; `in_flight`:
        the requests the routes count per model (Admission's); `calibration`: the
        margins learned per model (Admission's)."""
        self.settings, self.pipeline, self.recent, self.in_flight = settings, pipeline, recent, in_flight
        self.endings = endings or estimate.Endings()  # the requests served here that ended (Admission's)
        self.refusals = refusals or estimate.Refusals()  # what refused, in the log (Admission's)
        self.calibration = calibration or Calibration(settings.admission_margin)
        #: The estimates the requests let through were judged by, until their leases take them.
        self.judged: dict[str, Judged] = {}
        self.name = new_id()
        self.passed: dict[str, dict[str, tuple[float, int]]] = {}  # model -> member -> (when, tokens)
        self._telling: list[tuple[str, str, int]] = []  # let through by the protocol, peers not told yet
        self.demand = Demand()
        self.unreserved: dict[str, dict[str, float]] = {}  # model -> member let through -> until when it counts
        self.peers: dict[str, tuple[float, dict[str, float]]] = {}  # gateway -> (heard at, its demand)
        self._background = Background()

    async def start(self) -> None:
        if (nc := getattr(self.pipeline, "nc", None)) is not None:
            await nc.subscribe(SUBJECT, cb=self._on_peer)
            self._background.spawn(self._report_demand())

    async def stop(self) -> None:
        """Stops reporting demand (and any news still being sent) before the connection closes."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _report_demand(self) -> None:
        """Tells the peers this gateway's demand every DEMAND_EVERY_S (also: it is alive)."""
        while True:
            await asyncio.sleep(DEMAND_EVERY_S)
            nc = getattr(self.pipeline, "nc", None)
            if nc is not None and nc.is_connected:
                with suppress(*NATS_DOWN):
                    news = GatewayDemand(gateway=self.name, demand=self.demand.rates(time.time()))
                    await nc.publish(SUBJECT, encode_news(news))

    def _alive(self, now: float) -> list[dict[str, float]]:
        """The demand of every peer heard in the last PEER_SILENT_S."""
        return [demand for heard, demand in self.peers.values() if now - heard <= PEER_SILENT_S]

    def alone(self) -> bool:
        """No peer gateway alive (each reports its demand every DEMAND_EVERY_S, so a
        gateway starting beside others is alone for a second at most)."""
        return not self._alive(time.time())

    def share(self, model: str, now: float) -> float:
        """This gateway's share of the model's room (1 alone)."""
        alive = self._alive(now)
        if not alive:
            return 1.0
        return share(self.demand.rates(now).get(model, 0.0), [demand.get(model, 0.0) for demand in alive])

    async def _on_peer(self, msg) -> None:
        """A peer's news (events.fleet.GatewayNews): its demand, or requests it let
        through, published or dropped."""
        try:
            news = decode_news(msg.data)
        except ValueError:
            return
        if news.gateway == self.name:
            return
        match news:
            case GatewayDemand(gateway=gateway, demand=demand):
                self.peers[gateway] = (time.time(), demand)
            case GatewayAdmissions(gateway=gateway, model=model, requests=requests, state=state):
                for member, tokens in requests:
                    self._mark(model, f"{gateway}:{member}", tokens, state)

    def _mark(self, model: str, member: str, tokens: int, state: AdmissionState) -> None:
        """A request let through (`pass`: counted until published, PENDING_S at most),
        published (`pub`: counted until a stream state read after it) or dropped."""
        passed = self.passed.setdefault(model, {})
        if state == "drop":
            passed.pop(member, None)
        elif state == "pass" or member in passed:
            passed[member] = (time.time() + (PENDING_S if state == "pass" else 0.0), tokens)

    def _ahead(self, model: str, since: float, share: float = 1.0) -> tuple[int, int]:
        """Requests and tokens let through and not visible at `since` (older ones are
        dropped: the consumers' state has them). This gateway's own count 1/`share` times
        unless the peers' news says more: the peers are taken to be letting through
        their shares of the same traffic."""
        passed = self.passed.get(model, {})
        for member in [m for m, (t, _) in passed.items() if t <= since]:
            del passed[member]
        n, tokens = len(passed), sum(t for _, t in passed.values())
        if share >= 1.0:
            return n, tokens
        own = [t for member, (_, t) in passed.items() if ":" not in member]  # peers' are "gateway:member"
        return max(n, math.ceil(len(own) / share)), max(tokens, math.ceil(sum(own) / share))

    def decide(
        self, model: str, tokens: int, budget_s: float, workers: estimate.ModelQueue | None = None
    ) -> tuple[APIError | None, str | None]:
        """(the 429, None) for a request to refuse; (None, its member) for one let
        through, counted at once so the next one is judged with it (peers are told by
        `tell`); (None, None) when the model is not served or not yet, or its context
        cannot hold the token budget, or it cannot make that many tokens within the
        deadline even alone: the route answers.
        Refused too past the backstop (`max_queue_per_model` requests of this gateway in
        flight or let through here and not yet counted there): the route would refuse
        it, after a burst's worth of other requests' work. `workers`: the workers' queue
        to judge with (else as the heartbeats say now)."""
        workers = workers or self.pipeline.queue(model)
        if workers.slots <= 0:
            return None, None
        if (context := self.pipeline.context_len(model)) is not None and tokens >= context:
            return None, None  # it can never run, now or later: the route's 400 says why
        if estimate.never(workers, tokens, budget_s, self.settings.admission_overhead_s):
            return None, None  # too long for its deadline at any load: the route's 400 says why
        now = time.time()
        self.demand.count(model, now)
        waiting = self.unreserved.setdefault(model, {})
        for member in [m for m, until in waiting.items() if until <= now]:
            del waiting[member]
            self.judged.pop(member, None)
        if (queued := self.in_flight.get(model, 0) + len(waiting)) >= self.settings.max_queue_per_model:
            METRICS.rejections.labels(reason="overloaded").inc()
            return backstop(model, queued), None
        if (est := self.estimate(model, tokens, workers)).finish_s > budget_s:
            METRICS.rejections.labels(reason="deadline_unreachable").inc()
            self.refusals.say(model, est, tokens, budget_s)
            return overloaded(model, est, budget_s), None
        member = new_id()
        self.judged[member] = est.judged()
        self._mark(model, member, tokens, "pass")
        waiting[member] = now + PENDING_S
        return None, member

    def reserved(self, model: str, member: str) -> None:
        """A request this gate let through is counted in the route's queue now."""
        self.unreserved.get(model, {}).pop(member, None)

    def estimate(self, model: str, tokens: int, workers: estimate.ModelQueue | None = None) -> estimate.Estimate:
        """When the request would finish: the fleet's queue with what was let through
        since its state was read, at the model's learned margin (with peers, stricter
        than the fleet-wide check's that follows: `STRICTER`)."""
        workers = workers or self.pipeline.queue(model)
        stream = self.pipeline.stream_state
        n, ahead = self._ahead(model, stream.read_at - VISIBILITY_LAG_S, self.share(model, time.time()))
        queue = estimate.combine(workers, stream, n, ahead, self.recent.mean_budget, self.endings, model)
        margin = self.calibration.margin(model) * (1.0 if self.alone() else STRICTER)
        return estimate.estimate(queue, tokens, self.settings.admission_overhead_s, margin)

    async def published(self, model: str, member: str) -> None:
        await self._set(model, member, 0, "pub")

    def forget_soon(self, model: str, member: str) -> None:
        """`forget`, from a callback (the protocol's)."""
        self._background.spawn(self.forget(model, member))

    async def forget(self, model: str, member: str) -> None:
        """A request refused after this gate, or attached to an earlier one: not ahead of anyone."""
        self.reserved(model, member)
        self.judged.pop(member, None)
        await self._set(model, member, 0, "drop")

    async def _set(self, model: str, member: str, tokens: int, state: AdmissionState) -> None:
        if state != "pass":
            tokens = self.passed.get(model, {}).get(member, (0.0, 0))[1]
        self._mark(model, member, tokens, state)
        await self.tell(model, member, tokens, state)

    def tell_soon(self, model: str, member: str, tokens: int) -> None:
        """Tells the peers of a request the protocol let through, with every other one let
        through in the same read: one message, sent before any of them goes on, so a
        peer reading its share of the same burst judges with this one's."""
        if not self._telling:
            self._background.spawn(self._tell_passed())
        self._telling.append((model, member, tokens))

    async def _tell_passed(self) -> None:
        await asyncio.sleep(0)  # the rest of this read
        passed, self._telling = self._telling, []
        by_model: dict[str, list[tuple[str, int]]] = {}
        for model, member, tokens in passed:
            by_model.setdefault(model, []).append((member, tokens))
        nc = getattr(self.pipeline, "nc", None)
        if nc is not None and nc.is_connected:
            with suppress(*NATS_DOWN):
                for model, items in by_model.items():
                    news = GatewayAdmissions(gateway=self.name, model=model, requests=tuple(items), state="pass")
                    await nc.publish(SUBJECT, encode_news(news))

    async def tell(self, model: str, member: str, tokens: int, state: AdmissionState) -> None:
        nc = getattr(self.pipeline, "nc", None)
        if nc is not None and nc.is_connected and not self.alone():
            with suppress(*NATS_DOWN):  # peers then learn it from the Redis-backed check
                news = GatewayAdmissions(gateway=self.name, model=model, requests=((member, tokens),), state=state)
                await nc.publish(SUBJECT, encode_news(news))
