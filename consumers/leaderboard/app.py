"""The leaderboard consumer: battle events in, the current leaderboard in Redis out.

On start it reads every stored battle event (the projection is rebuilt from the stream,
never trusted from Redis), then follows its durable consumer. Votes are acked once
applied; the leaderboard is refit and stored at most every `refresh_s`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one fit at a time on a small box

from nats.aio.msg import Msg

from consumers.leaderboard.projection import VoteProjection, config_of
from consumers.leaderboard.settings import LeaderboardSettings
from events import decode, topology
from events.arena_readmodel import save_leaderboard
from events.battles import BATTLES_SUBJECT
from events.fleet import LeaderboardBeat
from runtime.consume import DurableConsumer
from runtime.process import Process, ProcessRuntime, decode_or_term, serve
from runtime.redis import redis_client

log = logging.getLogger(__name__)


async def backfill(js, projection: VoteProjection) -> None:
    """Every battle event already stored, with its stream sequence."""
    sub = await js.subscribe(BATTLES_SUBJECT, ordered_consumer=True)
    try:
        info = await sub.consumer_info()
        left = info.num_pending + info.delivered.consumer_seq
        while left > 0:
            msg = await sub.next_msg(timeout=5.0)
            projection.apply(decode(msg.data), msg.metadata.sequence.stream)
            left -= 1
    finally:
        await sub.unsubscribe()


def build_app(settings: LeaderboardSettings | None = None) -> Process:
    settings = settings or LeaderboardSettings()
    role = topology.LEADERBOARD
    projection = VoteProjection(config_of(settings))
    redis = redis_client(settings.redis_url)
    runtime = ProcessRuntime(role.name, settings, lambda beat: LeaderboardBeat(**beat.base(), seq=projection.seq))
    dirty = asyncio.Event()
    # The boards are computed on a thread: no event is folded meanwhile, so each stored view
    # is the fold of the events up to its `seq`, exactly what `arena leaderboard --at` replays.
    folding = asyncio.Lock()

    async def on_battle_event(message: Msg) -> None:
        event = await decode_or_term(role.name, message, role.consumes)
        if event is None:
            return
        # A redelivered event is applied again harmlessly: a battle's first vote holds.
        async with folding:
            projection.apply(event, message.metadata.sequence.stream)
        dirty.set()
        await message.ack()

    async def publisher() -> None:
        while True:
            await dirty.wait()
            dirty.clear()
            async with folding:
                boards = await asyncio.to_thread(projection.boards)
            try:
                for view, board in boards.items():
                    await save_leaderboard(redis, board, view)
            except Exception as exc:  # noqa: BLE001 - Redis down: keep going, retry on the next vote
                log.warning("could not store the leaderboard: %s", exc)
                dirty.set()
            await asyncio.sleep(settings.refresh_s)

    @asynccontextmanager
    async def projected(runtime: ProcessRuntime) -> AsyncIterator[None]:
        """The projection rebuilt from every stored battle event before the durable's
        pulls start, then stored in Redis whenever a vote changes it."""
        assert runtime.js is not None
        await backfill(runtime.js, projection)
        dirty.set()
        storing = asyncio.create_task(publisher())
        try:
            yield
        finally:
            storing.cancel()
            with suppress(asyncio.CancelledError):
                await storing
            await redis.aclose()

    # One worker, one message at a time: votes are folded in stream order.
    return Process(runtime, DurableConsumer(role, on_battle_event, "manual"), projected)


def main() -> None:
    serve(build_app())
