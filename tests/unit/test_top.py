"""infra/monitoring/top.py: percentiles, rates and the frame, from two scrapes."""

from __future__ import annotations

import math

import pytest
from rich.console import Console

from infra.monitoring.top import Process, Snapshot, frame, model_rows, quantile


def test_quantile_interpolates_like_prometheus():
    buckets = {0.1: 50.0, 0.5: 90.0, 1.0: 100.0, math.inf: 100.0}
    assert quantile(0.5, buckets) == pytest.approx(0.1)
    assert quantile(0.7, buckets) == pytest.approx(0.3)
    assert quantile(0.99, buckets) == pytest.approx(0.95)
    assert quantile(0.5, {0.1: 0.0, math.inf: 0.0}) is None
    assert quantile(0.99, {1.0: 10.0, math.inf: 20.0}) == 1.0  # in the +Inf bucket: its lower bound


def snapshot(at: float, requests: float, tokens: float, fast: float) -> Snapshot:
    gateway = Process("gateway", "gateway", "127.0.0.1:1", up=True, ready=True)
    gateway.samples = {
        ("arena_req_total", (("model", "m"), ("status", "200"))): requests,
        ("arena_req_total", (("model", "m"), ("status", "429"))): 2.0,
        ("arena_model_queue_requests", (("model", "m"),)): 3.0,
        ("arena_consumer_pending", (("durable", "inference"),)): 9.0,
        ("arena_req_latency_seconds_bucket", (("le", "0.5"), ("model", "m"))): fast,
        ("arena_req_latency_seconds_bucket", (("le", "+Inf"), ("model", "m"))): requests,
    }
    worker = Process("inference-0", "inference", "127.0.0.1:2", up=True, ready=False)
    worker.samples = {
        ("arena_tokens_generated_total", (("model", "m"),)): tokens,
        ("arena_requests_running", (("model", "m"),)): 4.0,
        ("arena_pool_resident", (("model", "m"),)): 1.0,
    }
    return Snapshot(at, [gateway, worker, Process("supervisor", "supervisor", "127.0.0.1:3")])


def test_rates_and_percentiles_are_over_the_interval():
    [row] = model_rows(snapshot(100.0, 10, 1000, 10), snapshot(102.0, 20, 1400, 10))
    model, req_s, queue, batch, tok_s, _, latency, refused, *_ = row
    assert (model, req_s, queue, batch, tok_s, refused) == ("m", "5.0", "3", "4", "200", "2")
    assert latency.endswith("/ 500ms")  # the 10 requests of the interval were all slow: not the 10 fast ones before


def test_the_frame_names_models_durables_and_processes_with_their_state():
    console = Console(width=140, record=True)
    console.print(frame(snapshot(100.0, 1, 0, 1), snapshot(101.0, 2, 10, 2)))
    text = console.export_text()
    for name in ("m", "inference", "gateway", "inference-0", "supervisor", "resident: m", "starting", "down"):
        assert name in text, name
