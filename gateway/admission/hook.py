"""Admission at the HTTP edge, before any route: the protocol's hook (`refusal`, run as
uvicorn reads a request's body, see uvicorn_adapter.py) and the middleware
(`EarlyAdmission`) for a request the hook did not judge. Both judge with the early gate
(gate.py) and leave the request's `Lease` in its scope, where the route takes it
(`lease_of`) for the serving layer to carry on: one lease from the edge to the publish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import orjson

from events.models import DEFAULT_MAX_TOKENS, MAX_TOKENS_LIMIT
from gateway.access import bearer
from gateway.admission.estimate import overloaded
from gateway.admission.leases import ALONE, Admission, Lease
from gateway.admission.uvicorn_adapter import ARRIVED, HOLD, TIMINGS
from gateway.errors import APIError
from gateway.metrics import METRICS
from gateway.protocol import COMPLETION_MAX_TOKENS
from gateway.settings import GatewaySettings
from runtime.redis import REDIS_DOWN

#: The routes whose requests go through admission, how each names its token budget, and
#: the budget when the body names none.
ROUTES = {
    "/v1/chat/completions": (("max_completion_tokens", "max_tokens"), DEFAULT_MAX_TOKENS),
    "/chat": (("max_tokens",), DEFAULT_MAX_TOKENS),
    "/v1/completions": (("max_tokens",), COMPLETION_MAX_TOKENS),
}
#: Scope key: the lease of a request the protocol's hook let through.
LEASE = "arena.lease"


def lease_of(request: Any) -> Lease | None:
    """The lease the edge left for the route (None off the admission routes, or for a
    request the edge did not judge: a model not served yet, a body it could not read)."""
    return request.scope.get("state", {}).get("admission")


def _number(value: Any) -> float | None:
    return value if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None


def request_of(settings: GatewaySettings, path: str, body: bytes) -> tuple[str, int, float] | None:
    """(model, token budget, deadline) of an admission route's body; None when the
    body is not one the gate can read (the route answers it, 400 included)."""
    if (route := ROUTES.get(path)) is None:
        return None
    names, default = route
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict):
        return None
    model = doc.get("model") or settings.default_model
    if not isinstance(model, str):
        return None
    # Fields this reads must be valid as the schema says, or the route's 400 names them.
    budgets = [doc[n] for n in names if doc.get(n) is not None]
    if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_TOKENS_LIMIT for v in budgets):
        return None
    deadline = doc.get("deadline_s")
    if deadline is not None and _number(deadline) is None:
        return None
    tokens = budgets[0] if budgets else default
    return model, tokens, min(deadline or settings.deadline_s, settings.max_deadline_s)


def refusal(
    admission: Admission, scope: dict, body: bytes, arrived: float, reply: Callable[[bytes | None], None]
) -> Any:
    """The whole HTTP response refusing a request as the protocol reads its body, before
    any task runs for it (HeadTimeoutProtocol.REFUSE); None to serve it; HOLD when
    the gate let it through: its task waits for the fleet-wide check, whose refusal
    `reply` writes at once. Only for a caller whose key is accepted (or keys off),
    with a readable body in the limits, a served model, and a deadline the fleet
    cannot meet: else the routes answer."""
    settings, gate = admission.settings, admission.gate
    if scope.get("method") != "POST" or scope.get("path") not in ROUTES or scope.get("query_string"):
        return None
    if settings.api_keys and bearer(scope.get("headers", [])) not in settings.api_keys:
        return None
    if len(body) > settings.max_body_bytes or (request := request_of(settings, scope["path"], body)) is None:
        return None
    model, tokens, budget_s = request
    judging = time.perf_counter()
    read = ("read", (judging - arrived) * 1000)  # from its first bytes to its whole body
    # The fleet-wide check judges with the same workers' queue (a heartbeat may come between).
    workers = admission.pipeline.queue(model)
    err, member = gate.decide(model, tokens, budget_s, workers)
    if err is not None:
        return _refused(model, err, arrived, [read])
    if member is None:
        return None
    lease = scope[LEASE] = admission.passed(model, tokens, member)
    if gate.alone():  # the gate's verdict is the fleet's: served at once
        admission.recent.observe(tokens)
        lease.entry = ALONE
        scope.setdefault(TIMINGS, []).append(read)
        return None
    gate.tell_soon(model, member, tokens)
    checking = time.perf_counter()
    judged = ("gate", (checking - judging) * 1000)

    def checked(done) -> None:
        took = (time.perf_counter() - checking) * 1000
        if done.cancelled() or done.exception() is not None:  # the middleware checks again
            return reply(None)
        entry, est = done.result()
        if est is None:
            lease.entry = (model, entry, tokens)
            scope.setdefault(TIMINGS, []).extend([read, ("admission", took)])
            return reply(None)
        lease.refused_soon()
        METRICS.rejections.labels(reason="deadline_unreachable").inc()
        reply(_refused(model, overloaded(model, est, budget_s), arrived, [read, judged, ("admission", took)]))

    admission.recent.submit(model, tokens, admission.judge(model, tokens, budget_s, workers), at_once=checked)
    return HOLD


def _refused(model: str, err: APIError, arrived: float, timings: Sequence[tuple[str, float]] = ()) -> bytes:
    METRICS.requests.labels(model, "429").inc()
    payload = orjson.dumps(err.body())
    stages = [("gateway", (time.perf_counter() - arrived) * 1000), *timings]
    head = [
        b"HTTP/1.1 429 Too Many Requests",
        b"content-type: application/json",
        b"content-length: %d" % len(payload),
        b"retry-after: " + err.headers["Retry-After"].encode(),
        b"server-timing: " + ", ".join(f"{name};dur={ms:.1f}" for name, ms in stages).encode(),
        b"connection: close",
    ]
    return b"\r\n".join(head) + b"\r\n\r\n" + payload


class EarlyAdmission:
    """ASGI middleware running the early gate on the admission routes (inside KeyGuard and
    BodyGuard: the caller has a key and the body is read), and leaving the request's
    lease for its route; a lease never published is refused once the route is done."""

    def __init__(self, app, admission: Admission):
        self.app, self.admission = app, admission

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        entered = time.perf_counter()
        state = scope.setdefault("state", {})
        if state.get("principal") is None:  # no valid key: the route answers 401
            return await self.app(scope, receive, send)
        message = await receive()  # BodyGuard's buffered body, at once
        body = message.get("body", b"") if message["type"] == "http.request" else b""
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return message
            return await receive()

        admission, gate = self.admission, self.admission.gate
        request = request_of(admission.settings, scope["path"], body)
        if request is None:
            return await self.app(scope, replay, send)
        model, tokens, budget_s = request
        if (lease := scope.get(LEASE)) is None:  # not judged as the protocol read it
            err, member = gate.decide(model, tokens, budget_s)
            if err is not None:
                return await self._refuse(model, err, scope, replay, send)
            if member is None:  # not served, or not yet: the route answers
                return await self.app(scope, replay, send)
            await gate.tell(model, member, tokens, "pass")  # (the protocol told the peers of its own)
            lease = admission.passed(model, tokens, member)
        state["admission"] = lease
        try:
            if lease.entry is None and (err := await self._fleet_check(lease, model, tokens, budget_s, scope, entered)):
                return await self._refuse(model, err, scope, replay, send)
            return await self.app(scope, replay, send)
        finally:
            await lease.refused()  # nothing, when the request was published

    async def _fleet_check(
        self, lease: Lease, model: str, tokens: int, budget_s: float, scope, entered: float
    ) -> APIError | None:
        """The fleet-wide check of a request the gate let through: its 429, or None (its
        lease then holds the entry). Alone, the gate's verdict is the fleet's (ALONE)."""
        admission = self.admission
        if admission.gate.alone():
            admission.recent.observe(tokens)
            lease.entry = ALONE
            return None
        await asyncio.sleep(0)  # every request that arrived with this one is judged first
        checking = time.perf_counter()
        timings = scope.setdefault(TIMINGS, [])
        timings.append(("queued", (entered - scope.get(ARRIVED, entered)) * 1000))
        try:
            with suppress(*REDIS_DOWN):  # the route's admission answers 503 then
                lease.entry = await admission.in_time(model, tokens, budget_s)
        except APIError as err:  # refused fleet-wide
            timings.append(("admission", (time.perf_counter() - checking) * 1000))
            return err
        timings.append(("admission", (time.perf_counter() - checking) * 1000))
        return None

    @staticmethod
    async def _refuse(model: str, err: APIError, scope, receive, send) -> None:
        METRICS.requests.labels(model, str(err.status)).inc()
        await err.response()(scope, receive, send)
