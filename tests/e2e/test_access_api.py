"""Two API keys on a real stack: the second cannot read, resume or extend anything of
the first, over HTTP and WebSocket; no route is open unless configured so; keys are
never logged."""

from __future__ import annotations

import json

import httpx
import pytest
from websockets.sync.client import connect

from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

A, B = "sk-alice-test-9a8b7c", "sk-bob-test-1d2e3f"
HA, HB = {"Authorization": f"Bearer {A}"}, {"Authorization": f"Bearer {B}"}


@pytest.fixture(scope="module")
def api(module_stack_factory):
    return module_stack_factory(
        ARENA_API_KEYS=json.dumps([A, B]), ARENA_MODELS_CONFIG=REPO / "configs" / "stories-arena.yaml"
    ).start()


def body(content="Once upon a time", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, **kw}


def ws_url(api, query: str = "") -> str:
    return api.url.replace("http", "ws") + "/v1/ws" + (f"?{query}" if query else "")


def until_done(ws) -> dict:
    while (frame := json.loads(ws.recv(timeout=30)))["type"] == "chunk":
        pass
    return frame


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
        ("GET", "/chat/result/x"),
        ("POST", "/arena/battles"),
        ("GET", "/arena/battles/x"),
        ("GET", "/arena/leaderboard"),
    ],
)
def test_no_route_is_open_without_a_key(api, method, path):
    r = httpx.request(method, api.url + path)
    assert r.status_code == 401, (path, r.status_code)


def test_health_open_readiness_without_details(api):
    assert httpx.get(api.url + "/healthz").status_code == 200
    assert set(httpx.get(api.url + "/readyz").json()) == {"ready"}
    assert "inference" in httpx.get(api.url + "/readyz", headers=HA).json()


def test_chat_result_is_404_to_the_other_key(api):
    rid = httpx.post(api.url + "/chat", json={"prompt": "A cat", "max_tokens": 8}, headers=HA).json()["request_id"]
    assert httpx.get(f"{api.url}/chat/result/{rid}", headers=HB).status_code == 404
    for _ in range(100):
        r = httpx.get(f"{api.url}/chat/result/{rid}", headers=HA)
        if r.status_code == 200:
            break
    assert r.status_code == 200
    assert httpx.get(f"{api.url}/chat/result/{rid}", headers=HB).status_code == 404  # finished: still not B's


def test_v1_conversation_is_404_to_the_other_key(api):
    first = httpx.post(api.url + "/v1/chat/completions", json=body(conv_id="ca-1", turn_id=0), headers=HA, timeout=30)
    assert first.status_code == 200
    for headers, status in ((HB, 404), (HA, 200)):
        r = httpx.post(
            api.url + "/v1/chat/completions",
            json=body("and then", conv_id="ca-1", turn_id=1),
            headers=headers,
            timeout=30,
        )
        assert r.status_code == status, r.text
    r = httpx.post(api.url + "/chat", json={"prompt": "x", "conv_id": "ca-1", "turn_id": 2}, headers=HB)
    assert r.status_code == 404


def test_websocket_conversation_and_resume_are_404_to_the_other_key(api):
    with connect(ws_url(api, "resume_grace_s=30"), additional_headers=HA) as ws:
        conv = json.loads(ws.recv())["conv_id"]
        ws.send(json.dumps({"type": "turn", "content": "Once upon a time", "max_tokens": 8}))
        done = until_done(ws)
        assert done["type"] == "done"
    with connect(ws_url(api, f"conv_id={conv}"), additional_headers=HB) as ws:
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["status"] == 404
    rid = done["request_id"]
    with connect(ws_url(api, f"resume_request_id={rid}&last_seq=-1"), additional_headers=HB) as ws:
        frame = json.loads(ws.recv())
        assert frame["type"] == "error" and frame["status"] == 404  # no chunk of A's reaches B
    with connect(ws_url(api, f"conv_id={conv}&resume_request_id={rid}&last_seq=-1"), additional_headers=HA) as ws:
        assert json.loads(ws.recv())["type"] == "session"
        assert until_done(ws)["type"] == "done"


def test_battle_is_404_to_the_other_key(api):
    battle = httpx.post(api.url + "/arena/battles", headers=HA).json()["battle_id"]
    assert httpx.get(f"{api.url}/arena/battles/{battle}", headers=HA).status_code == 200
    assert httpx.get(f"{api.url}/arena/battles/{battle}", headers=HB).status_code == 404
    turn = httpx.post(f"{api.url}/arena/battles/{battle}/turns", json={"prompt": "hi", "max_tokens": 4}, headers=HB)
    assert turn.status_code == 404
    vote = httpx.post(f"{api.url}/arena/battles/{battle}/vote", json={"choice": "a"}, headers=HB)
    assert vote.status_code == 404


def test_keys_never_reach_the_logs(api):
    assert httpx.get(f"{api.url}/v1/models?api_key={A}").status_code == 400
    for name in api.stack.procs:
        log = api.log(name)
        assert A not in log and B not in log, name
