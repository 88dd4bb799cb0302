"""Consumers get their pulled message on the event loop, not through a worker thread."""

from __future__ import annotations

import asyncio

import pytest
from fast_depends.utils import is_coroutine_callable

from runtime.process import PulledMessage

pytestmark = pytest.mark.timeout(30)


def test_the_message_is_looked_up_by_a_coroutine():
    # fast_depends runs a synchronous resolver in a thread pool (a round trip per message).
    (marker,) = PulledMessage.__metadata__
    assert is_coroutine_callable(marker.use)


async def test_a_handler_gets_its_message():
    from faststream.nats import NatsBroker, TestNatsBroker

    broker = NatsBroker()
    seen: list[bytes] = []

    @broker.subscriber("pulled.test")
    async def handler(message: PulledMessage) -> None:
        seen.append(message.body)

    async with TestNatsBroker(broker) as br:
        await br.publish(b"hello", "pulled.test")
        await asyncio.sleep(0)
    assert seen == [b"hello"]
