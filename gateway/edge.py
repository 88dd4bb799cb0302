"""The edge of the gateway: what a request must get right before any route sees it.

- `BodyGuard` (ASGI middleware) reads each HTTP body itself, counting bytes as they
  arrive: over `max_body_bytes` is 413 whatever the framing (Content-Length or chunked),
  and a body that does not arrive within `body_timeout_s` (shorter than its
  Content-Length, or trickled) is 408. The route then reads the buffered body.
  Before a 413 the rest of the body is read and dropped (`DRAIN_BYTES` and
  `body_timeout_s` at most): a connection closed with unread bytes is reset, and a client
  still sending (httpx's AsyncClient) would get that reset instead of the 413. A client
  that waits for `100 Continue` gets the 413 at once and sends nothing.
- The head timeout (a slow-loris client holds nothing for long), the connection limit
  and the WebSocket count live in uvicorn's protocols: gateway/admission/uvicorn_adapter.py.
- `ServerTiming` (ASGI middleware) adds `Server-Timing: gateway;dur=<ms>` to every
  response: the time from the request's arrival (as the protocol read it) to its head.
- `parse_frame` parses a WebSocket frame with bounded size and nesting depth.

Every refusal is in the API's error shape (gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from gateway.admission.uvicorn_adapter import ARRIVED, REFUSED, TIMINGS, too_slow
from gateway.errors import APIError
from gateway.metrics import METRICS

Scope = dict[str, Any]


#: The most of a refused body read (and dropped) before its 413 is sent (see the module doc).
DRAIN_BYTES = 64 * 2**20


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes", "body_too_large", headers={"connection": "close"})


async def _reply(send, err: APIError) -> None:
    response = err.response()
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class BodyGuard:
    """Buffers each HTTP request body within a size and a time limit (see the module doc)."""

    def __init__(self, app, max_body_bytes: int, body_timeout_s: float):
        self.app, self.limit, self.timeout_s = app, max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            if int(length) <= DRAIN_BYTES and headers.get(b"expect", b"").lower() != b"100-continue":
                await self._drain(receive)
            return await self._too_large(send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except TimeoutError:
            METRICS.rejections.labels(reason="body_timeout").inc()
            return await _reply(send, too_slow(self.timeout_s))
        except _TooLarge:
            await self._drain(receive)
            return await self._too_large(send)
        if body is None:  # the client left before its body was complete
            return None
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        METRICS.rejections.labels(reason="body_too_large").inc()
        await _reply(send, too_large(self.limit))

    async def _drain(self, receive) -> None:
        """Read and drop the rest of a refused body: until its end, the client leaving,
        DRAIN_BYTES or body_timeout_s, whichever comes first."""

        async def rest() -> None:
            dropped = 0
            while dropped <= DRAIN_BYTES:
                message = await receive()
                dropped += len(message.get("body", b""))
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(rest(), self.timeout_s)

    async def _read(self, receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                raise _TooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


class _TooLarge(Exception):
    pass


class ServerTiming:
    """Adds `Server-Timing: gateway;dur=<ms>` to each HTTP response: from the request's
    arrival to the response head, queueing in the event loop included (what a client's
    latency is made of, less the network and the client's own loop); then the stages
    timed on the way (`TIMINGS`: `read`, from its first bytes to its whole body;
    `queued`, from arrival to admission's first step in a task; `admission`, the
    fleet-wide check)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope.get(REFUSED):
            return None
        arrived = scope.get(ARRIVED) or time.perf_counter()

        async def timed(message: dict) -> None:
            if message["type"] == "http.response.start":
                stages = [("gateway", (time.perf_counter() - arrived) * 1000), *scope.get(TIMINGS, ())]
                took = ", ".join(f"{name};dur={ms:.1f}" for name, ms in stages).encode()
                message = {**message, "headers": [*message.get("headers", ()), (b"server-timing", took)]}
            await send(message)

        return await self.app(scope, receive, timed)


class FrameError(ValueError):
    """A WebSocket frame that is too large, too deep or not JSON."""


def _deeper_than(text: str, max_depth: int) -> bool:
    """Whether JSON `text` nests arrays and objects deeper than `max_depth` (brackets
    inside strings do not count)."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def parse_frame(text: str, max_bytes: int, max_depth: int) -> Any:
    """json.loads with bounds: size first, then nesting depth (scanned without recursion,
    so a deeply nested frame is refused instead of raising RecursionError)."""
    if len(text) > max_bytes:
        raise FrameError(f"frame over {max_bytes} characters")
    if _deeper_than(text, max_depth):
        raise FrameError(f"frame nested deeper than {max_depth} levels")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FrameError("frame is not valid JSON") from exc
