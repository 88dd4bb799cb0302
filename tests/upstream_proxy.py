"""A fault-injecting HTTP proxy for the upstream tests: it stands between the inference
worker and a real OpenAI-compatible server (a llama-server, another `arena up`), passes
requests through as they are, and fails the next generation requests the way a test
tells it (`fail_next`), one fault each:

- ``stall``: nothing sent, not even the status line, for ``stall_s`` (the worker's read
  timeout gives up first); the request never reaches the upstream;
- ``drop``: the upstream's stream passed on for ``drop_after`` events, then the
  connection cut without the stream's end;
- ``busy``: 429 with ``Retry-After: retry_after``;
- ``error``: 500 with an OpenAI error body;
- ``malformed``: ``drop_after`` events passed on, then a `data:` line that is no JSON.

``refusing`` closes its port (the worker's connections are refused by the kernel) until
it is set back. ``pace_s`` slows every streamed event (an answer long enough to kill its
worker in). ``calls`` lists each generation request the upstream was sent, path and body,
so a test counts them. Every answer closes its connection: no pooled connection outlives
a refusal. It runs its own event loop in a thread, for the synchronous tests."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp
import orjson
from aiohttp import web

from tests.arena_up import ArenaUp

Fault = Literal["stall", "drop", "busy", "error", "malformed"]
#: Request headers not passed on (the proxy's own connection to the upstream sets them).
HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


@dataclass(frozen=True)
class Call:
    """A generation request the upstream was sent."""

    path: str
    body: dict


class FaultyProxy:
    """The proxy (see the module's docstring) to ``target``, an upstream's root URL."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.faults: deque[Fault] = deque()
        self.calls: list[Call] = []
        self.stall_s, self.drop_after, self.retry_after, self.pace_s = 30.0, 3, "1", 0.0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="faulty-proxy", daemon=True).start()
        self.port = self._run(self._start(0))
        self.url = f"http://127.0.0.1:{self.port}"

    def fail_next(self, *faults: Fault) -> None:
        """The next generation requests fail so, one each, in order; then all pass."""
        self.faults.extend(faults)

    @property
    def refusing(self) -> bool:
        return self._site is None

    @refusing.setter
    def refusing(self, on: bool) -> None:
        if on != self.refusing:
            self._run(self._stop_listening() if on else self._start(self.port))

    def calls_with(self, text: str) -> list[Call]:
        """The generation requests whose body mentions ``text`` (a test's unique prompt)."""
        return [c for c in self.calls if text in orjson.dumps(c.body).decode()]

    def close(self) -> None:
        self._run(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)

    # ---- on the proxy's loop ---------------------------------------------------------

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    async def _start(self, port: int) -> int:
        if not hasattr(self, "_runner"):
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
            app = web.Application()
            app.router.add_route("*", "/{path:.*}", self._handle)
            self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
            await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self._site: web.TCPSite | None = site
        return site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def _stop_listening(self) -> None:
        assert self._site is not None
        site, self._site = self._site, None
        await site.stop()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        generation = request.method == "POST" and request.path.endswith("completions")
        fault = self.faults.popleft() if generation and self.faults else None
        if fault == "stall":
            await asyncio.sleep(self.stall_s)
            cut(request)
            raise asyncio.CancelledError
        if fault == "busy":
            return self._closing(
                web.json_response(error("busy"), status=429, headers={"Retry-After": self.retry_after})
            )
        if fault == "error":
            return self._closing(web.json_response(error("the upstream failed"), status=500))
        if generation:
            self.calls.append(Call(request.path, orjson.loads(raw)))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        url = self.target + request.path_qs
        async with self._session.request(request.method, url, data=raw, headers=headers) as upstream:
            if not upstream.content_type.startswith("text/event-stream"):
                body = await upstream.read()
                return self._closing(
                    web.Response(status=upstream.status, body=body, content_type=upstream.content_type)
                )
            return await self._streamed(request, upstream, fault)

    async def _streamed(
        self, request: web.Request, upstream: aiohttp.ClientResponse, fault: Fault | None
    ) -> web.StreamResponse:
        response = self._closing(web.StreamResponse(status=upstream.status))
        response.content_type = "text/event-stream"
        await response.prepare(request)
        events = 0
        async for line in upstream.content:
            if line.startswith(b"data:"):
                if fault in ("drop", "malformed") and events == self.drop_after:
                    if fault == "malformed":
                        await response.write(b'data: {"choices": [{"delta": {"content": "x"\n\n')
                    cut(request)  # no end of the stream
                    raise asyncio.CancelledError
                events += 1
                if self.pace_s:
                    await asyncio.sleep(self.pace_s)
            await response.write(line)
        await response.write_eof()
        return response

    @staticmethod
    def _closing(response: web.StreamResponse) -> web.StreamResponse:
        response.force_close()
        return response


def error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "code": None}}


def cut(request: web.Request) -> None:
    """The request's connection closed as it is (the client may have closed it already)."""
    if request.transport is not None:
        request.transport.close()


@contextmanager
def proxied_stack(upstream: str, tmp: Path, entries: list[str], key: str) -> Iterator[tuple[ArenaUp, FaultyProxy]]:
    """`arena up` serving stories-260k (the default) and the upstream models of
    ``entries`` (models-config list items; ``{url}`` in them is the proxy's API root, the
    key read from TEAM_KEY), through a FaultyProxy to the ``upstream`` API root; both
    stopped after."""
    proxy = FaultyProxy(upstream.removesuffix("/v1"))
    config = tmp / "models.yaml"
    lines = "".join(f"  - {entry.replace('{url}', proxy.url + '/v1')}\n" for entry in entries)
    config.write_text(f"models:\n  - {{name: stories-260k, path: stories260K-hf}}\n{lines}")
    stack = ArenaUp(tmp, "--models-config", str(config), "--default-model", "stories-260k", env={"TEAM_KEY": key})
    try:
        yield stack, proxy
    finally:
        stack.stop()
        proxy.close()
