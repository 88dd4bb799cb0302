"""gateway/fleet_metrics.py: the fleet's series, from heartbeats and the consumers' state."""

from __future__ import annotations

import time
from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from events.fleet import InferenceBeat, ModelLoad
from gateway.admission.estimate import StreamState
from gateway.admission.queues import LATE_BEAT_S
from gateway.fleet_metrics import FleetCollector
from gateway.fleet_view import FleetView
from gateway.settings import GatewaySettings
from infra.monitoring import series
from tests.unit.fake_pipeline import FakePipeline


def scrape(collector: FleetCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def beat(instance: str, resident: list[str], running: int = 0, ts: float | None = None) -> InferenceBeat:
    load = {m: ModelLoad(running=running, waiting=1, max_batch=8, tokens=40, step_s=0.01) for m in resident}
    return InferenceBeat(
        instance=instance,
        ready=True,
        ts=time.time() if ts is None else ts,
        pid=1,
        models=("a", "b"),
        resident=tuple(resident),
        load=load,
        resident_bytes=1000,
    )


def test_lag_resident_workers_queue_and_memory():
    pipeline = FakePipeline(GatewaySettings())
    pipeline.fleet = lambda: FleetView(
        {"filter": 1, "inference": 2, "delivery": 1}, models={"a": ["w1", "w2"], "b": []}
    )
    pipeline.beats = {(b.role, b.instance): b for b in (beat("w1", ["a"], running=3), beat("w2", ["a"], running=2))}
    pipeline.stream_state = StreamState(ahead=4, held=5, read_at=time.time())
    fleet = FleetCollector()
    fleet.pipeline = pipeline
    fleet.consumers["inference"] = SimpleNamespace(num_pending=7, num_ack_pending=5, num_redelivered=1)
    text = scrape(fleet)
    assert 'arena_consumer_pending{durable="inference"} 7.0' in text
    assert 'arena_consumer_ack_pending{durable="inference"} 5.0' in text
    assert 'arena_consumer_redelivered{durable="inference"} 1.0' in text
    assert 'arena_model_resident_workers{model="a"} 2.0' in text
    assert 'arena_model_resident_workers{model="b"} 0.0' in text
    assert 'arena_model_queue_requests{model="a"} 7.0' in text  # (3 + 1) + (2 + 1)
    assert 'arena_fleet_processes{role="inference"} 2.0' in text
    assert 'arena_fleet_resident_bytes{instance="w1"} 1000.0' in text
    assert 'arena_model_queue_estimate_seconds{model="a"}' in text


def test_a_model_nobody_holds_any_more_stays_visible_at_zero():
    pipeline = FakePipeline(GatewaySettings())
    fleet = FleetCollector()
    fleet.pipeline = pipeline
    pipeline.fleet = lambda: FleetView({"inference": 1}, models={"a": ["w1"]})
    scrape(fleet)
    pipeline.fleet = lambda: FleetView({"inference": 0})
    assert 'arena_model_resident_workers{model="a"} 0.0' in scrape(fleet)


def test_before_the_pipeline_starts_only_the_lag_families_are_declared():
    names = series.exported(scrape(FleetCollector()))
    assert {"arena_consumer_pending", "arena_consumer_ack_pending", "arena_consumer_redelivered"} <= names


def test_a_broken_fleet_view_does_not_fail_the_scrape():
    def boom():
        raise RuntimeError("broken fleet")

    fleet = FleetCollector()
    fleet.pipeline = SimpleNamespace(fleet=boom)
    text = scrape(fleet)
    assert "arena_consumer_pending" in text and "arena_model_resident_workers" not in text


def test_admission_judges_by_a_late_workers_last_beat_rather_than_by_none():
    """A worker whose heartbeats are late (busy, starved) drops out of the live ones; with
    no live heartbeat holding the model, admission still judges by its last one, for a
    while (LATE_BEAT_S), instead of taking the model for one never run."""
    pipeline = FakePipeline(GatewaySettings())
    late = beat("w1", ["a"], running=3, ts=time.time() - 10)
    pipeline.beats = {("inference", "w1"): late}
    assert pipeline.live_beats() == []
    q = pipeline.queue("a")
    assert (q.slots, q.requests, q.step_s) == (8, 4, 0.01)
    # Gone for longer: no slots (the route answers as for a model not running).
    pipeline.beats = {("inference", "w1"): beat("w1", ["a"], running=3, ts=time.time() - LATE_BEAT_S - 1)}
    assert pipeline.queue("a").slots == 0
    # A live worker holding the model: only the live ones count.
    pipeline.beats = {("inference", "w1"): late, ("inference", "w2"): beat("w2", ["a"], running=1)}
    assert (pipeline.queue("a").slots, pipeline.queue("a").requests) == (8, 2)
