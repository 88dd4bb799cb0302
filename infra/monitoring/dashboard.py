"""The Grafana dashboard, generated: `python -m infra.monitoring.dashboard` writes
`grafana/arenaflow.json` (committed; a test fails when it differs from what this makes,
and when a panel queries a series no process exports)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

PATH = Path(__file__).with_name("grafana") / "arenaflow.json"
UID = "arenaflow"


@dataclass(frozen=True)
class Panel:
    title: str
    #: (PromQL, legend) pairs
    queries: tuple[tuple[str, str], ...]
    unit: str = "short"


def _quantiles(metric: str, by: str = "model", qs: tuple[float, ...] = (0.5, 0.99)) -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[$__rate_interval])))",
            f"P{round(q * 100)} {{{{{by}}}}}",
        )
        for q in qs
    )


def _rate(metric: str, by: str) -> str:
    return f"sum by ({by}) (rate({metric}[$__rate_interval]))"


#: Rows of panels, in order. Fleet series come from every gateway alike: `max`, never `sum`.
ROWS: tuple[tuple[str, tuple[Panel, ...]], ...] = (
    (
        "Requests",
        (
            Panel(
                "Request rate by model and status",
                ((_rate("arena_req_total", "model, status"), "{{model}} {{status}}"),),
                "reqps",
            ),
            Panel("Latency by model", _quantiles("arena_req_latency_seconds"), "s"),
            Panel("Refused requests by reason", ((_rate("arena_rejections_total", "reason"), "{{reason}}"),), "reqps"),
            Panel("Deadline misses by model", ((_rate("arena_deadline_misses_total", "model"), "{{model}}"),), "reqps"),
        ),
    ),
    (
        "Tokens",
        (
            Panel("Time to first streamed token", _quantiles("arena_time_to_first_token_seconds"), "s"),
            Panel("Time to first token (inference, every request)", _quantiles("arena_ttft_seconds"), "s"),
            Panel("Time per output token", _quantiles("arena_time_per_output_token_seconds"), "s"),
            Panel("Tokens per second by model", ((_rate("arena_tokens_generated_total", "model"), "{{model}}"),)),
        ),
    ),
    (
        "Batches, queues and lag",
        (
            Panel(
                "Batch size",
                (
                    *_quantiles("arena_batch_size"),
                    (
                        "sum by (model) (rate(arena_batch_size_sum[$__rate_interval]))"
                        " / sum by (model) (rate(arena_batch_size_count[$__rate_interval]))",
                        "mean {{model}}",
                    ),
                ),
            ),
            Panel(
                "Running and waiting requests",
                (
                    ("sum by (model) (arena_requests_running)", "running {{model}}"),
                    ("sum by (model) (arena_requests_waiting)", "waiting {{model}}"),
                ),
            ),
            Panel(
                "Queue per model",
                (
                    ("max by (model) (arena_model_queue_requests)", "requests {{model}}"),
                    ("max by (model) (arena_model_queue_estimate_seconds)", "estimate (s) {{model}}"),
                ),
            ),
            Panel(
                "Consumer lag per durable",
                (
                    ("max by (durable) (arena_consumer_pending)", "pending {{durable}}"),
                    ("max by (durable) (arena_consumer_ack_pending)", "ack pending {{durable}}"),
                ),
            ),
            Panel(
                "Redeliveries",
                (
                    (_rate("arena_redelivered_messages_total", "role"), "{{role}} /s"),
                    ("max by (durable) (arena_consumer_redelivered)", "unacked redelivered {{durable}}"),
                ),
            ),
            Panel("Stream queue wait", _quantiles("arena_queue_wait_seconds"), "s"),
        ),
    ),
    (
        "Models and processes",
        (
            Panel("Resident workers per model", (("max by (model) (arena_model_resident_workers)", "{{model}}"),)),
            Panel(
                "Resident model memory",
                (("sum by (process) (arena_pool_resident_bytes)", "{{process}}"),),
                "bytes",
            ),
            Panel(
                "Pool hits, misses, loads and evictions",
                (
                    ("sum(rate(arena_pool_hits_total[$__rate_interval]))", "hits"),
                    ("sum(rate(arena_pool_misses_total[$__rate_interval]))", "misses"),
                    ("sum(rate(arena_model_loads_total[$__rate_interval]))", "loads"),
                    ("sum(rate(arena_pool_evictions_total[$__rate_interval]))", "evictions"),
                ),
                "ops",
            ),
            Panel(
                "Ready processes per role, restarts",
                (
                    ("max by (role) (arena_fleet_processes)", "{{role}}"),
                    ("sum by (process) (increase(arena_process_restarts_total[10m]))", "restarts {{process}}"),
                ),
            ),
        ),
    ),
    (
        "Filter",
        (
            Panel("Filter verdicts", ((_rate("arena_filter_verdicts_total", "action"), "{{action}}"),), "reqps"),
            Panel(
                "Classifier verdicts",
                ((_rate("arena_filter_classifier_verdicts_total", "mode, verdict"), "{{mode}} {{verdict}}"),),
                "reqps",
            ),
        ),
    ),
)


def queries() -> list[str]:
    return [q for _, panels in ROWS for p in panels for q, _ in p.queries]


def dashboard() -> dict:
    """Grafana's JSON model: a row per group, panels two to a line."""
    panels: list[dict] = []
    y, pid = 0, 1
    source = {"type": "prometheus", "uid": "${datasource}"}
    for row, group in ROWS:
        panels.append({"type": "row", "title": row, "id": pid, "collapsed": False, "gridPos": _grid(0, y, 24, 1)})
        pid, y = pid + 1, y + 1
        for i, p in enumerate(group):
            panels.append(
                {
                    "type": "timeseries",
                    "title": p.title,
                    "id": pid,
                    "datasource": source,
                    "gridPos": _grid(12 * (i % 2), y + 8 * (i // 2), 12, 8),
                    "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []},
                    "targets": [
                        {"datasource": source, "expr": q, "legendFormat": legend, "refId": chr(ord("A") + k)}
                        for k, (q, legend) in enumerate(p.queries)
                    ],
                }
            )
            pid += 1
        y += 8 * ((len(group) + 1) // 2)
    return {
        "uid": UID,
        "title": "arenaflow",
        "tags": ["arenaflow"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}]
        },
        "panels": panels,
    }


def _grid(x: int, y: int, w: int, h: int) -> dict:
    return {"x": x, "y": y, "w": w, "h": h}


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m infra.monitoring.dashboard", description=f"Write the Grafana dashboard, generated, to {PATH}."
    ).parse_args(argv)
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
