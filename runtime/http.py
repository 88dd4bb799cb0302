"""Each consumer process's own small HTTP endpoint: `/healthz` (the process runs),
`/readyz` (it is connected and has done its start-up, e.g. models warm; 503 before) and
`/metrics` (Prometheus). What a Kubernetes probe or a Prometheus scrape needs, with no
web framework: a few lines of HTTP/1.0 on asyncio."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from contextlib import suppress

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

log = logging.getLogger(__name__)


def _response(status: int, body: bytes, content_type: str) -> bytes:
    reason = {200: "OK", 404: "Not Found", 503: "Service Unavailable"}[status]
    head = f"HTTP/1.0 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class ProcessEndpoint:
    def __init__(
        self, role: str, ready: Callable[[], bool], host: str = "127.0.0.1", port: int = 0, fd: int | None = None
    ):
        """``fd``: a listening socket to serve (inherited from `arena up`), instead of binding host:port."""
        self.role, self.ready, self.host, self.port, self.fd = role, ready, host, port, fd
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        """Listen; returns the port (a free one when asked for 0)."""
        if self.fd is not None:
            self.server = await asyncio.start_server(self._serve, sock=socket.socket(fileno=self.fd))
        else:
            self.server = await asyncio.start_server(self._serve, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            with suppress(Exception):
                await self.server.wait_closed()

    def answer(self, path: str) -> bytes:
        if path == "/healthz":
            return _response(200, json.dumps({"status": "ok", "role": self.role}).encode(), "application/json")
        if path == "/readyz":
            ok = self.ready()
            return _response(
                200 if ok else 503, json.dumps({"ready": ok, "role": self.role}).encode(), "application/json"
            )
        if path == "/metrics":
            return _response(200, generate_latest(), CONTENT_TYPE_LATEST)
        return _response(404, b'{"error": "not found"}', "application/json")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), timeout=5.0)
            parts = line.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else "/"
            writer.write(self.answer(path))
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeError) as exc:
            log.debug("health endpoint: %s", exc)
        finally:
            writer.close()
            with suppress(Exception):
                await writer.wait_closed()
