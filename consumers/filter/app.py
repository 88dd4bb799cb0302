"""The filter consumer: every ChatRequested becomes PromptAccepted or PromptRejected."""

from __future__ import annotations

import logging

from faststream import AckPolicy, FastStream
from faststream.nats import NatsBroker

from consumers.filter.config import FilterConfig
from consumers.filter.policy import inspect_messages
from events import subjects
from events.models import ChatMessage, ChatRequested, FilterReport, PromptAccepted, PromptRejected
from infra.runtime import ProcessRuntime, durable_pull, wire_lifecycle
from infra.settings import FilterSettings

log = logging.getLogger("arena.filter")


def decide(event: ChatRequested, config: FilterConfig) -> PromptAccepted | PromptRejected:
    """Pure: the filter's verdict on one request, as the event to publish."""
    cleaned, verdicts, action = inspect_messages([m.model_dump() for m in event.messages], config)
    report = FilterReport(
        action=action,
        score=max((v.score for v in verdicts), default=0.0),
        reasons=tuple(dict.fromkeys(r for v in verdicts for r in v.reasons)),
        edits=tuple(dict.fromkeys(e for v in verdicts for e in v.edits)),
    )
    ids = dict(request_id=event.request_id, conv_id=event.conv_id, turn_id=event.turn_id)
    if action == "reject":
        reason = ", ".join(report.reasons[:3]) or "prompt injection suspected"
        return PromptRejected(**ids, reason=reason, filter=report)
    return PromptAccepted(
        **ids,
        model=event.model,
        messages=tuple(ChatMessage(**m) for m in cleaned),
        params=event.params,
        deadline_at=event.deadline_at,
        received_at=event.received_at,
        filter=report,
    )


def build_app(settings: FilterSettings | None = None, config: FilterConfig | None = None) -> FastStream:
    settings = settings or FilterSettings()
    config = config or FilterConfig()
    broker = NatsBroker(settings.nats_url, log_level=logging.DEBUG)
    runtime = ProcessRuntime("filter", settings)

    @durable_pull(broker, subjects.FILTER_SUBJECT, subjects.FILTER_CONSUMER, AckPolicy.NACK_ON_ERROR, settings.workers)
    async def on_requested(event: ChatRequested) -> None:
        out = decide(event, config)
        await runtime.publish(out)
        log.info("prompt %s", out.filter.action, extra={"request_id": event.request_id, "event": out.type})

    app = FastStream(broker)
    wire_lifecycle(app, runtime)
    return app
