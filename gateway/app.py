"""The HTTP gateway: a FastAPI app over the event pipeline."""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import errors, routes_async, ws
from gateway.assembler import Assembler
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import Pipeline
from gateway.protocol import ChatCompletionRequest, chunk_body, completion_body
from gateway.serving_chat import ChatService, Ticket, extra_of, failure, usage_of, wait_terminal
from infra.settings import GatewaySettings

log = logging.getLogger("arena.gateway")


def build_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    pipeline = Pipeline(settings)
    chat = ChatService(settings, pipeline)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await pipeline.start()
        yield
        await pipeline.stop()

    app = FastAPI(title="arenaflow gateway", version="0.1.0", lifespan=lifespan)
    app.state.pipeline, app.state.chat, app.state.settings = pipeline, chat, settings
    errors.install(app)
    app.include_router(routes_async.router(chat, pipeline, settings))
    app.include_router(ws.router(chat, pipeline, settings))

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/v1") or request.url.path.startswith("/chat"):
            if settings.api_keys:
                auth = request.headers.get("authorization", "")
                if not auth.startswith("Bearer ") or auth[7:] not in settings.api_keys:
                    METRICS.rejections.labels(reason="unauthorized").inc()
                    return APIError(
                        401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key"
                    ).response()
            length = request.headers.get("content-length")
            if length and length.isdigit() and int(length) > settings.max_body_bytes:
                METRICS.rejections.labels(reason="body_too_large").inc()
                return APIError(413, f"request body over {settings.max_body_bytes} bytes", "body_too_large").response()
        return await call_next(request)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        ok, fleet = pipeline.ready(settings.default_model)
        return JSONResponse(
            {"ready": ok, "default_model": settings.default_model, **fleet}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        fleet = pipeline.fleet()
        return {
            "object": "list",
            "data": [
                {"id": name, "object": "model", "created": 0, "owned_by": "arenaflow", "resident_on": len(insts)}
                for name, insts in sorted(fleet["models"].items())
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        ticket, event = await chat.admit(req, request.headers.get("idempotency-key"))
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                stream_chat(request, ticket, event, include_usage),
                media_type="text/event-stream",
                headers={"x-request-id": ticket.request_id},
            )
        return await answer_chat(request, ticket, event)

    async def answer_chat(request: Request, ticket: Ticket, event) -> JSONResponse:
        started = time.perf_counter()
        chat.enter(ticket.model)
        try:
            async with pipeline.follow(ticket.request_id) as follower:
                if event is not None:
                    await pipeline.publish(event)
                terminal = await wait_terminal(follower, ticket)
        finally:
            chat.leave(ticket.model)
        rid = {"x-request-id": ticket.request_id}
        if terminal is None:
            METRICS.requests.labels(ticket.model, "504").inc()
            raise APIError(504, "no answer before the request's deadline", "deadline_exceeded", headers=rid)
        if terminal.type != "chat.completed":
            err = failure(terminal)
            err.headers.update(rid)
            METRICS.requests.labels(ticket.model, str(err.status)).inc()
            raise err
        METRICS.requests.labels(ticket.model, "200").inc()
        METRICS.latency.labels(ticket.model).observe(time.perf_counter() - started)
        body = completion_body(
            ticket.request_id,
            ticket.model,
            terminal.text,
            terminal.finish_reason,
            usage_of(terminal),
            extra_of(ticket, terminal),
        )
        return JSONResponse(body, headers={"x-request-id": ticket.request_id})

    async def stream_chat(request: Request, ticket: Ticket, event, include_usage: bool):
        started = time.perf_counter()
        first = True
        finished = False

        def sse(body: dict) -> str:
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        chat.enter(ticket.model)
        try:
            async with pipeline.follow(ticket.request_id) as follower:
                if event is not None:
                    await pipeline.publish(event)
                yield sse(chunk_body(ticket.request_id, ticket.model, {"role": "assistant", "content": ""}))
                asm = Assembler()
                backlog = await pipeline.history(ticket.request_id) if ticket.attached else []
                terminal_seen = None
                async for ev in follower.events(until=ticket.deadline_at + 2.0, backlog=backlog):
                    for chunk in asm.add(ev):
                        if first:
                            METRICS.ttft.labels(ticket.model).observe(time.perf_counter() - started)
                            first = False
                        yield sse(chunk_body(ticket.request_id, ticket.model, {"content": chunk.text}))
                    if asm.terminal is not None and terminal_seen is None:
                        terminal_seen = time.monotonic()
                    # Chunks that never come live (delivered before a retry attached) are
                    # sent from the completed text after a short wait.
                    if asm.done or (terminal_seen and time.monotonic() - terminal_seen > 0.3):
                        break
                terminal = asm.terminal
                if terminal is None:
                    METRICS.requests.labels(ticket.model, "504").inc()
                    yield sse(APIError(504, "no answer before the request's deadline", "deadline_exceeded").body())
                elif terminal.type != "chat.completed":
                    err = failure(terminal)
                    METRICS.requests.labels(ticket.model, str(err.status)).inc()
                    yield sse(err.body())
                else:
                    rest = asm.remainder()
                    if rest:
                        yield sse(chunk_body(ticket.request_id, ticket.model, {"content": rest}))
                    yield sse(chunk_body(ticket.request_id, ticket.model, {}, terminal.finish_reason))
                    if include_usage:
                        yield sse(
                            chunk_body(ticket.request_id, ticket.model, {}, usage=usage_of(terminal), with_choice=False)
                        )
                    METRICS.requests.labels(ticket.model, "200").inc()
                    METRICS.latency.labels(ticket.model).observe(time.perf_counter() - started)
                finished = True
                yield "data: [DONE]\n\n"
        finally:
            chat.leave(ticket.model)
            if not finished and not ticket.attached:
                # The client went away mid-stream: stop spending the model on it. The
                # shield lets the publish finish inside the cancelled response task.
                with anyio.CancelScope(shield=True):
                    await pipeline.cancel(ticket.request_id, ticket.conv_id, ticket.turn_id)

    return app
