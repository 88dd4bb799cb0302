"""Reading events back from the stream: replay of a request or a conversation, and audit."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from nats.js.api import ConsumerConfig, DeliverPolicy

from events import decode, subjects
from events.models import TERMINAL_TYPES


async def read_events(js, filter_subject: str, since: datetime | None = None, timeout: float = 5.0) -> list:
    """Every stored event on `filter_subject` (optionally from `since` on), in stream order."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME if since else DeliverPolicy.ALL,
        opt_start_time=since.astimezone(UTC).isoformat().replace("+00:00", "Z") if since else None,
    )
    sub = await js.subscribe(filter_subject, ordered_consumer=True, config=config)
    try:
        info = await sub.consumer_info()
        # Messages may already be on their way to us: count those as well as the rest.
        total = info.num_pending + info.delivered.consumer_seq
        out = []
        while len(out) < total:
            msg = await sub.next_msg(timeout=timeout)
            out.append(decode(msg.data))
        return out
    finally:
        await sub.unsubscribe()


async def request_events(js, request_id: str) -> list:
    return await read_events(js, subjects.request_filter(request_id))


async def conversation_events(js, conv_id: str) -> list:
    return await read_events(js, subjects.conversation_filter(conv_id))


def parse_window(text: str) -> timedelta:
    """'90s', '15m', '1h', '2d' -> timedelta."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if not text or text[-1] not in units or not text[:-1].replace(".", "", 1).isdigit():
        raise ValueError(f"window must look like 30s, 15m, 1h or 2d; got {text!r}")
    return timedelta(seconds=float(text[:-1]) * units[text[-1]])


def audit(events: list, now: float | None = None, grace_s: float = 5.0) -> dict:
    """Every request seen in `events` must have exactly one terminal event.

    A request without one whose deadline (plus a grace) has not yet passed is in flight,
    not missing."""
    now = time.time() if now is None else now
    requested: dict[str, object] = {}
    terminals: dict[str, list] = {}
    for e in events:
        if e.type == "chat.requested":
            requested[e.request_id] = e
        elif e.type in TERMINAL_TYPES:
            terminals.setdefault(e.request_id, []).append(e)
    open_ = [r for r in requested if r not in terminals]
    in_flight = sorted(r for r in open_ if requested[r].deadline_at + grace_s > now)
    missing = sorted(r for r in open_ if requested[r].deadline_at + grace_s <= now)
    duplicated = sorted(r for r, ts in terminals.items() if len(ts) > 1)
    orphans = sorted(r for r in terminals if r not in requested)
    return {
        "requests": len(requested),
        "missing_terminal": missing,
        "duplicate_terminal": duplicated,
        "in_flight": in_flight,
        "terminal_without_request": orphans,
        "ok": not missing and not duplicated,
    }


async def audit_window(js, window: timedelta, settle_s: float = 0.0) -> dict:
    since = datetime.now(UTC) - window
    events = await read_events(js, "arena.>", since=since)
    if settle_s:
        await asyncio.sleep(settle_s)
    return audit(events)
