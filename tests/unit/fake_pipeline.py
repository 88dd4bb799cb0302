"""A pipeline with no NATS and no Redis server, for the gateway's fast tests.

It stands where `gateway.pipeline.Pipeline` talks to the servers (publish, subscribe,
history, the fleet) and keeps the rest real: the `Output` iterator, the read model and
the gateway's keys (on fakeredis). A published ChatRequested is "answered" at once the
way inference would: the user's last message echoed back in chunks of `chunk_chars`,
then ChatCompleted, all stored in an in-memory stream and sent to live subscribers.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import fakeredis
from fastapi.testclient import TestClient

from events.fleet import InferenceBeat, ModelLoad
from events.models import (
    ChatCompleted,
    ChatFailed,
    ChatRequested,
    Timings,
    TokenLogprob,
    TokensGenerated,
    TopLogprob,
    Usage,
)
from events.readmodel import ReadModel
from gateway.admission.estimate import StreamState
from gateway.app import build_app
from gateway.fleet_view import FleetView
from gateway.keys import GatewayKeys
from gateway.pipeline import Pipeline, stream_unavailable
from gateway.settings import GatewaySettings


@dataclass
class FakeSub:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    closed: bool = False

    async def next_msg(self, timeout: float):
        return await asyncio.wait_for(self.queue.get(), timeout)

    def stored(self, events: list) -> None:
        self.queue.put_nowait(events)

    async def unsubscribe(self) -> None:
        self.closed = True


@dataclass
class FakeMsg:
    data: bytes


class FakePipeline(Pipeline):
    def __init__(self, settings: GatewaySettings, models=("stories-260k",), chunk_chars: int = 4):
        self.settings = settings
        redis = fakeredis.FakeAsyncRedis()
        self.results = ReadModel(redis, settings.result_ttl_s)
        self.keys = GatewayKeys(redis, settings.result_ttl_s)
        self.admission_redis = redis
        self.models = list(models)
        self.chunk_chars = chunk_chars
        self.stream: list = []
        self.subs: dict[str, list[FakeSub]] = {}
        self.published: list = []
        self.fail_publish = False
        self.silent = False  # accept requests but never answer (deadline tests)
        self.beats: dict = {}  # (role, instance) -> events.fleet.ProcessBeat
        self.stream_state = StreamState()

    def hold(self, load: ModelLoad, model: str = "stories-260k") -> None:
        """One live inference worker holding `model` with `load` (its heartbeat, an hour ahead)."""
        beat = InferenceBeat(
            instance="w",
            ready=True,
            ts=time.time() + 3600,
            pid=1,
            models=(model,),
            resident=(model,),
            load={model: load},
        )
        self.beats = {(beat.role, beat.instance): beat}

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def fleet(self) -> FleetView:
        ready = {"filter": 1, "inference": 1, "delivery": 1}
        return FleetView(ready, models={m: ["fake-0"] for m in self.models})

    async def publish(self, event, until=None) -> None:
        if self.fail_publish:
            raise stream_unavailable()
        self.published.append(event)
        self.stream.append(event)
        if isinstance(event, ChatRequested) and not self.silent:
            for out in self.answer(event):
                await self._emit(out)

    def answer(self, event: ChatRequested) -> list:
        text = event.messages[-1].content
        ids = dict(request_id=event.request_id, conv_id=event.conv_id, turn_id=event.turn_id)
        if text == "fail me":
            return [ChatFailed(**ids, code="internal_error", message="the engine failed")]
        parts = [text[i : i + self.chunk_chars] for i in range(0, len(text), self.chunk_chars)]
        chunks = [
            TokensGenerated(
                **ids, seq=i, text=p, token_ids=(i,), model=event.model, logprobs=fake_logprobs(event, i, p)
            )
            for i, p in enumerate(parts)
        ]
        done = ChatCompleted(
            **ids,
            model=event.model,
            text=text,
            finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=len(parts), total_tokens=1 + len(parts)),
            timings=Timings(queue_wait_s=0.0, ttft_s=0.0, decode_s=0.0, compute_s=0.0),
            chunks=len(parts),
        )
        return [*chunks, done]

    async def _emit(self, event) -> None:
        self.stream.append(event)
        if event.terminal:
            await self.results.save_result(event.request_id, event.model_dump_json().encode())
        for sub in self.subs.get(event.request_id, []):
            if not sub.closed:
                sub.queue.put_nowait(FakeMsg(event.model_dump_json().encode()))

    async def subscribe(self, request_id: str) -> FakeSub:
        sub = FakeSub()
        self.subs.setdefault(request_id, []).append(sub)
        return sub

    async def history(self, request_id: str) -> list:
        return [e for e in self.stream if getattr(e, "request_id", None) == request_id and e.type != "chat.requested"]

    async def recover(self, request_id: str) -> tuple:
        return None, None  # the fake's results never expire

    async def conversation(self, conv_id: str) -> list:
        return [e for e in self.stream if getattr(e, "conv_id", None) == conv_id]

    def requests(self) -> list[ChatRequested]:
        return [e for e in self.published if isinstance(e, ChatRequested)]


def fake_logprobs(event: ChatRequested, seq: int, text: str) -> tuple[TokenLogprob, ...] | None:
    """A chunk's "log probabilities" when the request asks: the chunk as one token of
    logprob -(seq + 1) / 10, and `params.logprobs` alternatives named alt0, alt1..."""
    n = event.params.logprobs
    if n is None:
        return None
    top = tuple(TopLogprob(token=f"alt{k}", logprob=-float(k), bytes=tuple(f"alt{k}".encode())) for k in range(n))
    return (TokenLogprob(token=text, logprob=-(seq + 1) / 10, bytes=tuple(text.encode()), top_logprobs=top),)


def settings(**overrides) -> GatewaySettings:
    return GatewaySettings(nats_url="nats://unused:1", redis_url="redis://unused:1/0", **overrides)


def gateway(**overrides) -> tuple[TestClient, FakePipeline]:
    """A gateway app on a fake pipeline, with ``overrides`` on its settings."""
    s = settings(**overrides)
    pipeline = FakePipeline(s)
    return TestClient(build_app(s, pipeline)), pipeline


def chat(content: str = "Once upon a time", **fields) -> dict:
    """A chat completion body with one user message."""
    return {"messages": [{"role": "user", "content": content}], **fields}
