"""Watching a real `arena up`: Debian's Prometheus scrapes every process from the
configuration `arena up` writes; the dashboard and the alert rules query only series the
processes export; `arena top` shows the stack; and each process exports its spans by
OTLP, one trace per request across the processes."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import httpx
import psutil
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from events import topology
from infra.monitoring import dashboard, scrape, series
from infra.supervisor import DEFAULT_MODEL
from runtime.net import free_port
from tests.arena_up import ArenaUp, arena
from tests.prometheus import active_targets, query, run_prometheus, wait_for

pytestmark = pytest.mark.timeout(240)

REQUESTS = 6


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP trace receiver: every span, with the service that sent it."""

    spans: ClassVar[list[tuple[str, object]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            for scoped in resource.scope_spans:
                Collector.spans.extend((service, s) for s in scoped.spans)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def otlp():
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def up(tmp_path_factory, otlp):
    stack = ArenaUp(tmp_path_factory.mktemp("monitoring"), env={"ARENA_OTLP_ENDPOINT": otlp})
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prometheus(up, tmp_path_factory):
    with run_prometheus(up.state / "prometheus" / "prometheus.yml", tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@pytest.fixture(scope="module")
def traffic(up) -> list[str]:
    """Request ids of a few answered requests, streamed and not."""
    ids = []
    with httpx.Client(base_url=up.url, timeout=30) as client:
        for i in range(REQUESTS):
            body = {
                "messages": [{"role": "user", "content": "Once upon a time"}],
                "max_tokens": 8,
                "stream": i % 2 == 1,
            }
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            ids.append(r.headers["x-request-id"])
    return ids


def test_prometheus_scrapes_every_process_arena_up_started(up, prometheus):
    expected = {r.name for r in topology.ROLES} | {"supervisor"}

    def healthy():
        active = active_targets(prometheus)
        return active if {t["labels"]["role"] for t in active if t["health"] == "up"} == expected else None

    active = wait_for(healthy, 30, "every target up")
    assert len(active) == len(_targets(up)) == len(expected)  # one process per role here
    assert all(t["health"] == "up" for t in active), [(t["labels"], t["lastError"]) for t in active]


def test_prometheus_holds_requests_batches_and_consumer_lag(up, prometheus, traffic):
    answered = wait_for(
        lambda: [
            r for r in query(prometheus, 'sum(arena_req_total{status="200"})') if float(r["value"][1]) >= REQUESTS
        ],
        30,
        "arena_req_total",
    )
    assert float(answered[0]["value"][1]) >= REQUESTS
    steps = wait_for(lambda: query(prometheus, "sum by (model) (arena_batch_size_count)"), 30, "arena_batch_size")
    assert {r["metric"]["model"] for r in steps} == {DEFAULT_MODEL}  # what a request naming none gets
    for lag in ("arena_consumer_pending", "arena_consumer_ack_pending", "arena_consumer_redelivered"):
        seen = wait_for(lambda lag=lag: query(prometheus, lag), 30, lag)
        assert {r["metric"]["durable"] for r in seen} == {r.durable for r in topology.consumers()}
        assert all(r["metric"]["role"] == "gateway" for r in seen)
    workers = query(prometheus, "arena_model_resident_workers")
    assert {r["metric"]["model"]: r["value"][1] for r in workers}[DEFAULT_MODEL] == "1"


def test_dashboard_and_alerts_query_only_series_the_processes_export(up, traffic):
    exported: set[str] = set()
    for group in _targets(up):
        for address in group["targets"]:
            exported |= series.exported(httpx.get(f"http://{address}/metrics", timeout=5).text)
    rules = yaml.safe_load(scrape.RULES.read_text())["groups"]
    queries = dashboard.queries() + [r["expr"] for g in rules for r in g["rules"]]
    missing = {q: series.queried(q) - exported for q in queries if series.queried(q) - exported}
    assert not missing, f"queries of series no process exports: {missing}"


def test_arena_top_names_what_runs(up, traffic, tmp_path):
    out = arena(
        "top", "--once", "--interval", "1", "--state-dir", str(up.state), "--svg", str(tmp_path / "top.svg"), env=up.env
    )
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    for name in ("stories-260k", "gateway", "filter", "delivery", "inference-0", "leaderboard", "supervisor"):
        assert name in frame, name
    for durable in (r.durable for r in topology.consumers()):
        assert durable in frame
    assert "down" not in frame and "ready" in frame
    assert (tmp_path / "top.svg").read_text().startswith("<svg")


def test_each_process_exports_its_spans_one_trace_per_request(up, traffic):
    rid = traffic[0]

    def one_trace():
        roots = [s for svc, s in Collector.spans if s.name == "chat.request" and _attr(s, "arena.request_id") == rid]
        if not roots:
            return None
        services = {svc for svc, s in Collector.spans if s.trace_id == roots[0].trace_id}
        return services if {"arena-gateway", "arena-filter", "arena-inference", "arena-delivery"} <= services else None

    wait_for(one_trace, 30, "spans of every process in the request's trace")


def test_a_kill_9_shows_in_the_dashboards_restart_panel(up, prometheus):
    """The panel "Ready processes per role, restarts" under `arena up`: the gateway's
    ready processes keep their own role label (not the scraped gateway's), the
    supervisor's port is scraped, and a role killed with -9 reaches the restart query:
    each process's counter is there at 0 from the start, so increase() sees the step to 1
    (a series born at 1 reads as no increase)."""
    [ready, restarts] = [q for q in dashboard.queries() if "arena_fleet_processes" in q or "restarts_total" in q]
    roles = wait_for(lambda: {r["metric"].get("role") for r in query(prometheus, ready)}, 30, ready)
    assert {r.name for r in topology.consumers()} <= roles, roles
    at_zero = 'arena_process_restarts_total{process="leaderboard", role="supervisor"} == 0'
    wait_for(lambda: query(prometheus, at_zero), 30, "the leaderboard's restarts at 0")
    [victim] = [p for p in psutil.Process(up.proc.pid).children() if "leaderboard" in p.cmdline()]
    victim.kill()

    def counted():
        return [r for r in query(prometheus, restarts) if r["metric"].get("process") == "leaderboard"]

    wait_for(lambda: [r for r in counted() if float(r["value"][1]) >= 1], 30, f"{restarts} after the kill")
    assert {r["metric"]["process"] for r in query(prometheus, restarts)} >= {"gateway", "nats-server", "redis-server"}

    def back():
        return any(p.pid != victim.pid and "leaderboard" in p.cmdline() for p in psutil.Process(up.proc.pid).children())

    wait_for(back, 30, "the leaderboard restarted")


def _targets(up) -> list[dict]:
    return json.loads((up.state / "prometheus" / "targets.json").read_text())


def _attr(span, key: str):
    return next((a.value.string_value for a in span.attributes if a.key == key), None)
