"""runtime/tracing.py: off by default (no header, no span), W3C context in and out when on."""

from __future__ import annotations

import json
import logging

import pytest

from runtime import logs, tracing
from runtime.settings import CommonSettings
from tests.conftest import in_memory_traces


@pytest.fixture
def spans():
    with in_memory_traces() as exporter:
        yield exporter


def test_off_by_default_costs_no_header_and_no_span():
    assert not tracing.enabled()
    assert tracing.headers({"Nats-Msg-Id": "k"}) == {"Nats-Msg-Id": "k"}
    assert tracing.start("filter", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}) is None
    with tracing.consumed("delivery", None) as span, tracing.within(span):
        assert span is None
    tracing.setup(CommonSettings(), "filter")  # no endpoint: stays off
    assert not tracing.enabled()


def test_a_consumer_continues_the_trace_its_message_carries(spans):
    root = tracing.start("chat.request")
    with tracing.within(root):
        carrier = tracing.headers({"Nats-Msg-Id": "k"})
    assert carrier["Nats-Msg-Id"] == "k" and carrier["traceparent"].startswith("00-")
    with tracing.consumed("filter", carrier, request_id="r1") as span:
        hop = tracing.headers()
    tracing.span_at("prefill", tracing.start("inference", hop), 100.0, 100.5)
    tracing.end(root)
    tracing.end(root, "ended twice: ignored")
    done = {s.name: s for s in spans.get_finished_spans()}
    assert set(done) == {"chat.request", "filter", "prefill"}  # inference was never ended
    assert {s.context.trace_id for s in done.values()} == {root.get_span_context().trace_id}
    assert done["filter"].parent.span_id == root.get_span_context().span_id
    assert done["filter"].attributes["arena.request_id"] == "r1"
    assert span.get_span_context().span_id == done["filter"].context.span_id
    assert (done["prefill"].end_time - done["prefill"].start_time) == 500_000_000


def test_log_lines_inside_a_span_carry_its_trace_id(spans):
    root = tracing.start("chat.request")
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    record.request_id = "r1"
    with tracing.within(root):
        line = json.loads(logs.JsonFormatter().format(record))
    assert line["request_id"] == "r1"
    assert line["trace_id"] == format(root.get_span_context().trace_id, "032x")
    assert "trace_id" not in json.loads(logs.JsonFormatter().format(record))  # outside any span


def test_an_otlp_endpoint_switches_export_on(monkeypatch):
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    settings = CommonSettings(otlp_endpoint="http://127.0.0.1:1")
    try:
        tracing.setup(settings, "filter")
        provider = tracing._state["provider"]
        [processor] = provider._active_span_processor._span_processors
        assert isinstance(processor, BatchSpanProcessor)
        assert processor.span_exporter._endpoint == "http://127.0.0.1:1/v1/traces"
        assert provider.resource.attributes["service.name"] == "arena-filter"
    finally:
        tracing._state["provider"].shutdown()
        tracing.install(None)


def test_every_gateway_path_ends_the_request_s_trace(spans):
    """Answered, refused at admission, and attached to an earlier request (whose output
    nobody follows): each request's root span ends, with the outcome."""
    from fastapi.testclient import TestClient

    from gateway.app import build_app
    from tests.unit.fake_pipeline import FakePipeline, settings

    s = settings(max_queue_per_model=1)
    pipeline = FakePipeline(s)
    with TestClient(build_app(s, pipeline)) as client:
        body = {"prompt": "Once upon a time", "max_tokens": 8}
        first = client.post("/chat", json=body, headers={"Idempotency-Key": "k1"})
        again = client.post("/chat", json=body, headers={"Idempotency-Key": "k1"})
        pipeline.silent = True
        held = client.post("/chat", json={**body, "prompt": "held"})
        refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert (first.status_code, again.status_code, held.status_code, refused.status_code) == (202, 202, 202, 429)
    roots = [s for s in spans.get_finished_spans() if s.name == "chat.request"]
    rid = first.json()["request_id"]
    assert again.json()["request_id"] == rid
    answered = sorted((r for r in roots if r.attributes.get("arena.request_id") == rid), key=lambda r: r.start_time)
    assert [r.attributes["arena.attached"] for r in answered] == [False, True]
    assert all(r.status.is_ok for r in answered)
    [refusal] = [r for r in roots if "arena.request_id" not in r.attributes]
    assert refusal.status.description == "429 overloaded"
