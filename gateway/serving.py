"""Serving a chat request, whatever the transport (HTTP, SSE, `/chat`, WebSocket, arena):
admission, idempotency and publishing; `start` hands the transport the request's
session (gateway/session.py), which follows the output and records the outcome.

The routers only parse, call this, and shape the response.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time
from dataclasses import replace
from functools import partial
from typing import Any

import anyio

from events import subjects, topology
from events.models import ChatMessage, ChatRequested, new_id
from gateway import ratelimit
from gateway.access import not_found
from gateway.admission.estimate import too_slow
from gateway.admission.leases import Admission, Lease
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import Pipeline
from gateway.protocol import UNSERVED, ChatCompletionRequest
from gateway.ratelimit import Limits
from gateway.session import Leave, RequestSession, Ticket, ending
from gateway.settings import GatewaySettings
from gateway.variants import model_defaults, with_model_defaults
from runtime import tracing
from runtime.redis import REDIS_DOWN

log = logging.getLogger(__name__)


def body_hash(req: ChatCompletionRequest, model: str) -> str:
    """What makes two requests 'the same' for an idempotency key (transport options excluded)."""
    fields = req.model_dump(exclude={"stream", "stream_options", "deadline_s", "user", *UNSERVED})
    fields["model"] = model
    if req.prompt_format != "chat":  # a completion's prompt is no chat's message (older hashes unchanged)
        fields["prompt_format"] = req.prompt_format
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


def store_unavailable() -> APIError:
    return APIError(
        503, "the result store is unavailable; retry shortly", "store_unavailable", headers={"Retry-After": "2"}
    )


def budget_field(req: ChatCompletionRequest) -> str:
    """The field that set the request's token budget."""
    return "max_completion_tokens" if req.max_completion_tokens else "max_tokens"


def context_exceeded(req: ChatCompletionRequest, context: int) -> APIError:
    """The 400 for a token budget the model's context cannot hold, whatever the prompt
    (a prompt has a token at least): retrying it can never succeed, so no 429."""
    field = budget_field(req)
    return APIError(
        400,
        f"{field}: {req.token_limit()} tokens asked for, but the model takes {context} tokens a request, "
        f"prompt included (its context, or what a worker's KV cache budget holds); ask for at most "
        f"{context - 1} minus the prompt's tokens",
        "context_length_exceeded",
        field,
    )


#: What a request for a model being loaded, resident nowhere yet, is told to wait before it
#: asks again (a load takes seconds; a GGUF's first conversion a minute or more).
LOADING_RETRY_S = 5


def model_loading(model: str) -> APIError:
    """503 for a model `arena models add` is loading and no worker holds ready (its weights
    and its engine, started and profiled): said at once, not a 504 once the deadline has passed."""
    return APIError(
        503,
        f"model '{model}' is loading on the inference processes; retry after {LOADING_RETRY_S} s "
        "(`arena models add` returns once it is served)",
        "model_loading",
        "model",
        headers={"Retry-After": str(LOADING_RETRY_S)},
    )


class ChatService:
    def __init__(self, settings: GatewaySettings, pipeline: Pipeline, admission: Admission | None = None):
        self.settings = settings
        self.pipeline = pipeline
        self.admission = admission or Admission(settings, pipeline)
        self.limiter = ratelimit.RateLimiter(pipeline.keys.redis)

    # ---- admission -------------------------------------------------------------------

    def _check(self, req: ChatCompletionRequest) -> str:
        model = req.model or self.settings.default_model
        fleet = self.pipeline.fleet()
        if fleet.count(topology.INFERENCE.name) == 0:
            raise APIError(503, "no inference worker is connected; retry shortly", "no_workers")
        if model not in fleet.models:
            raise APIError(404, f"model '{model}' is not served; see GET /v1/models", "model_not_found", "model")
        if fleet.loading_everywhere(model):  # no worker holds it ready
            raise model_loading(model)
        if fleet.down_everywhere(model):  # its upstream is down wherever it is held
            raise APIError(
                503,
                f"model '{model}' is unavailable: its upstream server is failing; retry after {LOADING_RETRY_S} s",
                "model_unavailable",
                "model",
                headers={"Retry-After": str(LOADING_RETRY_S)},
            )
        if req.conv_id is not None and not subjects.is_valid_token(req.conv_id):
            raise APIError(400, "conv_id: use 1-128 letters, digits, '_' or '-'", "invalid_value", "conv_id")
        chars = sum(len(m.text()) for m in req.messages)
        if chars > self.settings.max_prompt_chars:
            raise APIError(
                400,
                f"messages: prompt is {chars} characters, over the limit of {self.settings.max_prompt_chars}",
                "prompt_too_long",
                "messages",
            )
        if (context := self.pipeline.context_len(model)) is not None and req.token_limit() >= context:
            raise context_exceeded(req, context)
        settings = self.settings
        if error := too_slow(
            model,
            self.pipeline.queue(model),
            budget_field(req),
            req.token_limit(),
            self.budget_s(req),
            settings.max_deadline_s,
            settings.admission_overhead_s,
        ):
            METRICS.rejections.labels(reason="deadline_too_short").inc()
            raise error
        return model

    def budget_s(self, req: ChatCompletionRequest) -> float:
        return min(req.deadline_s or self.settings.deadline_s, self.settings.max_deadline_s)

    async def admit(
        self,
        req: ChatCompletionRequest,
        idem_key: str | None,
        principal: str,
        limits: Limits | None = None,
        started: float | None = None,
        lease: Lease | None = None,
    ) -> tuple[Ticket, ChatRequested | None]:
        """Admit a request for `principal`; the event to publish is None when it attaches
        to an earlier one. A conversation another principal started is 404 (not 403);
        over the caller's rate `limits`, 429. The request's trace starts here, and its
        recorded latency at `started` (time.perf_counter(); default: now). `lease`: the
        admission the HTTP edge gave it (gateway.admission.hook.lease_of), if any."""
        started = time.perf_counter() if started is None else started
        root = tracing.start("chat.request", model=req.model or self.settings.default_model, stream=req.stream)
        span = tracing.start("gateway.admission", parent=root)
        try:
            held = {"trace": root, "started": started}
            ticket, event = await self._admission(req, idem_key, principal, limits, lease, held)
        except BaseException as exc:
            why = f"{exc.status} {exc.code}" if isinstance(exc, APIError) else type(exc).__name__
            if isinstance(exc, APIError) and exc.status == 429:  # refused for a served model: counted as answered
                METRICS.requests.labels(req.model or self.settings.default_model, "429").inc()
            tracing.end(span, why)
            tracing.end(root, why)
            raise
        tracing.end(span)
        if event is None and ticket.lease is not None:  # attached to an earlier request: no new work
            await ticket.lease.refused()
        if root is not None:
            root.set_attribute("arena.request_id", ticket.request_id)
            root.set_attribute("arena.attached", ticket.attached)
        return ticket, event

    async def _admission(
        self,
        req: ChatCompletionRequest,
        idem_key: str | None,
        principal: str,
        limits: Limits | None,
        edge: Lease | None,
        held: dict[str, Any],
    ) -> tuple[Ticket, ChatRequested | None]:
        """`held`: what the ticket carries beside the request's own fields (its trace, ...)."""
        await self.pipeline.heard_fleet()
        model = self._check(req)
        # Counted from here, with no await since the checks, so a burst sees itself.
        lease = self.admission.lease(model, req.token_limit(), edge)
        try:
            try:
                await self.admission.judged(lease, self.budget_s(req))  # fleet-wide, unless the edge did
            except REDIS_DOWN as exc:
                raise store_unavailable() from exc
            verdict = None
            if limits is not None and not limits.off:
                cost = ratelimit.cost_of(sum(len(m.text()) for m in req.messages), req.token_limit())
                try:
                    verdict = await self.limiter.take(principal, limits, cost)
                except REDIS_DOWN as exc:
                    raise store_unavailable() from exc
            held = {**held, "lease": lease, "headers": verdict.headers() if verdict else {}}
            return await self._admit(req, idem_key, principal, model, held)
        except BaseException:
            lease.release()
            await lease.refused()  # refused after the fleet-wide check: not ahead of anyone
            raise

    async def _admit(
        self, req: ChatCompletionRequest, idem_key: str | None, principal: str, model: str, held: dict[str, Any]
    ) -> tuple[Ticket, ChatRequested | None]:
        req = with_model_defaults(req, model_defaults(self.pipeline.live_beats()).get(model))
        request_id = new_id()
        conv_id = req.conv_id or request_id
        turn_id = req.turn_id if req.turn_id is not None else 0
        key = idem_key or (f"turn:{req.conv_id}:{req.turn_id}" if req.conv_id and req.turn_id is not None else None)
        # A new conversation's owner is bound beside the publish; no other principal can own it yet.
        new = req.conv_id is None and key is None
        ticket = Ticket(
            request_id,
            conv_id,
            turn_id,
            model,
            time.time() + self.budget_s(req),
            attached=False,
            key=f"{principal}:{key}" if key else None,  # one caller's key never meets another's
            bind=partial(self.pipeline.keys.bind_owner, request_id, conv_id, principal) if new else None,
            **held,
        )
        seed = req.seed if req.seed is not None else random.getrandbits(31)
        event: ChatRequested | None = None
        try:
            if not new and await self.pipeline.keys.bind_owner(request_id, conv_id, principal) != principal:
                METRICS.rejections.labels(reason="not_owner").inc()
                raise not_found("conversation", conv_id, "conv_id")
            if ticket.key and (earlier := await self._claim(ticket.key, req, ticket)) is not None:
                ticket = earlier
            else:
                if req.conv_id and req.seed is None:
                    seed = await self.pipeline.keys.seed_for(conv_id, turn_id, seed)
                event = self._event(req, ticket, seed, idem_key, principal)
        except REDIS_DOWN as exc:
            log.warning("redis unavailable at admission: %s", exc, extra={"request_id": request_id})
            raise store_unavailable() from exc
        return ticket, event

    async def remember(self, ticket: Ticket, holder: str | None = None) -> None:
        """Record an accepted request in the pending index (polling, resumes), and the
        WebSocket session that holds it; with Redis down, give back its queue place and 503."""
        try:
            await self.pipeline.results.record_pending(
                ticket.request_id, ticket.conv_id, ticket.turn_id, ticket.model, ticket.deadline_at
            )
            if holder is not None:
                await self.pipeline.keys.hold(ticket.request_id, holder)
        except REDIS_DOWN as exc:
            await self.abandon(ticket)
            raise store_unavailable() from exc

    async def _claim(self, key: str, req: ChatCompletionRequest, ticket: Ticket) -> Ticket | None:
        """Bind the key to this request; the earlier request's ticket when it was bound before."""
        digest = body_hash(req, ticket.model)
        held = await self.pipeline.keys.claim_key(key, ticket.request_id, digest)
        if held["body_hash"] != digest:
            METRICS.rejections.labels(reason="idempotency_conflict").inc()
            raise APIError(
                409,
                "this idempotency key was used with a different request body",
                "idempotency_conflict",
                "Idempotency-Key",
            )
        if held["request_id"] == ticket.request_id:
            return None
        METRICS.idempotent_hits.inc()
        return replace(ticket, request_id=held["request_id"], attached=True)

    @staticmethod
    def _event(
        req: ChatCompletionRequest, ticket: Ticket, seed: int, idem_key: str | None, principal: str
    ) -> ChatRequested:
        return ChatRequested(
            request_id=ticket.request_id,
            conv_id=ticket.conv_id,
            turn_id=ticket.turn_id,
            model=ticket.model,
            messages=tuple(
                ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text()) for m in req.messages
            ),
            params=req.sampling_params(seed),
            deadline_at=ticket.deadline_at,
            stream=req.stream,
            idempotency_key=idem_key,
            principal=principal,
            prompt_format=req.prompt_format,
        )

    # ---- running ---------------------------------------------------------------------

    async def start(
        self, ticket: Ticket, event: ChatRequested | None, *, after_seq: int = -1, leave: Leave | None = None
    ) -> RequestSession:
        """Follow the request's output, then publish it (when it is new): its session.
        `leave`: what to do with it when its client leaves before the end (default: `cancel`).

        A publish that fails gives a 503 before any response is sent, and unbinds the
        idempotency key, so the client's retry runs the request instead of waiting on one
        that never started."""
        output = self.pipeline.output(
            ticket.request_id, ticket.until, after_seq=after_seq, replay=ticket.attached or after_seq >= 0
        )
        span = tracing.start("client.stream", parent=ticket.trace)
        try:
            await output.open()
            if event is not None:
                with tracing.within(ticket.trace):  # the event carries the request's trace
                    await self._publish(ticket, event)
        except BaseException as exc:
            tracing.end(span, ending(None))
            ticket.close(ending(None))
            with anyio.CancelScope(shield=True):
                await output.close()
                await self.abandon(ticket, unbind=isinstance(exc, APIError))
            raise
        if event is not None and ticket.lease is not None:
            ticket.lease.published()
        return RequestSession(ticket, output, span, self.cancel if leave is None else leave)

    async def abandon(self, ticket: Ticket, unbind: bool = True) -> None:
        """An admitted request that will not run from here (refused after admission, or
        never started): its queue place and trace given back, its admission dropped, and
        (`unbind`) its idempotency key unbound, so a retry runs it."""
        ticket.close(ending(None))
        if ticket.lease is not None:
            await ticket.lease.refused()
        if unbind and ticket.key and not ticket.attached:
            try:
                await self.pipeline.keys.release_key(ticket.key, ticket.request_id)
            except REDIS_DOWN:
                log.warning("could not release the idempotency key", extra={"request_id": ticket.request_id})

    async def cancel(self, ticket: Ticket) -> None:
        """Stop a request whose client left (the sessions' default `leave`); not one this
        client attached to, which another client may still be waiting for."""
        if not ticket.attached:
            await self.pipeline.cancel(ticket.request_id, ticket.conv_id, ticket.turn_id)

    async def _publish(self, ticket: Ticket, event: ChatRequested) -> None:
        """Publish the request; a new conversation's owner is stored at the same time (one
        round trip fewer before the first token), and both are done before the client
        hears of the request. If the owner cannot be stored (Redis down), the request,
        published by then, is cancelled and the client gets the 503 it got before."""
        if ticket.bind is None:
            await self.pipeline.publish(event, until=ticket.deadline_at)
            return
        bind, ticket.bind = ticket.bind, None
        outcomes: tuple[Any, Any] = await asyncio.gather(
            bind(), self.pipeline.publish(event, until=ticket.deadline_at), return_exceptions=True
        )
        bound, published = outcomes
        if isinstance(published, BaseException):
            raise published
        if isinstance(bound, REDIS_DOWN):
            log.warning("redis unavailable at admission: %s", bound, extra={"request_id": ticket.request_id})
            await self.pipeline.cancel(ticket.request_id, ticket.conv_id, ticket.turn_id)
            raise store_unavailable() from bound
        if isinstance(bound, BaseException):
            raise bound
