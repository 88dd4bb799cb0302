"""The early gate (gateway/shed.py): reading a body's budget, and judging a burst
in arrival order from what the process knows (pure logic, a stand-in pipeline)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import fakeredis
import orjson
import pytest

from events.models import DEFAULT_MAX_TOKENS
from gateway.admission import FleetAdmissions, ModelQueue, StreamState, estimate
from gateway.edge import HOLD
from gateway.shed import STRICTER, EarlyGate
from runtime.settings import GatewaySettings


class Pipeline:
    """Just what the gate reads: one model on 32 slots at 20 ms a step, idle."""

    nc = None

    def __init__(self) -> None:
        self.stream_state = StreamState(read_at=time.time())

    def queue(self, model: str) -> ModelQueue:
        return ModelQueue(32, 0, 0, 0.02, 0.02, time.time())


class FleetCheck:
    """The fleet-wide check's judge: admits the first `room` requests it judges."""

    def __init__(self, room: int = 10**9):
        self.room = room

    def __call__(self, model: str, tokens: int, budget_s: float):
        return lambda stream, n, ahead: None if n < self.room else estimate(Pipeline().queue(model), 10**4, 0.0)


@pytest.fixture
def gate() -> EarlyGate:
    settings = GatewaySettings(default_model="m", admission_overhead_s=0.0, admission_margin=1.0)
    pipeline = Pipeline()
    recent = FleetAdmissions(fakeredis.FakeAsyncRedis(), lambda: pipeline.stream_state)
    chat = SimpleNamespace(pipeline=pipeline, settings=settings, recent=recent, judge=FleetCheck())
    return EarlyGate(chat)


def test_the_budget_and_deadline_are_read_from_the_body(gate):
    body = orjson.dumps({"model": "x", "max_tokens": 64, "deadline_s": 30, "messages": []})
    assert gate.request_of("/v1/chat/completions", body) == ("x", 64, 30.0)
    assert gate.request_of("/v1/chat/completions", b'{"max_completion_tokens": 8}') == ("m", 8, 15.0)
    assert gate.request_of("/chat", b'{"prompt": "hi", "deadline_s": 999}') == (
        "m",
        DEFAULT_MAX_TOKENS,
        120.0,
    )  # capped
    # Not this gate's to answer: the route gives the 400 (or serves it).
    for bad in (b"not json", b"[1]", b'{"model": 3}'):
        assert gate.request_of("/v1/chat/completions", bad) is None
    assert gate.request_of("/v1/models", b"{}") is None
    # A field it reads that the schema refuses is left to validation, which names it.
    for bad in (b'{"max_tokens": true}', b'{"max_tokens": 0}', b'{"max_tokens": 1e9}', b'{"deadline_s": "9"}'):
        assert gate.request_of("/chat", bad) is None


async def test_a_burst_is_cut_where_the_deadline_is_reached(gate):
    """32 slots, 100 tokens at 20 ms, 10% stricter than admission (STRICTER): a wave takes
    2.2 s; 15 s holds 6 waves (5 waiting + its own), not the 7 the fleet-wide check allows."""
    passed = 0
    for _ in range(400):
        est, member = gate.decide("m", 100, 15.0)
        assert (est is None) == (member is not None)
        passed += member is not None
    assert STRICTER == 1.1 and passed == 6 * 32
    est = gate.judge("m", 100, 15.0)
    assert est is not None and est.finish_s > 15.0
    assert gate.judge("m", 100, 60.0) is None  # a longer deadline still fits


async def test_peers_and_publishes_move_the_count(gate):
    assert gate.decide("m", 100, 15.0)[1] is not None
    gate._mark("m", "other:r1", 100, "pass")  # a peer's, as _on_peer records it
    assert gate._ahead("m", time.time()) == (2, 200)
    gate._mark("m", "other:r1", 100, "pub")  # published: counted until a stream state read after it
    gate.pipeline.stream_state = StreamState(read_at=time.time() + 1)
    assert gate._ahead("m", gate.pipeline.stream_state.read_at) == (1, 100)
    member = next(iter(gate.passed["m"]))
    await gate.forget("m", member)
    assert gate._ahead("m", time.time()) == (0, 0)
    # What a peer's protocol let through in one read comes as one message.
    news = [["r2", 100], ["r3", 50]]
    await gate._on_peer(SimpleNamespace(data=orjson.dumps(["other", "m", news, "pass"])))
    await gate._on_peer(SimpleNamespace(data=orjson.dumps([gate.name, "m", [["r4", 9]], "pass"])))  # its own
    assert gate._ahead("m", time.time()) == (2, 150)
    await gate._on_peer(SimpleNamespace(data=orjson.dumps(["other", "m", "r2", 0, "drop"])))
    assert gate._ahead("m", time.time()) == (1, 50)


async def test_the_protocol_gets_a_whole_429_or_holds_the_request_for_the_fleet_check(gate):
    """`refusal` runs as uvicorn's protocol reads a body: a request let through is counted
    at once (the next one read is judged with it) and held for the fleet-wide check;
    past the limit, a complete response at once."""
    scope = {"method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    body = orjson.dumps({"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
    replies: list = []
    scopes = [dict(scope) for _ in range(200)]
    answers = [gate.refusal(sc, body, time.perf_counter(), replies.append) for sc in scopes]
    assert answers[: 6 * 32] == [HOLD] * (6 * 32)
    head, _, payload = answers[-1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: " in head and b"server-timing: gateway;dur=" in head
    assert orjson.loads(payload)["error"]["code"] == "overloaded"
    await asyncio.sleep(0.05)  # the fleet-wide check: one batch, every one admitted
    assert replies == [None] * (6 * 32)
    assert all(sc["arena.checked"][0] == "m" and sc["arena.passed"][0] == "m" for sc in scopes[: 6 * 32])
    # Refused fleet-wide (another gateway's share): the protocol writes the 429, and this
    # gate no longer counts it.
    gate.passed.clear()
    gate.chat.judge.room = 0
    replies.clear()
    held = dict(scope)
    assert gate.refusal(held, body, time.perf_counter(), replies.append) is HOLD
    assert gate._ahead("m", 0.0) == (1, 100)
    await asyncio.sleep(0.05)
    [refused] = replies
    assert refused.startswith(b"HTTP/1.1 429 ") and b"admission;dur=" in refused and "arena.checked" not in held
    assert gate._ahead("m", 0.0) == (0, 0)
    # Not the protocol's to answer: the routes do (401, 400, or a request in the URL's terms).
    gate.settings.api_keys = ["sk-a"]
    assert gate.refusal(dict(scope), body, time.perf_counter(), replies.append) is None  # no key: 401
    assert gate.refusal({**scope, "path": "/v1/models"}, body, time.perf_counter(), replies.append) is None
