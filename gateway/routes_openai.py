"""OpenAI's API: `POST /v1/chat/completions` and `POST /v1/completions` (JSON and SSE
streaming), `GET /v1/models`. Both generation routes are one path (`serve`): the same
admission, events and output, shaped by `gateway.shapes`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from gateway.access import limits_of, principal_of
from gateway.admission.hook import lease_of
from gateway.errors import APIError, errors
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.serving import ChatService
from gateway.session import RequestSession, Ticket, answer_of, extra_of, usage_of
from gateway.shapes import ChatShape, CompletionShape, Shape, sse


async def stream_events(session: RequestSession, include_usage: bool, shape: Shape) -> AsyncIterator[str]:
    """The SSE body: the opening chunks, the text chunks, the finish (or an error object), [DONE]."""
    async with session:
        for opening in shape.opening():
            yield sse(opening)
        async for chunk in session:
            yield sse(shape.chunk(chunk.text, chunk.logprobs))
        answer = session.answer
        if isinstance(answer, APIError):
            yield sse(answer.body())
        else:
            if rest := session.remainder():
                yield sse(shape.chunk(rest, None))
            # The finish chunk carries what the JSON answer's `x_arena` does (ids, the
            # server's own timings), so a streaming client can tell its wait from the model's.
            yield sse(shape.finish(answer.finish_reason) | {"x_arena": extra_of(session.ticket, answer)})
            if include_usage:
                yield sse(shape.usage(usage_of(answer)))
        yield "data: [DONE]\n\n"


def router(chat: ChatService) -> APIRouter:
    r = APIRouter(tags=["openai"])

    def served() -> dict[str, dict]:
        return {
            name: {"id": name, "object": "model", "created": 0, "owned_by": "arenaflow", "resident_on": len(insts)}
            for name, insts in sorted(chat.pipeline.fleet().models.items())
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

    @r.post("/v1/chat/completions", responses=generation_responses("The completion (JSON)"))
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        """A chat completion; `stream: true` answers with server-sent events."""
        return await serve(
            chat, req, request, lambda ticket: ChatShape(ticket.request_id, ticket.model, bool(req.logprobs))
        )

    @r.post("/v1/completions", responses=generation_responses("The completion (`text_completion`)"))
    async def completions(req: CompletionRequest, request: Request):
        """A completion of a plain prompt (no chat template); `stream: true` answers with server-sent events."""
        logprobs = req.logprobs is not None
        shape = lambda ticket: CompletionShape(ticket.request_id, ticket.model, logprobs)  # noqa: E731
        return await serve(chat, req.to_chat(), request, shape)

    return r


def generation_responses(answer: str) -> dict:
    """The statuses a generation route answers, for its OpenAPI entry."""
    return {
        200: {
            "description": f"{answer}, or with `stream: true` server-sent events",
            "content": {"application/json": {}, "text/event-stream": {}},
        },
        **errors(400, 404, 409, 429, 499, 500, 503, 504),
    }


@contextmanager
def named_as(req: ChatCompletionRequest) -> Iterator[None]:
    """Errors naming the messages name a completion's `prompt`, the field its client sent."""
    try:
        yield
    except APIError as err:
        if req.prompt_format == "text" and err.param == "messages":
            err.param = "prompt"
            err.message = err.message.replace("messages:", "prompt:", 1)
        raise


async def serve(
    chat: ChatService, req: ChatCompletionRequest, request: Request, shape_for: Callable[[Ticket], Shape]
) -> Response:
    """Admit, run and answer one generation request (JSON, or SSE with `stream: true`)."""
    with named_as(req):
        ticket, event = await chat.admit(
            req,
            request.headers.get("idempotency-key"),
            principal_of(request),
            limits_of(request),
            lease=lease_of(request),
        )
    headers = {"x-request-id": ticket.request_id, **ticket.headers}
    shape = shape_for(ticket)
    session = await chat.start(ticket, event)  # published before the response head
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        # The background close also runs when the client left before the body started.
        return StreamingResponse(
            stream_events(session, include_usage, shape),
            media_type="text/event-stream",
            headers=headers,
            background=BackgroundTask(session.close),
        )
    async with session:
        answer = answer_of(await session.finish())
    if isinstance(answer, APIError):
        answer.headers.update(headers)
        with named_as(req):
            raise answer
    reply = shape.answer(answer.text, answer.finish_reason, usage_of(answer), session.logprobs)
    return JSONResponse(reply | {"x_arena": extra_of(ticket, answer)}, headers=headers)
