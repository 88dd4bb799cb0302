"""The gateway's routes against a fake pipeline (no servers): the fast tier.

The real-server versions of these behaviours are in tests/e2e/."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from gateway.admission.estimate import ModelQueue
from gateway.app import build_app
from tests.unit.fake_pipeline import FakePipeline, chat, gateway, settings


def metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_non_streaming_answer_and_request_id():
    client, pipeline = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200
    body = r.json()
    assert body["choices"][0]["message"]["content"] == "Once upon a time"
    assert r.headers["x-request-id"] == body["x_arena"]["request_id"]
    [event] = pipeline.requests()
    assert event.params.max_tokens == 64 and event.params.temperature == 1.0  # the one set of defaults


def test_streaming_sends_chunks_in_order_then_done():
    client, _ = gateway()
    with (
        client,
        client.stream(
            "POST", "/v1/chat/completions", json=chat(stream=True, stream_options={"include_usage": True})
        ) as r,
    ):
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    bodies = [json.loads(line[6:]) for line in lines[:-1]]
    text = "".join(b["choices"][0]["delta"].get("content", "") for b in bodies if b["choices"])
    assert text == "Once upon a time"
    assert bodies[-1]["usage"]["completion_tokens"] == 4
    finish = next(b for b in bodies if b["choices"] and b["choices"][0]["finish_reason"])
    assert finish["x_arena"]["request_id"] == r.headers["x-request-id"]  # the server's timings, as JSON answers carry
    assert set(finish["x_arena"]["timings"]) >= {"queue_wait_s", "ttft_s", "compute_s"}


def test_failure_maps_to_status_and_error_shape():
    client, _ = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=chat("fail me"))
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert r.headers["content-type"].startswith("application/json")


def test_deadline_gives_504_and_is_counted():
    client, pipeline = gateway(admission_overhead_s=0)  # admitted, then the fleet stays silent
    pipeline.silent = True
    with client:
        before = metric(client, 'arena_req_total{model="stories-260k",status="504"}')
        r = client.post("/v1/chat/completions", json=chat(deadline_s=0.1))
        after = metric(client, 'arena_req_total{model="stories-260k",status="504"}')
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert after == before + 1


def test_publish_failure_is_json_503_and_releases_the_key():
    client, pipeline = gateway()
    with client:
        pipeline.fail_publish = True
        r = client.post("/v1/chat/completions", json=chat(), headers={"Idempotency-Key": "k1"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "stream_unavailable"
        pipeline.fail_publish = False
        r = client.post("/v1/chat/completions", json=chat(), headers={"Idempotency-Key": "k1"})
    assert r.status_code == 200 and r.json()["x_arena"]["attached"] is False  # the retry ran


def test_streaming_publish_failure_comes_before_the_response_head():
    client, pipeline = gateway()
    pipeline.fail_publish = True
    with client:
        r = client.post("/v1/chat/completions", json=chat(stream=True))
    assert r.status_code == 503 and r.headers["content-type"].startswith("application/json")


def test_idempotency_key_attaches_and_conflicts():
    client, pipeline = gateway()
    with client:
        first = client.post("/v1/chat/completions", json=chat(), headers={"Idempotency-Key": "same"})
        again = client.post("/v1/chat/completions", json=chat(), headers={"Idempotency-Key": "same"})
        other = client.post("/v1/chat/completions", json=chat("other"), headers={"Idempotency-Key": "same"})
    assert again.json()["x_arena"]["request_id"] == first.json()["x_arena"]["request_id"]
    assert again.json()["x_arena"]["attached"] is True
    assert len(pipeline.requests()) == 1
    assert other.status_code == 409 and other.json()["error"]["param"] == "Idempotency-Key"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        (chat(temperature=3), "temperature"),
        (chat(max_tokens=0), "max_tokens"),
        (chat(conv_id="a.b", turn_id=0), "conv_id"),
        (chat(model="nope"), "model"),
        (chat("x" * 40_000), "messages"),
    ],
)
def test_bad_input_names_the_field(body, param):
    client, _ = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=body)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param


def test_async_api_result_and_unknown_id():
    client, _ = gateway()
    with client:
        r = client.post("/chat", json={"prompt": "Hello there", "max_tokens": 8})
        assert r.status_code == 202
        rid = r.json()["request_id"]
        result = client.get(f"/chat/result/{rid}")
        missing = client.get("/chat/result/nope")
    assert result.status_code == 200 and result.json()["text"] == "Hello there"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "request_not_found"


def test_websocket_turn_is_counted_in_request_metrics():
    client, _ = gateway()
    with client:
        before = metric(client, 'arena_req_total{model="stories-260k",status="200"}')
        latency_before = metric(client, 'arena_req_latency_seconds_count{model="stories-260k"}')
        with client.websocket_connect("/v1/ws") as ws:
            assert ws.receive_json()["type"] == "session"
            ws.send_json({"type": "turn", "content": "Once upon a time"})
            frames = [ws.receive_json()]
            while frames[-1]["type"] == "chunk":
                frames.append(ws.receive_json())
        after = metric(client, 'arena_req_total{model="stories-260k",status="200"}')
        latency_after = metric(client, 'arena_req_latency_seconds_count{model="stories-260k"}')
    assert frames[-1]["type"] == "done" and frames[-1]["text"] == "Once upon a time"
    assert [f["seq"] for f in frames[:-1]] == [0, 1, 2, 3]
    assert after == before + 1 and latency_after == latency_before + 1


def test_api_keys_guard_the_api_but_not_health():
    client, _ = gateway(api_keys=["secret"])
    with client:
        assert client.get("/healthz").status_code == 200
        assert client.post("/v1/chat/completions", json=chat()).status_code == 401
        ok = client.post("/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer secret"})
    assert ok.status_code == 200


def test_unexpected_error_is_json_500():
    client, pipeline = gateway()

    def boom():
        raise RuntimeError("broken fleet")

    pipeline.fleet = boom  # type: ignore[method-assign]
    with TestClient(client.app, raise_server_exceptions=False) as c:
        r = c.post("/v1/chat/completions", json=chat())
    assert r.status_code == 500
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["code"] == "internal_error"


async def test_a_burst_beyond_the_queue_limit_gets_429_and_leaks_no_slot():
    s = settings(max_queue_per_model=2, admission_overhead_s=0)  # the backstop under test, not the estimate
    pipeline = FakePipeline(s)
    pipeline.silent = True
    app = build_app(s, pipeline)
    transport = httpx.ASGITransport(app=app)
    refused = {"model": "stories-260k", "status": "429"}
    before = REGISTRY.get_sample_value("arena_req_total", refused) or 0
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        bodies = [chat(deadline_s=0.3, stream=i % 2 == 0) for i in range(8)]
        rs = await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))
    codes = sorted(r.status_code for r in rs)
    assert codes.count(429) == 6, codes
    assert REGISTRY.get_sample_value("arena_req_total", refused) == before + 6  # counted per model
    assert all(r.headers["content-type"].startswith(("application/json", "text/event-stream")) for r in rs)
    assert app.state.chat.admission.in_flight["stories-260k"] == 0


def test_a_temperature_the_sampler_cannot_honour_is_400_on_every_transport():
    client, pipeline = gateway()
    with client:
        v1 = client.post("/v1/chat/completions", json=chat(temperature=1e-300))
        task = client.post("/chat", json={"prompt": "hi", "temperature": 1e-300})
        with client.websocket_connect("/v1/ws") as ws:
            ws.receive_json()
            ws.send_json({"type": "turn", "content": "hi", "temperature": 1e-300})
            frame = ws.receive_json()
    assert (v1.status_code, v1.json()["error"]["param"]) == (400, "temperature")
    assert (task.status_code, task.json()["error"]["param"]) == (400, "temperature")
    assert (frame["type"], frame["status"], frame["error"]["param"]) == ("error", 400, "temperature")
    assert pipeline.requests() == []


def test_a_new_conversation_is_owned_by_its_caller_when_the_client_hears_of_it():
    client, pipeline = gateway()
    with client:
        r = client.post("/v1/chat/completions", json=chat(stream=True))
        rid = r.headers["x-request-id"]
        owners = (
            client.portal.call(pipeline.keys.owner, "req", rid),
            client.portal.call(pipeline.keys.owner, "conv", rid),
        )
    assert r.status_code == 200
    assert owners[0] is not None and owners[0] == owners[1]  # the request and its conversation, one owner


def test_redis_lost_while_a_new_conversation_is_bound_is_503_and_the_request_is_cancelled():
    from redis.exceptions import ConnectionError as RedisConnectionError

    client, pipeline = gateway()
    pipeline.silent = True  # the request would run; the cancellation ends it

    async def down(*_):
        raise RedisConnectionError("redis went away")

    pipeline.keys.bind_owner = down  # type: ignore[method-assign]
    with client:
        r = client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 503 and r.json()["error"]["code"] == "store_unavailable"
    kinds = [e.type for e in pipeline.published]
    assert kinds == ["chat.requested", "chat.cancelled"]


async def test_the_edge_lease_is_the_one_the_request_is_served_and_published_with():
    """The early gate's lease (middleware) travels to the route and the serving layer: it
    is published with the request (the gate's entry marked, not dropped), the fleet-wide
    entry recorded once, and the queue place given back; no second check in between."""
    s = settings()
    pipeline = FakePipeline(s)
    pipeline.queue = lambda model: ModelQueue(32, 0, 0, 0.02, 0.02, time.time())  # measured: the gate judges
    app = build_app(s, pipeline)
    admission = app.state.admission
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
        r = await client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    await asyncio.gather(*admission.background)
    [(member, (_, tokens))] = admission.gate.passed["stories-260k"].items()  # published, not dropped
    assert tokens == 64 and admission.gate.unreserved["stories-260k"] == {}
    recent = await admission.recent.redis.zrange("arena:admitted:stories-260k", 0, -1)
    assert recent == [f"{member}:64".encode()]  # the lone gateway's entry, recorded once published
    assert admission.in_flight["stories-260k"] == 0


def test_a_budget_too_long_for_the_deadline_even_alone_is_400_on_every_transport():
    """A worker that makes a token every 60 ms alone cannot make 256 in 15 s: 400
    deadline_too_short naming the field (never a 429 to retry), before anything is
    published; 200 tokens fit, and a longer deadline_s would too."""
    from events.fleet import ModelLoad

    client, pipeline = gateway()
    load = ModelLoad(max_batch=8, step_s=0.07, alone_step_s=0.06, measured_at=0.0)  # idle, measured long ago
    pipeline.hold(load)
    with client:
        v1 = client.post("/v1/chat/completions", json=chat(max_tokens=256))
        sse = client.post("/v1/chat/completions", json=chat(max_completion_tokens=256, stream=True))
        task = client.post("/chat", json={"prompt": "hi", "max_tokens": 256})
        with client.websocket_connect("/v1/ws") as ws:
            ws.receive_json()
            ws.send_json({"type": "turn", "content": "hi", "max_tokens": 256})
            frame = ws.receive_json()
        fits = client.post("/v1/chat/completions", json=chat(max_tokens=200))
        longer = client.post("/v1/chat/completions", json=chat(max_tokens=256, deadline_s=60))
    error = v1.json()["error"]
    assert (v1.status_code, error["code"], error["param"]) == (400, "deadline_too_short", "max_tokens"), error
    assert "at most 241 tokens, or a deadline_s up to 120" in error["message"]
    assert (sse.status_code, sse.json()["error"]["param"]) == (400, "max_completion_tokens")
    assert (task.status_code, task.json()["error"]["code"]) == (400, "deadline_too_short")
    assert (frame["type"], frame["status"], frame["error"]["param"]) == ("error", 400, "max_tokens")
    assert fits.status_code == 200 and longer.status_code == 200, (fits.text, longer.text)
    assert len(pipeline.requests()) == 2


def test_answers_faster_than_estimated_teach_admission_a_smaller_margin():
    """Each answered request admitted by an estimate near its deadline records the margin
    it needed (gateway.admission.calibrate): a fleet that answers at once brings the
    margin down to its floor after 20 of them, from the configured 1.25, on the HTTP edge
    and on WebSockets."""
    from events.fleet import ModelLoad
    from gateway.admission.calibrate import FLOOR, MIN_SAMPLES

    client, pipeline = gateway()
    # 64 tokens at 170 ms: 10.9 s of work, near the edge of 15 s (70 %: calibrate.NEAR_EDGE).
    load = ModelLoad(max_batch=64, running=1, tokens=10, step_s=0.17, measured_at=time.time() + 3600)
    pipeline.hold(load)
    with client:
        calibration = client.app.state.chat.admission.calibration
        assert calibration.margin("stories-260k") == 1.25
        for i in range(MIN_SAMPLES - 1):
            r = client.post("/v1/chat/completions", json=chat("word" * 64, max_tokens=64, stream=i % 2 == 0))
            assert r.status_code == 200, r.text
        with client.websocket_connect("/v1/ws") as ws:
            ws.receive_json()
            ws.send_json({"type": "turn", "content": "word" * 64, "max_tokens": 64})  # 64 chunks: 64 tokens
            while ws.receive_json()["type"] == "chunk":
                pass
    assert len(calibration.needed["stories-260k"]) == MIN_SAMPLES
    assert calibration.margin("stories-260k") == FLOOR
