"""API keys on every route, and results bound to the principal that asked (fake pipeline)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from runtime.logs import JsonFormatter
from runtime.net import free_port
from tests.unit.fake_pipeline import chat, gateway

A, B = "sk-alice-1234", "sk-bob-5678"
HA, HB = {"Authorization": f"Bearer {A}"}, {"Authorization": f"Bearer {B}"}


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/metrics"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/openapi.json"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/chat"),
        ("GET", "/chat/result/abc"),
        ("POST", "/arena/battles"),
        ("GET", "/arena/leaderboard"),
    ],
)
def test_every_route_needs_a_key(method, path):
    with gateway(api_keys=[A, B])[0] as client:
        r = client.request(method, path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert client.request(method, path, headers={"Authorization": "Bearer nope"}).status_code == 401


def test_health_is_open_and_readiness_shows_details_only_with_a_key():
    with gateway(api_keys=[A, B])[0] as client:
        assert client.get("/healthz").status_code == 200
        assert set(client.get("/readyz").json()) == {"ready"}
        assert "models" in client.get("/readyz", headers=HA).json()


def test_operator_can_open_docs_and_metrics():
    with gateway(api_keys=[A, B], open_paths=["/healthz", "/docs", "/openapi.json", "/metrics"])[0] as client:
        assert client.get("/docs").status_code == 200
        assert client.get("/metrics").status_code == 200
        assert client.get("/readyz").status_code == 401


def test_the_arena_pages_shell_is_open_its_data_is_not():
    with gateway(api_keys=[A, B])[0] as client:
        for path in ("/arena", "/arena/board", "/arena/static/key.js", "/arena/static/arena.js"):
            r = client.get(path)
            assert r.status_code == 200 and A not in r.text and B not in r.text, path
        assert "key.js" in client.get("/arena").text
        assert client.get("/arena/static/nope.js").status_code == 404
        for path in ("/arena/leaderboard", "/arena/battles/x", "/arena/boardx", "/arena/static"):
            assert client.get(path).status_code == 401, path


def test_metrics_port_answers_without_a_key():
    port = free_port()
    with gateway(api_keys=[A, B], metrics_port=port)[0] as client:
        assert client.get("/metrics").status_code == 401  # the API port still wants one
        r = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
        assert r.status_code == 200 and "arena_req_total" in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json()["role"] == "gateway"
    with pytest.raises(httpx.ConnectError):  # closed with the app
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_a_key_in_the_url_is_refused_and_never_logged(caplog):
    with gateway(api_keys=[A, B])[0] as client:
        r = client.get(f"/v1/models?api_key={A}")
        assert r.status_code == 400 and r.json()["error"]["code"] == "key_in_url"
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s "%s"', ("1.2.3.4", f"GET /x?api_key={A}"), None
    )
    assert A not in JsonFormatter().format(record)


def test_results_are_404_to_another_key():
    with gateway(api_keys=[A, B])[0] as client:
        rid = client.post("/chat", json={"prompt": "hello"}, headers=HA).json()["request_id"]
        assert client.get(f"/chat/result/{rid}", headers=HA).status_code in (200, 202)
        r = client.get(f"/chat/result/{rid}", headers=HB)
        assert r.status_code == 404 and r.json()["error"]["code"] == "request_not_found"


def test_a_conversation_is_404_to_another_key():
    with gateway(api_keys=[A, B])[0] as client:
        ok = client.post("/v1/chat/completions", json=chat(conv_id="conv-a", turn_id=0), headers=HA)
        assert ok.status_code == 200
        r = client.post("/v1/chat/completions", json=chat("more", conv_id="conv-a", turn_id=1), headers=HB)
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
        r = client.post("/chat", json={"prompt": "more", "conv_id": "conv-a"}, headers=HB)
        assert r.status_code == 404
        assert client.post(
            "/v1/chat/completions", json=chat("more", conv_id="conv-a", turn_id=1), headers=HA
        ).is_success


def test_idempotency_keys_do_not_cross_keys():
    with gateway(api_keys=[A, B])[0] as client:
        idem = {"Idempotency-Key": "same-key"}
        a = client.post("/v1/chat/completions", json=chat("from a"), headers={**HA, **idem}).json()
        b = client.post("/v1/chat/completions", json=chat("from b"), headers={**HB, **idem})
        assert b.status_code == 200  # not 409, and not a's answer
        assert b.json()["x_arena"]["request_id"] != a["x_arena"]["request_id"]


def test_websocket_resume_and_conversation_are_404_to_another_key():
    with gateway(api_keys=[A, B])[0] as client:
        with client.websocket_connect("/v1/ws", headers=HA) as ws:
            conv = ws.receive_json()["conv_id"]
            ws.send_json({"type": "turn", "content": "hello"})
            while (frame := ws.receive_json())["type"] == "chunk":
                pass
            rid = frame["request_id"]
        with client.websocket_connect(f"/v1/ws?conv_id={conv}", headers=HB) as ws:
            frame = ws.receive_json()
            assert frame["type"] == "error" and frame["status"] == 404
        with client.websocket_connect(f"/v1/ws?resume_request_id={rid}&last_seq=-1", headers=HB) as ws:
            frame = ws.receive_json()  # the conversation is not B's: refused before any session
            assert frame["type"] == "error" and frame["status"] == 404
        with client.websocket_connect(f"/v1/ws?conv_id=own-b&resume_request_id={rid}", headers=HB) as ws:
            assert ws.receive_json()["type"] == "session"
            frame = ws.receive_json()  # B's own conversation, A's request: as unknown
            assert frame["type"] == "error" and frame["status"] == 404
        with client.websocket_connect(f"/v1/ws?conv_id={conv}&resume_request_id={rid}", headers=HA) as ws:
            ws.receive_json()
            while (frame := ws.receive_json())["type"] == "chunk":
                pass
            assert frame["type"] == "done"
        with client.websocket_connect("/v1/ws") as ws:
            frame = ws.receive_json()
            assert frame["status"] == 401 and json.dumps(frame).find(A) < 0
