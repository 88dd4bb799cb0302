"""runtime.pulls against a real nats-server: a fetch takes every waiting message up to
its batch at once, and a lone message on an idle durable is not held back."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from runtime.pulls import fetch_available, fetch_in_batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _durable(url: str):
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="P", subjects=["p.>"]))
    await js.add_consumer("P", ConsumerConfig(durable_name="d", ack_policy=AckPolicy.EXPLICIT))
    return nc, js, await js.pull_subscribe_bind("d", "P")


async def test_a_backlog_comes_in_one_fetch_up_to_the_batch(nats_server):
    nc, js, sub = await _durable(nats_server.url)
    try:
        for i in range(20):
            await js.publish(f"p.{i}", str(i).encode())
        first = await fetch_available(sub, 16, timeout=1.0)
        rest = await fetch_available(sub, 16, timeout=1.0)
        assert [m.data for m in first + rest] == [str(i).encode() for i in range(20)]
        assert len(first) == 16 and len(rest) == 4
        for m in first + rest:
            await m.ack()
        with pytest.raises(asyncio.TimeoutError):  # nothing left: the long-poll times out
            await fetch_available(sub, 16, timeout=0.3)
    finally:
        await nc.close()


async def test_a_lone_message_on_an_idle_durable_is_not_held_for_the_batch(nats_server):
    nc, js, sub = await _durable(nats_server.url)
    try:

        async def later() -> float:
            await asyncio.sleep(0.3)
            await js.publish("p.x", b"lone")
            return time.monotonic()

        sent = asyncio.create_task(later())
        msgs = await fetch_available(sub, 16, timeout=5.0)  # long-polls: nothing is there yet
        took = time.monotonic() - await sent
        assert [m.data for m in msgs] == [b"lone"]
        assert took < 0.5, took  # stock nats-py waits out the 5 s for 15 more
        await msgs[0].ack()
    finally:
        await nc.close()


async def test_a_subscription_fetches_what_its_size_function_says(nats_server):
    nc, js, sub = await _durable(nats_server.url)
    try:
        for i in range(10):
            await js.publish(f"p.{i}", b"x")
        room = [3]
        fetch_in_batches(sub, lambda: room[0])
        assert len(await sub.fetch(batch=1, timeout=1)) == 3  # the size function, not the argument
        room[0] = 0  # no room: one message still, which waits for room in the handler
        assert len(await sub.fetch(batch=1, timeout=1)) == 1
    finally:
        await nc.close()
