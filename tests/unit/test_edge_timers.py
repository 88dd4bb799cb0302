"""The gateway protocol's timers against connections that outlive them (gateway/admission/uvicorn_adapter.py),
on a real uvicorn server over loopback with a head timeout of 0.3 s: a timer armed for
one protocol must never fire into a connection that now speaks another (a WebSocket
was cut with a 408 written into its frames 10 s after it opened), nor into a response
that streams past it; and open WebSockets do not count against the HTTP connection limit."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import uvicorn
import websockets
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from gateway.admission.uvicorn_adapter import WebSocketProtocol, head_timeout_protocol
from gateway.app import build_app
from tests.unit.fake_pipeline import FakePipeline, settings

HEAD_TIMEOUT_S = 0.3


async def app(scope, receive, send):
    if scope["type"] == "websocket":
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while (message := await receive())["type"] == "websocket.receive":
            await send({"type": "websocket.send", "text": message["text"]})
        return
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    for i in range(8):  # a stream four times as long as the head timeout
        await send({"type": "http.response.body", "body": b"%d\n" % i, "more_body": True})
        await asyncio.sleep(HEAD_TIMEOUT_S / 2)
    await send({"type": "http.response.body", "body": b"end\n"})


async def serve(limit: int | None = None):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(
        app,
        http=head_timeout_protocol(HEAD_TIMEOUT_S),
        ws=WebSocketProtocol,
        limit_concurrency=limit,
        log_config=None,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


async def stop(server, task) -> None:
    server.should_exit = True
    await task


async def test_a_websocket_outlives_the_head_timeout_idle_and_busy():
    server, task, port = await serve()
    try:
        async with (
            websockets.connect(f"ws://127.0.0.1:{port}/ws") as idle,
            websockets.connect(f"ws://127.0.0.1:{port}/ws") as busy,
        ):
            for i in range(int(4 * HEAD_TIMEOUT_S / 0.05)):  # one socket talks all along, one only at the end
                await busy.send(f"m{i}")
                assert await asyncio.wait_for(busy.recv(), 2) == f"m{i}"
                await asyncio.sleep(0.05)
            await idle.send("after")
            assert await asyncio.wait_for(idle.recv(), 2) == "after"
            assert WebSocketProtocol.open == 2
        await asyncio.sleep(0.1)
        assert WebSocketProtocol.open == 0
    finally:
        await stop(server, task)


async def test_a_streamed_response_outlives_the_head_timeout_and_a_silent_connection_does_not():
    server, task, port = await serve()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        got = await asyncio.wait_for(reader.read(), 5)
        assert got.startswith(b"HTTP/1.1 200") and b"end\n" in got and got.endswith(b"0\r\n\r\n"), got
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing: 408 and closed
        got = await asyncio.wait_for(reader.read(), 5)
        assert got.startswith(b"HTTP/1.1 408"), got
        writer.close()
    finally:
        await stop(server, task)


async def test_open_websockets_do_not_count_against_the_http_connection_limit():
    server, task, port = await serve(limit=3)
    try:
        sockets = [await websockets.connect(f"ws://127.0.0.1:{port}/ws") for _ in range(5)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        assert (await asyncio.wait_for(reader.read(), 5)).startswith(b"HTTP/1.1 200")
        writer.close()
        for ws in sockets:
            await ws.close()
    finally:
        await stop(server, task)


def test_an_idle_websocket_is_closed_after_the_idle_limit_and_a_frame_restarts_the_clock():
    s = settings(ws_idle_timeout_s=0.6)
    with TestClient(build_app(s, FakePipeline(s))) as client, client.websocket_connect("/v1/ws") as ws:
        assert ws.receive_json()["type"] == "session"
        for _ in range(4):  # 1.2 s in all, a frame every 0.3 s: never idle for 0.6 s
            time.sleep(0.3)
            ws.send_json({"type": "ping"})
            assert ws.receive_json()["type"] == "pong"
        started = time.monotonic()
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
        assert closed.value.code == 1000 and "idle" in closed.value.reason
        assert 0.4 < time.monotonic() - started < 3
