"""Audit: did every request reach exactly one terminal event?"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta

from events.models import ChatRequested, Terminal
from infra.battle_audit import audit_battles
from runtime.stream import read_events


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
    requested: dict[str, ChatRequested] = {}
    terminals: dict[str, list[Terminal]] = {}
    for e in events:
        if isinstance(e, ChatRequested):
            requested[e.request_id] = e
        elif isinstance(e, Terminal):
            terminals.setdefault(e.request_id, []).append(e)
    open_ = [r for r in requested if r not in terminals]
    in_flight = sorted(r for r in open_ if requested[r].deadline_at + grace_s > now)
    missing = sorted(r for r in open_ if requested[r].deadline_at + grace_s <= now)
    duplicated = sorted(r for r, ts in terminals.items() if len(ts) > 1)
    orphans = sorted(r for r in terminals if r not in requested)
    battles = audit_battles(events)
    return {
        **battles,
        "requests": len(requested),
        "missing_terminal": missing,
        "duplicate_terminal": duplicated,
        "in_flight": in_flight,
        "terminal_without_request": orphans,
        "ok": not missing
        and not duplicated
        and not battles["votes_without_battle"]
        and not battles["battles_with_several_votes"],
    }


async def audit_window(js, window: timedelta, settle_s: float = 0.0) -> dict:
    since = datetime.now(UTC) - window
    events = await read_events(js, "arena.>", since=since)
    if settle_s:
        await asyncio.sleep(settle_s)
    return audit(events)
