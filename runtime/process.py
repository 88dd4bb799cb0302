"""What every consumer process shares: its one NATS connection, heartbeats, readiness,
and the lifecycle `serve` runs (start in order, wait for SIGTERM or SIGINT, drain in
the reverse order).

A consumer process opens one NATS connection (`ProcessRuntime`): it publishes, pulls
its durable, subscribes (cancels, hot swap) and sends heartbeats on it. The lifecycle:

    start:  /healthz answers -> connect, topology in place, heartbeats
            -> the process's own lifespan is entered (Redis checked, models warmed,
               a projection rebuilt...) -> pulling starts -> ready
    stop:   not ready -> pulling stops (what was fetched and not started is naked)
            -> the lifespan exits (inference drains what it holds) -> the connection
            drains -> the endpoint stops
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, suppress
from typing import Any, TypeVar

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
E = TypeVar("E", bound=EventBase)

UNDECODABLE = Counter(
    "arena_undecodable_messages_total", "Stream messages that were no known event, terminated", ["role"]
)
REDELIVERED = Counter(
    "arena_redelivered_messages_total", "Stream messages delivered again (a consumer died or nak'ed)", ["role"]
)


class ProcessRuntime:
    """The process's one NATS connection (publishing, pulling, subscriptions, heartbeats)
    and its /healthz, /readyz and /metrics endpoint."""

    def __init__(self, role: str, settings, describe: Callable[[ProcessBeat], ProcessBeat] | None = None):
        self.role = role
        self.settings = settings
        #: Makes the role's own beat from what every process says (`events.fleet`).
        self.describe = describe or (lambda beat: beat)
        self.nc: nats.NATS | None = None
        self.js: JetStreamContext | None = None
        self._beat: asyncio.Task | None = None
        self._beat_soon = asyncio.Event()  # set: the next heartbeat goes now (beat_now)
        self.ready = False
        self.endpoint = ProcessEndpoint(
            role,
            lambda: self.ready and self.nc is not None and self.nc.is_connected,
            settings.http_host,
            settings.metrics_port,
            settings.metrics_fd,
        )

    async def start(self) -> None:
        tracing.setup(self.settings, self.role)
        await self.endpoint.start()  # /healthz answers while the rest starts (slow model loads)
        options = jetstream.connect_options(self.settings)
        self.nc = nc = await jetstream.connect(self.settings.nats_url, f"arena-{self.role}", **options)
        self.js = js = jetstream.context(nc)
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
            self._beat_soon.clear()
            with suppress(TimeoutError):
                await asyncio.wait_for(self._beat_soon.wait(), self.settings.heartbeat_s)

    def beat_now(self) -> None:
        """Send the next heartbeat now rather than at its period (calls before it goes are
        one beat): an inference worker's beat lists the messages it holds, and `arena up`
        naks those the moment it dies; one pulled since the last beat waited out its AckWait."""
        self._beat_soon.set()

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


#: A process's own start and drain around the pull loop: entered once the connection and
#: the topology are there, exited once pulling has stopped (FastStream's, FastAPI's lifespan).
Lifespan = Callable[["ProcessRuntime"], AbstractAsyncContextManager[None]]


class Process:
    """One consumer process: its runtime (connection, heartbeats, endpoint), its own
    `lifespan`, and the durable `consumer` it pulls (see the module doc for the order)."""

    def __init__(
        self, runtime: ProcessRuntime, consumer: DurableConsumer | None = None, lifespan: Lifespan | None = None
    ):
        self.runtime, self.consumer, self.lifespan = runtime, consumer, lifespan
        self._exits = AsyncExitStack()

    async def start(self) -> None:
        """Everything up to ready; what started is stopped by `stop()` even if this fails half way."""
        runtime = self.runtime
        self._exits.push_async_callback(runtime.stop)
        await runtime.start()
        if self.lifespan is not None:
            await self._exits.enter_async_context(self.lifespan(runtime))
        heap.freeze()  # startup's objects out of the collector (inference: torch and the warm models, 280 ms a walk)
        if self.consumer is not None:
            assert runtime.js is not None
            self._exits.push_async_callback(self.consumer.stop)
            await self.consumer.start(runtime.js)
        runtime.ready = True
        log.info("%s ready", runtime.role)

    async def stop(self) -> None:
        """Not ready, then every started part stopped in the reverse of its start."""
        self.runtime.ready = False
        await self._exits.aclose()

    async def run(self) -> None:
        """Start, serve until SIGTERM or SIGINT (one that comes during a slow start cuts
        it short), then stop."""
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        starting = asyncio.create_task(self.start())
        waiting = asyncio.create_task(stopping.wait())
        try:
            done, _ = await asyncio.wait({starting, waiting}, return_when=asyncio.FIRST_COMPLETED)
            if starting in done:
                starting.result()  # a failed start raises here, after the stop below
                await waiting
            log.info("%s stopping", self.runtime.role)
        finally:
            starting.cancel()
            waiting.cancel()
            await asyncio.gather(starting, waiting, return_exceptions=True)
            await self.stop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)


def serve(process: Process) -> None:
    """Run a consumer process until it is told to stop (`arena run ROLE`)."""
    asyncio.run(process.run())


async def decode_or_term(role: str, raw: Msg, reads: type[E] | tuple[type[E], ...]) -> E | None:
    """The message's event, typed as what the role reads (``reads``: its events in the
    topology, or their base), or None after terminating a message that is no such event.

    One policy for every consumer: a message that is no known event, or an event its
    role does not read, fails the same way on every redelivery, so it is terminated at
    once (logged and counted), never redelivered."""
    if _delivered(raw) > 1:
        REDELIVERED.labels(role).inc()
    try:
        event = decode(raw.data)
    except ValueError as exc:
        why = str(exc)[:200]
    else:
        if isinstance(event, reads):
            return event
        why = f"{event.type} is no event {role} reads"
    UNDECODABLE.labels(role).inc()
    log.error("undecodable message on %s terminated: %s", raw.subject, why)
    await raw.term()
    return None


def _delivered(raw) -> int:
    """How often the stream has delivered this message (1 for a message that is not a
    JetStream delivery, e.g. in a test)."""
    try:
        return raw.metadata.num_delivered
    except (AttributeError, TypeError, NatsError):
        return 1
