"""A durable consumer's pull loop: fetch, hand each message to the handler, settle it.

The consumers used FastStream's pull subscriber for this. Its per-message path (a task
group per fetch, the middleware chain, dependency injection for the handler's
arguments) cost, measured on one consumer republishing and acking each message, several
times this loop's CPU a message on a busy core and, on an idle machine, milliseconds
between the fetch returning and the handler starting (docs/benchmarks.md, "One user, hop
by hop; the pull loop"; `python -m bench.pull_loop`). Every request passes three
consumers (filter, inference, delivery), two of them before its first token.

This loop keeps what the consumers relied on and nothing else:
- each fetch takes what waits, up to a batch, else long-polls for one (`runtime.pulls`);
- up to `workers` messages are handled at once, in the order fetched (one worker:
  strictly in stream order, as the leaderboard needs);
- settling, as FastStream's exceptions say (STYLE: acknowledgement by raising):
  ``ack="auto"`` acks a handler that returns and naks one that raises;
  `NackMessage(delay=s)` naks with that delay, `RejectMessage` terminates, `AckMessage`
  acks; a message the handler settled itself is left alone. ``ack="manual"``: the
  handler settles every message itself;
- a fetch that fails, or times out while NATS is unreachable, is counted
  (`arena_pull_errors_total`) and retried, never silent; `stop()` stops fetching, naks
  what was fetched and not started, and waits for the handlers running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress
from functools import partial
from typing import Any, Literal

from faststream.exceptions import AckMessage, NackMessage, RejectMessage
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter

from events import subjects
from events.topology import Role
from runtime.jetstream import NATS_DOWN
from runtime.pulls import fetch_available

log = logging.getLogger(__name__)

Handler = Callable[[Msg], Awaitable[None]]

#: How long one fetch waits for a message. Short, because a fetch lost with its server
#: (a cluster node killed) stalls the consumer this long; an idle consumer asks once a
#: second. (It was 5 s: a 3-node cluster losing a follower stalled every answer 5 s.)
PULL_WAIT_S = 1.0
#: After a failed fetch (not a timeout), the wait before the next.
RETRY_S = 0.25
#: How long `stop()` waits for the handlers running.
STOP_WAIT_S = 10.0

PULL_ERRORS = Counter(
    "arena_pull_errors_total", "Fetches from a durable consumer that failed (NATS unreachable, no leader)", ["role"]
)


class DurableConsumer:
    """Pulls `role`'s durable and hands each message to `handler` (see the module doc)."""

    def __init__(
        self,
        role: Role,
        handler: Handler,
        ack: Literal["auto", "manual"],
        workers: int = 1,
        batch: int | Callable[[], int] = 1,
    ):
        assert role.reads and role.durable, f"role {role.name} reads no durable consumer"
        self.role, self.handler, self.ack = role, handler, ack
        self.workers = workers
        self.size = batch if callable(batch) else (lambda: batch)
        self._sub: JetStreamContext.PullSubscription | None = None
        self._loop: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._unstarted: list[Msg] = []

    async def start(self, js: JetStreamContext) -> None:
        """Bind to the durable (created by `jetstream.prepare_topology`) and start pulling."""
        self._sub = await js.pull_subscribe_bind(self.role.durable, subjects.STREAM)
        self._loop = asyncio.create_task(self._pull(), name=f"pull-{self.role.name}")

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            with suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        for msg in self._unstarted:  # fetched, never handled: to another consumer now
            with suppress(Exception):
                await msg.nak()
        self._unstarted = []
        if self._running:
            await asyncio.wait(set(self._running), timeout=STOP_WAIT_S)
        if self._sub is not None:
            with suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _pull(self) -> None:
        assert self._sub is not None
        slots = asyncio.Semaphore(self.workers)
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time()
            try:
                msgs = await fetch_available(self._sub, max(1, self.size()), PULL_WAIT_S)
            except TimeoutError:  # nats-py's TimeoutError is one too: nothing came
                if not self._sub._nc.is_connected:  # nothing could: NATS is unreachable
                    PULL_ERRORS.labels(self.role.name).inc()
                if loop.time() - asked < RETRY_S:  # answered at once (e.g. 409, max ack pending): no spinning
                    await asyncio.sleep(RETRY_S)
                continue
            except NATS_DOWN as exc:
                PULL_ERRORS.labels(self.role.name).inc()
                log.warning("fetch from %s failed: %r", self.role.durable, exc)
                await asyncio.sleep(RETRY_S)
                continue
            self._unstarted = list(msgs)
            while self._unstarted:
                await slots.acquire()
                msg = self._unstarted.pop(0)
                task = asyncio.create_task(self._handle(msg))
                self._running.add(task)
                task.add_done_callback(partial(self._done, slots))

    def _done(self, slots: asyncio.Semaphore, task: asyncio.Task) -> None:
        self._running.discard(task)
        slots.release()

    async def _handle(self, msg: Msg) -> None:
        try:
            await self.handler(msg)
        except AckMessage:
            await _settle(msg, msg.ack)
        except NackMessage as exc:
            await _settle(msg, msg.nak, exc.extra_options.get("delay"))
        except RejectMessage:
            await _settle(msg, msg.term)
        except Exception:
            log.exception("handler of %s failed", self.role.name)
            if self.ack == "auto":
                await _settle(msg, msg.nak)
        else:
            if self.ack == "auto":
                await _settle(msg, msg.ack)


async def _settle(msg: Msg, how: Callable[..., Awaitable[Any]], *args: Any) -> None:
    """Ack, nak or term once (a message the handler settled itself is left as it is); a
    settle lost with the connection is left to the message's AckWait."""
    if msg._ackd:
        return
    try:
        await how(*args)
    except NATS_DOWN as exc:
        log.warning("could not settle a message: %r", exc)
