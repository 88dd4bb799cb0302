"""The gateway's side of the event pipeline: publishing requests, following their output,
and knowing which processes are alive (from their heartbeats).

This is the boundary the HTTP and WebSocket layers talk to; tests of those layers pass
a fake with the same methods (`tests/unit/fake_pipeline.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import suppress
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from events import decode, subjects, topology
from events.fleet import InferenceBeat, ProcessBeat, decode_beat
from events.models import ChatCancelled, EventBase, RequestEvent, Terminal, TokensGenerated
from events.readmodel import ReadModel
from gateway.admission.estimate import ModelQueue, StreamState
from gateway.admission.queues import model_queue
from gateway.assembler import Assembler
from gateway.errors import APIError
from gateway.fleet_view import FleetView
from gateway.keys import GatewayKeys
from gateway.metrics import METRICS
from gateway.settings import GatewaySettings
from runtime import jetstream
from runtime.jetstream import NATS_DOWN
from runtime.recovery import recover_request
from runtime.redis import redis_client
from runtime.stream import conversation_events, read_events

log = logging.getLogger(__name__)

#: Live silence after which the stream is read for output that did not come live
#: (doubling up to QUIET_MAX_S while the request stays silent).
QUIET_S = 2.0
QUIET_MAX_S = 8.0
#: How long a publish is retried while NATS is unreachable, at most (and never past the
#: request's deadline). Long enough to ride out a stream leader's election when a
#: cluster node dies (raft's election timeout is 4-9 s in nats-server).
PUBLISH_RETRY_S = 10.0
#: How often the consumers' state is read for admission control while the pipeline holds
#: a request or this gateway published one within STREAM_BUSY_S.
STREAM_POLL_S = 0.25
STREAM_BUSY_S = 5.0
#: How often it is read while the pipeline is idle (a publish of this gateway's reads it
#: at once). Read every 0.25 s, an idle `arena up`'s gateway spent 0.7% of a core on the
#: reads alone (and nats-server as much answering them), taken from a model server's
#: cores between its steps.
STREAM_IDLE_POLL_S = 1.0


def stream_unavailable() -> APIError:
    return APIError(
        503, "the event stream is unavailable; retry shortly", "stream_unavailable", headers={"Retry-After": "2"}
    )


#: Stream reads for ids Redis does not know: at most this many at once, and an id found
#: nowhere is answered from memory for a while (up to so many ids).
RECOVERIES_AT_ONCE, NOT_IN_STREAM_S, NOT_IN_STREAM_MAX = 4, 30.0, 10_000


class Pipeline:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.nc: nats.NATS | None = None
        self.js: Any = None
        redis = redis_client(settings.redis_url)
        self.results = ReadModel(redis, settings.result_ttl_s)
        self.keys = GatewayKeys(redis, settings.result_ttl_s)
        #: Admission's batched fleet-wide check alone (admission.FleetAdmissions).
        self.admission_redis = redis_client(settings.redis_url, max_connections=2)
        self.beats: dict[tuple[str, str], ProcessBeat] = {}
        #: When this gateway began to hear heartbeats (None: not yet).
        self.listening_since: float | None = None
        #: The consumers' state (requests ahead of and held by the inference workers).
        self.stream_state = StreamState()
        #: When this gateway last published a request, and the watcher's wake-up for it.
        self._published_at = 0.0
        self._published = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        #: Ids a stream read found nothing for, until when (a probe of random ids must not
        #: cost a JetStream read each), and a bound on reads running at once.
        self._not_in_stream: OrderedDict[str, float] = OrderedDict()
        self._recoveries = asyncio.Semaphore(RECOVERIES_AT_ONCE)
        #: The requests' live subjects followed now, told when the connection is back.
        self._following: weakref.WeakSet[LiveSub] = weakref.WeakSet()

    async def start(self) -> None:
        options = jetstream.connect_options(self.settings)
        self.nc = await jetstream.connect(
            self.settings.nats_url, "arena-gateway", reconnected_cb=self._reconnected, **options
        )
        self.js = jetstream.context(self.nc)
        await jetstream.prepare_topology(self.js, self.settings)
        await self.nc.subscribe(f"{subjects.HEARTBEAT_PREFIX}.>", cb=self._on_beat)
        self.listening_since = time.time()
        self._tasks.append(asyncio.create_task(self._watch_stream()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.nc and not self.nc.is_closed:
            await self.nc.drain()
        await self.results.redis.aclose()
        await self.admission_redis.aclose()

    # ---- the fleet, from heartbeats --------------------------------------------------

    async def _on_beat(self, msg) -> None:
        with suppress(ValueError):
            beat = decode_beat(msg.data)
            self.beats[(beat.role, beat.instance)] = beat

    def beat_horizon(self) -> float:
        """Seconds a process's last heartbeat counts for."""
        return max(3 * self.settings.heartbeat_s, 3.0)

    def live_beats(self) -> list[ProcessBeat]:
        horizon = time.time() - self.beat_horizon()
        return [b for b in self.beats.values() if b.ts >= horizon]

    async def heard_fleet(self) -> None:
        """While this gateway is younger than a heartbeat's horizon and has heard no
        inference worker, wait for one to beat: a request sent as the gateway starts (a
        client reconnecting across its restart, which waited in the listening socket's
        backlog) is not told that no worker is connected before the workers, beating every
        `heartbeat_s`, could have said otherwise."""
        if self.fleet().count(topology.INFERENCE.name) or self.listening_since is None:
            return
        until = self.listening_since + self.beat_horizon()
        while not self.fleet().count(topology.INFERENCE.name) and time.time() < until:
            await asyncio.sleep(0.05)

    def workers(self) -> list[InferenceBeat]:
        """The live inference workers' beats."""
        return [b for b in self.live_beats() if isinstance(b, InferenceBeat)]

    def fleet(self) -> FleetView:
        """Ready processes per role, and which inference instances hold each model."""
        beats = self.live_beats()
        roles = [r.name for r in topology.ROLES if r.name != topology.GATEWAY.name]
        ready = {role: sum(1 for b in beats if b.role == role and b.ready) for role in roles}
        served: dict[str, set] = {}
        loading: dict[str, set] = {}
        unavailable: dict[str, set] = {}
        for b in beats:
            if isinstance(b, InferenceBeat):
                for name in b.models:
                    served.setdefault(name, set())
                for name in b.resident:
                    served.setdefault(name, set()).add(b.instance)
                for name in b.loading:
                    loading.setdefault(name, set()).add(b.instance)
                for name in b.unavailable:
                    unavailable.setdefault(name, set()).add(b.instance)
        return FleetView(
            ready,
            models={name: sorted(insts) for name, insts in served.items()},
            loading={name: sorted(insts) for name, insts in loading.items()},
            unavailable={name: sorted(insts) for name, insts in unavailable.items()},
        )

    def context_len(self, model: str) -> int | None:
        """The model's context in tokens (prompt and completion), as the workers listing
        it report it (from its config, or as loaded); None until one does."""
        lens = [b.context[model] for b in self.workers() if model in b.context]
        return min(lens) if lens else None

    async def _watch_stream(self) -> None:
        """Poll the consumers' state: the requests still ahead of the inference workers
        (being filtered, or waiting in the stream for a worker to pull them), and those
        they hold. Every STREAM_POLL_S while any is in the pipeline or this gateway
        published one lately; else every STREAM_IDLE_POLL_S, and at once after a publish
        (another gateway's admissions count as ahead until a read shows them, so a later
        read only counts them longer)."""
        while True:
            self._published.clear()
            with suppress(*NATS_DOWN):
                started = time.time()
                filt = await self.js.consumer_info(subjects.STREAM, topology.FILTER.durable)
                inf = await self.js.consumer_info(subjects.STREAM, topology.INFERENCE.durable)
                ahead = filt.num_pending + filt.num_ack_pending + inf.num_pending
                self.stream_state = StreamState(ahead, inf.num_ack_pending, started)
            state = self.stream_state
            if state.ahead or state.held or time.time() - self._published_at < STREAM_BUSY_S:
                await asyncio.sleep(STREAM_POLL_S)
            else:
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._published.wait(), STREAM_IDLE_POLL_S)

    def queue(self, model: str) -> ModelQueue:
        """The model's queue as its workers' heartbeats report it (gateway.admission.queues)."""
        return model_queue(model, self.live_beats(), self.beats.values(), time.time())

    def ready(self, default_model: str) -> tuple[bool, FleetView]:
        fleet = self.fleet()
        ok = all(fleet.count(r) > 0 for r in topology.required()) and bool(fleet.models.get(default_model))
        return ok, fleet

    # ---- the stream ------------------------------------------------------------------

    async def publish(self, event: RequestEvent, until: float | None = None) -> None:
        """Publish an event, retrying while NATS is unreachable; 503 when it stays so.

        The dedupe key makes a retried publish safe: the server keeps one copy."""
        end = min(until or float("inf"), time.time() + PUBLISH_RETRY_S)
        delay = 0.1
        while True:
            try:
                await jetstream.publish(self.js, event)
                self._published_at = time.time()
                self._published.set()
                return
            except NATS_DOWN as exc:
                if time.time() + delay >= end:
                    log.warning("publish failed: %s", exc, extra={"request_id": event.request_id})
                    raise stream_unavailable() from exc
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    async def history(self, request_id: str) -> list[EventBase]:
        """The request's output events already in the stream (chunks and terminal), in order."""
        return await read_events(self.js, subjects.output_filter(request_id))

    async def recover(self, request_id: str) -> tuple[Terminal | None, dict | None]:
        """A request Redis has forgotten (its data lost), rebuilt from the stream:
        (terminal event or None, pending record or None). The gateway's own keys are
        refilled for a request still running; a result is delivery's to write (a finished
        one is read from the stream again, or refilled by `arena rebuild-readmodel`)."""
        now = time.monotonic()
        if self._not_in_stream.get(request_id, 0.0) > now:
            return None, None
        try:
            async with self._recoveries:
                terminal, record = await recover_request(self.js, self.results, request_id, results=False)
        except NATS_DOWN as exc:
            log.warning("cannot read the stream: %s", exc, extra={"request_id": request_id})
            return None, None
        if terminal is None and record is None:
            self._not_in_stream[request_id] = now + NOT_IN_STREAM_S
            self._not_in_stream.move_to_end(request_id)
            while len(self._not_in_stream) > NOT_IN_STREAM_MAX:
                self._not_in_stream.popitem(last=False)
        return terminal, record

    async def conversation(self, conv_id: str) -> list[EventBase]:
        return await conversation_events(self.js, conv_id)

    async def cancel(self, request_id: str, conv_id: str, turn_id: int) -> None:
        """Tell inference to stop a request whose client went away (best effort, logged)."""
        try:
            await self.publish(ChatCancelled(request_id=request_id, conv_id=conv_id, turn_id=turn_id))
        except APIError:
            log.warning("could not publish the cancellation", extra={"request_id": request_id})

    async def subscribe(self, request_id: str) -> LiveSub:
        """Subscribe to a request's live output; do it BEFORE publishing the request."""
        assert self.nc is not None
        live = LiveSub()
        live.sub = await self.nc.subscribe(subjects.live_subject(request_id), cb=live.put)
        self._following.add(live)
        return live

    async def _reconnected(self) -> None:
        """Back on NATS after a loss (its server restarted): what was sent live while this
        gateway was away is lost to it (workers that reconnected first sent what they had
        buffered then), and in the stream; every request followed reads it there."""
        for live in list(self._following):
            live.reconnected()

    def output(self, request_id: str, until: float, *, after_seq: int = -1, replay: bool = False) -> Output:
        return Output(self, request_id, until, after_seq=after_seq, replay=replay)


#: What a request's live subject brings: a live message, the events a stream read found
#: (`LiveSub.stored`), or None: the connection is back after a loss.
Arrival = Msg | list[EventBase] | None


class LiveSub:
    """A request's live subject, read with a timeout: the subscription's callback queues
    each message, and a read takes one at once when one is there. (nats-py's `next_msg`
    starts two tasks and draws a UUID for every message: for a stream of chunks, a
    share of the gateway's work per token.) Stream reads done beside it come through
    the same queue (`Arrival`)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Arrival] = asyncio.Queue()
        self.sub: Subscription | None = None

    async def put(self, msg: Msg) -> None:
        self.queue.put_nowait(msg)

    def stored(self, events: list[EventBase]) -> None:
        """A stream read's events, taken in turn with the live messages."""
        self.queue.put_nowait(events)

    def reconnected(self) -> None:
        """The connection is back after a loss: messages may have been lost (None)."""
        self.queue.put_nowait(None)

    async def next_msg(self, timeout: float) -> Arrival:
        """The next arrival; TimeoutError when none comes within `timeout` seconds."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        async with asyncio.timeout(timeout):
            return await self.queue.get()

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            await self.sub.unsubscribe()


class Output:
    """One request's output in order: iterate its chunks (each once, in sequence), then
    read `terminal` (None when the deadline passed first).

    Live messages come from delivery's fan-out; anything that did not come live (a retry
    or a resume attaching late, chunks still inside delivery when the terminal overtook
    them, a message lost in a reconnect) is read from the stream, which holds it all.
    `open()` subscribes, so it must run before the request is published."""

    def __init__(self, pipeline: Pipeline, request_id: str, until: float, *, after_seq: int = -1, replay: bool = False):
        self.pipeline, self.request_id, self.until = pipeline, request_id, until
        self.after_seq, self.replay = after_seq, replay
        self.assembler = Assembler()
        self.sub: LiveSub | None = None
        self._reading: asyncio.Task | None = None  # a stream read beside the live subject
        self._held = False  # chunks are held behind a missing one

    @property
    def terminal(self) -> Terminal | None:
        return self.assembler.terminal

    def remainder(self) -> str:
        """Completed text no chunk carried (only if the stream lost chunks)."""
        return self.assembler.remainder()

    async def open(self) -> Output:
        self.sub = await self.pipeline.subscribe(self.request_id)
        return self

    async def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        if self.sub is not None:
            with suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None

    async def __aenter__(self) -> Output:
        return await self.open() if self.sub is None else self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _stored(self) -> list[EventBase]:
        try:
            return await self.pipeline.history(self.request_id)
        except NATS_DOWN as exc:
            log.warning("cannot read the stream: %s", exc, extra={"request_id": self.request_id})
            return []

    def _deliverable(self, events: list[EventBase]) -> list[TokensGenerated]:
        """The chunks these events make deliverable, in order, past the client's last seq."""
        return [c for e in events for c in self.assembler.add(e) if c.seq > self.after_seq]

    def _read_soon(self) -> None:
        """Read the stream beside the live subject (one read at a time): its events come
        in turn with the live messages, so a slow read (a NATS server that just restarted
        answers one in seconds) holds no live chunk back."""
        if self._reading is None or self._reading.done():
            self._reading = asyncio.create_task(self._read_into(self.sub))

    def _chase_gap(self) -> None:
        """A chunk came past one that is missing (lost live, as in a NATS restart): read
        the stream for it once, now; `QUIET_S` later again if it is still missing."""
        held = bool(self.assembler.pending)
        if held and not self._held:
            self._read_soon()
        self._held = held

    async def _read_into(self, sub: LiveSub | None) -> None:
        events = await self._stored()
        if sub is not None:
            sub.stored(events)

    async def __aiter__(self) -> AsyncIterator[TokensGenerated]:
        """Quiet is counted from the last chunk delivered, not the last message: chunks
        held behind a lost one (a NATS restart) are no progress. The stream is read for
        the missing one when the gap shows, and again once the request has been quiet
        that long."""
        asm = self.assembler
        incoming = await self._stored() if self.replay else []
        quiet, progress_at = QUIET_S, time.time()
        while True:
            delivered = self._deliverable(incoming)
            self._chase_gap()
            for chunk in delivered:
                yield chunk
            if delivered:
                quiet, progress_at = QUIET_S, time.time()
            if asm.terminal is not None:
                if not asm.done:  # the terminal overtook chunks: the stream has them all
                    for chunk in self._deliverable(await self._stored()):
                        yield chunk
                return
            left = self.until - time.time()
            if left <= 0:
                return
            if time.time() >= progress_at + quiet:
                self._read_soon()
                quiet, progress_at = min(quiet * 2, QUIET_MAX_S), time.time()
            incoming = await self._next(min(progress_at + quiet - time.time(), left))

    async def _next(self, timeout: float) -> list[EventBase]:
        """What arrives within `timeout` s: a live event, a stream read's events; nothing
        when nothing came. After a live message that is no event the stream is read (it
        has what was meant)."""
        assert self.sub is not None, "open() the output before iterating it"
        try:
            arrival = await self.sub.next_msg(timeout=timeout)
        except TimeoutError:
            return []
        if arrival is None:  # back after a loss: the stream has what was lost
            self._read_soon()
            return []
        if isinstance(arrival, list):
            return arrival
        try:
            return [decode(arrival.data)]
        except ValueError as exc:  # no event (a buggy or older publisher): the stream has what it meant
            METRICS.live_skipped.inc()
            log.warning("undecodable live message skipped: %s", str(exc)[:200], extra={"request_id": self.request_id})
            self._read_soon()
            return []
