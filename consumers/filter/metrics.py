"""The filter consumer's Prometheus metrics (one place, bounded labels)."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter

__all__ = ["METRICS", "FilterMetrics"]


class FilterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        # action: pass / sanitized / reject, the verdict published.
        self.verdicts = Counter(
            "arena_filter_verdicts_total", "Prompts judged by the filter", ["action"], registry=registry
        )
        # mode: block / shadow / sanitize-only; verdict: flagged / clear. In shadow mode
        # this is the one place the classifier's would-be rejections show up live.
        self.classifier_verdicts = Counter(
            "arena_filter_classifier_verdicts_total",
            "Prompts scored by the classifier stage",
            ["mode", "verdict"],
            registry=registry,
        )
        # Each stage of a classifier ensemble; mode: block / shadow (the stage's own). A stage in
        # shadow counts its would-be rejections here before it is enforced.
        self.stage_verdicts = Counter(
            "arena_filter_stage_verdicts_total",
            "Prompts scored by each classifier ensemble stage",
            ["stage", "mode", "verdict"],
            registry=registry,
        )
        self.classifier_reloads = Counter(
            "arena_filter_classifier_reloads_total", "Classifier artifact reloads", ["outcome"], registry=registry
        )


#: The process's metrics, registered once (a filter app built twice in one process shares them).
METRICS = FilterMetrics()
