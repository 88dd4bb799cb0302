"""The delivery consumer: records results and fans a request's output out to gateways.

A chunk already delivered
(same request and sequence number, e.g. from a worker that regenerated the request
after a crash) is dropped; the first terminal event is stored in Redis. Each event is
then published on the request's live subject, where whichever gateway holds the client
(one or several) is listening.
"""

from __future__ import annotations

import logging

from faststream import AckPolicy, FastStream
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage

from consumers.delivery.store import ResultStore
from events import decode, subjects
from events.models import TERMINAL_TYPES
from infra.runtime import ProcessRuntime, durable_pull, wire_lifecycle
from infra.settings import DeliverySettings

log = logging.getLogger("arena.delivery")


async def deliver(raw: bytes, store: ResultStore, runtime: ProcessRuntime) -> bool:
    """Record and fan out one output event; False when it was a duplicate and dropped."""
    event = decode(raw)
    if event.type == "tokens.generated":
        fresh = await store.mark_chunk(event.request_id, event.seq)
    elif event.type in TERMINAL_TYPES:
        fresh = await store.save_result(event.request_id, raw)
    else:
        return False
    if fresh:
        await runtime.nc.publish(subjects.live_subject(event.request_id), raw)
        if event.type in TERMINAL_TYPES:
            log.info("delivered %s", event.type, extra={"request_id": event.request_id, "event": event.type})
    return fresh


def build_app(settings: DeliverySettings | None = None) -> FastStream:
    settings = settings or DeliverySettings()
    broker = NatsBroker(settings.nats_url, log_level=logging.DEBUG)
    runtime = ProcessRuntime("delivery", settings)
    store = ResultStore.from_url(settings.redis_url, settings.result_ttl_s)

    # Gateways put chunks back in sequence order, so workers may deliver concurrently.
    @durable_pull(
        broker, subjects.DELIVERY_SUBJECT, subjects.DELIVERY_CONSUMER, AckPolicy.NACK_ON_ERROR, settings.workers
    )
    async def on_output(body: dict, message: NatsMessage) -> None:
        await deliver(message.body, store, runtime)

    app = FastStream(broker)
    wire_lifecycle(app, runtime, before=store.redis.ping, after_stop=store.close)
    return app
