"""runtime.jetstream.connect against a real nats-server killed with SIGKILL: the replies
awaited on the lost connection fail at once (callers retry), not at their timeouts."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
from nats.js.api import StreamConfig

from infra.servers import start_nats
from runtime import jetstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_replies_awaited_on_a_killed_server_fail_at_once_and_publishing_resumes(tmp_path, caplog):
    server = start_nats(tmp_path / "store")
    servers = [server]
    nc = await jetstream.connect(server.url, "test")
    try:
        js = jetstream.context(nc)
        await js.add_stream(StreamConfig(name="R", subjects=["r.>"]))

        async def ignore(_msg) -> None:  # takes requests, never answers
            return None

        await nc.subscribe("silent", cb=ignore)
        # A request and a JetStream publish whose replies will never come: both go to a
        # subscriber that does not answer (as a killed server's would not).
        request = asyncio.create_task(nc.request("silent", b"?", timeout=30))
        ack = await js.publish_async("silent", b"x")
        await asyncio.sleep(0.2)
        assert not request.done() and not ack.done()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        killed = time.monotonic()
        with pytest.raises(jetstream.ReplyLost):
            await request
        with pytest.raises(jetstream.ReplyLost):
            await ack
        failed_after = time.monotonic() - killed
        assert failed_after < 5, failed_after  # not the request's 30 s
        await asyncio.sleep(0.6)  # a reconnect attempt or two refused meanwhile
        servers.append(start_nats(tmp_path / "store", port=server.port))
        stored = await js.publish("r.1", b"after", timeout=10)  # reconnected by itself
        assert stored.stream == "R"
        said = [r.getMessage() for r in caplog.records]
        assert any(m.startswith("NATS connection lost; 2 replies") for m in said), said
        assert any(m.startswith("NATS connection back after") for m in said), said
        assert any(m.startswith("NATS: ConnectionRefusedError") for m in said), said
        assert not [r for r in caplog.records if r.exc_info], "a refused reconnect attempt is one line, no traceback"
        print(f"\n[replies lost] failed {failed_after:.2f} s after the kill")
    finally:
        await nc.close()
        for s in servers:
            s.stop()
