"""The early gate (gateway/shed.py): reading a body's budget, and judging a burst
in arrival order from what the process knows (pure logic, a stand-in pipeline)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import orjson
import pytest

from events.models import DEFAULT_MAX_TOKENS
from gateway.admission import ModelQueue, StreamState
from gateway.shed import EarlyGate
from runtime.settings import GatewaySettings


class Pipeline:
    """Just what the gate reads: one model on 32 slots at 20 ms a step, idle."""

    nc = None

    def __init__(self) -> None:
        self.stream_state = StreamState(read_at=time.time())

    def queue(self, model: str) -> ModelQueue:
        return ModelQueue(32, 0, 0, 0.02, 0.02, time.time())


@pytest.fixture
def gate() -> EarlyGate:
    settings = GatewaySettings(default_model="m", admission_overhead_s=0.0, admission_margin=1.0)
    chat = SimpleNamespace(pipeline=Pipeline(), settings=settings, recent=SimpleNamespace(mean_budget=100.0))
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
    # A budget of the wrong type is left to validation; the default counts meanwhile.
    assert gate.request_of("/chat", b'{"max_tokens": true}') == ("m", DEFAULT_MAX_TOKENS, 15.0)


async def test_a_burst_is_cut_where_the_deadline_is_reached(gate):
    """32 slots, 100 tokens at 20 ms: a wave takes 2 s; 15 s holds 7 waves (6 waiting + its own)."""
    passed = 0
    for _ in range(400):
        if gate.judge("m", 100, 15.0) is None:
            await gate.let_through("m", 100)
            passed += 1
    assert passed == 7 * 32
    est = gate.judge("m", 100, 15.0)
    assert est is not None and est.finish_s > 15.0
    assert gate.judge("m", 100, 60.0) is None  # a longer deadline still fits


async def test_peers_and_publishes_move_the_count(gate):
    await gate.let_through("m", 100)
    gate._mark("m", "other:r1", 100, "pass")  # a peer's, as _on_peer records it
    assert gate._ahead("m", time.time()) == (2, 200)
    gate._mark("m", "other:r1", 100, "pub")  # published: counted until a stream state read after it
    gate.pipeline.stream_state = StreamState(read_at=time.time() + 1)
    assert gate._ahead("m", gate.pipeline.stream_state.read_at) == (1, 100)
    member = next(iter(gate.passed["m"]))
    await gate.forget("m", member)
    assert gate._ahead("m", time.time()) == (0, 0)
