"""runtime.pulls and runtime.consume against a real nats-server: a fetch takes every
waiting message up to its batch at once, a lone message on an idle durable is not held
back, and the pull loop settles each message as its handler says."""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

import nats
import pytest
from faststream.exceptions import NackMessage, RejectMessage
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig

from events import subjects
from events.topology import Role
from runtime.consume import DurableConsumer
from runtime.pulls import fetch_available
from tests.conftest import until

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


async def _consumer_on(url: str, durable: str = "d", ack_wait: float = 30.0):
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=subjects.STREAM, subjects=["arena.>"]))
    config = ConsumerConfig(
        durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=ack_wait, deliver_policy=DeliverPolicy.ALL
    )
    await js.add_consumer(subjects.STREAM, config)
    return nc, js, Role(name=durable, entry="tests:none", reads="arena.>")


async def _pending(js, durable: str = "d") -> tuple[int, int]:
    info = await js.consumer_info(subjects.STREAM, durable)
    return info.num_pending, info.num_ack_pending


async def test_auto_ack_settles_each_message_as_its_handler_says(nats_server):
    nc, js, role = await _consumer_on(nats_server.url)
    seen: dict[str, int] = {}

    async def handle(msg) -> None:
        kind = msg.subject.rsplit(".", 1)[-1]
        seen[kind] = msg.metadata.num_delivered
        if kind == "nak":
            raise NackMessage(delay=0.2) if msg.metadata.num_delivered == 1 else RejectMessage()
        if kind == "boom" and msg.metadata.num_delivered == 1:
            raise RuntimeError("a handler bug: naked, tried again")
        if kind == "reject":
            raise RejectMessage()

    consumer = DurableConsumer(role, handle, "auto", workers=4, batch=4)
    try:
        for kind in ("ok", "nak", "boom", "reject"):
            await js.publish(f"arena.t.{kind}", b"x")
        await consumer.start(js)
        await until(lambda: seen.get("nak") == 2 and seen.get("boom") == 2 and "ok" in seen and "reject" in seen)
        await until(lambda: _settled(js), what=lambda: _pending(js))
        assert seen == {"ok": 1, "nak": 2, "boom": 2, "reject": 1}  # acked, terminated: none comes back
    finally:
        await consumer.stop()
        await nc.close()


async def _settled(js) -> bool:
    return await _pending(js) == (0, 0)


async def test_one_worker_handles_messages_in_stream_order(nats_server):
    nc, js, role = await _consumer_on(nats_server.url)
    order: list[int] = []

    async def handle(msg) -> None:
        await asyncio.sleep(0.01 if int(msg.data) % 2 else 0.0)  # a slower one must not be overtaken
        order.append(int(msg.data))
        await msg.ack()

    consumer = DurableConsumer(role, handle, "manual", batch=8)
    try:
        for i in range(20):
            await js.publish(f"arena.o.{i}", str(i).encode())
        await consumer.start(js)
        await until(lambda: len(order) == 20)
        assert order == list(range(20))
    finally:
        await consumer.stop()
        await nc.close()


async def test_stop_gives_back_what_was_fetched_and_not_started(nats_server):
    nc, js, role = await _consumer_on(nats_server.url, ack_wait=60.0)
    release = asyncio.Event()
    started: list[bytes] = []

    async def handle(msg) -> None:
        started.append(msg.data)
        await release.wait()
        await msg.ack()

    consumer = DurableConsumer(role, handle, "manual", workers=1, batch=5)
    for i in range(5):
        await js.publish(f"arena.s.{i}", str(i).encode())
    await consumer.start(js)
    await until(lambda: len(started) == 1)
    stopping = asyncio.create_task(consumer.stop())
    await asyncio.sleep(0.2)
    release.set()  # the running handler finishes; the four waiting were naked, not held to AckWait
    await stopping
    assert started == [b"0"]
    sub = await js.pull_subscribe_bind("d", subjects.STREAM)
    again = await fetch_available(sub, 10, timeout=2.0)
    assert sorted(m.data for m in again) == [b"1", b"2", b"3", b"4"]
    assert all(m.metadata.num_delivered == 2 for m in again)
    await nc.close()


async def test_fetches_while_nats_is_down_are_counted(nats_server):
    from runtime.consume import PULL_ERRORS

    nc, js, role = await _consumer_on(nats_server.url)

    async def handle(msg) -> None:
        await msg.ack()

    consumer = DurableConsumer(role, handle, "auto")
    await consumer.start(js)
    failed = PULL_ERRORS.labels(role.name)._value.get()
    try:
        nats_server.stop()  # a real outage: the server process is gone
        await until(lambda: PULL_ERRORS.labels(role.name)._value.get() >= failed + 2, timeout=10)
    finally:
        await consumer.stop()
        with suppress(Exception):  # the server is gone
            await nc.close()
