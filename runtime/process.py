"""What every consumer process shares: a management connection and heartbeats."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from prometheus_client import Counter

from events import decode, subjects, topology
from events.fleet import ProcessBeat, encode_beat
from events.models import EventBase
from runtime import heap, jetstream, tracing
from runtime.consume import DurableConsumer
from runtime.http import ProcessEndpoint
from runtime.stream import read_events

log = logging.getLogger(__name__)

#: Publishes an event with its dedupe key (`ProcessRuntime.publish`).
Publish = Callable[[EventBase], Awaitable[None]]

UNDECODABLE = Counter(
    "arena_undecodable_messages_total", "Stream messages that were no known event, terminated", ["role"]
)
REDELIVERED = Counter(
    "arena_redelivered_messages_total", "Stream messages delivered again (a consumer died or nak'ed)", ["role"]
)


class ProcessRuntime:
    """A NATS connection for publishing and heartbeats, opened before the broker subscribes."""

    def __init__(self, role: str, settings, describe: Callable[[ProcessBeat], ProcessBeat] | None = None):
        self.role = role
        self.settings = settings
        #: Makes the role's own beat from what every process says (`events.fleet`).
        self.describe = describe or (lambda beat: beat)
        self.nc: nats.NATS | None = None
        self.js: JetStreamContext | None = None
        self._beat: asyncio.Task | None = None
        self.ready = False
        self.endpoint = ProcessEndpoint(
            role,
            lambda: self.ready and self.nc is not None and self.nc.is_connected,
            settings.http_host,
            settings.metrics_port,
        )

    async def start(self) -> None:
        tracing.setup(self.settings, self.role)
        await self.endpoint.start()  # /healthz answers while the rest starts (slow model loads)
        options = jetstream.connect_options(self.settings)
        self.nc = nc = await jetstream.connect(self.settings.nats_url, f"arena-{self.role}", **options)
        self.js = js = nc.jetstream()
        await jetstream.prepare_topology(js, self.settings, topology.role(self.role).durable)
        self._beat = asyncio.create_task(self._heartbeats())

    async def _heartbeats(self) -> None:
        subject = subjects.heartbeat_subject(self.role, self.settings.instance_id.replace(".", "_"))
        while True:
            beat = ProcessBeat(
                role=self.role,
                instance=self.settings.instance_id,
                ready=self.ready,
                ts=time.time(),
                pid=os.getpid(),
                metrics_port=self.endpoint.port,
            )
            raw = encode_beat(self.describe(beat))
            with suppress(Exception):  # a heartbeat lost in a reconnect is replaced by the next
                await self.connection().publish(subject, raw)
            await asyncio.sleep(self.settings.heartbeat_s)

    def connection(self) -> nats.NATS:
        assert self.nc is not None, "start() the runtime first"
        return self.nc

    async def recorded(self, request_id: str) -> list[Any]:
        """A request's output events as the stream holds them (chunks, terminal)."""
        assert self.js is not None, "start() the runtime first"
        return await read_events(self.js, subjects.output_filter(request_id), timeout=2.0)

    async def publish(self, event: EventBase, raw: bytes | None = None) -> None:
        assert self.js is not None, "start() the runtime first"
        await jetstream.publish(self.js, event, raw)

    async def publish_nowait(self, event: EventBase, raw: bytes | None = None) -> asyncio.Future:
        """Send without waiting for the stream's ack; await the result for it (see `jetstream.publish_nowait`)."""
        assert self.js is not None, "start() the runtime first"
        return await jetstream.publish_nowait(self.js, event, raw)

    async def publish_live(self, subject: str, raw: bytes) -> None:
        """Core NATS, not stored: the live copy of an event for whoever follows it now
        (with the current span's trace context, as the stored copy has)."""
        await self.connection().publish(subject, raw, headers=tracing.headers())

    async def stop(self) -> None:
        if self._beat:
            self._beat.cancel()
            with suppress(asyncio.CancelledError):
                await self._beat
        if self.nc and not self.nc.is_closed:
            await self.nc.drain()
        await self.endpoint.stop()
        tracing.shutdown()


def wire_lifecycle(
    app, runtime: ProcessRuntime, consumer: DurableConsumer | None = None, before=None, after_stop=None
) -> None:
    """Start the runtime (topology, heartbeats), then the durable `consumer`'s pulls, and
    report ready; on shutdown stop pulling (what was fetched and not started is naked),
    then the runtime. `before` / `after_stop` are extra async steps."""

    @app.on_startup
    async def _start() -> None:
        if before:
            await before()
        await runtime.start()

    @app.after_startup
    async def _ready() -> None:
        heap.freeze()
        if consumer is not None:
            assert runtime.js is not None
            await consumer.start(runtime.js)
        runtime.ready = True

    @app.on_shutdown
    async def _stop() -> None:
        runtime.ready = False
        if consumer is not None:
            await consumer.stop()
        await runtime.stop()
        if after_stop:
            await after_stop()


async def decode_or_term(role: str, raw: Msg) -> Any:
    """The message's event, or None after terminating a message that is no known event.

    One policy for every consumer: such a message fails the same way on every
    redelivery, so it is terminated at once (logged and counted), never redelivered."""
    if _delivered(raw) > 1:
        REDELIVERED.labels(role).inc()
    try:
        return decode(raw.data)
    except ValueError as exc:
        UNDECODABLE.labels(role).inc()
        log.error("undecodable message on %s terminated: %s", raw.subject, str(exc)[:200])
        await raw.term()
        return None


def _delivered(raw) -> int:
    """How often the stream has delivered this message (1 for a message that is not a
    JetStream delivery, e.g. in a test)."""
    try:
        return raw.metadata.num_delivered
    except (AttributeError, TypeError, NatsError):
        return 1
