"""The filter consumer: every ChatRequested becomes PromptAccepted or PromptRejected."""

from __future__ import annotations

import asyncio
import logging

from faststream import AckPolicy, FastStream
from faststream.nats import NatsBroker
from faststream.nats.annotations import NatsMessage

from consumers.filter.config import FilterConfig
from consumers.filter.policy import inspect_messages
from events import topology
from events.models import ChatMessage, ChatRequested, FilterReport, PromptAccepted, PromptRejected
from runtime.process import ProcessRuntime, Publish, decode_or_term, durable_pull, wire_lifecycle
from runtime.settings import FilterSettings

log = logging.getLogger(__name__)


def filter_request(event: ChatRequested, config: FilterConfig) -> PromptAccepted | PromptRejected:
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


def filter_config(settings: FilterSettings) -> FilterConfig:
    """The filter's config from its settings (ARENA_FILTER__*), with the shared prompt limit."""
    return FilterConfig(**{"max_prompt_chars": settings.max_prompt_chars, **settings.filter})


def build_app(
    settings: FilterSettings | None = None, config: FilterConfig | None = None, publish: Publish | None = None
) -> FastStream:
    """The filter process; `publish` (default: the runtime's, with dedupe keys) is replaceable in tests."""
    settings = settings or FilterSettings()
    config = config or filter_config(settings)
    broker = NatsBroker(settings.nats_url, log_level=logging.DEBUG)
    runtime = ProcessRuntime(topology.FILTER.name, settings)
    publish = publish or runtime.publish

    @durable_pull(broker, topology.FILTER, AckPolicy.NACK_ON_ERROR, settings.workers)
    async def on_requested(message: NatsMessage) -> None:
        event = await decode_or_term(topology.FILTER.name, message)
        if not isinstance(event, ChatRequested):
            return
        out = filter_request(event, config)
        await publish(out)
        log.info("prompt %s", out.filter.action, extra={"request_id": event.request_id, "event": out.type})

    app = FastStream(broker)
    wire_lifecycle(app, runtime)
    return app


def main() -> None:
    asyncio.run(build_app().run())
