"""The early gate (gateway/admission/gate.py, and its hook at the HTTP edge in hook.py):
reading a body's budget, and judging a burst
in arrival order from what the process knows (pure logic, a stand-in pipeline)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import fakeredis
import orjson
import pytest

from events.models import DEFAULT_MAX_TOKENS
from gateway.admission.estimate import ModelQueue, StreamState, estimate
from gateway.admission.gate import DEMAND_WINDOW_S, PEER_SILENT_S, STRICTER, Demand, EarlyGate, share
from gateway.admission.hook import LEASE, refusal, request_of
from gateway.admission.leases import ALONE, Admission
from gateway.admission.recent import FleetAdmissions
from gateway.admission.uvicorn_adapter import HOLD
from gateway.settings import GatewaySettings
from tests.waiting import until


class Pipeline:
    """Just what the gate reads: one model on 32 slots at 20 ms a step, idle."""

    nc = None

    def __init__(self) -> None:
        self.stream_state = StreamState(read_at=time.time())

    def queue(self, model: str) -> ModelQueue:
        return ModelQueue(32, 0, 0, 0.02, 0.02, time.time())

    def context_len(self, model: str) -> int:
        return 2048


class FleetCheck:
    """The fleet-wide check's judge: admits the first `room` requests it judges."""

    def __init__(self, room: int = 10**9):
        self.room = room

    def __call__(self, model: str, tokens: int, budget_s: float, workers=None):
        return lambda stream, n, ahead: None if n < self.room else estimate(Pipeline().queue(model), 10**4, 0.0)


@pytest.fixture
def admission() -> Admission:
    settings = GatewaySettings(default_model="m", admission_overhead_s=0.0, admission_margin=1.0)
    pipeline = Pipeline()
    recent = FleetAdmissions(fakeredis.FakeAsyncRedis(), lambda: pipeline.stream_state)
    admission = Admission(settings, pipeline, recent)
    admission.judge = FleetCheck()  # type: ignore[method-assign]
    return admission


@pytest.fixture
def gate(admission: Admission) -> EarlyGate:
    return admission.gate


def test_the_budget_and_deadline_are_read_from_the_body(gate):
    body = orjson.dumps({"model": "x", "max_tokens": 64, "deadline_s": 30, "messages": []})
    assert request_of(gate.settings, "/v1/chat/completions", body) == ("x", 64, 30.0)
    assert request_of(gate.settings, "/v1/chat/completions", b'{"max_completion_tokens": 8}') == ("m", 8, 15.0)
    assert request_of(gate.settings, "/chat", b'{"prompt": "hi", "deadline_s": 999}') == (
        "m",
        DEFAULT_MAX_TOKENS,
        120.0,
    )  # capped
    # Not this gate's to answer: the route gives the 400 (or serves it).
    for bad in (b"not json", b"[1]", b'{"model": 3}'):
        assert request_of(gate.settings, "/v1/chat/completions", bad) is None
    assert request_of(gate.settings, "/v1/models", b"{}") is None
    # A field it reads that the schema refuses is left to validation, which names it.
    for bad in (b'{"max_tokens": true}', b'{"max_tokens": 0}', b'{"max_tokens": 1e9}', b'{"deadline_s": "9"}'):
        assert request_of(gate.settings, "/chat", bad) is None


def _passed(gate, n: int = 400) -> int:
    passed = 0
    for _ in range(n):
        err, member = gate.decide("m", 100, 15.0)
        assert (err is None) == (member is not None)
        passed += member is not None
    return passed


async def test_a_burst_is_cut_where_the_deadline_is_reached(gate):
    """32 slots, 100 tokens at 20 ms: a wave takes 2 s; 15 s holds 7 waves (6 waiting +
    its own). Alone, the gate's verdict is the fleet's: judged as the fleet-wide check would."""
    assert gate.alone() and _passed(gate) == 7 * 32
    est = gate.estimate("m", 100)
    assert 15.0 < est.finish_s <= 60.0  # a longer deadline still fits


async def test_with_peers_the_gate_is_stricter_than_the_check_that_follows(gate, monkeypatch):
    """10% stricter (STRICTER): a wave takes 2.2 s; 15 s holds 6 waves, not the 7 the
    fleet-wide check allows, so the check rarely refuses what the gate let on."""
    monkeypatch.setattr(gate, "alone", lambda: False)
    assert STRICTER == 1.1 and _passed(gate) == 6 * 32


async def test_a_budget_over_the_context_is_left_to_the_routes_400(gate):
    """One the model's context cannot hold is never a 429 (retry), however busy the fleet."""
    assert gate.decide("m", 2048, 0.001) == (None, None)
    err, _ = gate.decide("m", 2047, 0.001)
    assert err is not None and err.status == 429


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


async def test_the_backstop_counts_what_the_gate_let_through(gate):
    """The hard cap per gateway (`max_queue_per_model`) is the route's; the gate counts
    the requests it let through and the route has not counted yet, so a burst past the
    cap is refused as it is read, not after the admitted requests' work."""
    gate.settings.max_queue_per_model = 50
    gate.in_flight["m"] = 20
    verdicts = [gate.decide("m", 1, 15.0) for _ in range(40)]
    assert sum(member is not None for _, member in verdicts) == 30
    err = verdicts[-1][0]
    assert err is not None and err.status == 429 and err.code == "overloaded" and "50 requests queued" in err.message
    # The route counts one (reserve): the gate stops counting it. A forgotten one frees its place.
    first, second = verdicts[0][1], verdicts[1][1]
    gate.reserved("m", first)
    gate.in_flight["m"] += 1
    assert gate.decide("m", 1, 15.0)[0] is not None
    await gate.forget("m", second)
    assert gate.decide("m", 1, 15.0)[1] is not None


def test_shares_follow_demand():
    assert share(0.0, []) == 1.0
    assert share(0.0, [0.0]) == 0.5  # no demand anywhere: an even split
    assert share(30.0, [10.0]) == 0.75
    assert share(1.0, [99.0]) == 0.5  # never under an even split: the fleet-wide check judges the rest
    demand = Demand()
    for second in range(100, 100 + DEMAND_WINDOW_S + 1):
        for _ in range(10):
            demand.count("m", second + 0.5)
    # the current second is not counted yet; older than the window are dropped
    assert demand.rates(100 + DEMAND_WINDOW_S + 0.9) == {"m": 10.0}
    assert demand.rates(100 + 3 * DEMAND_WINDOW_S) == {"m": 0.0} and demand.buckets["m"] == {}


async def test_with_peers_a_gateway_lets_through_its_share_of_a_burst(gate):
    """Two gateways with the same traffic lately: each lets through half the room on its
    own (the peer is taken to be letting through its half of the same burst); the
    peer's news, once here, counts instead."""
    # Demand is counted in one-second buckets (the decisions below count too): start just
    # after a second begins, so that none passes before the checks (1 run in 5 failed).
    await asyncio.sleep(1.0 - time.time() % 1.0 + 0.01)
    now = time.time()
    for second in range(int(now) - DEMAND_WINDOW_S, int(now)):
        for _ in range(20):
            gate.demand.count("m", second + 0.5)
    await gate._on_peer(SimpleNamespace(data=orjson.dumps({"gateway": "other", "demand": {"m": 20.0}})))
    assert gate.share("m", time.time()) == 0.5
    passed = sum(gate.decide("m", 100, 15.0)[1] is not None for _ in range(400))
    assert passed == 3 * 32  # half of the 6 waves a lone gateway lets through
    # The peer's news of its own share replaces the assumption (no double count).
    news = [[f"r{i}", 100] for i in range(3 * 32)]
    await gate._on_peer(SimpleNamespace(data=orjson.dumps(["other", "m", news, "pass"])))
    assert gate._ahead("m", 0.0, gate.share("m", time.time())) == (6 * 32, 6 * 32 * 100)
    # A silent peer is gone: alone again.
    gate.peers["other"] = (time.time() - 60, {"m": 20.0})
    assert gate.share("m", time.time()) == 1.0


async def _until(done, within_s: float = 10.0) -> None:
    """Wait for the gate's background work (the fleet-wide check on fakeredis takes
    longer on a slow machine than a fixed sleep allows)."""
    await until(done, within_s, "the gate's background work", every=0.01)


def _with_an_idle_peer(gate: EarlyGate) -> None:
    """A live peer gateway with no traffic, while this one had all of it lately (its
    share is the whole room, but the fleet-wide check is needed)."""
    now = time.time()
    for second in range(int(now) - DEMAND_WINDOW_S, int(now)):
        gate.demand.count("m", second + 0.5)
    gate.peers["other"] = (now, {"m": 0.0})
    assert not gate.alone() and gate.share("m", now) == 1.0


async def test_a_lone_gateway_admits_on_its_gate_alone(admission, gate):
    """With no peer alive, the gate sees every request the fleet-wide check would: a
    request let through is served at once, with no Redis round trip and no news, and the
    gate judges as that check would (7 waves of 2 s in 15 s, not STRICTER's 6)."""
    published: list = []
    gate.pipeline.nc = SimpleNamespace(is_connected=True, publish=lambda *a: published.append(a) or asyncio.sleep(0))
    scope = {"method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    body = orjson.dumps({"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
    assert gate.alone()
    scopes = [dict(scope) for _ in range(240)]
    answers = [refusal(admission, sc, body, time.perf_counter(), lambda _: None) for sc in scopes]
    assert answers[: 7 * 32] == [None] * (7 * 32) and all(sc[LEASE].entry is ALONE for sc in scopes[: 7 * 32])
    assert answers[-1].startswith(b"HTTP/1.1 429 ")  # the gate still refuses past the room
    assert gate.recent.mean_budget > DEFAULT_MAX_TOKENS  # what unknown requests ahead count follows them
    await gate.tell("m", "r1", 100, "pass")
    await asyncio.sleep(0.01)
    assert published == [] and await gate.recent.redis.keys("*") == []
    # Published: recorded among the fleet's recent admissions (for peers joining later,
    # and this gateway's turns judged by the Redis-backed check), after the fact.
    member = next(iter(gate.passed["m"]))
    lease = admission.passed("m", 100, member)
    lease.entry = ALONE
    lease.published()
    await asyncio.gather(*admission.background)
    assert await gate.recent.redis.zrange("arena:admitted:m", 0, -1) == [f"{member}:100".encode()]
    await gate.recent.redis.delete("arena:admitted:m")
    # A peer reports: news and the fleet-wide check again.
    await gate._on_peer(SimpleNamespace(data=orjson.dumps({"gateway": "other", "demand": {"m": 1.0}})))
    assert not gate.alone()
    gate.passed.clear()
    assert refusal(admission, dict(scope), body, time.perf_counter(), lambda _: None) is HOLD
    await _until(lambda: bool(published))
    await _until(lambda: gate.recent.redis.keys("*"))
    assert published and await gate.recent.redis.keys("*") != []
    # Silent for PEER_SILENT_S: alone again.
    gate.peers["other"] = (time.time() - PEER_SILENT_S - 1, {"m": 1.0})
    assert gate.alone()


async def test_the_protocol_gets_a_whole_429_or_holds_the_request_for_the_fleet_check(admission, gate):
    """`refusal` runs as uvicorn's protocol reads a body: a request let through is counted
    at once (the next one read is judged with it) and held for the fleet-wide check;
    past the limit, a complete response at once."""
    scope = {"method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
    body = orjson.dumps({"max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]})
    replies: list = []
    _with_an_idle_peer(gate)
    scopes = [dict(scope) for _ in range(200)]
    answers = [refusal(admission, sc, body, time.perf_counter(), replies.append) for sc in scopes]
    assert answers[: 6 * 32] == [HOLD] * (6 * 32)
    head, _, payload = answers[-1].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"retry-after: " in head and b"server-timing: gateway;dur=" in head
    assert orjson.loads(payload)["error"]["code"] == "overloaded"
    await _until(lambda: len(replies) == 6 * 32)  # the fleet-wide check: one batch, every one admitted
    assert replies == [None] * (6 * 32)
    assert all(sc[LEASE].entry[0] == "m" and sc[LEASE].model == "m" for sc in scopes[: 6 * 32])
    # Refused fleet-wide (another gateway's share): the protocol writes the 429, and this
    # gate no longer counts it.
    gate.passed.clear()
    admission.judge.room = 0
    replies.clear()
    held = dict(scope)
    assert refusal(admission, held, body, time.perf_counter(), replies.append) is HOLD
    assert gate._ahead("m", 0.0) == (1, 100)
    await _until(lambda: bool(replies))
    [refused] = replies
    assert refused.startswith(b"HTTP/1.1 429 ") and b"admission;dur=" in refused and held[LEASE].entry is None
    assert gate._ahead("m", 0.0) == (0, 0)
    # Not the protocol's to answer: the routes do (401, 400, or a request in the URL's terms).
    gate.settings.api_keys = ["sk-a"]
    assert refusal(admission, dict(scope), body, time.perf_counter(), replies.append) is None  # no key: 401
    assert refusal(admission, {**scope, "path": "/v1/models"}, body, time.perf_counter(), replies.append) is None
