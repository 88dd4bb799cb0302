"""The design's asynchronous API: `POST /chat` answers 202 at once, `GET /chat/result/{id}`
is polled for the answer.

No connection is held while the model works: the request is published as a
`ChatRequested` event and delivery keeps its terminal event in Redis, where the result
endpoint reads it. Admission, validation and idempotency are `/v1/chat/completions`'
own (`ChatService.admit`), so the two APIs refuse and deduplicate the same requests.

Result statuses: 200 `completed`; 202 `pending` (with `Retry-After`); a failed request
answers with the status its failure has on `/v1` (400 `prompt_rejected`, 499
`cancelled`, 504 `deadline_exceeded`, ...) and an OpenAI error object; 404 for an id
that was never accepted or whose records expired (`result_ttl_s`).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from events import decode_terminal, subjects
from events.models import ChatCompleted
from gateway.access import limits_of, principal_of
from gateway.admission.hook import lease_of
from gateway.errors import APIError, errors
from gateway.protocol import ChatCompletionRequest, ConvId, Deadline, Seed, Temperature, Text, Tokens, TurnId
from gateway.serving import ChatService, store_unavailable
from gateway.session import RequestSession, deadline_error, failure, keep_running, usage_of
from runtime.background import Background
from runtime.redis import REDIS_DOWN

# A request with no terminal event this long after its deadline never will have one.
LOST_AFTER_S = 5.0


class ChatTask(BaseModel):
    """Body of `POST /chat`: one user prompt, optionally inside a conversation."""

    model_config = ConfigDict(extra="ignore")

    prompt: Text = Field(min_length=1, description="The user message.")
    system: Text | None = Field(None, description="An optional system message before the prompt.")
    model: Text | None = Field(None, description="Served model name; default: the gateway's default model.")
    conv_id: ConvId | None = Field(None, description="Conversation id (letters, digits, '_' and '-').")
    turn_id: TurnId | None = Field(None, description="Turn index; with conv_id, a retry is idempotent.")
    temperature: Temperature | None = None
    max_tokens: Tokens | None = None
    seed: Seed | None = None
    deadline_s: Deadline | None = None

    def to_chat(self) -> ChatCompletionRequest:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt})
        fields = self.model_dump(exclude={"prompt", "system"}, exclude_none=True)
        return ChatCompletionRequest(messages=messages, **fields)


def result_url(request_id: str) -> str:
    return f"/chat/result/{request_id}"


def pending(request_id: str) -> JSONResponse:
    body = {"request_id": request_id, "status": "pending", "result_url": result_url(request_id)}
    return JSONResponse(
        body,
        status_code=202,
        headers={"x-request-id": request_id, "Retry-After": "1", "Location": result_url(request_id)},
    )


def failed(request_id: str, err: APIError) -> JSONResponse:
    return JSONResponse(
        {"request_id": request_id, "status": "failed", **err.body()},
        status_code=err.status,
        headers={"x-request-id": request_id},
    )


def completed(request_id: str, terminal: ChatCompleted) -> JSONResponse:
    body = {
        "request_id": request_id,
        "status": "completed",
        "text": terminal.text,
        "finish_reason": terminal.finish_reason,
        "usage": usage_of(terminal),
        "model": terminal.model,
        "conv_id": terminal.conv_id,
        "turn_id": terminal.turn_id,
    }
    return JSONResponse(body, headers={"x-request-id": request_id})


def router(chat: ChatService) -> APIRouter:
    r = APIRouter(tags=["async"])
    results = chat.pipeline.results
    watchers = Background()

    async def watch(session: RequestSession) -> None:
        """Count the request as in flight until it ends (admission control sees it), and
        record its outcome like every other transport."""
        async with session:
            await session.finish()

    @r.post("/chat", status_code=202, responses=errors(400, 404, 409, 429, 503))
    async def submit(task: ChatTask, request: Request) -> JSONResponse:
        """Accept a prompt and answer 202 with the URL to poll for its result."""
        ticket, event = await chat.admit(
            task.to_chat(),
            request.headers.get("idempotency-key"),
            principal_of(request),
            limits_of(request),
            lease=lease_of(request),
        )
        await chat.remember(ticket)
        if event is None:  # attached: the earlier request's own watcher follows it
            ticket.close()
        else:  # published (or 503) before the 202; no client follows it: it runs on to its result
            watchers.spawn(watch(await chat.start(ticket, event, leave=keep_running)))
        response = pending(ticket.request_id)
        response.headers.update(ticket.headers)
        return response

    @r.get(
        "/chat/result/{request_id}",
        responses={
            202: {"description": "Still running; poll again after `Retry-After`"},
            **errors(400, 404, 429, 499, 500, 503, 504),
        },
    )
    async def result(request_id: str, request: Request) -> JSONResponse:
        """The request's answer, `pending` while it runs, or its failure (404 to anyone
        but the principal that created it)."""
        known = subjects.is_valid_token(request_id)
        try:
            owner = await chat.pipeline.keys.owner("req", request_id) if known else None
            terminal, record = None, None
            if known and owner is None:  # Redis lost it (or never knew it)? The stream has it.
                terminal, record = await chat.pipeline.recover(request_id)
                owner = record.get("principal") if record else None
            known = known and owner == principal_of(request)
            if known and terminal is None:
                stored = await results.get_result(request_id)
                terminal = decode_terminal(stored) if stored is not None else None
                record = record or (await results.pending(request_id) if terminal is None else None)
            elif not known:
                terminal, record = None, None
        except REDIS_DOWN as exc:
            raise store_unavailable() from exc
        if terminal is not None:
            if not isinstance(terminal, ChatCompleted):
                return failed(request_id, failure(terminal))
            return completed(request_id, terminal)
        if record is None:
            raise APIError(
                404,
                f"no request '{request_id}' is known here (results are kept {chat.settings.result_ttl_s} s)",
                "request_not_found",
                "request_id",
            )
        if time.time() > record["deadline_at"] + LOST_AFTER_S:
            return failed(request_id, deadline_error())
        return pending(request_id)

    return r
