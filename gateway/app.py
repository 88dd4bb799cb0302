"""The HTTP gateway: a FastAPI app over the event pipeline.

`build_app` takes the pipeline as a parameter, so the routes can be tested against a
fake one (tests/unit/fake_pipeline.py) without NATS or Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway import errors, routes_async, routes_openai, ws
from gateway.arena import routes as arena_routes
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.pipeline import Pipeline
from gateway.serving import ChatService
from runtime.settings import GatewaySettings

#: Paths under these prefixes need an API key when keys are configured.
GUARDED = ("/v1", "/chat")


def build_app(settings: GatewaySettings | None = None, pipeline: Pipeline | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    pipeline = pipeline or Pipeline(settings)
    chat = ChatService(settings, pipeline)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pipeline.start()
        yield
        await pipeline.stop()

    app = FastAPI(title="arenaflow gateway", version="0.1.0", lifespan=lifespan)
    app.state.pipeline, app.state.chat, app.state.settings = pipeline, chat, settings
    errors.install(app)
    app.middleware("http")(guard(settings))
    app.include_router(ops_router(settings, pipeline))
    app.include_router(routes_openai.router(chat))
    app.include_router(routes_async.router(chat))
    app.include_router(ws.router(chat, settings))
    app.include_router(arena_routes.router(chat, settings))
    return app


def guard(settings: GatewaySettings):
    """API keys and the body-size limit, checked before a route runs."""

    async def middleware(request: Request, call_next):
        if request.url.path.startswith(GUARDED):
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

    return middleware


def ops_router(settings: GatewaySettings, pipeline: Pipeline) -> APIRouter:
    r = APIRouter(tags=["operations"])

    @r.get("/healthz")
    async def healthz() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @r.get("/readyz")
    async def readyz() -> JSONResponse:
        """200 only when every required role has a live process and the default model is resident."""
        ok, fleet = pipeline.ready(settings.default_model)
        body = {"ready": ok, "default_model": settings.default_model, **fleet}
        return JSONResponse(body, status_code=200 if ok else 503)

    @r.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return r


def main() -> None:
    settings = GatewaySettings()
    uvicorn.run(
        build_app(settings), host=settings.host, port=settings.port, log_config=None, timeout_graceful_shutdown=10
    )
