"""Per-key rate limits (token buckets in Redis, one Lua script; fakeredis runs it)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from gateway.app import build_app
from gateway.ratelimit import duration
from tests.unit.fake_pipeline import FakePipeline, settings
from tests.unit.fake_pipeline import chat as base_chat

A, B = "sk-alice-1234", "sk-bob-5678"
HA, HB = {"Authorization": f"Bearer {A}"}, {"Authorization": f"Bearer {B}"}


def chat(content: str = "Once upon a time", **fields) -> dict:
    return base_chat(content, max_tokens=16, **fields)


def gateways(n: int = 1, **overrides) -> list[TestClient]:
    """n gateways sharing one Redis, as on a real deployment."""
    s = settings(api_keys=[A, B], **overrides)
    first = FakePipeline(s)
    out = []
    for _ in range(n):
        p = FakePipeline(s)
        p.keys, p.results = first.keys, first.results
        out.append(TestClient(build_app(s, p)))
    return out


def test_requests_per_minute_then_429_with_openai_headers():
    [client] = gateways(rate_limit_rpm=3)
    with client:
        oks = [client.post("/v1/chat/completions", json=chat(), headers=HA) for _ in range(3)]
        assert all(r.status_code == 200 for r in oks)
        assert [r.headers["x-ratelimit-remaining-requests"] for r in oks] == ["2", "1", "0"]
        assert oks[0].headers["x-ratelimit-limit-requests"] == "3"
        r = client.post("/v1/chat/completions", json=chat(), headers=HA)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert 15 <= int(r.headers["retry-after"]) <= 20  # one request refills in 20 s
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        assert client.post("/v1/chat/completions", json=chat(), headers=HB).status_code == 200  # B has its own


def test_tokens_per_minute_count_prompt_and_max_tokens():
    [client] = gateways(rate_limit_tpm=100)
    with client:
        ok = client.post("/chat", json={"prompt": "x" * 40, "max_tokens": 50}, headers=HA)  # 10 + 50
        assert ok.status_code == 202 and ok.headers["x-ratelimit-remaining-tokens"] == "40"
        r = client.post("/chat", json={"prompt": "x" * 40, "max_tokens": 50}, headers=HA)
        assert r.status_code == 429 and "tokens" in r.json()["error"]["message"]
        assert client.post("/chat", json={"prompt": "hi", "max_tokens": 30}, headers=HA).status_code == 202


def test_per_key_limits_override_the_default():
    [client] = gateways(rate_limit_rpm=1, rate_limits={B: {"rpm": 5}})
    with client:
        codes_a = [client.post("/v1/chat/completions", json=chat(), headers=HA).status_code for _ in range(2)]
        codes_b = [client.post("/v1/chat/completions", json=chat(), headers=HB).status_code for _ in range(5)]
        assert codes_a == [200, 429] and codes_b == [200] * 5


def test_limits_are_shared_by_gateways():
    one, two = gateways(2, rate_limit_rpm=4)
    with one, two:
        codes = [c.post("/v1/chat/completions", json=chat(), headers=HA).status_code for c in (one, two) * 3]
    assert codes == [200, 200, 200, 200, 429, 429]


def test_websocket_turns_are_limited_too():
    [client] = gateways(rate_limit_rpm=1)
    with client, client.websocket_connect("/v1/ws", headers=HA) as ws:
        ws.receive_json()
        ws.send_json({"type": "turn", "content": "hi"})
        while ws.receive_json()["type"] == "chunk":
            pass
        ws.send_json({"type": "turn", "content": "again"})
        frame = ws.receive_json()
        assert frame["type"] == "error" and frame["status"] == 429


def test_bad_per_key_limits_are_refused_at_start():
    with pytest.raises(ValueError, match="rpm and tpm"):
        settings(rate_limits=json.loads('{"sk-x": {"rph": 3}}'))


@pytest.mark.parametrize("seconds,text", [(0.02, "20ms"), (1.2, "2s"), (59.5, "1m0s"), (360, "6m0s")])
def test_reset_format_is_openais(seconds, text):
    assert duration(seconds) == text
