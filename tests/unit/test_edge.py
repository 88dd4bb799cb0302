"""Hostile input at the gateway's edge (fake pipeline, no servers): body limits while
reading, read timeouts, unencodable strings, bounded WebSocket frames, 405 with Allow,
strict number types, and the OpenAPI document's declared statuses."""

from __future__ import annotations

import asyncio
import json

import pytest

from gateway.app import build_app
from gateway.edge import DRAIN_BYTES, BodyGuard, FrameError, parse_frame
from tests.unit.fake_pipeline import FakePipeline, chat, gateway, settings

LONE = '{"messages": [{"role": "user", "content": "a\\ud800b"}]}'


def assert_error(r, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code:
        assert err["code"] == code
    if param:
        assert err["param"] == param
    return err


def test_chunked_body_over_the_limit_is_413():
    with gateway(max_body_bytes=4096)[0] as client:
        chunks = (b"x" * 1024 for _ in range(64))  # no Content-Length: chunked transfer
        r = client.post("/v1/chat/completions", content=chunks, headers={"content-type": "application/json"})
        assert_error(r, 413, "body_too_large")
        assert client.get("/healthz").status_code == 200


def test_declared_length_over_the_limit_is_413_before_reading():
    with gateway(max_body_bytes=4096)[0] as client:
        r = client.post("/chat", content=b"{}", headers={"content-length": "99999999"})
        assert_error(r, 413, "body_too_large")


def _body_guard_run(headers: list[tuple[bytes, bytes]], chunks: int) -> list[str]:
    """BodyGuard (limit 4096) on a body of ``chunks`` chunks of 1 KiB: what happened, in order
    ("read" for each chunk taken, then the response's status)."""
    happened: list[str] = []
    left = [b"x" * 1024 for _ in range(chunks)]

    async def inner(scope, receive, send):
        raise AssertionError("a body over the limit reached the app")

    async def receive():
        happened.append("read")
        part = left.pop(0)
        return {"type": "http.request", "body": part, "more_body": bool(left)}

    async def send(message):
        if message["type"] == "http.response.start":
            happened.append(str(message["status"]))

    scope = {"type": "http", "headers": headers}
    asyncio.run(asyncio.wait_for(BodyGuard(inner, 4096, 5.0)(scope, receive, send), 10))
    return happened


def test_a_body_over_the_limit_is_read_to_its_end_before_the_413():
    """A client still sending its body reads the 413 (a socket closed with unread bytes is reset)."""
    assert _body_guard_run([], 64) == ["read"] * 64 + ["413"]  # chunked
    declared = [(b"content-length", b"65536")]
    assert _body_guard_run(declared, 64) == ["read"] * 64 + ["413"]


def test_a_body_not_sent_yet_or_past_the_drain_bound_is_not_read():
    waiting = [(b"content-length", b"65536"), (b"expect", b"100-continue")]
    assert _body_guard_run(waiting, 64) == ["413"]  # reading would send 100 Continue: it sends nothing
    assert _body_guard_run([(b"content-length", str(DRAIN_BYTES + 1).encode())], 64) == ["413"]


async def _call_raw(app, receive) -> tuple[int, dict]:
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], json.loads(body)


async def test_body_shorter_than_its_length_or_trickling_is_408():
    s = settings(body_timeout_s=0.3)
    app = build_app(s, FakePipeline(s))
    parts = [b'{"messages": ', b"[{"]  # then nothing more: the rest of Content-Length never comes

    async def receive():
        if parts:
            await asyncio.sleep(0.05)
            return {"type": "http.request", "body": parts.pop(0), "more_body": True}
        await asyncio.sleep(3600)

    status, body = await asyncio.wait_for(_call_raw(app, receive), 5)
    assert status == 408 and body["error"]["code"] == "request_timeout"


@pytest.mark.parametrize(
    "path,payload,param",
    [
        ("/v1/chat/completions", LONE, "messages.0.content"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"}', "user"),
        ("/chat", '{"prompt": "x\\ud800"}', "prompt"),
        ("/chat", '{"prompt": "hi", "system": "\\ud800"}', "system"),
    ],
)
def test_lone_surrogates_are_400_naming_the_field(path, payload, param):
    with gateway()[0] as client:
        r = client.post(path, content=payload, headers={"content-type": "application/json"})
        assert_error(r, 400, "invalid_value", param)


def test_lone_surrogate_in_a_websocket_turn_is_an_error_frame():
    with gateway()[0] as client, client.websocket_connect("/v1/ws") as ws:
        ws.receive_json()
        ws.send_text('{"type": "turn", "content": "\\ud800"}')
        frame = ws.receive_json()
        assert frame["type"] == "error" and frame["status"] == 400 and frame["error"]["param"] == "content"
        ws.send_json({"type": "ping"})
        assert ws.receive_json()["type"] == "pong"  # the socket stays usable


def test_deeply_nested_websocket_frame_is_400_not_recursion_error():
    with gateway()[0] as client, client.websocket_connect("/v1/ws") as ws:
        ws.receive_json()
        ws.send_text("[" * 100_000 + "]" * 100_000)
        frame = ws.receive_json()
        assert frame["type"] == "error" and frame["status"] == 400 and "deeper" in frame["error"]["message"]
        ws.send_text('{"type": "turn", "content": "' + "x" * 300_000 + '"}')
        frame = ws.receive_json()
        assert frame["status"] == 400 and "frame over" in frame["error"]["message"]


def test_deeply_nested_http_body_is_400():
    with gateway()[0] as client:
        r = client.post("/v1/chat/completions", content="[" * 50_000, headers={"content-type": "application/json"})
        assert_error(r, 400)


def test_parse_frame_bounds():
    assert parse_frame('{"a": "[[[[[["}', 100, 2) == {"a": "[[[[[["}  # brackets inside strings do not count
    with pytest.raises(FrameError):
        parse_frame("[[[1]]]", 100, 2)
    with pytest.raises(FrameError):
        parse_frame("x" * 101, 100, 2)


@pytest.mark.parametrize("field", ["deadline_s", "temperature", "max_tokens", "top_p", "seed"])
def test_booleans_are_not_numbers(field):
    with gateway()[0] as client:
        r = client.post("/v1/chat/completions", json=chat(**{field: True}))
        assert_error(r, 400, "invalid_value", field)


def test_empty_content_is_accepted_as_the_schema_says():
    with gateway()[0] as client:
        r = client.post("/v1/chat/completions", json=chat(""))
        assert r.status_code == 200, r.text


def test_405_names_the_allowed_methods():
    with gateway()[0] as client:
        r = client.delete("/v1/chat/completions")
        assert_error(r, 405)
        assert r.headers["allow"] == "POST"


def test_openapi_declares_each_status_with_the_error_schema():
    with gateway()[0] as client:
        doc = client.get("/openapi.json").json()
    ref = {"$ref": "#/components/schemas/ErrorBody"}
    declared = {
        ("/v1/chat/completions", "post"): {"400", "404", "408", "409", "413", "429", "503", "504"},
        ("/chat", "post"): {"400", "404", "408", "409", "413", "429", "503"},
        ("/chat/result/{request_id}", "get"): {"400", "404", "499", "503", "504"},
        ("/arena/battles/{battle_id}/turns", "post"): {"400", "404", "409", "413", "429", "503"},
    }
    for (path, method), statuses in declared.items():
        responses = doc["paths"][path][method]["responses"]
        assert "422" not in responses
        for status in statuses:
            assert responses[status]["content"]["application/json"]["schema"] == ref, (path, status)
    deadline = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["deadline_s"]
    assert "number" in json.dumps(deadline) and "boolean" not in json.dumps(deadline)
    # The rate-limited operations declare the headers clients pace themselves by.
    for path, ok in (("/v1/chat/completions", "200"), ("/chat", "202"), ("/arena/battles/{battle_id}/turns", "200")):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"Retry-After", "x-ratelimit-remaining-requests", "x-ratelimit-reset-tokens"} <= set(
            responses["429"]["headers"]
        ), path
        assert "x-ratelimit-limit-tokens" in responses[ok]["headers"], path


async def test_over_the_connection_limit_is_json_503_not_uvicorns_text():
    """uvicorn's own answer past `limit_concurrency` is a text/plain 503; the gateway's
    protocol answers the same limit in the API's error shape (real uvicorn server)."""
    import uvicorn

    from gateway.admission.uvicorn_adapter import head_timeout_protocol
    from runtime.net import free_port

    s = settings()
    port = free_port()
    config = uvicorn.Config(
        build_app(s, FakePipeline(s)),
        host="127.0.0.1",
        port=port,
        http=head_timeout_protocol(10),
        limit_concurrency=3,
        log_config=None,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = (await asyncio.wait_for(reader.read(), 5)).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), head
        assert b"content-type: application/json" in head.lower() and b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        writer.close()
        for _, w in idle:
            w.close()
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # room again
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        server.should_exit = True
        await serving
