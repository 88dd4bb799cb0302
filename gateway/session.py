"""One admitted request from its publish to its end, whatever the transport: `RequestSession`.

HTTP (JSON and SSE), `/chat`, WebSocket turns and arena battles each get a session from
`ChatService.start`, iterate its chunks and read its terminal, and shape the bytes. The
session's exit does the rest, once, the same way for all of them (as vLLM's
`with_cancellation` wraps its serving calls): the outcome is recorded when the output
ran to its end, the request's queue place is given back, its trace ends, and when the
client left before the end the request is stopped in the engine (`leave`: at once by
default; after a resume grace for a WebSocket).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from opentelemetry.trace import Span

from events.models import (
    ChatCompleted,
    ChatFailed,
    Failure,
    PromptRejected,
    Terminal,
    TokenLogprob,
    TokensGenerated,
)
from gateway.admission.leases import Lease
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import Output
from runtime import tracing

FAILURE_STATUS = {
    "deadline_exceeded": 504,
    "unknown_model": 404,
    "prompt_too_long": 400,
    "cancelled": 499,
    "overloaded": 429,
    "internal_error": 500,
    "invalid_request": 400,
    "deadline_too_short": 400,
    "model_unavailable": 503,
}
#: The fields a worker's failure message may name first ("max_tokens: ..."): its `param`.
NAMED_FIELDS: tuple[str, ...] = ("max_tokens", "messages", "logit_bias", "prompt", "seed", "stop", "temperature")
NAMED_FIELDS += ("top_p", "presence_penalty", "frequency_penalty", "logprobs")
#: Output is followed this long past the deadline: a terminal event published at the
#: deadline (inference ends a running request there) still reaches the client.
FOLLOW_GRACE_S = 2.0


@dataclass
class Ticket:
    """A request admitted into the pipeline (or attached to an earlier identical one)."""

    request_id: str
    conv_id: str
    turn_id: int
    model: str
    deadline_at: float
    attached: bool  # True when this is a retry of an earlier request
    key: str | None = None  # the idempotency key bound to it, if any
    #: Its admission (None for a resumed request, admitted where it began).
    lease: Lease | None = field(default=None, repr=False)
    #: The caller's `x-ratelimit-*` headers (empty without limits).
    headers: dict[str, str] = field(default_factory=dict)
    #: The request's trace (its root span; None when tracing is off).
    trace: Span | None = field(default=None, repr=False)
    #: When the transport began serving it (time.perf_counter()): the recorded latency's start.
    started: float = field(default_factory=time.perf_counter, repr=False)
    #: The owner binding still to store (`ChatService.start` runs it beside the publish):
    #: set for a new conversation, which no other principal can own yet.
    bind: Callable[[], Awaitable[Any]] | None = field(default=None, repr=False)
    closed: bool = field(default=False, repr=False)

    @property
    def until(self) -> float:
        return self.deadline_at + FOLLOW_GRACE_S

    def close(self, error: str | None = None) -> None:
        """Give back the request's queue place and end its trace (failed with `error`); once."""
        if not self.closed:
            self.closed = True
            if self.lease is not None:
                self.lease.release()
            tracing.end(self.trace, error)


def deadline_error() -> APIError:
    return APIError(504, "no answer before the request's deadline", "deadline_exceeded")


def failure(terminal: Failure) -> APIError:
    """The client error for a terminal event that is not an answer."""
    if isinstance(terminal, PromptRejected):
        return APIError(400, f"prompt rejected by the filter: {terminal.reason}", "prompt_rejected", "messages")
    # An overloaded worker says when it expects room (the openai client waits that long).
    headers = {"Retry-After": str(terminal.retry_after_s or 1)} if terminal.code == "overloaded" else None
    # A worker's message names the field at fault first ("max_tokens: ..."), as the edge's do.
    named = terminal.message.partition(":")[0]
    param = named if named in NAMED_FIELDS else None
    code = "context_length_exceeded" if terminal.code == "prompt_too_long" and param == "max_tokens" else terminal.code
    return APIError(FAILURE_STATUS.get(terminal.code, 500), terminal.message, code, param, headers=headers)


def answer_of(terminal: Terminal | None) -> ChatCompleted | APIError:
    """The answer, else the error the client gets instead (504 when no terminal came)."""
    if terminal is None:
        return deadline_error()
    return terminal if isinstance(terminal, ChatCompleted) else failure(terminal)


def usage_of(terminal: ChatCompleted) -> dict:
    return terminal.usage.model_dump()


def extra_of(ticket: Ticket, terminal: ChatCompleted) -> dict:
    return {
        "request_id": ticket.request_id,
        "conv_id": ticket.conv_id,
        "turn_id": ticket.turn_id,
        "timings": terminal.timings.model_dump(),
        "attached": ticket.attached,
    }


def ending(terminal: Terminal | None) -> str | None:
    """How a request's trace ends: None for an answer, else the failure's code or type
    ("no answer" when none came: the deadline, or a client gone first)."""
    match terminal:
        case None:
            return "no answer"
        case ChatCompleted():
            return None
        case ChatFailed(code=code):
            return code
    return terminal.type


#: What to do with a request whose client left before its end (ChatService.cancel: stop it now).
Leave = Callable[[Ticket], Awaitable[None]]


async def keep_running(ticket: Ticket) -> None:
    """The `leave` of a request nobody waits on (`POST /chat`): it runs on to its stored result."""


class RequestSession:
    """A started request: `async for chunk in session`, then `session.terminal` and
    `session.error` (or `await session.finish()` for the terminal alone). Use it as an
    async context manager, or call `close()`; closing twice does nothing."""

    def __init__(self, ticket: Ticket, output: Output, span: Span | None = None, leave: Leave | None = None):
        self.ticket, self.output, self.span, self.leave = ticket, output, span, leave
        self.ended = False  # the output ran to its end: a terminal, or the deadline
        self.closed = False

    async def __aenter__(self) -> RequestSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def __aiter__(self) -> AsyncIterator[TokensGenerated]:
        first = True
        async for chunk in self.output:
            if first:
                METRICS.ttft.labels(self.ticket.model).observe(time.perf_counter() - self.ticket.started)
                first = False
            yield chunk
        self._end()

    async def finish(self) -> Terminal | None:
        """Wait for the terminal event (None past the deadline), sending nothing."""
        async for _ in self.output:
            pass
        self._end()
        return self.terminal

    def _end(self) -> None:
        """The outcome in the metrics, for every transport."""
        if self.ended:
            return
        self.ended = True
        model, err = self.ticket.model, self.error
        METRICS.requests.labels(model, "200" if err is None else str(err.status)).inc()
        took = time.perf_counter() - self.ticket.started
        if err is None:
            METRICS.latency.labels(model).observe(took)
        if (lease := self.ticket.lease) is not None and (err is None or err.code == "deadline_exceeded"):
            answer = self.output.terminal
            tokens = answer.usage.completion_tokens if isinstance(answer, ChatCompleted) else 0
            budget_s = self.ticket.deadline_at - (time.time() - took)
            lease.ended(took, tokens, missed=err is not None, budget_s=budget_s)

    @property
    def terminal(self) -> Terminal | None:
        return self.output.terminal

    @property
    def answer(self) -> ChatCompleted | APIError:
        """The answer, else the error the client gets instead (`answer_of`)."""
        return answer_of(self.output.terminal)

    @property
    def error(self) -> APIError | None:
        """None for an answer, else the error the client gets."""
        return answer if isinstance(answer := self.answer, APIError) else None

    def remainder(self) -> str:
        """Completed text no chunk carried (only if the stream lost chunks)."""
        return self.output.remainder()

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """The chunks' log probabilities, in order (those that carry any)."""
        return self.output.assembler.logprobs

    async def close(self) -> None:
        """Stop following the output, give back the queue place, end the trace; stop the
        request in the engine (`leave`) when its client left before the end. Shielded:
        it also runs inside a response task cancelled by the client's disconnect."""
        if self.closed:
            return
        self.closed = True
        error = ending(self.terminal)
        tracing.end(self.span, error)
        self.ticket.close(error)
        with anyio.CancelScope(shield=True):
            await self.output.close()
            if not self.ended and self.leave is not None:
                await self.leave(self.ticket)
