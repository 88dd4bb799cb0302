"""Which series a query names and which series the processes export: what keeps the
dashboard and the alert rules from drifting away from the metrics."""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_NAME = re.compile(r"\barena_[a-z0-9_]+\b")
#: The samples a family of each type exports (prometheus_client's exposition).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
    "gauge": ("",),
}


def queried(expr: str) -> set[str]:
    """The arenaflow series a PromQL expression reads."""
    return set(_NAME.findall(expr))


def exported(text: str) -> set[str]:
    """The series a /metrics page declares, with or without samples yet (a labelled
    counter nothing has incremented shows only its HELP and TYPE)."""
    out: set[str] = set()
    for family in text_string_to_metric_families(text):
        out |= {sample.name for sample in family.samples}
        out |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return out
