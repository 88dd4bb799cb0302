"""Fetching a durable's messages in batches without holding a lone message back.

nats-py's `fetch(batch=N)` has two stages: a `no_wait` request for what the stream
holds now, then, when that was nothing, a long-poll for N that, once a message
arrives, waits out the rest of its timeout for the other N-1. So a consumer that
fetched more than one message at a time either held an idle system's lone request
for up to a second, or (batch 1, what the consumers did) paid a pull request, its
server-side bookkeeping and a wake-up for every message: about three times the
consumer's CPU and nats-server's per message of fetching in batches (docs/benchmarks.md,
"One user, hop by hop; the pull loop").

`fetch_available` keeps the first stage and replaces the second by a long-poll for
one: under load a fetch returns everything waiting (up to the batch), and an idle
consumer answers its next message as soon as it comes (`runtime.consume` pulls so).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from nats.js.client import JetStreamContext


async def fetch_available(sub: JetStreamContext.PullSubscription, batch: int, timeout: float) -> list[Any]:
    """Up to `batch` of the durable's messages: those waiting now, or else the next one
    to arrive within `timeout` (nats-py's TimeoutError when none does)."""
    if batch == 1:
        return await sub.fetch(1, timeout)
    queue = sub._sub._pending_queue
    msgs: list[Any] = []
    while not queue.empty() and len(msgs) < batch:  # late deliveries of an earlier request
        msg = queue.get_nowait()
        sub._sub._pending_size -= len(msg.data)
        if not JetStreamContext.is_status_msg(msg):
            msgs.append(msg)
    if msgs:
        return msgs
    request = {"batch": batch, "no_wait": True}
    await sub._nc.publish(sub._nms, json.dumps(request).encode(), sub._deliver)
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(msgs) < batch:
        try:
            msg = await sub._sub.next_msg(timeout=max(end - loop.time(), 0.001))
        except TimeoutError:
            break
        status = JetStreamContext.is_status_msg(msg)
        if status is None:
            msgs.append(msg)
        elif not JetStreamContext._is_heartbeat(status):  # 404/408: nothing more there now
            break
    if msgs:
        return msgs
    return await sub.fetch(1, max(end - loop.time(), 0.01))
