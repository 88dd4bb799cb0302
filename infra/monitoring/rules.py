"""The alert rules (`alerts.yml`) as a Prometheus Operator PrometheusRule for Kubernetes:
`python -m infra.monitoring.rules` writes `infra/k8s/monitoring/prometheus-rule.yaml`
(committed; a test fails when it differs from the rules)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from infra.monitoring.scrape import RULES

PATH = Path(__file__).resolve().parents[1] / "k8s" / "monitoring" / "prometheus-rule.yaml"
HEAD = "# Generated from infra/monitoring/alerts.yml by `python -m infra.monitoring.rules`; do not edit.\n"


def prometheus_rule() -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "arenaflow", "labels": {"app.kubernetes.io/name": "arenaflow"}},
        "spec": {"groups": yaml.safe_load(RULES.read_text())["groups"]},
    }


def render() -> str:
    return HEAD + yaml.safe_dump(prometheus_rule(), sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="python -m infra.monitoring.rules",
        description=f"Write the PrometheusRule of the alert rules, generated, to {PATH}.",
    ).parse_args(argv)
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
