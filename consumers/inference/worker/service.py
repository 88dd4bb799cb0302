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
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from nats.aio.msg import Msg
from opentelemetry.trace import Span

from consumers.inference.engine.batch import BatchEngine, check_kv, check_prompt, check_room, kv_room
from consumers.inference.engine.logprobs import spelled, speller
from consumers.inference.engine.sampling import SamplingParams as EngineParams
from consumers.inference.errors import (
    PermanentError,
    PromptTooLong,
    RetryableError,
    Unavailable,
    UnknownModel,
    Unsupported,
)
from consumers.inference.llamacpp.build import LlamaServerMissing, locate
from consumers.inference.llamacpp.engine import LlamaCppEngine
from consumers.inference.metrics import METRICS
from consumers.inference.models import encode_prompt, encode_text, machine, vocab_size, weights_nbytes
from consumers.inference.protocol import GenRequest, StepOutput
from consumers.inference.runners.cores import CoreShare, share_or_none, sizing
from consumers.inference.runners.process import START_TIMEOUT_S, ProcessRunner, shm_room
from consumers.inference.runners.thread import EngineRunner
from consumers.inference.upstream.engine import UpstreamEngine, upstream_request
from consumers.inference.worker import spans
from events import encode, subjects
from events.fleet import ModelLoad
from events.models import (
    ChatCompleted,
    ChatFailed,
    FailureCode,
    PromptAccepted,
    Terminal,
    Timings,
    TokensGenerated,
    Usage,
)
from runtime import tracing
from runtime.jetstream import NATS_DOWN, PUBLISH_TIMEOUT_S, ReplyLost
from runtime.steps import too_long_alone

log = logging.getLogger(__name__)

#: A chunk send or acknowledgement that failed: the chunk is published again, awaited.
#: A redelivery that arrives while its first delivery is still being given back (its
#: engine lost it, a moment ago) comes again after this long, when the first is gone.
GIVEN_BACK_RETRY_S = 0.5
#: How long a cancel of a request not held here is remembered: past the longest deadline
#: a gateway gives (120 s), when the request is refused unrun anyway.
CALLED_OFF_KEEP_S = 180.0
#: What steps a model's engine: a thread beside the loop, or a process of its own.
Runner = EngineRunner | ProcessRunner


@dataclass
class Job:
    event: PromptAccepted
    msg: Msg  # acked after the terminal event
    runner: Runner
    pin: AsyncExitStack
    started_at: float = field(default_factory=time.time)
    first_token_at: float | None = None
    seq: int = 0
    generated: int = 0  # tokens so far
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list = field(default_factory=list)  # the engine's, for the next chunk (when asked)
    text: str = ""
    #: Chunks sent to the stream whose acknowledgement is still to be collected, by seq.
    unconfirmed: dict[int, tuple[TokensGenerated, asyncio.Future | None]] = field(default_factory=dict)
    closed: bool = False  # its terminal event is queued; later engine outputs are ignored
    span: Span | None = None  # its trace's inference span (None: tracing off)
    gen: GenRequest | None = None  # what the engine runs (when it joined a batch)

    @property
    def ids(self) -> dict:
        e = self.event
        return dict(request_id=e.request_id, conv_id=e.conv_id, turn_id=e.turn_id)


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
        self.kv_budget = int(settings.kv_cache_mb * 2**20)
        #: Every model engine's keyword arguments, wherever it steps (a process or a thread).
        self.engine_options: dict[str, Any] = {
            "kv_budget_bytes": self.kv_budget,
            "prefix_cache_bytes": prefix_cache_bytes(settings),
        }
        self.watchdog_margin_s = watchdog_margin_s
        self.watchdog_period_s = watchdog_period_s
        self.pool = pool
        self.publish = publish
        self.publish_nowait = publish_nowait or self._publish_in_task
        self.live = live
        self.recorded = recorded
        self.jobs: dict[str, Job] = {}
        #: Cancels of requests not held here (yet), by when they came: a battle's other
        #: side is called off when its pair is refused, often before this worker fetched
        #: it; it ends as cancelled when it comes, without running.
        self.called_off: dict[str, float] = {}
        self.holding: dict[int, Msg] = {}  # pulled, not yet jobs (Msg is not hashable)
        self.runners: dict[int, Runner] = {}
        self._core_notes: CoreShare | Literal[False] | None = None  # _notes(); False: none can be made
        self.outbox: asyncio.Queue = asyncio.Queue()
        self._endings: set[asyncio.Task] = set()  # jobs being settled (`_ending`)
        self._room = asyncio.Condition()
        self._tasks: list[asyncio.Task] = []
        self.loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._tasks = [
            asyncio.create_task(self._publisher()),
            asyncio.create_task(self._keepalive()),
            asyncio.create_task(self._watchdog()),
        ]

    async def stop(self) -> None:
        for runner in self.runners.values():
            runner.stop()
        for task in [*self._tasks, *self._endings]:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

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
            rooms[name] = min(context, kv_room(loaded, self.kv_budget) or context) if loaded else context
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
            params = engine_params(event)
        except ValueError as exc:  # the gateway validates these; a message from elsewhere may not be
            await self._fail(event, msg, "internal_error", f"sampling parameters cannot be served: {exc}")
            return
        chunks: list[TokensGenerated] = []
        if msg.metadata.num_delivered > 1:  # another worker had it: continue where it was
            chunks, terminal = await self._delivered(rid)
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
            code, message = _failure_of(exc, rid)
            await self._fail(event, msg, code, message, exc.retry_after_s if isinstance(exc, _Refused) else None)

    async def _start(
        self,
        event: PromptAccepted,
        msg: Msg,
        span: Span | None,
        params: EngineParams,
        chunks: list[TokensGenerated],
        pin: AsyncExitStack,
    ) -> None:
        """Load the model (held by `pin` while the job lives), check the request against
        it and its engine's speed, and add it to the engine as a job; _Refused when it
        cannot be served, as the errors of consumers.inference.errors say."""
        loaded = await pin.enter_async_context(self.pool.use(event.model))
        if params.logit_bias and (top := params.logit_bias[-1][0]) >= (vocab := vocab_size(loaded)):
            raise _Refused(
                "invalid_request", f"logit_bias: token {top} is outside the model's vocabulary ({vocab} tokens)"
            )
        if loaded.spec.upstream is not None:  # its server tokenizes: the prompt goes as text
            gen = upstream_request(event, params, chunks, loaded.spec)
            resume_ids = gen.resume_ids
        else:
            if event.prompt_format == "text":  # POST /v1/completions: the prompt as it is
                prompt_ids = encode_text(loaded, event.messages[-1].content)
            else:
                prompt_ids = encode_prompt(loaded, [m.model_dump() for m in event.messages])
            resume_ids = [t for c in chunks for t in c.token_ids]
            gen = GenRequest(event.request_id, prompt_ids, params, deadline=event.deadline_at, resume_ids=resume_ids)
            # One that can never fit is a 400 before anything judges its time (a 429 would
            # tell its client to retry it).
            check_prompt(gen, loaded.context_len)
            if not resume_ids:
                check_room(gen, loaded.context_len)
                check_kv(gen, loaded, self.kv_budget)
        runner = self._runner_for(loaded)
        budget_s = event.deadline_at - event.received_at
        never = too_long_alone("max_tokens", event.model, params.max_tokens, runner.load().alone_step_s, budget_s)
        if not resume_ids and never:
            METRICS.deadline_misses.labels(event.model).inc()
            raise _Refused("deadline_too_short", never)
        late = (eta := runner.finish_at(params.max_tokens)) is not None and eta > event.deadline_at
        if late and msg.metadata.num_delivered == 1:
            # It waited too long to finish in time at the speed measured now: refuse it
            # before spending steps on it (429, retry) rather than end it at its deadline.
            # Work redelivered from a dead worker is run: it was admitted, its client has
            # waited, and the estimate is a worst case (the whole token budget); the
            # engine still ends it at its deadline if it really cannot finish.
            METRICS.deadline_misses.labels(event.model).inc()
            over_s = max(1, math.ceil((eta or 0.0) - event.deadline_at))  # its work ahead drains by then
            why = f"the worker cannot finish it before its deadline; retry in {over_s} s"
            raise _Refused("overloaded", why, over_s)
        job = self.jobs[event.request_id] = Job(event, msg, runner, pin, span=span, gen=gen)
        if chunks:
            job.seq, job.generated, job.text = len(chunks), len(resume_ids), "".join(c.text for c in chunks)
            METRICS.resumed_tokens.inc(len(resume_ids))
        runner.add(gen)
        if self.called_off.pop(event.request_id, None) is not None:  # while its model loaded
            runner.cancel(event.request_id)

    async def _delivered(self, rid: str) -> tuple[list[TokensGenerated], Terminal | None]:
        """What earlier workers put in the stream for `rid`: its chunks from seq 0 without
        a gap, and its terminal event if there is one. A failed read costs the shortcut,
        not the request: it is then regenerated from the start (chunks deduplicated)."""
        if self.recorded is None:
            return [], None
        try:
            events = await self.recorded(rid)
        except Exception as exc:  # noqa: BLE001 - any read failure falls back to regeneration
            log.warning("cannot read what was delivered (%r); regenerating", exc, extra={"request_id": rid})
            return [], None
        terminal = next((e for e in events if isinstance(e, Terminal)), None)
        by_seq = {e.seq: e for e in events if isinstance(e, TokensGenerated)}
        chunks: list[TokensGenerated] = []
        while len(chunks) in by_seq:
            chunks.append(by_seq[len(chunks)])
        return chunks, terminal

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
        engines = [r.engine for r in self.runners.values() if isinstance(r, EngineRunner)]
        return sorted(e.name for e in engines if isinstance(e, UpstreamEngine) and e.circuit.open)

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
            if isinstance(runner, ProcessRunner):  # ready once its profile ended
                await asyncio.to_thread(runner.ready.wait, START_TIMEOUT_S)
            else:  # an engine on a thread: ready once its profile ended (a llama-server's waits for it to come up)
                await asyncio.to_thread(runner.profiled.wait, START_TIMEOUT_S)

    def _runner_for(self, loaded) -> Runner:
        runner = self.runners.get(id(loaded))
        if runner is None or runner.loaded is not loaded:
            assert self.loop is not None, "start() the service first"
            s = self.settings
            hold_s = s.max_wait_ms / 1000 if s.engine == "static" else 0.0  # a micro-batch's wait to fill
            figures = self.figures_path(loaded)
            if loaded.spec.backend == "llamacpp":  # llama-server steps it; the runner's thread reads its steps
                binary = locate(s.llama_cpp_dir)  # the error names the build command
                llama = LlamaCppEngine(loaded, binary, s.max_batch_size, s.llama_cpp_threads)
                runner = EngineRunner(
                    llama,
                    self.loop,
                    self.on_outputs,
                    profile=s.step_profile,
                    figures=figures,
                    before_step=self._notes(),
                )
            elif loaded.spec.upstream is not None:  # no profile: its server is someone's, its streams time it
                runner = EngineRunner(UpstreamEngine(loaded), self.loop, self.on_outputs)
            elif s.engine_process and self._shareable(loaded):
                runner = ProcessRunner(
                    loaded,
                    s.engine,
                    s.max_batch_size,
                    self.loop,
                    self.on_outputs,
                    hold_s,
                    s.torch_threads,
                    self.engine_options,
                    s.step_profile,
                    figures,
                    reload=functools.partial(self.pool.loader, loaded.spec, loaded.version),
                    alone_threads=s.torch_threads_alone,
                    cores_dir=s.cores_dir,
                )
            else:
                engine = BatchEngine(loaded, s.engine, s.max_batch_size, **self.engine_options)
                runner = EngineRunner(
                    engine,
                    self.loop,
                    self.on_outputs,
                    hold_s,
                    profile=s.step_profile,
                    figures=figures,
                    before_step=self._notes(),
                )
            self.runners[id(loaded)] = runner
        return runner

    def _notes(self) -> Callable[[], int | None] | None:
        """This process's note of its engines' steps (a llama.cpp server's, an engine on a
        thread), so the machine's engine processes size their threads to them (cores.py);
        None where they do not (ARENA_TORCH_THREADS_ALONE unset) or the notes' directory
        cannot be made."""
        if not sizing(self.settings.torch_threads, self.settings.torch_threads_alone):
            return None
        if self._core_notes is None:
            self._core_notes = share_or_none(self.settings.cores_dir, 0, 0) or False
        return self._core_notes.before_step if self._core_notes else None

    def figures_path(self, loaded) -> str | None:
        """Where ``loaded``'s engine keeps its measured steps (:data:`figures.FIGURES_MAX_AGE_S`):
        one file per model, engine settings, threads and machine; None without a step
        profile or with ARENA_STEP_FIGURES_DIR empty."""
        s = self.settings
        if not s.step_profile or not s.step_figures_dir:
            return None
        key = {
            "spec": loaded.spec.model_dump(mode="json"),
            "version": loaded.version,
            "engine": [
                s.engine,
                s.engine_process,
                s.max_batch_size,
                s.torch_threads,
                s.torch_threads_alone,
                self.engine_options,
            ],
            "machine": machine(),
            "code": engine_code(),
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        return str(Path(s.step_figures_dir).expanduser() / f"{loaded.spec.name}-{digest}.json")

    @staticmethod
    def _shareable(loaded) -> bool:
        """An engine process reads the pool's weights from shared memory; where /dev/shm
        is too small for them, the model's engine runs on a thread instead (and says so)."""
        if loaded.spec.device != "cpu" or shm_room(shared := weights_nbytes(loaded.model)):
            return True
        log.warning(
            "/dev/shm has no room for %s's %.0f MB of weights: its engine runs on a thread, not in a process "
            "(give the container more shared memory, e.g. docker run --shm-size, to have it in one)",
            loaded.spec.name,
            shared / 1e6,
        )
        return False

    # ---- outputs (called on the loop by the engine thread) ---------------------------

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        now = time.time()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.closed:
                continue
            if out.finish_reason == "lost":  # its engine process died: continued from its chunks
                job.closed = True
                self.outbox.put_nowait(("give back", job, None))
                continue
            if out.new_token_ids and job.first_token_at is None:
                job.first_token_at = now
            job.pending_ids += out.new_token_ids
            job.pending_logprobs += out.logprobs or ()
            job.generated += len(out.new_token_ids)
            job.pending_text += out.new_text
            # The first chunk goes out at once (time to first token); then every
            # chunk_tokens tokens. Boundaries depend on token counts only, so a request
            # regenerated after a crash is cut into the same chunks.
            full = len(job.pending_ids) >= self.settings.chunk_tokens or job.seq == 0
            if job.pending_text and (full or out.finished):
                self._emit_chunk(job)
            if out.finished:
                self._finish(job, out, now)

    def _emit_chunk(self, job: Job) -> None:
        logprobs = None
        if job.event.params.logprobs is not None:
            logprobs = spelled(job.pending_logprobs, speller(job.runner.loaded.tokenizer))
        event = TokensGenerated(
            **job.ids,
            seq=job.seq,
            text=job.pending_text,
            token_ids=tuple(job.pending_ids),
            model=job.event.model,
            logprobs=logprobs,
        )
        job.text += job.pending_text
        job.seq += 1
        job.pending_ids, job.pending_text, job.pending_logprobs = [], "", []
        self.outbox.put_nowait(("chunk", job, event))

    def _finish(self, job: Job, out: StepOutput, now: float) -> None:
        e = job.event
        model = e.model
        METRICS.requests.labels(model, out.finish_reason or "unknown").inc()
        METRICS.tokens.labels(model).inc(out.completion_tokens)
        if out.finish_reason in ("stop", "length"):
            first = job.first_token_at or now
            timings = Timings(
                queue_wait_s=max(0.0, job.started_at - e.received_at),
                ttft_s=max(0.0, first - e.received_at),
                decode_s=max(0.0, now - first),
                compute_s=max(0.0, now - job.started_at),
            )
            METRICS.queue_wait.labels(model).observe(timings.queue_wait_s)
            METRICS.ttft.labels(model).observe(timings.ttft_s)
            if out.completion_tokens > 1:
                METRICS.tpot.labels(model).observe(timings.decode_s / (out.completion_tokens - 1))
            terminal: ChatCompleted | ChatFailed = ChatCompleted(
                **job.ids,
                model=model,
                text=job.text,
                finish_reason=out.finish_reason,
                usage=Usage(
                    prompt_tokens=out.prompt_tokens,
                    completion_tokens=out.completion_tokens,
                    total_tokens=out.prompt_tokens + out.completion_tokens,
                ),
                timings=timings,
                chunks=job.seq,
            )
        else:
            code = {"deadline": "deadline_exceeded", "cancelled": "cancelled"}.get(
                out.finish_reason or "", "internal_error"
            )
            if code == "deadline_exceeded":
                METRICS.deadline_misses.labels(model).inc()
            message = (
                "the model failed on this request (its batch neighbours were not affected)"
                if out.finish_reason == "error"
                else f"generation ended: {out.finish_reason}"
            )
            if out.failure is not None:  # the engine says more (an upstream's refusal)
                code, message = out.failure
            terminal = ChatFailed(**job.ids, code=code, message=message, chunks=job.seq)
        job.closed = True
        self.outbox.put_nowait(("terminal", job, terminal))

    async def _fail(self, event, msg, code: str, message: str, retry_after_s: int | None = None) -> None:
        """A permanent failure: publish ChatFailed, then terminate the message (no redelivery)."""
        ids = dict(request_id=event.request_id, conv_id=event.conv_id, turn_id=event.turn_id)
        await self.publish(ChatFailed(**ids, code=code, message=message, retry_after_s=retry_after_s))
        await msg.term()
        log.info("failed: %s", code, extra={"request_id": event.request_id, "model": event.model})

    # ---- background tasks ------------------------------------------------------------

    async def _publisher(self) -> None:
        """Send chunks as they come (live, and to the stream without waiting for acks), in
        the order the engine made them; settle each job beside the others (`_ending`).

        Settling waits for the job's chunk acks. It ran in this loop once: after a NATS
        restart every job waited out its lost acks (PUBLISH_TIMEOUT_S) in turn, and the
        chunks of every other job waited behind it (one answer every 1.5 s)."""
        while True:
            kind, job, event = await self.outbox.get()
            if kind != "chunk":  # the job's chunks are all sent: nothing of it follows
                self._endings.add(task := asyncio.create_task(self._ending(kind, job, event)))
                task.add_done_callback(self._endings.discard)
                continue
            try:
                with tracing.within(job.span):  # the events carry the request's trace
                    await self._send_chunk(job, event)
            except Exception:
                log.exception("publish failed", extra={"request_id": job.event.request_id})
            finally:
                self.outbox.task_done()

    async def _ending(self, kind: str, job: Job, terminal: Terminal | None) -> None:
        """A job's end: its message given back, or its terminal event stored and the
        message acked (or termed, `reaped`). Done for `outbox.join()` once settled."""
        try:
            with tracing.within(job.span):
                if kind == "give back":
                    await self._give_back(job)
                else:
                    await self._settle(job, terminal, term=kind == "reaped")
        except Exception:
            log.exception("publish failed", extra={"request_id": job.event.request_id})
        finally:
            self.outbox.task_done()

    async def _send_chunk(self, job: Job, event: TokensGenerated) -> None:
        raw = encode(event)
        if self.live is not None:
            with suppress(Exception):  # the stream has it; a gateway that missed it reads it there
                await self.live(subjects.live_subject(event.request_id), raw)
        try:
            ack = asyncio.ensure_future(await self.publish_nowait(event, raw))
        except NATS_DOWN:
            log.warning("chunk not sent; retried before the terminal event", extra={"request_id": event.request_id})
            job.unconfirmed[event.seq] = (event, None)
            return
        job.unconfirmed[event.seq] = (event, ack)
        ack.add_done_callback(functools.partial(self._chunk_acked, job, event))

    def _chunk_acked(self, job: Job, event: TokensGenerated, ack: asyncio.Future) -> None:
        """A chunk whose ack was lost with the connection (NATS restarted under it) is sent
        again at once, live and to the stream (buffered until the connection is back): it
        may never have reached either, and a gateway holds every later chunk behind it.
        Once the job's end is queued, `_confirm_chunks` publishes it instead."""
        if ack.cancelled() or not isinstance(ack.exception(), ReplyLost) or job.closed:
            return
        METRICS.chunks_resent.inc()
        self.outbox.put_nowait(("chunk", job, event))

    async def _confirm_chunks(self, job: Job) -> None:
        """Every chunk of the job stored in the stream: collect the acks, publish again
        (dedupe keys make that safe) whatever the stream did not confirm."""
        pending = list(job.unconfirmed.values())
        job.unconfirmed = {}
        acks = [ack for _, ack in pending if ack is not None]
        if acks:  # all at once: a stream leader lost mid-answer costs one timeout, not one per chunk
            await asyncio.wait(acks, timeout=PUBLISH_TIMEOUT_S)
        for event, ack in pending:
            if ack is not None:
                if ack.done() and not ack.cancelled() and ack.exception() is None:
                    continue
                ack.cancel()
            await self._publish_retrying(event)

    async def _publish_in_task(self, event, raw: bytes | None = None) -> Awaitable:
        return asyncio.ensure_future(self.publish(event))

    async def _settle(self, job: Job, terminal, term: bool) -> None:
        """Publish the terminal event, ack (or term) the message and release the job.

        If the job's events cannot be published the message is given back instead, so
        the request is computed again (the dedupe keys make that safe); it is never acked
        without its chunks and terminal event in the stream.
        """
        try:
            await self._confirm_chunks(job)
            raw = encode(terminal)
            await self._publish_retrying(terminal, raw=raw)
            if self.live is not None:
                with suppress(Exception):  # delivery fans the stored terminal out as well
                    await self.live(subjects.live_subject(terminal.request_id), raw)
        except Exception:
            log.exception("terminal event not published; message given back", extra={"request_id": terminal.request_id})
            with suppress(Exception):
                await job.msg.nak(delay=1.0)
        else:
            await (job.msg.term() if term else job.msg.ack())
        finally:
            await self._release(job)

    async def _give_back(self, job: Job) -> None:
        """Its engine died under it: its chunks stored, the message is given back (nak),
        so a worker (this one's next engine process, or another) continues it from them,
        as it continues a dead worker's. Tokens past the last chunk are made again."""
        try:
            await self._confirm_chunks(job)
            await job.msg.nak()
            log.warning("engine lost; given back after %d chunks", job.seq, extra=job.ids)
        except Exception:  # its AckWait gives it back all the same
            log.exception("could not give the request back", extra=job.ids)
        finally:
            await self._release(job)

    async def _release(self, job: Job) -> None:
        if self.jobs.get(job.event.request_id) is job:
            del self.jobs[job.event.request_id]
        await job.pin.aclose()
        spans.record(job, time.time())
        async with self._room:
            self._room.notify_all()

    async def _publish_retrying(self, event, attempts: int = 6, raw: bytes | None = None) -> None:
        for i in range(attempts):
            try:
                await self.publish(event, raw) if raw is not None else await self.publish(event)
                return
            except Exception:
                if i == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * (i + 1))

    async def _keepalive(self) -> None:
        """In-progress acks, so AckWait does not expire during a long generation."""
        period = self.settings.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for msg in self.held_messages():
                with suppress(Exception):
                    await msg.in_progress()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_period_s)
            try:
                self.reap_overdue(time.time())
                for runner in self.prune_runners():
                    await asyncio.to_thread(runner.stop)
            except Exception:
                log.exception("watchdog pass failed")

    def prune_runners(self) -> list[Runner]:
        """Take out the runners of model versions the pool let go (evicted, or replaced
        and no longer borrowed), for the caller to stop: a runner holds its engine, the
        engine its weights (and an engine process its own copy), so the pool's eviction
        frees nothing while the runner stays."""
        stale = {key: runner for key, runner in self.runners.items() if not self.pool.holds(runner.loaded)}
        for key, runner in stale.items():
            del self.runners[key]
            log.info("engine of %s v%d stopped: its model left the pool", runner.name, runner.loaded.version)
        return list(stale.values())

    def reap_overdue(self, now: float) -> int:
        """Fail every open job ``watchdog_margin_s`` past its deadline; returns how many.

        The engine ends a request at its deadline, so such a job was lost on the way (a
        stuck or dead engine thread, an output that never came back); holding it would
        leave its client waiting and, with enough of them, stop this worker pulling.
        """
        late = [j for j in self.jobs.values() if not j.closed and now > j.event.deadline_at + self.watchdog_margin_s]
        for job in late:
            e = job.event
            log.error("no terminal event %.1f s past the deadline; failing it", now - e.deadline_at, extra=job.ids)
            METRICS.watchdog_reaped.labels(e.model).inc()
            METRICS.deadline_misses.labels(e.model).inc()
            METRICS.requests.labels(e.model, "deadline").inc()
            job.closed = True
            job.runner.cancel(e.request_id)  # in case the engine still holds it
            message = "the worker lost this request; failed by its watchdog after the deadline"
            failed = ChatFailed(**job.ids, code="deadline_exceeded", message=message, chunks=job.seq)
            self.outbox.put_nowait(("reaped", job, failed))
        return len(late)


def prefix_cache_bytes(settings) -> int:
    """The prefix cache's budget per engine, in bytes (0: off)."""
    return int(settings.prefix_cache_mb * (1 << 20))


def engine_params(event: PromptAccepted) -> EngineParams:
    """The engine's sampling parameters of ``event``; ValueError names what cannot be served."""
    p = event.params
    return EngineParams(
        temperature=p.temperature,
        top_p=p.top_p,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        seed=p.seed,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=tuple(p.logit_bias.items()),
        logprobs=p.logprobs,
        ignore_eos=p.ignore_eos,
    )


class _Refused(Exception):
    """A request the worker will not start, and the failure its client gets."""

    def __init__(self, code: FailureCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def _failure_of(exc: Exception, request_id: str) -> tuple[FailureCode, str]:
    """The ChatFailed code and message for a request that could not start."""
    match exc:
        case _Refused(code=code, message=message):
            return code, message
        case UnknownModel():
            return "unknown_model", str(exc)
        case PromptTooLong():
            return "prompt_too_long", str(exc)
        case Unsupported():
            return "invalid_request", str(exc)
        case Unavailable():
            return "model_unavailable", str(exc)
        case PermanentError():
            return "internal_error", str(exc)
    # A bug: fail this request rather than hold it until its deadline.
    log.error("intake failed", exc_info=exc, extra={"request_id": request_id})
    return "internal_error", f"the worker could not start this request: {exc!r}"


@functools.cache
def engine_code() -> str:
    """A digest of the code that steps a model (this package's sources) and of torch's and
    transformers' versions: kept step figures are another code's after an upgrade."""
    import torch  # noqa: PLC0415 - loaded by now wherever a model is
    import transformers  # noqa: PLC0415

    digest = hashlib.sha256(f"{torch.__version__} {transformers.__version__}".encode())
    for source in sorted(Path(__file__).parents[1].rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]
