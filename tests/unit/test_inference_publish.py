"""The inference worker's publish path with fakes: chunks go live and to the stream without
waiting for acks; the message is acked only after every chunk and the terminal are stored."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest

from consumers.inference.engine.batch import StepOutput
from consumers.inference.settings import InferenceSettings
from consumers.inference.worker.jobs import Job
from consumers.inference.worker.worker import InferenceService
from events import subjects
from events.models import ChatMessage, FilterReport, PromptAccepted, SamplingParams
from runtime.jetstream import PUBLISH_TIMEOUT_S, ReplyLost
from tests.waiting import until

pytestmark = pytest.mark.timeout(30)


class FakeMsg:
    def __init__(self) -> None:
        self.settled: list[str] = []

    async def ack(self) -> None:
        self.settled.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append("nak")

    async def term(self) -> None:
        self.settled.append("term")


class FakeStream:
    """Stores what is published; `lose` names chunk seqs whose first ack fails, `hang`
    the dedupe keys whose first ack never comes (lost with a NATS server killed)."""

    def __init__(self, lose: set[int] = frozenset(), hang: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.stored: list[str] = []
        self.live: list[tuple[str, str]] = []
        self.lose = set(lose)
        self.hang = set(hang)
        self.held: dict[str, asyncio.Future] = {}  # the acks left waiting, by dedupe key

    async def publish(self, event, raw: bytes | None = None) -> None:
        self.stored.append(subjects.dedupe_key(event))

    async def publish_nowait(self, event, raw: bytes | None = None) -> asyncio.Future:
        ack: asyncio.Future = asyncio.get_running_loop().create_future()
        if (key := subjects.dedupe_key(event)) in self.hang:
            self.hang.discard(key)
            self.held[key] = ack
        elif event.seq in self.lose:
            self.lose.discard(event.seq)
            ack.set_exception(TimeoutError("no ack"))
        else:
            self.stored.append(subjects.dedupe_key(event))
            ack.set_result(None)
        return ack

    async def send_live(self, subject: str, raw: bytes) -> None:
        self.live.append((subject, raw.decode()))


def accepted(rid: str = "r1") -> PromptAccepted:
    now = time.time()
    return PromptAccepted(
        request_id=rid,
        conv_id=rid,
        model="m",
        messages=(ChatMessage(role="user", content="hi"),),
        params=SamplingParams(max_tokens=9),
        deadline_at=now + 60,
        received_at=now,
        filter=FilterReport(action="pass"),
    )


def started(stream: FakeStream) -> InferenceService:
    service = InferenceService(
        InferenceSettings(nats_url="nats://unused:1", chunk_tokens=4),
        pool=None,
        publish=stream.publish,
        publish_nowait=stream.publish_nowait,
        live=stream.send_live,
    )
    service.start()
    return service


def generate(service: InferenceService, rid: str) -> FakeMsg:
    """A job for ``rid`` whose engine makes its 9 tokens at once: its message."""
    msg = FakeMsg()
    service.jobs[rid] = Job(accepted(rid), msg, runner=None, pin=AsyncExitStack())  # type: ignore[arg-type]
    outputs = [StepOutput(rid, [i], f"t{i}", i == 8, "length" if i == 8 else None, 3, i + 1) for i in range(9)]
    service.on_outputs(outputs)
    return msg


async def run_job(stream: FakeStream) -> FakeMsg:
    service = started(stream)
    msg = generate(service, "r1")
    await service.outbox.join()
    await service.stop()
    return msg


async def test_chunks_go_live_and_to_the_stream_and_the_message_is_acked_after_the_terminal():
    stream = FakeStream()
    msg = await run_job(stream)
    assert stream.stored == ["r1:tok:0", "r1:tok:1", "r1:tok:2", "r1:terminal"]  # first chunk at once, then 4 tokens
    assert [s for s, _ in stream.live] == [subjects.live_subject("r1")] * 4  # 3 chunks and the terminal
    assert '"text":"t0"' in stream.live[0][1] and "chat.completed" in stream.live[-1][1]
    assert msg.settled == ["ack"]


async def test_a_chunk_the_stream_did_not_confirm_is_published_again_before_the_terminal():
    stream = FakeStream(lose={1})
    msg = await run_job(stream)
    assert stream.stored == ["r1:tok:0", "r1:tok:2", "r1:tok:1", "r1:terminal"]
    assert msg.settled == ["ack"]


async def test_a_job_waiting_for_a_lost_ack_holds_up_no_other_job():
    """A NATS restart loses the acks of the chunks in flight: the job that waits for one
    (PUBLISH_TIMEOUT_S, then publishes the chunk again) holds up neither the chunks nor
    the end of the jobs after it. (They waited in turn: one answer every 1.5 s.)"""
    stream = FakeStream(hang={"a:tok:0"})
    service = started(stream)
    waiting, other = generate(service, "a"), generate(service, "b")
    await until(lambda: other.settled == ["ack"], timeout=PUBLISH_TIMEOUT_S / 2)
    assert waiting.settled == [] and "b:terminal" in stream.stored and "a:terminal" not in stream.stored
    await service.outbox.join()
    assert waiting.settled == ["ack"]
    assert stream.stored[-2:] == ["a:tok:0", "a:terminal"]  # the chunk published again, then the terminal
    await service.stop()


async def test_a_chunk_whose_ack_was_lost_with_the_connection_is_sent_again_at_once():
    """Not at the job's end: a gateway holds every later chunk behind it until it comes."""
    stream = FakeStream(hang={"r1:tok:0"})
    service = started(stream)
    msg = FakeMsg()
    service.jobs["r1"] = Job(accepted(), msg, runner=None, pin=AsyncExitStack())  # type: ignore[arg-type]
    service.on_outputs([StepOutput("r1", [0], "t0", False, None, 3, 1)])
    await service.outbox.join()
    assert stream.stored == [] and len(stream.live) == 1
    stream.held["r1:tok:0"].set_exception(ReplyLost())  # the connection went: that ack cannot come
    await until(lambda: stream.stored == ["r1:tok:0"] and len(stream.live) == 2, timeout=1.0)
    assert msg.settled == []  # the job runs on
    await service.stop()


async def test_a_request_cancelled_before_it_was_fetched_ends_cancelled_unrun():
    """A battle's other side is called off (core NATS) when its pair is refused, often
    before this worker fetched it: when it comes it ends as cancelled, its message
    terminated, without a model loaded (the fake service has no pool to load one)."""
    stream = FakeStream()
    service = started(stream)
    service.cancel("r1")
    msg = FakeMsg()
    msg.metadata = type("Meta", (), {"num_delivered": 1})()  # type: ignore[attr-defined]
    await service.submit(accepted("r1"), msg)
    assert stream.stored == ["r1:terminal"] and msg.settled == ["term"]
    assert "r1" not in service.called_off and "r1" not in service.jobs
    await service.stop()
