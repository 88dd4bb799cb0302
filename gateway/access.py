"""Who is calling: the API key check for every route, and principals.

A principal names whoever created a request, a conversation or a battle: a keyed hash
(HMAC with the deployment's secret, shared by every gateway through Redis) of the API
key, never the key itself; `anonymous` when keys are off. Another principal asking for
it gets 404, as if it did not exist, so ids cannot be probed.

`KeyGuard` (ASGI middleware) checks the key on every HTTP route and WebSocket except
the paths the operator leaves open (`open_paths`: by default /healthz and /readyz, the
latter without details for a caller without a key) and the arena pages' shell
(`PAGE_PATHS`: static HTML, script and style, no data; the page asks for a key and sends
it on its API calls). Keys are taken from the
`Authorization: Bearer` header only: a key in the query string (`?api_key=`) would be
written to access logs, so it is refused.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from events.arena_readmodel import arena_secret
from gateway.errors import APIError
from gateway.keyed import keyed
from gateway.metrics import METRICS
from gateway.ratelimit import Limits
from gateway.settings import GatewaySettings
from runtime.redis import REDIS_DOWN

ANONYMOUS = "anonymous"
#: Query parameters that look like credentials: refused, and redacted in logs.
KEY_PARAMS = ("api_key", "apikey", "api-key", "access_token", "key", "token")
#: The arena pages' static shell, served without a key whatever `open_paths` says (the
#: data behind it, under /arena/battles and /arena/leaderboard, still needs one).
PAGE_PATHS = ("/arena", "/arena/board", "/arena/static/*")


def bearer(headers: list[tuple[bytes, bytes]]) -> str | None:
    auth = dict(headers).get(b"authorization", b"").decode("latin-1")
    return auth[7:] if auth.startswith("Bearer ") else None


def unauthorized() -> APIError:
    return APIError(401, "missing or invalid API key (Authorization: Bearer ...)", "invalid_api_key")


def not_found(kind: str, ident: str, param: str) -> APIError:
    """What another principal gets: the same answer as for an id that does not exist."""
    return APIError(404, f"no {kind} '{ident}' is known here", f"{kind}_not_found", param)


def limits_of(conn: Any) -> Limits | None:
    """The rate limits KeyGuard found for the caller's key (or the default)."""
    return getattr(conn.state, "limits", None)


def principal_of(conn: Any) -> str:
    """The principal KeyGuard found for a request or WebSocket (anonymous on a route the
    operator left open, for a caller without a key)."""
    return getattr(conn.state, "principal", None) or ANONYMOUS


class Access:
    def __init__(self, settings: GatewaySettings, redis: Any):
        self.settings, self.redis = settings, redis
        self._secret: bytes | None = None
        self.default_limits = Limits(rpm=settings.rate_limit_rpm, tpm=settings.rate_limit_tpm)
        self.key_limits = {
            key: self.default_limits.model_copy(update=limits.model_dump(exclude_none=True))
            for key, limits in settings.rate_limits.items()
        }

    def limits(self, api_key: str | None) -> Limits:
        return self.key_limits.get(api_key, self.default_limits) if api_key else self.default_limits

    async def secret(self) -> bytes:
        if self._secret is None:
            self._secret = await arena_secret(self.redis)
        return self._secret

    async def principal(self, api_key: str | None) -> str | None:
        """The caller's principal; None for a key that is not accepted."""
        if not self.settings.api_keys:
            return ANONYMOUS
        if api_key is None or api_key not in self.settings.api_keys:
            return None
        return "p-" + keyed(await self.secret(), "principal", api_key)[:24]

    def is_open(self, path: str) -> bool:
        return any(
            path == p or (p.endswith("*") and path.startswith(p[:-1])) for p in (*self.settings.open_paths, *PAGE_PATHS)
        )


class KeyGuard:
    """Sets `scope["state"]["principal"]` (None: no valid key, on an open path or a
    WebSocket, whose handler answers with an error frame); 401 on other HTTP routes."""

    def __init__(self, app, access: Access):
        self.app, self.access = app, access

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        err: APIError | None = None
        principal: str | None = None
        api_key = bearer(scope["headers"])
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"))
        if any(name.lower() in KEY_PARAMS for name, _ in query):
            err = APIError(
                400, "send the API key as 'Authorization: Bearer ...', never in the URL", "key_in_url", "api_key"
            )
        else:
            try:
                principal = await self.access.principal(api_key)
            except REDIS_DOWN:
                err = APIError(503, "the key store is unavailable; retry shortly", "store_unavailable")
            if principal is None and err is None and not self.access.is_open(scope["path"]):
                METRICS.rejections.labels(reason="unauthorized").inc()
                err = unauthorized()
        scope.setdefault("state", {}).update(principal=principal, limits=self.access.limits(api_key))
        if err is not None and scope["type"] == "http":
            response = err.response()
            await response(scope, receive, send)
            return None
        scope["state"]["access_error"] = err
        return await self.app(scope, receive, send)
