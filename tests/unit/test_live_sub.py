"""The gateway's read of a request's live subject (gateway.pipeline.LiveSub): messages in
order, at once when queued, TimeoutError when none comes (pure asyncio, no server)."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.pipeline import LiveSub


async def test_messages_come_in_order_and_a_silent_subject_times_out():
    live = LiveSub()
    for i in range(3):
        await live.put(i)
    assert [await live.next_msg(timeout=0.01) for _ in range(3)] == [0, 1, 2]
    started = time.perf_counter()
    with pytest.raises(TimeoutError):
        await live.next_msg(timeout=0.05)
    assert 0.04 <= time.perf_counter() - started < 1.0
    # A message arriving while a read waits ends the wait.
    asyncio.get_running_loop().call_later(0.01, live.queue.put_nowait, "late")
    assert await live.next_msg(timeout=2.0) == "late"
    await live.unsubscribe()  # no subscription yet: nothing to do
