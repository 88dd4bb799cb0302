"""What a pulled request is checked against before it becomes a job: its sampling
parameters, its prompt against its model's context and KV budget, its deadline against
its engine's measured speed; and the failure each refusal becomes (its ChatFailed code)."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable

from consumers.inference.engine.batch import check_kv, check_prompt, check_room
from consumers.inference.engine_io import GenRequest
from consumers.inference.errors import PermanentError, PromptTooLong, Unavailable, UnknownModel, Unsupported
from consumers.inference.metrics import METRICS
from consumers.inference.model_loading import LoadedModel, encode_prompt, encode_text, vocab_size
from consumers.inference.runners.base import Runner
from consumers.inference.upstream.engine import upstream_request
from events.models import FailureCode, PromptAccepted, SamplingParams, Terminal, TokensGenerated
from runtime.steps import too_long_alone

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request the worker will not start, and the failure its client gets."""

    def __init__(self, code: FailureCode, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retry_after_s = code, message, retry_after_s


def gen_request(
    event: PromptAccepted,
    loaded: LoadedModel,
    params: SamplingParams,
    chunks: list[TokensGenerated],
    kv_budget_bytes: int | None,
) -> GenRequest:
    """What the engine runs for ``event`` (continued after ``chunks``, the stored ones of
    a worker that had it), checked against its model: Refused, or the errors of
    consumers.inference.errors, when it cannot be served."""
    if params.logit_bias and (top := params.logit_bias[-1][0]) >= (vocab := vocab_size(loaded)):
        raise Refused("invalid_request", f"logit_bias: token {top} is outside the model's vocabulary ({vocab} tokens)")
    if loaded.spec.upstream is not None:  # its server tokenizes: the prompt goes as text
        return upstream_request(event, params, chunks, loaded.spec)
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
        check_kv(gen, loaded, kv_budget_bytes)
    return gen


def check_speed(event: PromptAccepted, gen: GenRequest, runner: Runner, first_delivery: bool) -> None:
    """Refused when ``runner``'s engine, at the speed measured now, cannot finish the
    request before its deadline: never (alone), or not behind the work it holds."""
    max_tokens = gen.params.max_tokens
    budget_s = event.deadline_at - event.received_at
    never = too_long_alone("max_tokens", event.model, max_tokens, runner.load().alone_step_s, budget_s)
    if not gen.resume_ids and never:
        METRICS.deadline_misses.labels(event.model).inc()
        raise Refused("deadline_too_short", never)
    late = (eta := runner.finish_at(max_tokens)) is not None and eta > event.deadline_at
    if late and first_delivery:
        # It waited too long to finish in time at the speed measured now: refuse it
        # before spending steps on it (429, retry) rather than end it at its deadline.
        # Work redelivered from a dead worker is run: it was admitted, its client has
        # waited, and the estimate is a worst case (the whole token budget); the
        # engine still ends it at its deadline if it really cannot finish.
        METRICS.deadline_misses.labels(event.model).inc()
        over_s = max(1, math.ceil((eta or 0.0) - event.deadline_at))  # its work ahead drains by then
        why = f"the worker cannot finish it before its deadline; retry in {over_s} s"
        raise Refused("overloaded", why, over_s)


def failure_of(exc: Exception, request_id: str) -> tuple[FailureCode, str]:
    """The ChatFailed code and message for a request that could not start."""
    match exc:
        case Refused(code=code, message=message):
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


async def delivered(
    recorded: Callable[[str], Awaitable[list]] | None, rid: str
) -> tuple[list[TokensGenerated], Terminal | None]:
    """What earlier workers put in the stream for `rid` (``recorded``: its output events
    there): its chunks from seq 0 without a gap, and its terminal event if there is one.
    A failed read costs the shortcut, not the request: it is then regenerated from the
    start (chunks deduplicated)."""
    if recorded is None:
        return [], None
    try:
        events = await recorded(rid)
    except Exception as exc:  # noqa: BLE001 - any read failure falls back to regeneration
        log.warning("cannot read what was delivered (%r); regenerating", exc, extra={"request_id": rid})
        return [], None
    terminal = next((e for e in events if isinstance(e, Terminal)), None)
    by_seq = {e.seq: e for e in events if isinstance(e, TokensGenerated)}
    chunks: list[TokensGenerated] = []
    while len(chunks) in by_seq:
        chunks.append(by_seq[len(chunks)])
    return chunks, terminal
