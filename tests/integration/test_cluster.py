"""A three-node JetStream cluster (stream at R3) loses a node under load and loses
nothing: every request reaches exactly one terminal event, streamed text equals the
completed text, and the node comes back and catches up. Figures are printed (-s)."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

import httpx
import nats
import pytest
from nats.js.errors import ServiceUnavailableError

from infra.servers import start_nats_cluster
from runtime import jetstream
from tests.conftest import RunningStack, stored_events
from tests.streams import Stream, audit_of, prompt, stream_one

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@dataclass
class ClusterURL:
    url: str


async def stream_info(url: str, wait_s: float = 30.0):
    """The stream's info, asked again while the cluster answers nothing: a node that was
    killed or has just rejoined can hold a leader election, and the API is silent then."""
    end = time.monotonic() + wait_s
    nc = await nats.connect(jetstream.servers(url), connect_timeout=2)
    try:
        while True:
            try:
                return await nc.jetstream().stream_info("ARENA")
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, ServiceUnavailableError):
                if time.monotonic() > end:
                    raise
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


@pytest.mark.parametrize("victim", ["leader", "follower"])
def test_losing_a_node_under_load_loses_and_doubles_nothing(tmp_path, redis_server, victim):
    cluster = start_nats_cluster(tmp_path / "nats", 3, log_dir=tmp_path)
    s = RunningStack(tmp_path / "stack", ClusterURL(cluster.url), redis_server, ARENA_STREAM_REPLICAS=3)
    try:
        s.start(timeout=120)
        info = asyncio.run(stream_info(cluster.url))
        assert info.config.num_replicas == 3
        names = [n.name for n in cluster.nodes]
        leader = info.cluster.leader
        target = leader if victim == "leader" else next(n for n in names if n != leader)
        index = names.index(target)

        async def run():
            # A closed loop of 16 users for 6 s, the node killed from 1.5 s in, at a moment when
            # an answer is streaming (its first chunks in, most still to come): the users start
            # together and answer alike, so their requests can all sit between two answers at
            # one instant. More requests arrive during the election and after.
            start = time.monotonic()
            streams: list[Stream] = []

            async def user(client: httpx.AsyncClient, i: int) -> list:
                out: list[Stream] = []
                while time.monotonic() - start < 6.0:
                    streams.append(current := Stream())
                    out.append(await stream_one(client, s.url, prompt(100 * i + len(out), 100), out=current))
                return out

            def mid_answer() -> bool:
                return any(not x.done and x.error is None and 1 <= len(x.chunk_times) <= 8 for x in streams)

            async with httpx.AsyncClient(timeout=60) as client:
                users = [asyncio.create_task(user(client, i)) for i in range(16)]
                await asyncio.sleep(1.5)
                while not mid_answer() and time.monotonic() - start < 4.0:
                    await asyncio.sleep(0.005)
                cluster.servers[index].proc.send_signal(signal.SIGKILL)
                killed_at = time.monotonic()
                return [x for u in await asyncio.gather(*users) for x in u], killed_at

        streams, killed_at = asyncio.run(run())
        across = [x for x in streams if x.chunk_times and x.chunk_times[0] < killed_at < x.chunk_times[-1]]
        assert across, "no answer was streaming when the node died"
        answered = [x for x in streams if x.done and x.error is None]
        missed = [x for x in streams if x.error is not None and x.error.get("code") == "deadline_exceeded"]
        assert all(x.status == 200 and x.done for x in streams), [(x.status, x.done, x.error) for x in streams]
        assert len(answered) + len(missed) == len(streams), [x.error for x in streams]
        # The stall (a re-election, clients moving to another node) may cost deadlines on a
        # loaded machine: reported, not asserted; losing or doubling a request is asserted.
        for x in answered:
            [done] = [e for e in stored_events(s.nats.url, x.request_id) if e.type == "chat.completed"]
            assert done.text == x.text
        report = asyncio.run(audit_of(cluster.url, settle_s=1.0))
        assert report["missing_terminal"] == [] and report["duplicate_terminal"] == [], report
        stall = max(
            (b - a for x in streams for a, b in zip(x.chunk_times, x.chunk_times[1:], strict=False) if b > killed_at),
            default=0.0,
        )

        cluster.start_node(index)  # same port, same store: it catches up from the others
        end = time.monotonic() + 60
        caught_up = False
        while time.monotonic() < end and not caught_up:
            info = asyncio.run(stream_info(cluster.url))
            peers = info.cluster.replicas or []
            caught_up = len(peers) == 2 and all(p.current and not p.offline for p in peers)
            time.sleep(0.5)
        assert caught_up, info.cluster
        new_leader = info.cluster.leader
        print(
            f"\n[cluster, {victim} {target} killed] answered {len(answered)}/{len(streams)} ({len(across)} streaming "
            f"across the kill), missed deadline {len(missed)}, "
            f"longest stall after the kill {stall:.2f}s, leader now {new_leader}, {target} caught up"
        )
    finally:
        s.stop()
        cluster.stop()
