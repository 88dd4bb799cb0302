"""The filter consumer: every ChatRequested becomes PromptAccepted or PromptRejected."""

from __future__ import annotations

import asyncio
import logging
from typing import overload

from nats.aio.msg import Msg

from consumers.filter.config import FilterConfig
from consumers.filter.ensemble import Ensemble
from consumers.filter.interface import Classifier
from consumers.filter.metrics import METRICS, FilterMetrics
from consumers.filter.policy import deciding, inspect_messages
from consumers.filter.reload import ClassifierSlot, slot_for
from consumers.filter.settings import FilterSettings
from consumers.filter.stage import SINGLE, ClassifierOutcome, strongest
from events import topology
from events.models import (
    ChatMessage,
    ChatRequested,
    ClassifierFeature,
    ClassifierReport,
    FilterReport,
    PromptAccepted,
    PromptRejected,
)
from runtime import tracing
from runtime.consume import DurableConsumer, Handler
from runtime.process import Process, ProcessRuntime, Publish, decode_or_term, serve

log = logging.getLogger(__name__)


def filter_request(
    event: ChatRequested, config: FilterConfig, classifier: Classifier | Ensemble | None = None
) -> PromptAccepted | PromptRejected:
    """Pure: the filter's verdict on one request, as the event to publish."""
    cleaned, verdicts, action = inspect_messages([m.model_dump() for m in event.messages], config, classifier)
    report = FilterReport(
        action=action,
        score=max((v.score for v in verdicts), default=0.0),
        reasons=tuple(dict.fromkeys(r for v in verdicts for r in v.reasons)),
        edits=tuple(dict.fromkeys(e for v in verdicts for e in v.edits)),
        classifier=_report(strongest([v.classifier for v in verdicts])),
        stages=tuple(_report(o) for o in (deciding(verdicts).stages if verdicts else ()) if o.stage != SINGLE),
    )
    if action == "reject":
        reason = ", ".join(report.reasons[:3]) or "prompt injection suspected"
        ids = dict(request_id=event.request_id, conv_id=event.conv_id, turn_id=event.turn_id)
        return PromptRejected(**ids, reason=reason, filter=report)
    return PromptAccepted.of(event, tuple(ChatMessage(**m) for m in cleaned), report)


@overload
def _report(outcome: ClassifierOutcome) -> ClassifierReport: ...
@overload
def _report(outcome: None) -> None: ...
def _report(outcome: ClassifierOutcome | None) -> ClassifierReport | None:
    if outcome is None:
        return None
    ensemble = outcome.stage != SINGLE
    return ClassifierReport(
        version=outcome.version,
        score=outcome.score,
        threshold=outcome.threshold,
        flagged=outcome.flagged,
        enforced=outcome.enforced,
        features=tuple(ClassifierFeature(text=t, weight=w) for t, w in outcome.features),
        stage=outcome.stage if ensemble else None,
        mode=("shadow" if outcome.mode == "shadow" else "block") if ensemble else None,
        benign_tail=outcome.benign_tail,
    )


def filter_config(settings: FilterSettings) -> FilterConfig:
    """The filter's config from its settings (ARENA_FILTER__*), with the shared prompt limit."""
    return settings.config()


def handler(
    config: FilterConfig, publish: Publish, slot: ClassifierSlot | None = None, metrics: FilterMetrics = METRICS
) -> Handler:
    """The filter's handler of one pulled ChatRequested: its verdict published (acked by
    the pull loop when it returns; garbage terminated)."""

    async def on_requested(message: Msg) -> None:
        event = await decode_or_term(topology.FILTER.name, message, ChatRequested)
        if event is None:
            return
        with tracing.consumed("filter", message.headers, request_id=event.request_id) as span:
            classifier = _current(slot, metrics)
            if classifier is not None and classifier.blocking:
                out = await asyncio.to_thread(
                    filter_request, event, config, classifier
                )  # a guard model: keep the loop free
            else:
                out = filter_request(event, config, classifier)
            if out.filter.classifier is not None:
                metrics.classifier_verdicts.labels(
                    config.mode, "flagged" if out.filter.classifier.flagged else "clear"
                ).inc()
            _count_stages(out.filter, metrics, event.request_id)
            metrics.verdicts.labels(out.filter.action).inc()
            if span is not None:
                span.set_attribute("arena.verdict", out.filter.action)
            await publish(out)
            log.info("prompt %s", out.filter.action, extra={"request_id": event.request_id, "event": out.type})

    return on_requested


def build_app(
    settings: FilterSettings | None = None, config: FilterConfig | None = None, publish: Publish | None = None
) -> Process:
    """The filter process; `publish` (default: the runtime's, with dedupe keys) is replaceable in tests."""
    settings = settings or FilterSettings()
    config = config or filter_config(settings)
    runtime = ProcessRuntime(topology.FILTER.name, settings)
    publish = publish or runtime.publish
    slot = slot_for(config)  # loaded at build: a missing artifact stops the process at start
    on_requested = handler(config, publish, slot)
    consumer = DurableConsumer(topology.FILTER, on_requested, "auto", settings.workers, batch=settings.workers)
    return Process(runtime, consumer)


def _count_stages(report: FilterReport, metrics: FilterMetrics, request_id: str) -> None:
    """Each ensemble stage's verdict in its metric; a stage in shadow that flags is logged too,
    so an operator watches its would-be rejections (and false positives) before enforcing it."""
    for stage in report.stages:
        verdict = "flagged" if stage.flagged else "clear"
        metrics.stage_verdicts.labels(stage.stage, stage.mode, verdict).inc()
        if stage.flagged and stage.mode == "shadow":
            log.info(
                "stage %s would reject (shadow): score %.4f, threshold %.4f",
                stage.stage,
                stage.score,
                stage.threshold,
                extra={"request_id": request_id, "stage": stage.stage, "version": stage.version},
            )


def _current(slot: ClassifierSlot | None, metrics: FilterMetrics) -> Classifier | Ensemble | None:
    if slot is None:
        return None
    reloads, failures = slot.reloads, slot.failures
    classifier = slot.current()
    if slot.reloads != reloads:
        metrics.classifier_reloads.labels("ok").inc()
    if slot.failures != failures:
        metrics.classifier_reloads.labels("failed").inc()
    return classifier


def main() -> None:
    serve(build_app())
