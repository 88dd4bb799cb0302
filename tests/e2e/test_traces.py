"""One request, one trace, every stage: the pipeline's four processes run here, in one
event loop, over a real nats-server, redis-server and model, with the OpenTelemetry
SDK's in-memory exporter. The trace context crosses every hop in NATS headers, as it
does between separate processes (the provider is this process's, the propagation is not).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import time
from types import SimpleNamespace

import httpx
import nats
import pytest
import pytest_asyncio
import uvicorn
import websockets
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from consumers.delivery.app import build_app as delivery_app
from consumers.delivery.settings import DeliverySettings
from consumers.filter.app import build_app as filter_app
from consumers.filter.settings import FilterSettings
from consumers.inference.app import build_app as inference_app
from consumers.inference.settings import InferenceSettings
from events import subjects
from gateway.app import build_app as gateway_app
from gateway.settings import GatewaySettings
from infra.servers import start_nats, start_redis
from runtime import logs
from runtime.net import free_port
from tests.conftest import SHARED, in_memory_traces

pytestmark = [pytest.mark.timeout(180), pytest.mark.asyncio(loop_scope="module")]

#: The stages every answered request's trace holds.
STAGES = {
    "chat.request",
    "gateway.admission",
    "filter",
    "inference",
    "stream.queue_wait",
    "batch.wait",
    "prefill",
    "decode",
    "delivery",
    "client.stream",
}


@pytest.fixture(scope="module")
def exporter():
    with in_memory_traces() as spans:
        yield spans


@pytest.fixture(scope="module")
def log_lines():
    """The processes' JSON log lines, as `arena run` writes them."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield out
    root.removeHandler(handler)
    root.setLevel(level)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def pipeline(tmp_path_factory, exporter, log_lines):
    tmp = tmp_path_factory.mktemp("traces")
    nats_srv, redis_srv = start_nats(tmp / "nats"), start_redis(tmp / "redis")
    common = {"nats_url": nats_srv.url, "redis_url": redis_srv.url, "heartbeat_s": 0.2}
    consumers = [
        filter_app(FilterSettings(**common)),
        delivery_app(DeliverySettings(**common)),
        inference_app(InferenceSettings(**common, models_dir=str(SHARED / "models"))),
    ]
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(gateway_app(GatewaySettings(**common, port=port)), port=port, log_config=None, lifespan="on")
    )
    serving = None
    try:
        for app in consumers:
            await app.start()
        serving = asyncio.create_task(server.serve())
        url = f"http://127.0.0.1:{port}"
        async with httpx.AsyncClient(base_url=url) as client:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    if (await client.get("/readyz")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        yield SimpleNamespace(url=url, nats_url=nats_srv.url)
    finally:
        server.should_exit = True
        if serving is not None:
            await serving
        for app in reversed(consumers):
            await app.stop()
        nats_srv.stop()
        redis_srv.stop()


@pytest.fixture
def gateway_url(pipeline) -> str:
    return pipeline.url


async def trace_of(exporter: InMemorySpanExporter, request_id: str) -> list:
    """The request's spans, once its trace holds every stage (the last ones end after
    the client has its answer: delivery of the terminal event, the gateway's close)."""
    end = time.monotonic() + 10
    spans: list = []
    while time.monotonic() < end:
        roots = [
            s
            for s in exporter.get_finished_spans()
            if s.name == "chat.request" and s.attributes.get("arena.request_id") == request_id
        ]
        if roots:
            tid = roots[0].context.trace_id
            spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == tid]
            if {s.name for s in spans} >= STAGES and _terminal_delivered(spans):
                return spans
        await asyncio.sleep(0.1)
    return spans


def _terminal_delivered(spans) -> bool:
    return any(s.name == "delivery" and s.attributes.get("arena.event") == "chat.completed" for s in spans)


def assert_one_connected_trace(spans: list) -> None:
    names = {s.name for s in spans}
    assert names >= STAGES, f"missing stages: {STAGES - names}"
    roots = [s for s in spans if s.parent is None]
    assert [r.name for r in roots] == ["chat.request"], "one root, the gateway's"
    ids = {s.context.span_id for s in spans}
    orphans = [s.name for s in spans if s.parent is not None and s.parent.span_id not in ids]
    assert not orphans, f"spans whose parent is not in the trace: {orphans}"
    by_id = {s.context.span_id: s for s in spans}

    def chain(span) -> list[str]:
        out = [span.name]
        while span.parent is not None:
            span = by_id[span.parent.span_id]
            out.append(span.name)
        return out

    decode = next(s for s in spans if s.name == "decode")
    # The hops in order: the gateway published into filter, filter into inference.
    assert chain(decode) == ["decode", "inference", "filter", "chat.request"]
    delivery = next(s for s in spans if s.name == "delivery")
    assert chain(delivery)[:2] == ["delivery", "inference"]
    for s in spans:
        assert s.end_time >= s.start_time, s.name


def assert_logged_with_trace(log_lines: io.StringIO, request_id: str, trace_id: int) -> None:
    lines = [json.loads(line) for line in log_lines.getvalue().splitlines() if request_id in line]
    traced = [line for line in lines if line.get("trace_id") == format(trace_id, "032x")]
    assert traced, f"no log line of {request_id} carries its trace id: {lines}"


BODY = {"messages": [{"role": "user", "content": "Once upon a time"}], "max_tokens": 12, "temperature": 0}


async def test_http_request_is_one_trace(gateway_url, exporter, log_lines):
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    spans = await trace_of(exporter, rid)
    assert_one_connected_trace(spans)
    assert_logged_with_trace(log_lines, rid, spans[0].context.trace_id)


async def test_sse_stream_is_one_trace(gateway_url, exporter, log_lines):
    async with (
        httpx.AsyncClient(base_url=gateway_url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as r,
    ):
        assert r.status_code == 200
        rid = r.headers["x-request-id"]
        body = "".join([part async for part in r.aiter_text()])
    assert body.rstrip().endswith("data: [DONE]")
    spans = await trace_of(exporter, rid)
    assert_one_connected_trace(spans)
    root = next(s for s in spans if s.name == "chat.request")
    assert root.attributes["arena.stream"] is True
    assert_logged_with_trace(log_lines, rid, root.context.trace_id)


async def test_websocket_turn_is_one_trace(gateway_url, exporter, log_lines):
    async with websockets.connect(gateway_url.replace("http", "ws") + "/v1/ws") as ws:
        assert json.loads(await ws.recv())["type"] == "session"
        await ws.send(json.dumps({"type": "turn", "content": "Once upon a time", "max_tokens": 12}))
        while (frame := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] == "chunk":
            pass
    assert frame["type"] == "done", frame
    spans = await trace_of(exporter, frame["request_id"])
    assert_one_connected_trace(spans)
    assert_logged_with_trace(log_lines, frame["request_id"], spans[0].context.trace_id)


async def test_chat_task_is_one_trace(gateway_url, exporter):
    async with httpx.AsyncClient(base_url=gateway_url, timeout=30) as client:
        r = await client.post("/chat", json={"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 202, r.text
    assert_one_connected_trace(await trace_of(exporter, r.json()["request_id"]))


async def test_the_trace_comes_back_to_the_gateway_with_the_output(pipeline, exporter):
    nc = await nats.connect(pipeline.nats_url)
    live = await nc.subscribe(f"{subjects.LIVE_PREFIX}.>")
    try:
        async with httpx.AsyncClient(base_url=pipeline.url, timeout=30) as client:
            r = await client.post("/v1/chat/completions", json=BODY)
        rid = r.headers["x-request-id"]
        spans = await trace_of(exporter, rid)
        trace_id = format(spans[0].context.trace_id, "032x")
        # Chunks go live from inference, terminal results from delivery (and inference).
        delivered = {s.context.span_id for s in spans if s.name in ("delivery", "inference")}
        seen = []
        while True:
            try:
                msg = await live.next_msg(timeout=1)
            except TimeoutError:
                break
            if msg.subject == subjects.live_subject(rid):
                _, tid, parent, _ = msg.headers["traceparent"].split("-")
                seen.append((tid, int(parent, 16)))
    finally:
        await nc.close()
    assert seen, "no live message for the request"
    assert all(tid == trace_id and parent in delivered for tid, parent in seen), seen
