"""Prometheus for `arena up`: the processes it started, as a file_sd target file, and a
configuration that scrapes them and loads the alert rules.

`arena up` writes both into `<state>/prometheus/`; then

    prometheus --config.file .arena/prometheus/prometheus.yml

scrapes every process of the stack (a child restarted by the supervisor keeps its port).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

RULES = Path(__file__).with_name("alerts.yml")
#: Local stacks are small: a short interval makes `arena up` + Prometheus show a change at once.
SCRAPE_INTERVAL = "2s"


@dataclass(frozen=True)
class Target:
    """One process's /metrics endpoint."""

    process: str  # e.g. inference-0
    role: str  # a role of events.topology, or "supervisor"
    port: int
    host: str = "127.0.0.1"


def file_sd(targets: list[Target]) -> list[dict]:
    """Prometheus file_sd groups: one per process, labelled with its role and name."""
    return [{"targets": [f"{t.host}:{t.port}"], "labels": {"role": t.role, "process": t.process}} for t in targets]


def config(targets_file: Path, interval: str = SCRAPE_INTERVAL) -> dict:
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "arenaflow",
                # A series's own role/process labels win over its target's: the supervisor's
                # restarts per process and the gateway's ready processes per role would
                # otherwise all read as the scraped process's (renamed exported_process/role).
                "honor_labels": True,
                "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": interval}],
            }
        ],
    }


def write(directory: Path, targets: list[Target]) -> Path:
    """Write `targets.json` and `prometheus.yml` into `directory`; the configuration's path."""
    directory.mkdir(parents=True, exist_ok=True)
    targets_file = directory / "targets.json"
    targets_file.write_text(json.dumps(file_sd(targets), indent=2))
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config(targets_file), sort_keys=False))
    return path
