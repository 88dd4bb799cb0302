"""The uvicorn protocols the gateway serves with, and all of uvicorn's private state they
touch, in this one module (`UVICORN_PRIVATE`; tests/unit/test_uvicorn_adapter.py fails
loudly when a uvicorn release renames or drops any of it).

- `HeadTimeoutProtocol` (uvicorn's HTTP protocol, httptools) closes a connection whose
  request head does not arrive within `header_timeout_s` with a 408, answers its own
  connection limit in the API's error shape, and runs admission's hook (`REFUSE`,
  gateway/admission/hook.py) as it reads a request's body: a burst's refusals are
  written before any task runs for them.
  A connection upgraded to a WebSocket leaves this protocol for uvicorn's WebSocket one
  (`WebSocketProtocol`, which counts the open sockets): every HTTP timer is cancelled
  at the upgrade, so none fires into a socket that now speaks another protocol (a
  WebSocket was once cut 10 s after opening by a 408 written into its frames).
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

#: What this module reads or writes of uvicorn that is not its public API: the HTTP
#: protocol's methods it overrides and the attributes it uses, the request cycle's
#: attributes (RequestResponseCycle), and the WebSocket protocol's overridden methods.
UVICORN_PRIVATE: dict[str, tuple[str, ...]] = {
    "http methods": (
        "connection_made",
        "handle_websocket_upgrade",
        "data_received",
        "on_message_begin",
        "on_message_complete",
        "on_response_complete",
        "connection_lost",
    ),
    "http state": ("limit_concurrency", "app", "connections", "tasks", "loop", "cycle", "scope", "transport", "parser"),
    "cycle state": (
        "scope",
        "body",
        "more_body",
        "message_event",
        "response_started",
        "response_complete",
        "keep_alive",
    ),
    "websocket methods": ("connection_made", "connection_lost"),
}


def missing_private_state(protocol: Any) -> list[str]:
    """The names in UVICORN_PRIVATE that `protocol` (an HTTP protocol of this module that
    has read a request, its cycle still current) or uvicorn's classes lack: [] when this
    module still fits the installed uvicorn."""
    wanted = [
        *((FastProtocol, name) for name in UVICORN_PRIVATE["http methods"]),
        *((protocol, name) for name in UVICORN_PRIVATE["http state"]),
        *((WebSocketsSansIOProtocol, name) for name in UVICORN_PRIVATE["websocket methods"]),
    ]
    missing = [f"{_name(owner)}.{name}" for owner, name in wanted if not hasattr(owner, name)]
    cycle = getattr(protocol, "cycle", None)
    missing += [f"RequestResponseCycle.{name}" for name in UVICORN_PRIVATE["cycle state"] if not hasattr(cycle, name)]
    if not hasattr(getattr(protocol, "parser", None), "should_upgrade"):
        missing.append("HttpToolsProtocol.parser.should_upgrade")
    return missing


def _name(owner: Any) -> str:
    return getattr(owner, "__name__", type(owner).__name__)


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive within {timeout_s:g} s",
        "request_timeout",
        headers={"connection": "close"},
    )


#: Scope keys: when the request's first bytes were read (time.perf_counter()); whether
#: the protocol already answered it (HeadTimeoutProtocol.REFUSE).
ARRIVED, REFUSED = "arena.arrived", "arena.refused"
#: What `HeadTimeoutProtocol.REFUSE` answers for a request it will decide later.
HOLD = object()
Refuse = Callable[[Scope, bytes, float, Callable[[bytes | None], None]], "bytes | object | None"]

#: Scope key: more Server-Timing entries, (name, ms), for stages a middleware timed.
TIMINGS = "arena.timings"


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
    #: refusal needs no task (gateway/admission/hook.py: a burst's refusals). `body` is what the
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
