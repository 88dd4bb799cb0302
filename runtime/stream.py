"""Reading stored events back from the stream, in stream order (replay, conversation history)."""

from __future__ import annotations

from datetime import UTC, datetime

from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from events import decode, subjects
from events.models import EventBase


async def read_events(
    js: JetStreamContext, filter_subject: str, since: datetime | None = None, timeout: float = 5.0
) -> list[EventBase]:
    """Every stored event on `filter_subject` (optionally from `since` on), in stream order."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME if since else DeliverPolicy.ALL,
        # nats-py passes this through as given; the server wants an RFC 3339 string.
        opt_start_time=since.astimezone(UTC).isoformat().replace("+00:00", "Z") if since else None,  # type: ignore[arg-type]
    )
    sub = await js.subscribe(filter_subject, ordered_consumer=True, config=config)
    try:
        info = await sub.consumer_info()
        # Messages may already be on their way to us: count those as well as the rest.
        total = (info.num_pending or 0) + (info.delivered.consumer_seq or 0 if info.delivered else 0)
        out: list[EventBase] = []
        while len(out) < total:
            msg = await sub.next_msg(timeout=timeout)
            out.append(decode(msg.data))
        return out
    finally:
        await sub.unsubscribe()


async def request_events(js: JetStreamContext, request_id: str) -> list[EventBase]:
    return await read_events(js, subjects.request_filter(request_id))


async def conversation_events(js: JetStreamContext, conv_id: str) -> list[EventBase]:
    return await read_events(js, subjects.conversation_filter(conv_id))
