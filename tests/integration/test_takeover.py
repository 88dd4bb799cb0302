"""The supervisor's dead-worker hand-on (infra.takeover) against a real nats-server: a
message a dead process held is pulled again at once, not after its AckWait."""

from __future__ import annotations

import asyncio
import time

import pytest

from events import subjects, topology
from events.fleet import InferenceBeat, encode_beat
from events.models import ChatMessage, FilterReport, PromptAccepted, SamplingParams
from infra.takeover import Takeover
from runtime import jetstream

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

ACK_WAIT_S = 30.0


async def test_a_dead_process_messages_are_redelivered_before_their_ack_wait(nats_server):
    nc = await jetstream.connect(nats_server.url, "test-takeover")
    js = nc.jetstream()
    await jetstream.ensure_topology(js, ack_wait_s=ACK_WAIT_S)
    now = time.time()
    await jetstream.publish(
        js,
        PromptAccepted(
            request_id="r1",
            conv_id="c1",
            model="stories-260k",
            messages=(ChatMessage(role="user", content="hi"),),
            params=SamplingParams(),
            deadline_at=now + 60,
            received_at=now,
            filter=FilterReport(action="pass"),
        ),
    )
    sub = await js.pull_subscribe(subjects.INFERENCE_SUBJECT, durable=topology.INFERENCE.name)
    [held] = await sub.fetch(1, timeout=5)  # the "worker" pulls it, then dies without an ack

    takeover = await asyncio.to_thread(Takeover, nats_server.url)
    try:
        beat = InferenceBeat(instance="dead", ready=True, ts=time.time(), pid=4242, acks=(held.reply,))
        end = time.monotonic() + 10
        while 4242 not in takeover.held and time.monotonic() < end:
            await nc.publish(subjects.heartbeat_subject("inference", "dead"), encode_beat(beat))
            await asyncio.sleep(0.1)
        assert await asyncio.to_thread(takeover.release, 4242) == 1
        assert await asyncio.to_thread(takeover.release, 4242) == 0  # handed on once

        started = time.monotonic()
        [again] = await sub.fetch(1, timeout=5)
        took = time.monotonic() - started
        assert again.data == held.data and again.metadata.num_delivered == 2
        assert took < ACK_WAIT_S / 10, took
        print(f"\n[takeover] redelivered {took * 1000:.0f} ms after the hand-on (AckWait {ACK_WAIT_S:.0f} s)")
        await again.ack()
    finally:
        await asyncio.to_thread(takeover.close)
        await nc.close()
