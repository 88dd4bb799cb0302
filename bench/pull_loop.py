"""The consumers' pull loop against FastStream's pull subscriber, side by side.

    python -m bench.pull_loop                 # ~30 s: a nats-server of its own on a free port

Two figures for each (the same durable, handler and server; each run in a process of
its own, so CPU times are the loop's alone):
- **idle**: one message every 50 ms; from the stream storing it to the handler's first
  line (what every hop of a lone user's request pays);
- **busy**: a backlog of messages, each republished to the stream (acked) and acked, as
  the filter does: the consumer's CPU per message, and nats-server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

import nats
import psutil
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError

from events import subjects
from infra.servers import start_nats

LOOPS = ("runtime.consume", "faststream")
DURABLE = "bench"


async def _prepare(url: str, backlog: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    with suppress(NotFoundError):
        await js.delete_stream(subjects.STREAM)
    await js.add_stream(StreamConfig(name=subjects.STREAM, subjects=["arena.>"]))
    body = json.dumps({"type": "x", "text": "a" * 600}).encode()
    for i in range(backlog):
        await js.publish(f"arena.in.{i % 50}", body)
    config = ConsumerConfig(
        durable_name=DURABLE,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        filter_subject="arena.in.>",
        max_ack_pending=256,
    )
    await js.add_consumer(subjects.STREAM, config)
    await nc.close()


async def _consume(loop: str, url: str, mode: str, count: int) -> dict:
    """In the measured process: run one loop until `count` messages were handled."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    done = asyncio.Event()
    seen: list[float] = []

    async def handle(raw) -> None:
        seen.append(time.time() - raw.metadata.timestamp.timestamp())
        if mode == "busy":
            await js.publish("arena.out.x", raw.data)
        if len(seen) >= count:
            done.set()

    stop = await _start(loop, url, js, handle)
    result: dict[str, Any]
    if mode == "idle":
        for i in range(count):
            await js.publish(f"arena.in.{i}", b"{}")
            await asyncio.sleep(0.05)
        await asyncio.wait_for(done.wait(), 10)
        result = {"store_to_handler_ms": sorted(1000 * s for s in seen)}
    else:
        cpu0, t0 = time.process_time(), time.perf_counter()
        await asyncio.wait_for(done.wait(), 120)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
        result = {"cpu_us_per_msg": 1e6 * cpu / count, "msgs_per_s": count / wall}
    await stop()
    await nc.close()
    return result


async def _start(loop: str, url: str, js, handle):
    if loop == "runtime.consume":
        from events.topology import Role
        from runtime.consume import DurableConsumer

        consumer = DurableConsumer(Role(DURABLE, "bench:none", reads="arena.in.>"), handle, "auto", 4, batch=4)
        await consumer.start(js)
        return consumer.stop
    from typing import Annotated

    from faststream import AckPolicy as FsAck
    from faststream._internal.context.context_type import Context
    from faststream.nats import JStream, NatsBroker, PullSub
    from faststream.nats.message import NatsMessage

    class OnLoop(Context):  # as the consumers had it: the message looked up on the loop, not in a thread
        async def use(self, /, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
            return super().use(**kwargs)

    logging.disable(logging.INFO)
    broker = NatsBroker(url)

    @broker.subscriber(
        "arena.in.>",
        stream=JStream(subjects.STREAM, declare=False),
        durable=DURABLE,
        pull_sub=PullSub(batch_size=1, timeout=1.0),
        ack_policy=FsAck.NACK_ON_ERROR,
        max_workers=4,
    )
    async def on_message(message: Annotated[NatsMessage, OnLoop("message")]) -> None:  # the filter's, before
        await handle(message.raw_message)

    await broker.start()
    return broker.stop


def _measure(loop: str, url: str, mode: str, count: int, server: psutil.Process) -> dict:
    nats0 = sum(server.cpu_times()[:2])
    out = subprocess.run(
        [sys.executable, "-m", "bench.pull_loop", "--child", loop, mode, str(count), url],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{loop} {mode}: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["nats_us_per_msg"] = 1e6 * (sum(server.cpu_times()[:2]) - nats0) / count
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        allow_abbrev=False, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--idle", type=int, default=100, help="messages one at a time, 50 ms apart")
    parser.add_argument("--busy", type=int, default=4000, help="messages in the backlog")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        loop, mode, count, url = args.child
        print(json.dumps(asyncio.run(_consume(loop, url, mode, int(count)))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            proc = psutil.Process(server.proc.pid)
            rows = []
            for loop in LOOPS:
                asyncio.run(_prepare(server.url, 0))
                idle = _measure(loop, server.url, "idle", args.idle, proc)["store_to_handler_ms"]
                asyncio.run(_prepare(server.url, args.busy))
                busy = _measure(loop, server.url, "busy", args.busy, proc)
                rows.append((loop, idle, busy))
                print(f"[pull_loop] {loop} done", file=sys.stderr)
        finally:
            server.stop()
    columns = ("pull loop", "idle: store to handler P50 / P90 (ms)", "busy: consumer CPU µs/msg", "nats-server µs/msg")
    print("| " + " | ".join((*columns, "msgs/s")) + " |")
    print("|---|---|---|---|---|")
    for loop, idle, busy in rows:
        p90 = idle[int(len(idle) * 0.9)]
        print(
            f"| {loop} | {statistics.median(idle):.2f} / {p90:.2f} | {busy['cpu_us_per_msg']:.0f} "
            f"| {busy['nats_us_per_msg']:.0f} | {busy['msgs_per_s']:.0f} |"
        )


if __name__ == "__main__":
    main()
