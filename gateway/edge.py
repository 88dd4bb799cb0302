"""The edge of the gateway: what a request must get right before any route sees it.

- `BodyGuard` (ASGI middleware) reads each HTTP body itself, counting bytes as they
  arrive: over `max_body_bytes` is 413 whatever the framing (Content-Length or chunked),
  and a body that does not arrive within `body_timeout_s` (shorter than its
  Content-Length, or trickled) is 408. The route then reads the buffered body.
- `HeadTimeoutProtocol` (uvicorn's HTTP protocol) closes a connection whose request head
  does not arrive within `header_timeout_s`: a slow-loris client holds nothing for long.
  A connection upgraded to a WebSocket leaves this protocol for uvicorn's WebSocket one
  (`WebSocketProtocol`, which counts the open sockets): every HTTP timer is cancelled
  at the upgrade, so none fires into a socket that now speaks another protocol.
- `ServerTiming` (ASGI middleware) adds `Server-Timing: gateway;dur=<ms>` to every
  response: the time from the request's arrival (as the protocol read it) to its head.
- `parse_frame` parses a WebSocket frame with bounded size and nesting depth.

Every refusal is in the API's error shape (gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

try:  # the faster parser, when installed (uvicorn[standard])
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as FastProtocol
except ImportError:  # pragma: no cover
    FastProtocol = H11Protocol  # type: ignore[misc,assignment]

from gateway.errors import APIError
from gateway.metrics import METRICS

Scope = dict[str, Any]


def too_large(limit: int) -> APIError:
    return APIError(413, f"request body over {limit} bytes", "body_too_large", headers={"connection": "close"})


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout_s:g} s",
        "request_timeout",
        headers={"connection": "close"},
    )


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
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            METRICS.rejections.labels(reason="body_too_large").inc()
            return await _reply(send, too_large(self.limit))
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except TimeoutError:
            METRICS.rejections.labels(reason="body_timeout").inc()
            return await _reply(send, too_slow(self.timeout_s))
        except _TooLarge:
            METRICS.rejections.labels(reason="body_too_large").inc()
            return await _reply(send, too_large(self.limit))
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


#: Scope keys: when the request's first bytes were read (time.perf_counter()); whether
#: the protocol already answered it (HeadTimeoutProtocol.REFUSE).
ARRIVED, REFUSED = "arena.arrived", "arena.refused"
#: What `HeadTimeoutProtocol.REFUSE` answers for a request it will decide later.
HOLD = object()
Refuse = Callable[[Scope, bytes, float, Callable[[bytes | None], None]], "bytes | object | None"]

#: Scope key: more Server-Timing entries, (name, ms), for stages a middleware timed.
TIMINGS = "arena.timings"


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


class HeadTimeoutProtocol(FastProtocol):
    """uvicorn's HTTP protocol (httptools, else h11), plus a deadline for each request head.

    uvicorn times out idle keep-alive connections but waits forever for a head that
    trickles in (or never comes) on a fresh connection; this closes such a connection
    after `HEADER_TIMEOUT_S` with a 408."""

    HEADER_TIMEOUT_S = 10.0
    #: (scope, body, arrived, reply) -> a whole HTTP response refusing the request as its
    #: body is read, None to serve it, or HOLD: its task gets the end of its body only
    #: once `reply` is called (with the refusal, or None to serve it; HOLD_S at most), so
    #: a request waiting for a fleet-wide check does no work past reading it, and its
    #: refusal needs no task (gateway/shed.py: a burst's refusals). `body` is what the
    #: task has not taken yet: all of it when it came in one read, as a burst's requests
    #: do; a part otherwise, which the gate cannot parse and leaves to the routes.
    REFUSE: Refuse | None = None
    HOLD_S = 2.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn answers past `limit_concurrency` with a text/plain 503 of its own; the
        # same limit is checked here instead, answered in the API's error shape.
        limit, self.limit_concurrency = self.limit_concurrency, None
        if limit is not None:
            self.app = _limited(self.app, self.connections, self.tasks, limit)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._head_timer = self.loop.call_later(self.HEADER_TIMEOUT_S, self._head_timeout)

    def handle_websocket_upgrade(self, *args) -> None:
        """The transport goes to a WebSocket protocol and never comes back: its HTTP
        timers stop here (uvicorn cancels its keep-alive timer as the upgrade is read;
        the head timer is this class's own)."""
        self._head_timer.cancel()
        super().handle_websocket_upgrade(*args)

    def data_received(self, data: bytes) -> None:
        self._data_at = time.perf_counter()  # a request head starting in this read arrived now
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._head_timer.cancel()  # a head arrived: the body has BodyGuard's timeout

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[ARRIVED] = self._data_at  # type: ignore[literal-required]

    def on_message_complete(self) -> None:
        cycle = self.cycle
        if self.REFUSE is None or cycle is None or cycle.response_started or self.parser.should_upgrade():
            return super().on_message_complete()
        replied = False

        def reply(answer: bytes | None) -> None:
            nonlocal replied
            if replied:
                return
            replied = True
            timer.cancel()
            cycle.more_body = False
            if answer is not None and not self.transport.is_closing() and not cycle.response_started:
                self._refuse(cycle, answer)
            elif held:  # let on: its task resumes with others, a few a turn (`_resume`)
                _RESUMING.append(cycle)
                if len(_RESUMING) == 1:
                    self.loop.call_soon(_resume, self.loop)
                return
            cycle.message_event.set()  # the body, to its task (a disconnect when refused)

        held = False
        timer = self.loop.call_later(self.HOLD_S, reply, None)
        answer = self.REFUSE(self.scope, cycle.body, self._data_at, reply)  # type: ignore[arg-type]
        if answer is not HOLD:
            reply(answer)  # type: ignore[arg-type]
        held = True

    def _refuse(self, cycle, answer: bytes) -> None:
        """Answered here; the request's task (already created) returns at ServerTiming or,
        when it was held, as its body is read."""
        cycle.scope[REFUSED] = True
        cycle.response_started = cycle.response_complete = True
        cycle.keep_alive = False
        self.transport.write(answer)
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._head_timer.cancel()
        if not self.transport.is_closing():
            self._arm()  # the next head on this keep-alive connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_timeout(self) -> None:
        if self.transport.is_closing() or (self.cycle is not None and not self.cycle.response_complete):
            return
        if self.transport.get_protocol() is not self:  # upgraded: the socket speaks WebSocket now
            return
        METRICS.rejections.labels(reason="header_timeout").inc()
        body = json.dumps(too_slow(self.HEADER_TIMEOUT_S).body()).encode()
        head = (
            b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
        )
        self.transport.write(head + body.replace(b"request body", b"request head"))
        self.transport.close()


#: Held requests let on, whose tasks have not resumed yet (HeadTimeoutProtocol).
_RESUMING: deque = deque()
#: How many resume in one turn of the event loop: a burst admitted at once must not fill
#: a turn with hundreds of requests' validation and publish, while connections that
#: arrived with it (refusals, mostly: answered as soon as they are read) wait unread.
RESUME_PER_TURN = 8


def _resume(loop: asyncio.AbstractEventLoop) -> None:
    for _ in range(min(RESUME_PER_TURN, len(_RESUMING))):
        _RESUMING.popleft().message_event.set()
    if _RESUMING:
        loop.call_soon(_resume, loop)


class WebSocketProtocol(WebSocketsSansIOProtocol):
    """uvicorn's WebSocket protocol (websockets' sans-I/O implementation, what uvicorn's
    "auto" picks), counting the open sockets: they share uvicorn's connection and task
    sets with HTTP, and the HTTP connection limit counts HTTP alone (an idle socket held
    by a person between turns must not refuse the next chat request). Their own bound is
    `GatewaySettings.max_websockets`, checked by the route."""

    #: Open WebSocket connections in this process.
    open = 0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        WebSocketProtocol.open += 1

    def connection_lost(self, exc: Exception | None) -> None:
        WebSocketProtocol.open -= 1
        super().connection_lost(exc)


def _limited(app, connections: set, tasks: set, limit: int):
    """`app`, answering JSON 503 when the open HTTP connections or running HTTP requests
    (this one counted) are over `limit`, as uvicorn's own check would (before any route
    runs). WebSockets are in the same sets, one connection and one task each, and are
    not counted (`WebSocketProtocol.open`)."""

    async def limited(scope: Scope, receive, send) -> None:
        sockets = WebSocketProtocol.open
        if scope["type"] == "http" and (len(connections) - sockets >= limit or len(tasks) - sockets > limit):
            METRICS.rejections.labels(reason="too_many_connections").inc()
            error = APIError(
                503,
                f"the gateway holds {limit} connections or requests already; retry shortly",
                "too_many_connections",
                headers={"retry-after": "1", "connection": "close"},
            )
            await error.response()(scope, receive, send)
            return
        await app(scope, receive, send)

    return limited


def head_timeout_protocol(timeout_s: float, refuse: Refuse | None = None) -> type[HeadTimeoutProtocol]:
    return type(
        "HeadTimeout",
        (HeadTimeoutProtocol,),
        {"HEADER_TIMEOUT_S": timeout_s, "REFUSE": staticmethod(refuse) if refuse else None},
    )


class FrameError(ValueError):
    """A WebSocket frame that is too large, too deep or not JSON."""


def parse_frame(text: str, max_bytes: int, max_depth: int) -> Any:
    """json.loads with bounds: size first, then nesting depth (scanned without recursion,
    so a deeply nested frame is refused instead of raising RecursionError)."""
    if len(text) > max_bytes:
        raise FrameError(f"frame over {max_bytes} characters")
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
                raise FrameError(f"frame nested deeper than {max_depth} levels")
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text)
    except ValueError as exc:
        raise FrameError("frame is not valid JSON") from exc
