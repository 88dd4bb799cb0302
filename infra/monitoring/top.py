"""`arena top`: a live terminal view of a running `arena up` stack.

It reads what Prometheus would: every process listed in `<state>/prometheus/targets.json`
is scraped (its /metrics and /readyz) each refresh, and rates and percentiles are taken
over the interval between two scrapes. Per model: request rate, queue, running batch,
tokens/s, time to first token and latency (P50/P99), 429s and deadline misses; per
durable: its lag; per process: whether it answers and is ready.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

Labels = tuple[tuple[str, str], ...]


@dataclass
class Process:
    name: str
    role: str
    address: str
    up: bool = False
    ready: bool | None = None
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)


@dataclass
class Snapshot:
    at: float
    processes: list[Process]

    def values(self, name: str, **match: str) -> Iterable[tuple[dict[str, str], float]]:
        for p in self.processes:
            for (sample, labels), value in p.samples.items():
                d = dict(labels)
                if sample == name and all(d.get(k) == v for k, v in match.items()):
                    yield d, value

    def total(self, name: str, **match: str) -> float:
        return sum(v for _, v in self.values(name, **match))

    def most(self, name: str, **match: str) -> float | None:
        found = [v for _, v in self.values(name, **match)]
        return max(found) if found else None

    def buckets(self, name: str, **match: str) -> dict[float, float]:
        out: dict[float, float] = {}
        for labels, value in self.values(f"{name}_bucket", **match):
            le = float(labels["le"])
            out[le] = out.get(le, 0.0) + value
        return out

    def label_values(self, label: str, *names: str) -> set[str]:
        return {d[label] for n in names for d, _ in self.values(n) if label in d}


def targets(state_dir: str | Path) -> list[Process]:
    path = Path(state_dir) / "prometheus" / "targets.json"
    if not path.exists():
        raise SystemExit(f"no running stack in {state_dir}: start `arena up` (or pass --state-dir)")
    return [
        Process(group["labels"]["process"], group["labels"]["role"], address)
        for group in json.loads(path.read_text())
        for address in group["targets"]
    ]


def scrape(procs: list[Process], client: httpx.Client) -> Snapshot:
    """Read every process's /metrics and /readyz (a process that does not answer is down)."""
    out = []
    for p in procs:
        seen = Process(p.name, p.role, p.address)
        try:
            text = client.get(f"http://{p.address}/metrics").text
            seen.up = True
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    seen.samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
            if p.role != "supervisor":
                seen.ready = client.get(f"http://{p.address}/readyz").status_code == 200
        except (httpx.HTTPError, ValueError):
            seen.up = False
        out.append(seen)
    return Snapshot(time.time(), out)


def quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts (None: no observations)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        count = buckets[le]
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def _delta(cur: dict[float, float], prev: dict[float, float]) -> dict[float, float]:
    """Bucket counts over the interval; the cumulative ones when nothing was observed in it."""
    delta = {le: v - prev.get(le, 0.0) for le, v in cur.items()}
    return delta if any(v > 0 for v in delta.values()) else cur


def model_rows(prev: Snapshot, cur: Snapshot) -> list[list[str]]:
    dt = max(cur.at - prev.at, 1e-3)
    names = ("arena_req_total", "arena_model_queue_requests", "arena_requests_running", "arena_pool_resident")
    rows = []
    for model in sorted(cur.label_values("model", *names)):
        req_s = (cur.total("arena_req_total", model=model) - prev.total("arena_req_total", model=model)) / dt
        tok = cur.total("arena_tokens_generated_total", model=model)
        tok_s = (tok - prev.total("arena_tokens_generated_total", model=model)) / dt
        ttft = _delta(cur.buckets("arena_ttft_seconds", model=model), prev.buckets("arena_ttft_seconds", model=model))
        lat = _delta(
            cur.buckets("arena_req_latency_seconds", model=model),
            prev.buckets("arena_req_latency_seconds", model=model),
        )
        rows.append(
            [
                model,
                f"{req_s:.1f}",
                _num(cur.most("arena_model_queue_requests", model=model)),
                _num(cur.total("arena_requests_running", model=model)),
                f"{tok_s:.0f}",
                f"{_ms(quantile(0.5, ttft))} / {_ms(quantile(0.99, ttft))}",
                f"{_ms(quantile(0.5, lat))} / {_ms(quantile(0.99, lat))}",
                _num(cur.total("arena_req_total", model=model, status="429")),
                _num(cur.total("arena_deadline_misses_total", model=model)),
                _num(cur.most("arena_model_resident_workers", model=model)),
            ]
        )
    return rows


def process_rows(cur: Snapshot) -> list[list[str]]:
    rows = []
    for p in cur.processes:
        state = "down" if not p.up else ("ready" if p.ready in (True, None) else "starting")
        resident = sorted(dict(labels)["model"] for (n, labels), v in p.samples.items() if n == "arena_pool_resident")
        detail = f"resident: {', '.join(resident)}" if resident else ""
        rows.append([p.name, p.role, p.address, state, detail])
    return rows


def frame(prev: Snapshot, cur: Snapshot) -> Group:
    models = Table(title="models", title_justify="left", expand=True)
    for col in ("model", "req/s", "queue", "batch", "tok/s", "TTFT p50/p99", "latency p50/p99", "429s", "misses"):
        models.add_column(col, justify="left" if col == "model" else "right")
    models.add_column("workers", justify="right")
    for row in model_rows(prev, cur):
        models.add_row(*row)
    lag = Table(title="consumers", title_justify="left", expand=True)
    for col in ("durable", "pending", "ack pending", "redelivered"):
        lag.add_column(col, justify="left" if col == "durable" else "right")
    for durable in sorted(cur.label_values("durable", "arena_consumer_pending")):
        lag.add_row(
            durable,
            *(
                _num(cur.most(n, durable=durable))
                for n in ("arena_consumer_pending", "arena_consumer_ack_pending", "arena_consumer_redelivered")
            ),
        )
    procs = Table(title="processes", title_justify="left", expand=True)
    for col in ("process", "role", "metrics", "state", ""):
        procs.add_column(col)
    for row in process_rows(cur):
        procs.add_row(*row, style="red" if row[3] == "down" else None)
    when = time.strftime("%H:%M:%S", time.localtime(cur.at))
    return Group(f"[b]arena top[/b]  {when}  ({len(cur.processes)} processes)", models, lag, procs)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:g}"


def _ms(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f}ms" if v < 1 else f"{v:.1f}s"


def run(state_dir: str, interval: float = 2.0, once: bool = False, svg: str | None = None, width: int = 120) -> int:
    """Refresh every `interval` s until Ctrl-C; `once`: print one frame (two scrapes apart)."""
    procs = targets(state_dir)
    with httpx.Client(timeout=1.0) as client:
        prev = scrape(procs, client)
        if once:
            time.sleep(interval)
            console = Console(record=svg is not None, width=width)
            console.print(frame(prev, scrape(procs, client)))
            if svg:
                console.save_svg(svg, title="arena top")
            return 0
        with Live(frame(prev, prev), refresh_per_second=4, screen=False) as live:
            try:
                while True:
                    time.sleep(interval)
                    cur = scrape(procs, client)
                    live.update(frame(prev, cur))
                    prev = cur
            except KeyboardInterrupt:
                return 0
