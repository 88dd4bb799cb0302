"""The inference worker's asyncio side: jobs from pulled messages to terminal events.

A pulled message becomes a job: its model is pinned in the pool, its prompt queued in
that model's engine. Step outputs come back from the engine thread and are cut into
TokensGenerated chunks; the terminal event is published, and only then is the message
acked. Every publish carries a dedupe key, so a worker that regenerates a request after
another one crashed (deterministically: every request has a seed) cannot duplicate a
chunk or a terminal event in the stream.

Chunks go out two ways at once: live on core NATS (the request's live subject, which
the gateway holding the client follows) and durably to the stream without waiting for
each acknowledgement. A job's chunk acks are collected before its terminal event is
published (a chunk the stream did not confirm is published again), so the message is
still acked only once every event of the request is stored.

No job is held without a terminal event: every job leaves through exactly one terminal
(the engine's output, a failure at intake, or the watchdog, which fails jobs still open
a margin past their deadline, whatever lost them).

The service ties the worker's parts together: intake's checks (`intake.py`), the runner of
each model (`runners.factory`), the output processor (`outputs.py`), the outbox
(`outbox.py`) and the watchdog (`watchdog.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from consumers.inference.engine.batch import kv_room
from consumers.inference.engine_io import StepOutput
from consumers.inference.errors import RetryableError
from consumers.inference.llamacpp.build import LlamaServerMissing
from consumers.inference.metrics import METRICS
from consumers.inference.model_loading import LoadedModel, ModelSpec
from consumers.inference.runners.base import Runner
from consumers.inference.runners.factory import RunnerFactory, Runners
from consumers.inference.runners.process import START_TIMEOUT_S
from consumers.inference.worker import spans
from consumers.inference.worker.intake import Refused, check_speed, delivered, failure_of, gen_request
from consumers.inference.worker.jobs import Job
from consumers.inference.worker.outbox import Outbox
from consumers.inference.worker.outputs import OutputProcessor
from consumers.inference.worker.watchdog import Watchdog
from events.fleet import ModelLoad
from events.models import ChatFailed, PromptAccepted, SamplingParams, TokensGenerated
from runtime import tracing

log = logging.getLogger(__name__)

#: A chunk send or acknowledgement that failed: the chunk is published again, awaited.
#: A redelivery that arrives while its first delivery is still being given back (its
#: engine lost it, a moment ago) comes again after this long, when the first is gone.
GIVEN_BACK_RETRY_S = 0.5
#: How long a cancel of a request not held here is remembered: past the longest deadline
#: a gateway gives (120 s), when the request is refused unrun anyway.
CALLED_OFF_KEEP_S = 180.0


class InferenceService:
    def __init__(
        self,
        settings,
        pool,
        publish,
        watchdog_margin_s: float = 2.0,
        watchdog_period_s: float = 0.5,
        *,
        recorded: Callable[[str], Awaitable[list]] | None = None,
        publish_nowait: Callable[..., Awaitable[Awaitable]] | None = None,
        live: Callable[[str, bytes], Awaitable[None]] | None = None,
    ):
        """``publish``: async (event, raw=None) -> None once stored, with dedupe keys.
        ``publish_nowait``: the same, returning the acknowledgement to await later
        (default: ``publish`` in a task). ``live``: async (subject, raw) -> None on core
        NATS for the request's live subject (None: output reaches gateways through delivery only).
        ``watchdog_margin_s``: how long past its deadline a job may stay open before the
        watchdog fails it (the engine itself ends a request at its deadline; the audit
        calls a terminal missing 5 s past it). ``watchdog_period_s``: how often it looks.
        ``recorded``: a request's output events in the stream (chunks, terminal), read
        when a message comes back from another worker, to continue where it was."""
        self.settings = settings
        #: How every model engine runs, wherever it steps (a process or a thread).
        self.engine_config = settings.engine_config()
        self.pool = pool
        self.publish = publish
        self.recorded = recorded
        self.jobs: dict[str, Job] = {}
        #: Cancels of requests not held here (yet), by when they came: a battle's other
        #: side is called off when its pair is refused, often before this worker fetched
        #: it; it ends as cancelled when it comes, without running.
        self.called_off: dict[str, float] = {}
        self.holding: dict[int, Msg] = {}  # pulled, not yet jobs (Msg is not hashable)
        self.runners = Runners()  # the engines' runners (built once started)
        self.outbox = Outbox(publish, self._release, publish_nowait, live)
        self.outputs = OutputProcessor(self.jobs, self.outbox, settings.chunk_tokens)
        self.watchdog = Watchdog(self.jobs, self.outbox, self.prune_runners, watchdog_margin_s, watchdog_period_s)
        self._room = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.runners.factory = RunnerFactory(self.engine_config, self.loop, self.on_outputs, reload=self._reload)
        self._tasks = [
            asyncio.create_task(self.outbox.run()),
            asyncio.create_task(self._keepalive()),
            asyncio.create_task(self.watchdog.run()),
        ]

    async def stop(self) -> None:
        for runner in self.runners.values():
            runner.stop()
        for task in self._tasks:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
        await self.outbox.stop()

    async def drain(self, grace_s: float) -> int:
        """Finish held jobs within `grace_s`; give back (nak) the rest. Returns how many were naked."""
        end = time.monotonic() + grace_s
        while self.jobs and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await self.outbox.join()
        left = list(self.jobs.values())
        for job in left:
            job.runner.cancel(job.event.request_id)
            with suppress(Exception):
                await job.msg.nak()
            self.jobs.pop(job.event.request_id, None)
            await job.pin.aclose()
            tracing.end(job.span, "given back at drain")
        return len(left)

    # ---- intake --------------------------------------------------------------------

    @asynccontextmanager
    async def held(self, msg: Msg) -> AsyncIterator[None]:
        """A pulled message not yet a job (waiting for room, its model loading) is kept
        alive too: AckWait is short, so a dead worker's work moves on quickly, and a
        live one must not lose what it is about to start."""
        self.holding[id(msg)] = msg
        try:
            yield
        finally:
            self.holding.pop(id(msg), None)

    def held_messages(self) -> list[Msg]:
        """Every message this worker holds: its jobs', and those waiting to become one."""
        return [job.msg for job in self.jobs.values()] + list(self.holding.values())

    def ack_subjects(self) -> list[str]:
        """The ack subjects of the held messages: heartbeats carry them, so `arena up` can
        nak them the moment this process dies instead of leaving them to their AckWait
        (infra.takeover)."""
        return [m.reply for m in self.held_messages() if m.reply]

    def token_rooms(self) -> dict[str, int]:
        """What the heartbeats tell the gateway each model can take a request of (prompt
        and completion): its context, or for a resident model what the KV budget holds."""
        rooms = {}
        for name, context in self.pool.contexts().items():
            loaded = self.pool.resident_model(name)
            rooms[name] = (
                min(context, kv_room(loaded, self.engine_config.kv_budget_bytes) or context) if loaded else context
            )
        return rooms

    def limit(self) -> int:
        """Hold no more than two batches' worth, so other workers get the rest."""
        return 2 * self.settings.max_batch_size

    def room(self) -> int:
        """How many messages the next fetch may take: the room left under the limit, at
        most a batch's worth (the pull loop takes at least one, which waits for room)."""
        return min(self.settings.max_batch_size, self.limit() - len(self.jobs) - len(self.holding))

    async def wait_for_room(self) -> None:
        async with self._room:
            await self._room.wait_for(lambda: len(self.jobs) < self.limit())

    async def submit(self, event: PromptAccepted, msg) -> None:
        """Make the message a job, or fail it at once; both inside its trace."""
        if self.called_off.pop(event.request_id, None) is not None:  # called off before it came
            await self._fail(event, msg, "cancelled", "generation ended: cancelled before it started")
            return
        span = tracing.start("inference", msg.headers, request_id=event.request_id, model=event.model)
        with tracing.within(span):
            await self._submit(event, msg, span)
        job = self.jobs.get(event.request_id)
        if job is None or job.span is not span:  # no job of its own: it ended here
            tracing.end(span)

    async def _submit(self, event: PromptAccepted, msg, span: Span | None) -> None:
        rid = event.request_id
        if msg.metadata.num_delivered > 1:
            METRICS.redeliveries.inc()
        if (held := self.jobs.get(rid)) is not None:  # redelivered while still running here: keep the first
            if held.closed:  # ... unless the first is being given back right now: this one comes again
                await msg.nak(delay=GIVEN_BACK_RETRY_S)
            return
        if time.time() >= event.deadline_at:
            METRICS.deadline_misses.labels(event.model).inc()
            await self._fail(event, msg, "deadline_exceeded", "the request's deadline passed before it was computed")
            return
        try:
            params = event.params.checked()
        except ValueError as exc:  # the gateway validates these; a message from elsewhere may not be
            await self._fail(event, msg, "internal_error", f"sampling parameters cannot be served: {exc}")
            return
        chunks: list[TokensGenerated] = []
        if msg.metadata.num_delivered > 1:  # another worker had it: continue where it was
            chunks, terminal = await delivered(self.recorded, rid)
            if terminal is not None:  # it even ended; only its ack was lost
                await msg.ack_sync()
                log.info("already answered (%s) by the worker that died", terminal.type, extra={"request_id": rid})
                return
        pin = AsyncExitStack()
        try:
            await self._start(event, msg, span, params, chunks, pin)
        except RetryableError as exc:
            await self._drop(rid, pin)
            log.warning("retrying later: %s", exc, extra={"request_id": rid})
            await msg.nak(delay=1.0)
        except Exception as exc:  # noqa: BLE001 - each becomes the request's failure; a bug is logged there
            await self._drop(rid, pin)
            code, message = failure_of(exc, rid)
            await self._fail(event, msg, code, message, exc.retry_after_s if isinstance(exc, Refused) else None)

    async def _start(
        self,
        event: PromptAccepted,
        msg: Msg,
        span: Span | None,
        params: SamplingParams,
        chunks: list[TokensGenerated],
        pin: AsyncExitStack,
    ) -> None:
        """Load the model (held by `pin` while the job lives), check the request against
        it and its engine's speed (intake.py), and add it to the engine as a job; Refused
        when it cannot be served, as the errors of consumers.inference.errors say."""
        loaded = await pin.enter_async_context(self.pool.use(event.model))
        gen = gen_request(event, loaded, params, chunks, self.engine_config.kv_budget_bytes)
        runner = self._runner_for(loaded)
        check_speed(event, gen, runner, first_delivery=msg.metadata.num_delivered == 1)
        job = self.jobs[event.request_id] = Job(event, msg, runner, pin, span=span, gen=gen)
        if chunks:
            job.seq, job.generated, job.text = len(chunks), len(gen.resume_ids), "".join(c.text for c in chunks)
            METRICS.resumed_tokens.inc(len(gen.resume_ids))
        runner.add(gen)
        if self.called_off.pop(event.request_id, None) is not None:  # while its model loaded
            runner.cancel(event.request_id)

    async def _drop(self, rid: str, pin: AsyncExitStack) -> None:
        self.jobs.pop(rid, None)
        await pin.aclose()

    def load(self) -> dict[str, ModelLoad]:
        """Per model: requests held, their remaining token budgets, and the engine's
        measured step times; heartbeats carry it to the gateways' admission control."""
        out: dict[str, ModelLoad] = {}
        for runner in self.runners.values():
            out[runner.name] = out.get(runner.name, ModelLoad()).plus(runner.load())
        tokens: dict[str, int] = {}
        for job in self.jobs.values():
            if job.runner.name in out and not job.closed:
                tokens[job.runner.name] = tokens.get(job.runner.name, 0) + max(
                    0, job.event.params.max_tokens - job.generated
                )
        return {name: load.model_copy(update={"tokens": tokens.get(name, 0)}) for name, load in out.items()}

    def unavailable(self) -> list[str]:
        """The models whose upstream's circuit is open: the heartbeat says so, and the
        gateways refuse them at once and the arena pairs them no more."""
        return sorted(r.name for r in self.runners.values() if not r.available())

    def cancel(self, request_id: str) -> None:
        if (job := self.jobs.get(request_id)) is not None:
            job.runner.cancel(request_id)
            return
        now = time.monotonic()
        self.called_off[request_id] = now
        for rid, at in list(self.called_off.items()):  # oldest first; none outlives a deadline
            if now - at < CALLED_OFF_KEEP_S:
                break
            del self.called_off[rid]

    async def warm(self, names: list[str]) -> None:
        """Load ``names`` and start their engines, so that the first request (one handed
        on from a worker that died, say) waits for neither."""
        for name in names:
            async with self.pool.use(name) as loaded:
                try:
                    runner = self._runner_for(loaded)
                except LlamaServerMissing as exc:  # its requests fail saying so; the others serve
                    log.error("%s: %s", name, exc)
                    continue
            await asyncio.to_thread(runner.wait_ready, START_TIMEOUT_S)

    def _runner_for(self, loaded: LoadedModel) -> Runner:
        return self.runners.get(loaded)

    def _reload(self, spec: ModelSpec, version: int) -> LoadedModel:
        """The same model loaded again (the pool's loader), for an engine process's refill."""
        return self.pool.loader(spec, version)

    # ---- outputs (called on the loop by the engine thread) ---------------------------

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        """The engines' outputs, on the loop: chunks and terminal events into the outbox."""
        self.outputs.on_outputs(outputs)

    async def _fail(self, event, msg, code: str, message: str, retry_after_s: int | None = None) -> None:
        """A permanent failure: publish ChatFailed, then terminate the message (no redelivery)."""
        ids = dict(request_id=event.request_id, conv_id=event.conv_id, turn_id=event.turn_id)
        await self.publish(ChatFailed(**ids, code=code, message=message, retry_after_s=retry_after_s))
        await msg.term()
        log.info("failed: %s", code, extra={"request_id": event.request_id, "model": event.model})

    # ---- background tasks ------------------------------------------------------------

    async def _release(self, job: Job) -> None:
        if self.jobs.get(job.event.request_id) is job:
            del self.jobs[job.event.request_id]
        await job.pin.aclose()
        spans.record(job, time.time())
        async with self._room:
            self._room.notify_all()

    async def _keepalive(self) -> None:
        """In-progress acks, so AckWait does not expire during a long generation."""
        period = self.settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for msg in self.held_messages():
                with suppress(Exception):
                    await msg.in_progress()

    def prune_runners(self) -> list[Runner]:
        """Take out the runners of model versions the pool let go (evicted, or replaced
        and no longer borrowed), for the caller to stop: a runner holds its engine, the
        engine its weights (and an engine process its own copy), so the pool's eviction
        frees nothing while the runner stays."""
        return self.runners.prune(self.pool.holds)
