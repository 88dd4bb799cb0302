"""Rebuilding the Redis read model from the stream: the events are the truth, Redis only
answers fast. Used by the gateway for one request when Redis has forgotten it (cheap: one
filtered read), and by `arena rebuild-readmodel` for everything in a window."""

from __future__ import annotations

from datetime import datetime

from nats.js import JetStreamContext

from events import encode
from events.models import ChatRequested, EventBase, RequestEvent, Terminal
from events.readmodel import ReadModel
from runtime.stream import read_events, request_events


async def restore(
    store: ReadModel, events: list[EventBase], results: bool = True
) -> tuple[Terminal | None, dict | None]:
    """Write one request's pending record and result from its events; returns its
    terminal event (None while it runs) and its pending record (None if never requested).

    Without `results` (the gateway, whose Redis user may not write results: only
    delivery's may, infra/redis_auth.py) a finished request is answered from its events
    and nothing is written; a pending record and owner without the result would read as
    still running."""
    requested = next((e for e in events if isinstance(e, ChatRequested)), None)
    terminal = next((e for e in events if isinstance(e, Terminal)), None)
    record = None
    write = results or terminal is None
    if requested is not None:
        if write:
            await store.record_pending(
                requested.request_id, requested.conv_id, requested.turn_id, requested.model, requested.deadline_at
            )
        record = {
            "conv_id": requested.conv_id,
            "turn_id": requested.turn_id,
            "model": requested.model,
            "deadline_at": requested.deadline_at,
            "principal": requested.principal,
        }
        if write and requested.principal is not None:  # the events record who asked: ownership comes back too
            await store.restore_owner(requested.request_id, requested.principal)
    if terminal is not None and results:
        await store.save_result(terminal.request_id, encode(terminal))
    return terminal, record


async def recover_request(
    js: JetStreamContext, store: ReadModel, request_id: str, results: bool = True
) -> tuple[Terminal | None, dict | None]:
    return await restore(store, await request_events(js, request_id), results)


async def rebuild(js: JetStreamContext, store: ReadModel, since: datetime | None = None) -> dict[str, int]:
    """Every request's pending record and result from the stream (from `since` on)."""
    by_request: dict[str, list[EventBase]] = {}
    for event in await read_events(js, "arena.>", since=since, timeout=10.0):
        if isinstance(event, RequestEvent):
            by_request.setdefault(event.request_id, []).append(event)
    results = 0
    for events in by_request.values():
        terminal, _ = await restore(store, events)
        results += terminal is not None
    return {"requests": len(by_request), "results": results}
