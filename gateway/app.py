"""The HTTP gateway: a FastAPI app over the event pipeline.

`build_app` takes the pipeline as a parameter, so the routes can be tested against a
fake one (tests/unit/fake_pipeline.py) without NATS or Redis."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic.json_schema import models_json_schema

from gateway import errors, routes_async, routes_openai, ws
from gateway.access import Access, KeyGuard
from gateway.admission.hook import EarlyAdmission, refusal
from gateway.admission.leases import Admission
from gateway.admission.uvicorn_adapter import WebSocketProtocol, head_timeout_protocol
from gateway.arena import routes as arena_routes
from gateway.edge import BodyGuard, ServerTiming
from gateway.fleet_metrics import FLEET
from gateway.metrics import METRICS
from gateway.pipeline import Pipeline
from gateway.served_schema import one_board_query, served_contexts, with_served_limits
from gateway.serving import ChatService
from gateway.settings import GatewaySettings
from runtime import heap, tracing
from runtime.http import ProcessEndpoint

log = logging.getLogger(__name__)


def build_app(settings: GatewaySettings | None = None, pipeline: Pipeline | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    pipeline = pipeline or Pipeline(settings)
    admission = Admission(settings, pipeline)
    chat = ChatService(settings, pipeline, admission)
    # The operator's port: scraped without an API key, and answering while the API port
    # sheds load (its connection limit, the early gate) or Redis is down (key checks).
    endpoint = ProcessEndpoint(
        "gateway",
        lambda: pipeline.ready(settings.default_model)[0],
        settings.http_host,
        settings.metrics_port,
        settings.metrics_fd,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tracing.setup(settings, "gateway")
        if settings.metrics_port or settings.metrics_fd is not None:
            await endpoint.start()
        await pipeline.start()
        await admission.start()
        watcher = asyncio.create_task(FLEET.watch(pipeline))  # the fleet's series on /metrics
        heap.freeze()  # startup's objects: no full collection walks them in a burst
        yield
        watcher.cancel()
        await admission.stop()
        await pipeline.stop()
        await endpoint.stop()
        tracing.shutdown()

    app = FastAPI(title="arenaflow gateway", version="0.1.0", lifespan=lifespan)
    app.state.pipeline, app.state.chat, app.state.settings = pipeline, chat, settings
    app.state.admission = admission
    errors.install(app)
    app.include_router(ops_router(settings, pipeline))
    app.include_router(routes_openai.router(chat))
    app.include_router(routes_async.router(chat))
    app.include_router(ws.router(chat, settings))
    app.include_router(arena_routes.router(chat, settings))
    # Middleware added first runs last: the early gate sees a caller with a key and a read body.
    app.add_middleware(EarlyAdmission, admission=admission)
    app.add_middleware(BodyGuard, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s)
    # Added last, so it runs first: no body is read for a caller without a key.
    app.add_middleware(KeyGuard, access=Access(settings, pipeline.keys.redis))
    app.add_middleware(ServerTiming)  # outermost: times every response from its request's arrival
    # the document as served now: the deployment's and the served models' limits (gateway/served_schema.py)
    app.openapi = lambda: with_served_limits(  # type: ignore[method-assign]
        openapi(app), settings.admission_overhead_s, served_contexts(pipeline), settings.default_model
    )
    return app


def openapi(app: FastAPI) -> dict:
    """FastAPI's document, with the statuses the edge and the error handlers add: 400 in
    place of FastAPI's 422 (validation errors are answered 400), and 408/413 wherever a
    body is read."""
    if app.openapi_schema:
        return app.openapi_schema
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    error_ref = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    doc.setdefault("components", {}).setdefault("schemas", {})
    doc["components"]["schemas"].update(
        {name: schema for name, schema in _error_schemas().items() if name not in doc["components"]["schemas"]}
    )
    for item in doc["paths"].values():
        for op in item.values():
            responses = op.setdefault("responses", {})
            had_422 = responses.pop("422", None) is not None
            statuses = ["400"] if had_422 or op.get("parameters") else []
            if "requestBody" in op:
                statuses += ["400", "408", "413"]
            for status in statuses:
                responses.setdefault(status, {"description": errors.STATUS_TEXT[int(status)], **error_ref})
            if "429" in responses and "requestBody" in op:  # rate-limited: what clients pace themselves by
                responses["429"].setdefault("headers", {}).update({**RATE_LIMIT_HEADERS, **RETRY_AFTER})
                for ok in ("200", "202"):
                    if ok in responses:
                        responses[ok].setdefault("headers", {}).update(RATE_LIMIT_HEADERS)
    doc["components"]["schemas"].pop("HTTPValidationError", None)
    doc["components"]["schemas"].pop("ValidationError", None)
    one_board_query(doc)
    app.openapi_schema = doc
    return doc


def _header(description: str, type_: str = "string") -> dict:
    return {"description": description, "schema": {"type": type_}}


#: OpenAI's rate-limit headers (gateway/ratelimit.py), sent when the caller's key has limits.
RATE_LIMIT_HEADERS = {
    f"x-ratelimit-{what}-{unit}": _header(f"{text} ({unit} per minute; only when the key has limits)", type_)
    for unit in ("requests", "tokens")
    for what, text, type_ in (
        ("limit", "The key's limit", "integer"),
        ("remaining", "What is left of it now", "integer"),
        ("reset", "When it is full again, e.g. '6m0s' or '20ms'", "string"),
    )
}
RETRY_AFTER = {"Retry-After": _header("Seconds to wait before retrying", "integer")}


def _error_schemas() -> dict:
    _, defs = models_json_schema([(errors.ErrorBody, "validation")], ref_template="#/components/schemas/{model}")
    return defs["$defs"]


def ops_router(settings: GatewaySettings, pipeline: Pipeline) -> APIRouter:
    r = APIRouter(tags=["operations"])

    @r.get("/healthz")
    async def healthz() -> dict:
        """The process is up."""
        return {"status": "ok"}

    @r.get("/readyz", responses={503: {"description": "Not ready; the body says what is missing"}})
    async def readyz(request: Request) -> JSONResponse:
        """200 only when every required role has a live process and the default model is
        resident; the details (instances, models) only for a caller with a valid key."""
        ok, fleet = pipeline.ready(settings.default_model)
        body: dict[str, Any] = {"ready": ok}
        if request.state.principal is not None:
            body.update({"default_model": settings.default_model, **fleet.as_dict()})
        return JSONResponse(body, status_code=200 if ok else 503)

    @r.get("/metrics", responses={200: {"content": {"text/plain": {}}, "description": "Prometheus metrics"}})
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return r


def raise_open_files() -> int:
    """The soft limit on open files raised to the hard one (one descriptor per connection:
    a default soft limit of 1,024 would cap the open WebSockets far below max_websockets).
    Returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return soft


def main() -> None:
    settings = GatewaySettings()
    app = build_app(settings)
    METRICS.websockets.set_function(lambda: WebSocketProtocol.open)  # the protocol counts them
    files = raise_open_files()
    if files < settings.max_websockets + settings.max_connections:
        log.warning(
            "open-file limit below max_websockets + max_connections",
            extra={"limit": files, "max_websockets": settings.max_websockets},
        )
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_config=None,
        timeout_graceful_shutdown=10,
        # Slow and idle clients: a head must arrive within header_timeout_s (HeadTimeout),
        # a body within body_timeout_s (BodyGuard), an idle keep-alive connection closes.
        # A burst's refusals are answered as their bodies are read (gateway/admission/hook.py).
        http=head_timeout_protocol(settings.header_timeout_s, refuse=partial(refusal, app.state.admission)),
        timeout_keep_alive=settings.keep_alive_s,
        limit_concurrency=settings.max_connections,
        ws=WebSocketProtocol,
        ws_max_size=settings.max_ws_frame_bytes,
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        ws_per_message_deflate=settings.ws_per_message_deflate,
    )
    server = uvicorn.Server(config)
    # `arena up` hands over the socket it holds for the stack (infra.start_checks.listen_on).
    server.run(sockets=[socket.socket(fileno=settings.listen_fd)] if settings.listen_fd is not None else None)
    if not server.started:
        sys.exit(3)  # as uvicorn.run: it could not start (a failed bind, logged)
