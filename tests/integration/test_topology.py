"""Adding a consumer is one registry entry plus its app: JetStream set-up and readiness
follow the registry (real nats-server)."""

from __future__ import annotations

import asyncio

import nats
import pytest

from events import topology
from gateway.pipeline import Pipeline
from gateway.settings import GatewaySettings
from runtime import jetstream
from runtime.process import ProcessRuntime
from runtime.settings import CommonSettings

pytestmark = pytest.mark.integration

TOY = topology.Role(name="toy", entry="tests.integration.toy_app:main", reads="arena.res.completed.>")


async def test_a_registered_stage_is_created_and_awaited_by_readiness(nats_server, monkeypatch):
    monkeypatch.setattr(topology, "ROLES", [*topology.ROLES, TOY])
    settings = CommonSettings(nats_url=nats_server.url, heartbeat_s=0.2)
    gateway = Pipeline(GatewaySettings(nats_url=nats_server.url, redis_url="redis://127.0.0.1:1/0", heartbeat_s=0.2))
    await gateway.start()
    runtimes = [ProcessRuntime(name, settings) for name in ("filter", "delivery", "inference")]
    for rt in runtimes:
        await rt.start()
        rt.ready = True
    try:
        nc = await nats.connect(nats_server.url)
        info = await nc.jetstream().consumer_info("ARENA", "toy")
        await nc.close()
        assert info.config.filter_subject == "arena.res.completed.>"
        await asyncio.sleep(0.5)
        assert gateway.fleet().count("toy") == 0
        assert not gateway.ready("any")[0] and "toy" in topology.required()

        toy = ProcessRuntime("toy", settings)
        await toy.start()
        toy.ready = True
        runtimes.append(toy)
        for _ in range(50):  # heartbeats every 0.2 s; a slow machine may take a few
            if gateway.fleet().count("toy") == 1:
                break
            await asyncio.sleep(0.1)
        assert gateway.fleet().count("toy") == 1
    finally:
        for rt in runtimes:
            await rt.stop()
        await gateway.stop()


def test_consumer_configs_follow_the_registry():
    names = [c.durable_name for c in jetstream.consumer_configs(ack_wait_s=4.0)]
    assert names == [r.name for r in topology.consumers()]
    inference = next(c for c in jetstream.consumer_configs(ack_wait_s=4.0) if c.durable_name == "inference")
    assert inference.ack_wait == 4.0 and inference.max_ack_pending == 256
