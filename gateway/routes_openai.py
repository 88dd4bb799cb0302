"""OpenAI's API: `POST /v1/chat/completions` (JSON and SSE streaming) and `GET /v1/models`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from gateway.access import limits_of, principal_of
from gateway.errors import APIError, errors
from gateway.metrics import METRICS
from gateway.pipeline import Output
from gateway.protocol import ChatCompletionRequest, chunk_body, completion_body
from gateway.serving import ChatService, Ticket, extra_of, outcome, usage_of


def sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_events(
    chat: ChatService, ticket: Ticket, output: Output, include_usage: bool, started: float
) -> AsyncIterator[str]:
    """The SSE body: a role chunk, the text chunks, the finish (or an error object), [DONE]."""
    rid, model = ticket.request_id, ticket.model
    finished = False
    try:
        yield sse(chunk_body(rid, model, {"role": "assistant", "content": ""}))
        first = True
        async for chunk in output:
            if first:
                METRICS.ttft.labels(model).observe(time.perf_counter() - started)
                first = False
            yield sse(chunk_body(rid, model, {"content": chunk.text}))
        terminal, err = output.terminal, outcome(output.terminal)
        chat.record(model, err, started)
        if err is not None:
            yield sse(err.body())
        else:
            if rest := output.remainder():
                yield sse(chunk_body(rid, model, {"content": rest}))
            # The finish chunk carries what the JSON answer's `x_arena` does (ids, the
            # server's own timings), so a streaming client can tell its wait from the model's.
            yield sse(chunk_body(rid, model, {}, terminal.finish_reason) | {"x_arena": extra_of(ticket, terminal)})
            if include_usage:
                yield sse(chunk_body(rid, model, {}, usage=usage_of(terminal), with_choice=False))
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        await output.close()
        if not finished and not ticket.attached:
            # The client went away mid-stream: stop spending the model on it. The
            # shield lets the publish finish inside the cancelled response task.
            with anyio.CancelScope(shield=True):
                await chat.pipeline.cancel(rid, ticket.conv_id, ticket.turn_id)


def router(chat: ChatService) -> APIRouter:
    r = APIRouter(tags=["openai"])

    def served() -> dict[str, dict]:
        return {
            name: {"id": name, "object": "model", "created": 0, "owned_by": "arenaflow", "resident_on": len(insts)}
            for name, insts in sorted(chat.pipeline.fleet()["models"].items())
        }

    @r.get("/v1/models")
    async def models() -> dict:
        """The served models and how many inference processes hold each one."""
        return {"object": "list", "data": list(served().values())}

    @r.get("/v1/models/{model_id:path}", responses=errors(404))
    async def model(model_id: str) -> dict:
        """One served model (the openai SDK's `models.retrieve`); 404 when none holds it."""
        if (found := served().get(model_id)) is None:
            raise APIError(404, f"model '{model_id}' is not served; see GET /v1/models", "model_not_found", "model")
        return found

    @r.post(
        "/v1/chat/completions",
        responses={
            200: {
                "description": "The completion (JSON), or with `stream: true` server-sent events",
                "content": {"application/json": {}, "text/event-stream": {}},
            },
            **errors(400, 404, 409, 429, 499, 500, 503, 504),
        },
    )
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        """A chat completion; `stream: true` answers with server-sent events."""
        started = time.perf_counter()
        ticket, event = await chat.admit(
            req, request.headers.get("idempotency-key"), principal_of(request), limits_of(request)
        )
        headers = {"x-request-id": ticket.request_id, **ticket.headers}
        if req.stream:
            output = await chat.start(ticket, event)  # published before the response head
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = stream_events(chat, ticket, output, include_usage, started)
            # The background close also runs when the client left before the body started.
            return StreamingResponse(
                body, media_type="text/event-stream", headers=headers, background=BackgroundTask(output.close)
            )
        terminal = await chat.answer(ticket, event)
        err = outcome(terminal)
        chat.record(ticket.model, err, started)
        if err is not None:
            err.headers.update(headers)
            raise err
        answer = completion_body(
            ticket.request_id,
            ticket.model,
            terminal.text,
            terminal.finish_reason,
            usage_of(terminal),
            extra_of(ticket, terminal),
        )
        return JSONResponse(answer, headers=headers)

    return r
