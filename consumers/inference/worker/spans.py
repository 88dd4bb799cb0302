"""A request's inference stages in its trace, recorded once its job has ended.

The stages' boundaries are known only afterwards (the engine thread stamps when a
request joined a batch; the first token arrives with a step's outputs), so they are
recorded as finished spans under the job's `inference` span, which ends here too:

    stream.queue_wait  stored in the stream -> pulled by this worker
    batch.wait         pulled -> joined a running batch (model pinned, a slot free)
    prefill            joined -> first token
    decode             first token -> last token
"""

from __future__ import annotations

from typing import Any

from runtime import tracing


def record(job: Any, now: float) -> None:
    span = job.span
    if span is None:
        return
    pulled = getattr(span, "start_time", None)
    pulled = pulled / 1e9 if pulled else job.started_at
    try:
        stored = job.msg.metadata.timestamp.timestamp()
    except Exception:  # noqa: BLE001 - a message that is no JetStream delivery has no stream time
        stored = None
    if stored is not None:
        tracing.span_at("stream.queue_wait", span, min(stored, pulled), pulled)
    joined = job.gen.admitted_at if job.gen is not None else None
    tracing.span_at("batch.wait", span, pulled, joined or now)
    if joined is not None:
        first = job.first_token_at or now
        tracing.span_at("prefill", span, joined, first)
        if job.first_token_at is not None:
            tracing.span_at("decode", span, first, now, tokens=job.generated, chunks=job.seq)
    tracing.end(span)
