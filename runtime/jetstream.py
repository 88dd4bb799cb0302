"""Creating the stream and the durable consumers, and publishing events.

Everything is declared explicitly and idempotently at start-up (never implicitly by a
first subscriber), so a consumer's ack deadline and bounds are what the code says.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections.abc import Awaitable, Callable

import nats
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError, ServiceUnavailableError

from events import encode, subjects, topology
from runtime import tracing

log = logging.getLogger(__name__)

#: What callers catch when NATS is unreachable: nats-py's errors (a closed or lost
#: connection, no responders, its own timeouts), a request that timed out, the socket.
#: The one definition, as runtime.redis.REDIS_DOWN is Redis's.
NATS_DOWN = (nats.errors.Error, TimeoutError, OSError)

DAY_S = 86_400


def servers(url: str) -> list[str]:
    """NATS_URL may list several servers (a cluster), comma-separated."""
    return [u.strip() for u in url.split(",") if u.strip()]


def stream_config(retention_days: float, replicas: int = 1) -> StreamConfig:
    return StreamConfig(
        name=subjects.STREAM,
        num_replicas=replicas,  # 3 on a cluster: the stream survives the loss of a node
        subjects=list(subjects.STREAM_SUBJECTS),
        # Limits retention: acked events stay, so any request can be replayed.
        retention=RetentionPolicy.LIMITS,
        max_age=retention_days * DAY_S,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=300.0,
    )


def consumer_configs(ack_wait_s: float = 30.0, max_ack_pending: int = 256) -> list[ConsumerConfig]:
    """One durable pull consumer per role in `events.topology` that reads one."""
    return [
        ConsumerConfig(
            durable_name=role.durable,
            filter_subject=None if role.filters else role.reads,
            filter_subjects=list(role.filters) or None,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW,
            ack_wait=role.ack_wait_s or ack_wait_s,
            max_deliver=role.max_deliver,
            max_ack_pending=max_ack_pending if role.bounded else None,
        )
        for role in topology.consumers()
    ]


async def ensure_topology(js: JetStreamContext, retention_days: float = 7.0, replicas: int = 1, **consumer_kw) -> None:
    """Create or update the stream and the durable consumers; safe to run from every process.

    A cluster that is still electing its JetStream leader answers 503 for a while: that is
    waited out (up to a minute), not fatal."""
    config = stream_config(retention_days, replicas)
    end = time.monotonic() + 60.0
    while True:
        try:
            try:
                await js.update_stream(config)
            except NotFoundError:
                await js.add_stream(config)
            break
        except (TimeoutError, ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
            if time.monotonic() > end:
                raise
            log.warning("JetStream not ready yet (%s); retrying", type(exc).__name__)
            await asyncio.sleep(0.5)
    for cc in consumer_configs(**consumer_kw):
        try:
            await js.add_consumer(subjects.STREAM, cc)
        except BadRequestError as exc:
            # Exists with other settings (e.g. an operator changed ack_wait): keep it, say so.
            log.warning("consumer %s kept as it is: %s", cc.durable_name, exc)


def connect_options(settings) -> dict:
    """nats-py connect arguments for a process's credentials and TLS (`CommonSettings`)."""
    options: dict = {}
    if settings.nats_user:
        options["user"] = settings.nats_user
        options["password"] = settings.nats_password.get_secret_value() if settings.nats_password else ""
    if settings.nats_tls_ca or settings.nats_tls_cert:
        context = ssl.create_default_context(cafile=settings.nats_tls_ca)
        if settings.nats_tls_cert:
            context.load_cert_chain(settings.nats_tls_cert, settings.nats_tls_key)
        options["tls"] = context
    return options


class ReplyLost(nats.errors.Error):
    """The connection a request or publish went out on was lost before its reply came."""

    def __str__(self) -> str:
        return "nats: connection lost before the reply came"


#: The JetStream contexts made on each connection (`context`), whose publish acks a lost
#: connection fails.
_CONTEXTS: weakref.WeakKeyDictionary[nats.NATS, list[JetStreamContext]] = weakref.WeakKeyDictionary()


async def connect(
    url: str, name: str, reconnected_cb: Callable[[], Awaitable[None]] | None = None, **options
) -> nats.NATS:
    """The one place a process connects to NATS; `options` from `connect_options`,
    `reconnected_cb` called when the connection is back after a loss.

    When the connection is lost, every reply still awaited on it (a request's, a
    JetStream publish's ack, an async publish's ack) is failed at once with `ReplyLost`
    (callers retry: the dedupe keys make a second publish safe). None of them can come:
    the server or the connection they were bound to is gone. Left to their timeouts,
    they cost a NATS restart of 0.7 s a PUBLISH_TIMEOUT_S more, once per waiter that
    waits in turn."""
    nc: nats.NATS | None = None
    lost_at = 0.0

    async def lost() -> None:
        nonlocal lost_at
        lost_at = time.monotonic()
        if nc is None:
            return
        failed = _fail_replies(nc)
        if not nc.is_closed:  # lost, not closed by the process
            log.warning("NATS connection lost; %d replies awaited on it failed, to be retried", failed)

    async def back() -> None:
        log.warning("NATS connection back after %.2f s", time.monotonic() - lost_at)
        if reconnected_cb is not None:
            await reconnected_cb()

    async def error(exc: Exception) -> None:
        # One line each: nats-py's default logs every refused reconnect attempt with its traceback.
        log.warning("NATS: %r", exc)

    nc = await nats.connect(
        servers(url),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        disconnected_cb=lost,
        reconnected_cb=back,
        error_cb=error,
        **options,
    )
    return nc


def context(nc: nats.NATS) -> JetStreamContext:
    """The connection's JetStream context; its publish acks fail with the connection (`connect`)."""
    js = nc.jetstream()
    _CONTEXTS.setdefault(nc, []).append(js)
    return js


def _fail_replies(nc: nats.NATS) -> int:
    """Fail the replies awaited on a lost connection (nats-py's own tables of them: it
    replays subscriptions and buffered publishes on the next connection, not these)."""
    waiting = list(nc._resp_map.values())
    for js in _CONTEXTS.get(nc, []):
        waiting += js._publish_async_futures.values()
    failed = 0
    for future in waiting:
        if not future.done():
            future.set_exception(ReplyLost())
            failed += 1
    return failed


async def prepare_topology(js: JetStreamContext, settings, durable: str | None = None) -> None:
    """Create the topology, or, where the operator owns it (`manage_topology` off), wait
    until the stream and the process's own durable exist."""
    if settings.manage_topology:
        await ensure_topology(js, settings.retention_days, **settings.topology())
        return
    while True:
        try:
            await js.stream_info(subjects.STREAM)
            if durable:
                await js.consumer_info(subjects.STREAM, durable)
            return
        except NotFoundError:
            log.warning("waiting for the operator to create the stream and consumer %s (arena topology)", durable)
            await asyncio.sleep(1.0)


#: How long a publish waits for the stream's acknowledgement. Short, because callers
#: retry (the dedupe key makes a retry safe): an ack lost when a node dies or a client
#: moves to another node costs this much, not nats-py's default of 5 s.
PUBLISH_TIMEOUT_S = 1.5


async def publish(js: JetStreamContext, event, raw: bytes | None = None) -> None:
    """Publish an event with its dedupe key, so a repeated publish is dropped by the server,
    and the current span's trace context (when tracing is on)."""
    await js.publish(
        subjects.subject_for(event),
        raw if raw is not None else encode(event),
        timeout=PUBLISH_TIMEOUT_S,
        headers=tracing.headers({"Nats-Msg-Id": subjects.dedupe_key(event)}),
    )


async def publish_nowait(js: JetStreamContext, event, raw: bytes | None = None) -> asyncio.Future:
    """Send an event with its dedupe key without waiting for the stream's acknowledgement.

    Returns the acknowledgement's future: await it with a timeout (PUBLISH_TIMEOUT_S),
    and publish again if it fails or times out (the dedupe key makes that safe). Many can
    be in flight at once, so a stream of chunks costs no round trip each."""
    return await js.publish_async(
        subjects.subject_for(event),
        raw if raw is not None else encode(event),
        headers=tracing.headers({"Nats-Msg-Id": subjects.dedupe_key(event)}),
    )
