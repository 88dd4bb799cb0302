"""The uvicorn-private state gateway/admission/uvicorn_adapter.py touches, checked on a
real protocol of the installed uvicorn reading a real request: a uvicorn release that
renames or drops any of it fails here, by name, before the hook misbehaves in a burst
(or a timer fires into a WebSocket, as one did: its regression tests are in
test_edge_timers.py and tests/e2e/test_long_connections.py)."""

from __future__ import annotations

import asyncio

import uvicorn
from uvicorn.server import ServerState

from gateway.admission.uvicorn_adapter import UVICORN_PRIVATE, head_timeout_protocol, missing_private_state


class Transport(asyncio.Transport):
    """A socket that keeps what is written to it."""

    def __init__(self) -> None:
        super().__init__()
        self.written, self.closed = b"", False

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_the_adapter_still_fits_the_installed_uvicorn():
    bodies: list[bytes] = []
    held = asyncio.Event()

    async def app(scope, receive, send):
        if scope["type"] == "http":
            bodies.append((await receive())["body"])
            await held.wait()

    def hook(scope, body, arrived, reply):
        return None  # serve it

    protocol_class = head_timeout_protocol(10.0, refuse=hook)
    config = uvicorn.Config(app, log_config=None, lifespan="off", http=protocol_class)
    config.load()
    protocol = protocol_class(config=config, server_state=ServerState(), app_state={})
    transport = Transport()
    protocol.connection_made(transport)
    protocol.data_received(b"POST /chat HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}")
    await asyncio.sleep(0.05)
    assert bodies == [b"{}"]  # the request went through the hook to the app
    assert protocol.cycle is not None and not protocol.cycle.response_complete
    missing = missing_private_state(protocol)
    assert missing == [], (
        f"uvicorn {uvicorn.__version__} no longer has {missing}: gateway/admission/uvicorn_adapter.py "
        f"reads or writes them (UVICORN_PRIVATE); adapt it before upgrading"
    )
    assert set(UVICORN_PRIVATE) == {"http methods", "http state", "cycle state", "websocket methods"}
    held.set()
    protocol.connection_lost(None)
    await asyncio.sleep(0)


def test_a_protocol_missing_the_state_is_named():
    """The check itself names what it cannot find (a stand-in with none of it)."""
    missing = missing_private_state(object())
    assert "object.cycle" in missing and "RequestResponseCycle.more_body" in missing
