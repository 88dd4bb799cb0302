"""The delivery consumer: records results in the read model and fans them out to gateways.

It reads the terminal events (its durable's filter): the first one of a request is
stored in the read model, then published on the request's live subject, where whichever
gateway holds the client (one or several) is listening. Token chunks do not pass
through here: the inference worker sends each live itself as it stores it in the
stream, and gateways drop a chunk they already have (e.g. regenerated after a crash).
A chunk that still arrives (a durable created before its filter changed) is acked and
dropped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from faststream.exceptions import NackMessage
from nats.aio.msg import Msg
from prometheus_client import Counter

from consumers.delivery.settings import DeliverySettings
from events import subjects, topology
from events.models import RequestEvent, Terminal
from events.readmodel import ReadModel
from runtime import tracing
from runtime.consume import DurableConsumer, Handler
from runtime.process import Process, ProcessRuntime, decode_or_term, serve
from runtime.redis import REDIS_DOWN, redis_client

log = logging.getLogger(__name__)

#: Delay before a message whose Redis record failed is redelivered (the durable's
#: max_deliver times this is the Redis outage delivery rides out).
REDIS_RETRY_S = 2.0
REDIS_RETRIES = Counter("arena_delivery_redis_retries_total", "Output events redelivered because Redis was unreachable")

Fanout = Callable[[str, bytes], Awaitable[None]]


async def deliver(event, raw: bytes, store: ReadModel, fanout: Fanout) -> bool:
    """Record and fan out one output event; False when it was a duplicate (or no output) and dropped.

    With Redis unreachable the event is fanned out anyway (gateways drop a chunk they
    already have) and the message is redelivered later (NackMessage with a delay), when
    its record can be written: a Redis outage delays no answer and loses no result."""
    if not isinstance(event, Terminal):
        return False
    try:
        fresh = await store.save_result(event.request_id, raw)
    except REDIS_DOWN as exc:
        REDIS_RETRIES.inc()
        log.warning(
            "redis unavailable; fanned out, record retried later: %s", exc, extra={"request_id": event.request_id}
        )
        await fanout(subjects.live_subject(event.request_id), raw)
        raise NackMessage(delay=REDIS_RETRY_S) from exc
    if fresh:
        await fanout(subjects.live_subject(event.request_id), raw)
        log.info("delivered %s", event.type, extra={"request_id": event.request_id, "event": event.type})
    return fresh


def handler(store: ReadModel, fanout: Fanout) -> Handler:
    """Delivery's handler of one pulled output event (each request has one terminal
    event, so workers may deliver concurrently)."""

    async def on_output(message: Msg) -> None:
        event = await decode_or_term(topology.DELIVERY.name, message, RequestEvent)
        if event is None:
            return
        with tracing.consumed("delivery", message.headers, request_id=event.request_id, event=event.type):
            await deliver(event, message.data, store, fanout)

    return on_output


def build_app(
    settings: DeliverySettings | None = None, store: ReadModel | None = None, fanout: Fanout | None = None
) -> Process:
    """The delivery process; `store` and `fanout` (core-NATS publish) are replaceable in tests."""
    settings = settings or DeliverySettings()
    runtime = ProcessRuntime(topology.DELIVERY.name, settings)
    store = store or ReadModel(redis_client(settings.redis_url), settings.result_ttl_s)

    async def live(subject: str, raw: bytes) -> None:
        # The trace goes back to the gateway with the event.
        await runtime.connection().publish(subject, raw, headers=tracing.headers())

    @asynccontextmanager
    async def redis(_: ProcessRuntime) -> AsyncIterator[None]:
        await store.redis.ping()  # Redis unreachable at start: the process exits and is restarted
        try:
            yield
        finally:
            await store.redis.aclose()

    on_output = handler(store, fanout or live)
    consumer = DurableConsumer(topology.DELIVERY, on_output, "auto", settings.workers, batch=settings.workers)
    return Process(runtime, consumer, redis)


def main() -> None:
    serve(build_app())
