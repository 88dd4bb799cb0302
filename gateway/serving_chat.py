"""Serving a chat completion: admission, idempotency, publishing, and answering."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from dataclasses import dataclass

from events import subjects
from events.models import TERMINAL_TYPES, ChatMessage, ChatRequested, SamplingParams, new_id
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import Pipeline
from gateway.protocol import ChatCompletionRequest

log = logging.getLogger("arena.gateway")

DEFAULT_MAX_TOKENS = 64
FAILURE_STATUS = {
    "deadline_exceeded": 504,
    "unknown_model": 404,
    "prompt_too_long": 400,
    "cancelled": 499,
    "overloaded": 429,
    "internal_error": 500,
}


@dataclass
class Ticket:
    """A request admitted into the pipeline (or attached to an earlier identical one)."""

    request_id: str
    conv_id: str
    turn_id: int
    model: str
    deadline_at: float
    attached: bool  # True when this is a retry of an earlier request


def body_hash(req: ChatCompletionRequest, model: str) -> str:
    fields = req.model_dump(exclude={"stream", "stream_options", "deadline_s", "user"})
    fields["model"] = model
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


class ChatService:
    def __init__(self, settings, pipeline: Pipeline):
        self.settings = settings
        self.pipeline = pipeline
        self.in_flight: dict[str, int] = {}

    def enter(self, model: str) -> None:
        """Count a request against its model's queue while a gateway waits on it."""
        self.in_flight[model] = self.in_flight.get(model, 0) + 1
        METRICS.in_flight.labels(model).inc()

    def leave(self, model: str) -> None:
        self.in_flight[model] -= 1
        METRICS.in_flight.labels(model).dec()

    def _check(self, req: ChatCompletionRequest) -> str:
        model = req.model or self.settings.default_model
        fleet = self.pipeline.fleet()
        if fleet["inference"] == 0:
            raise APIError(503, "no inference worker is connected; retry shortly", "no_workers")
        if model not in fleet["models"]:
            raise APIError(404, f"model '{model}' is not served; see GET /v1/models", "model_not_found", "model")
        if req.conv_id is not None and not subjects.is_valid_token(req.conv_id):
            raise APIError(400, "conv_id: use 1-128 letters, digits, '_' or '-'", "invalid_value", "conv_id")
        if not any(m.role == "user" and m.text().strip() for m in req.messages):
            raise APIError(
                400, "messages: at least one non-empty user message is required", "invalid_value", "messages"
            )
        chars = sum(len(m.text()) for m in req.messages)
        if chars > self.settings.max_prompt_chars:
            raise APIError(
                400,
                f"messages: prompt is {chars} characters, over the limit of {self.settings.max_prompt_chars}",
                "prompt_too_long",
                "messages",
            )
        if self.in_flight.get(model, 0) >= self.settings.max_queue_per_model:
            METRICS.rejections.labels(reason="overloaded").inc()
            raise APIError(
                429,
                f"model '{model}' has {self.in_flight[model]} requests queued; retry later",
                "overloaded",
                None,
                headers={"Retry-After": "1"},
            )
        return model

    async def admit(self, req: ChatCompletionRequest, idem_key: str | None) -> tuple[Ticket, ChatRequested | None]:
        """Admit a request; the event to publish is None when it attaches to an earlier one."""
        model = self._check(req)
        request_id = new_id()
        conv_id = req.conv_id or request_id
        turn_id = req.turn_id if req.turn_id is not None else 0
        budget = min(req.deadline_s or self.settings.deadline_s, self.settings.max_deadline_s)
        deadline_at = time.time() + budget
        key = idem_key or (f"turn:{req.conv_id}:{req.turn_id}" if req.conv_id and req.turn_id is not None else None)
        if key:
            digest = body_hash(req, model)
            held = await self.pipeline.store.claim_key(key, request_id, digest)
            if held["body_hash"] != digest:
                METRICS.rejections.labels(reason="idempotency_conflict").inc()
                raise APIError(
                    409,
                    "this idempotency key was used with a different request body",
                    "idempotency_conflict",
                    "Idempotency-Key",
                )
            if held["request_id"] != request_id:
                METRICS.idempotent_hits.inc()
                return Ticket(held["request_id"], conv_id, turn_id, model, deadline_at, attached=True), None
        seed = req.seed if req.seed is not None else random.getrandbits(31)
        if req.conv_id and req.seed is None:
            seed = await self.pipeline.store.seed_for(conv_id, turn_id, seed)
        return Ticket(request_id, conv_id, turn_id, model, deadline_at, attached=False), ChatRequested(
            request_id=request_id,
            conv_id=conv_id,
            turn_id=turn_id,
            model=model,
            messages=tuple(
                ChatMessage(role="system" if m.role == "developer" else m.role, content=m.text()) for m in req.messages
            ),
            params=SamplingParams(
                temperature=req.temperature,
                top_p=req.top_p,
                max_tokens=req.token_limit(DEFAULT_MAX_TOKENS),
                stop=tuple(req.stop_list()),
                seed=seed,
            ),
            deadline_at=deadline_at,
            stream=req.stream,
            idempotency_key=idem_key,
        )


def failure(terminal) -> APIError:
    if terminal.type == "prompt.rejected":
        return APIError(400, f"prompt rejected by the filter: {terminal.reason}", "prompt_rejected", "messages")
    return APIError(FAILURE_STATUS.get(terminal.code, 500), terminal.message, terminal.code)


def usage_of(terminal) -> dict:
    return terminal.usage.model_dump()


def extra_of(ticket: Ticket, terminal) -> dict:
    return {
        "request_id": ticket.request_id,
        "conv_id": ticket.conv_id,
        "turn_id": ticket.turn_id,
        "timings": terminal.timings.model_dump(),
        "attached": ticket.attached,
    }


async def wait_terminal(follower, ticket: Ticket):
    """Wait for the request's terminal event (non-streaming); None past the deadline."""
    async for event in follower.events(until=ticket.deadline_at + 2.0):
        if event.type in TERMINAL_TYPES:
            return event
    return None
