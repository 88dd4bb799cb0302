"""The HTTP protocol holding a request for a later verdict (gateway/admission/uvicorn_adapter.py, used by
the early gate in gateway/admission/hook.py), on a real uvicorn server over loopback: a held request's
task does not get the end of its body until the verdict; a refusal is written by the protocol and
the app never sees the request; requests let on resume in arrival order."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from gateway.admission.uvicorn_adapter import HOLD, head_timeout_protocol


async def _serve(refuse):
    seen: list[bytes] = []

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:  # the whole body, as BodyGuard reads it (the last part comes with the verdict)
            message = await receive()
            if message["type"] != "http.request":
                return  # refused while held: the protocol answered, the task sees a disconnect
            body += message["body"]
            if not message.get("more_body"):
                break
        seen.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=head_timeout_protocol(10.0, refuse=refuse), log_config=None, lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1], seen


async def _post(port: int, body: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /x HTTP/1.1\r\nhost: t\r\ncontent-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
    await writer.drain()
    return reader, writer


async def test_a_held_request_waits_for_its_verdict_and_a_refusal_needs_no_task():
    held = []

    def refuse(scope, body, arrived, reply):
        held.append((body, reply))
        return HOLD

    server, task, port, seen = await _serve(refuse)
    try:
        conns = [await _post(port, b"r%d" % i) for i in range(3)]
        while len(held) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        assert seen == []  # no task got a body while held
        refusal = b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno"
        held[1][1](refusal)
        held[0][1](None)
        held[2][1](None)
        held[2][1](refusal)  # a second verdict is ignored
        answers = [await asyncio.wait_for(reader.read(), 5) for reader, _ in conns]
        assert answers[1] == refusal
        assert answers[0].startswith(b"HTTP/1.1 200") and answers[2].startswith(b"HTTP/1.1 200")
        assert seen == [b"r0", b"r2"]  # in arrival order; the refused one never reached the app
        for _, writer in conns:
            writer.close()
    finally:
        server.should_exit = True
        await task


async def test_an_answer_or_none_at_once_is_not_held():
    answers = iter([None, b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"])
    server, task, port, seen = await _serve(lambda scope, body, arrived, reply: next(answers))
    try:
        first, second = [await _post(port, b"x") for _ in range(2)]
        assert (await asyncio.wait_for(first[0].read(), 5)).startswith(b"HTTP/1.1 200")
        assert (await asyncio.wait_for(second[0].read(), 5)).startswith(b"HTTP/1.1 429")
        assert seen == [b"x"]
    finally:
        server.should_exit = True
        await task
