"""The gateway's side of the event pipeline: publishing requests, following their output,
and knowing which consumers are alive (from their heartbeats)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from consumers.delivery.store import ResultStore
from events import decode, subjects
from events.models import ChatCancelled
from infra import jetstream
from infra.replay import read_events

log = logging.getLogger("arena.gateway")

ROLES = ("filter", "inference", "delivery")


class Pipeline:
    def __init__(self, settings):
        self.settings = settings
        self.nc = None
        self.js = None
        self.store = ResultStore.from_url(settings.redis_url, settings.result_ttl_s)
        self.beats: dict[tuple[str, str], dict] = {}

    async def start(self) -> None:
        await self.store.redis.ping()
        self.nc = await jetstream.connect(self.settings.nats_url, "arena-gateway")
        self.js = self.nc.jetstream()
        await jetstream.ensure_topology(self.js, self.settings.retention_days, **self.settings.topology())
        await self.nc.subscribe(f"{subjects.HEARTBEAT_PREFIX}.>", cb=self._on_beat)

    async def stop(self) -> None:
        if self.nc and not self.nc.is_closed:
            await self.nc.drain()
        await self.store.close()

    async def _on_beat(self, msg) -> None:
        with suppress(ValueError, KeyError):
            beat = json.loads(msg.data)
            self.beats[(beat["role"], beat["instance"])] = beat

    def live_beats(self) -> list[dict]:
        horizon = time.time() - max(3 * self.settings.heartbeat_s, 3.0)
        return [b for b in self.beats.values() if b["ts"] >= horizon]

    def fleet(self) -> dict:
        beats = self.live_beats()
        out = {role: sum(1 for b in beats if b["role"] == role and b.get("ready")) for role in ROLES}
        served: dict[str, set] = {}
        for b in beats:
            if b["role"] == "inference":
                for name in b.get("models", []):
                    served.setdefault(name, set())
                for name in b.get("resident", []):
                    served.setdefault(name, set()).add(b["instance"])
        out["models"] = {name: sorted(insts) for name, insts in served.items()}
        return out

    def ready(self, default_model: str) -> tuple[bool, dict]:
        fleet = self.fleet()
        ok = all(fleet[r] > 0 for r in ROLES) and bool(fleet["models"].get(default_model))
        return ok, fleet

    async def publish(self, event) -> None:
        await jetstream.publish(self.js, event)

    async def history(self, request_id: str) -> list:
        """The request's output events already in the stream (for a retry that attaches late)."""
        return await read_events(self.js, f"{subjects.TOKENS}.*.{request_id}")

    async def cancel(self, request_id: str, conv_id: str, turn_id: int) -> None:
        with suppress(Exception):
            await self.publish(ChatCancelled(request_id=request_id, conv_id=conv_id, turn_id=turn_id))

    @asynccontextmanager
    async def follow(self, request_id: str) -> AsyncIterator[Follower]:
        """Subscribe to a request's live output; subscribe BEFORE publishing the request."""
        sub = await self.nc.subscribe(subjects.live_subject(request_id))
        try:
            yield Follower(self, request_id, sub)
        finally:
            with suppress(Exception):
                await sub.unsubscribe()


class Follower:
    """Yields a request's output events as they arrive, checking Redis now and then so a
    result whose live message was missed (the gateway attached late) is still found."""

    POLL_S = 0.5

    def __init__(self, pipeline: Pipeline, request_id: str, sub):
        self.pipeline, self.request_id, self.sub = pipeline, request_id, sub

    async def events(self, until: float, backlog: list = ()) -> AsyncIterator:
        for event in backlog:
            yield event
        while True:
            left = until - time.time()
            if left <= 0:
                return
            try:
                msg = await self.sub.next_msg(timeout=min(self.POLL_S, left))
                yield decode(msg.data)
            except TimeoutError:
                stored = await self.pipeline.store.get_result(self.request_id)
                if stored is not None:
                    yield decode(stored)
