"""What the engines' step outputs become (on the loop): a job's tokens cut into
TokensGenerated chunks, and its end a terminal event, both queued in the outbox in the
order the engine made them (as vLLM's output processor turns engine outputs into
request outputs)."""

from __future__ import annotations

import time

from consumers.inference.engine.logprobs import spelled, speller
from consumers.inference.engine_io import StepOutput
from consumers.inference.metrics import METRICS
from consumers.inference.worker.jobs import Chunk, Ended, GiveBack, Job
from consumers.inference.worker.outbox import Outbox
from events.models import ChatCompleted, ChatFailed, Timings, TokensGenerated, Usage


class OutputProcessor:
    """Cuts the jobs' outputs into chunks of ``chunk_tokens`` tokens (the first at once:
    time to first token) and ends them."""

    def __init__(self, jobs: dict[str, Job], outbox: Outbox, chunk_tokens: int) -> None:
        self.jobs = jobs
        self.outbox = outbox
        self.chunk_tokens = chunk_tokens

    def on_outputs(self, outputs: list[StepOutput]) -> None:
        now = time.time()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None or job.closed:
                continue
            if out.finish_reason == "lost":  # its engine process died: continued from its chunks
                job.closed = True
                self.outbox.put(GiveBack(job))
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
            full = len(job.pending_ids) >= self.chunk_tokens or job.seq == 0
            if job.pending_text and (full or out.finished):
                self._emit_chunk(job)
            if out.finished:
                job.closed = True
                self.outbox.put(Ended(job, terminal_of(job, out, now)))

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
        self.outbox.put(Chunk(job, event))


def terminal_of(job: Job, out: StepOutput, now: float) -> ChatCompleted | ChatFailed:
    """The terminal event of a job its engine finished (``out``), with its metrics."""
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
        return ChatCompleted(
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
    code = {"deadline": "deadline_exceeded", "cancelled": "cancelled"}.get(out.finish_reason or "", "internal_error")
    if code == "deadline_exceeded":
        METRICS.deadline_misses.labels(model).inc()
    message = (
        "the model failed on this request (its batch neighbours were not affected)"
        if out.finish_reason == "error"
        else f"generation ended: {out.finish_reason}"
    )
    if out.failure is not None:  # the engine says more (an upstream's refusal)
        code, message = out.failure
    return ChatFailed(**job.ids, code=code, message=message, chunks=job.seq)
