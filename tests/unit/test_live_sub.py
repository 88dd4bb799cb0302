"""The gateway's read of a request's live subject (gateway.pipeline.LiveSub): messages in
order, at once when queued, TimeoutError when none comes; and `Output` over one that lost
a chunk (pure asyncio, no server)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.msg import Msg

from events import encode
from events.models import ChatCompleted, Timings, TokensGenerated, Usage
from gateway import pipeline as pipeline_module
from gateway.pipeline import LiveSub, Output


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


# ---- gateway.pipeline.Output over a live subject that lost a chunk ------------------


class LossyPipeline:
    """A request's chunks 0..n-1 in the "stream"; live, every chunk but `lost`, one every
    `every` s (as after a NATS restart: the chunk sent to the dead server never came live),
    and `lost` after chunk `resend_after` (sent again)."""

    def __init__(self, n: int, lost: int, every: float, resend_after: int | None = None) -> None:
        ids = dict(request_id="r", conv_id="r", turn_id=0)
        self.chunks = [TokensGenerated(**ids, seq=i, text=f"t{i}", token_ids=(i,), model="m") for i in range(n)]
        self.done = ChatCompleted(
            **ids,
            model="m",
            text="".join(c.text for c in self.chunks),
            finish_reason="length",
            usage=Usage(prompt_tokens=1, completion_tokens=n, total_tokens=n + 1),
            timings=Timings(queue_wait_s=0, ttft_s=0, decode_s=0, compute_s=0),
            chunks=n,
        )
        self.lost, self.every, self.resend_after = lost, every, resend_after
        self.stored_late = 0  # how many stream reads miss the lost chunk too
        self.live = LiveSub()
        self.reads = 0

    async def subscribe(self, request_id: str) -> LiveSub:
        return self.live

    async def history(self, request_id: str) -> list:
        self.reads += 1
        if self.reads <= self.stored_late:  # not in the stream yet
            return [c for c in self.chunks if c.seq != self.lost]
        return list(self.chunks)

    async def send(self, terminal: bool) -> None:
        for chunk in self.chunks:
            if chunk.seq != self.lost:
                await self.live.put(Msg(None, data=encode(chunk)))  # type: ignore[arg-type]
                await asyncio.sleep(self.every)
            if chunk.seq == self.resend_after:  # its worker sends the lost one again
                await self.live.put(Msg(None, data=encode(self.chunks[self.lost])))  # type: ignore[arg-type]
        if terminal:
            await self.live.put(Msg(None, data=encode(self.done)))  # type: ignore[arg-type]


async def read(pipeline: LossyPipeline, within: float) -> list[tuple[int, float]]:
    """The chunks Output yields (seq, seconds from the start) until `within` s have passed."""
    start, got = time.monotonic(), []
    output = Output(pipeline, "r", until=time.time() + within)  # type: ignore[arg-type]
    async with output:
        async for chunk in output:
            got.append((chunk.seq, time.monotonic() - start))
    return got


async def test_chunks_held_behind_a_lost_one_are_no_progress_and_the_stream_is_read_for_it(monkeypatch):
    monkeypatch.setattr(pipeline_module, "QUIET_S", 0.3)
    lossy = LossyPipeline(n=40, lost=1, every=0.05)  # live messages keep coming, none deliverable
    lossy.stored_late = 1  # the read when the gap shows misses it too
    sender = asyncio.create_task(lossy.send(terminal=False))
    got = await read(lossy, within=1.5)
    await sender
    assert [seq for seq, _ in got] == list(range(40))
    assert 0.25 < got[1][1] < 0.8, got[:3]  # one quiet interval after chunk 0, not the end of the answer


async def test_a_slow_stream_read_holds_no_live_chunk_back(monkeypatch):
    """A NATS server that just restarted answers a stream read in seconds: live chunks
    keep coming out meanwhile (here the lost one, sent again by its worker), and what
    the read finds is taken when it ends."""
    monkeypatch.setattr(pipeline_module, "QUIET_S", 0.2)
    lossy = LossyPipeline(n=30, lost=1, every=0.05, resend_after=8)
    history = lossy.history

    async def slow(request_id: str) -> list:
        await asyncio.sleep(1.0)
        return await history(request_id)

    lossy.history = slow  # type: ignore[method-assign]
    sender = asyncio.create_task(lossy.send(terminal=True))
    got = await read(lossy, within=5.0)
    await sender
    assert [seq for seq, _ in got] == list(range(30)) and lossy.reads >= 1
    assert got[1][1] < 0.9, got[:3]  # at the resend (~0.4 s), not after the read (1.2 s)


async def test_a_gap_is_read_from_the_stream_when_it_shows():
    """Not `QUIET_S` (2 s) later: the chunk lost live is in the stream already."""
    lossy = LossyPipeline(n=20, lost=1, every=0.05)
    sender = asyncio.create_task(lossy.send(terminal=True))
    got = await read(lossy, within=5.0)
    await sender
    assert [seq for seq, _ in got] == list(range(20)) and lossy.reads == 1
    assert got[1][1] < 0.5, got[:3]  # at the next live chunk's arrival and the read


async def test_a_reconnect_reads_the_stream_at_once():
    """What was sent live while the gateway was away (its server restarted, a worker back
    first) is in the stream: read when the connection is back, not `QUIET_S` (2 s) later."""
    lossy = LossyPipeline(n=3, lost=2, every=0.0)  # the last chunk lost: no gap shows
    await lossy.send(terminal=False)
    lossy.live.reconnected()
    got = await read(lossy, within=1.0)
    assert [seq for seq, _ in got] == [0, 1, 2] and got[2][1] < 0.5 and lossy.reads == 1
