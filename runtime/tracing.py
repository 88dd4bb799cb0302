"""One trace per request across the pipeline: W3C trace context in the NATS headers.

The gateway starts a request's trace; every publish carries the current span's context
in a `traceparent` header (`headers`), and each consumer continues the trace from the
message it handles (`start`, `consumed`). Nothing here knows the pipeline's stages:
the processes name their spans.

Off by default: until `setup` (an OTLP endpoint in the settings) or `install` (a test's
in-memory exporter) puts a provider in place, `start` returns None, no header is
written and no span object is made, so a process pays one flag check per call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACER = trace.get_tracer("arenaflow")
_state: dict[str, Any] = {"on": False, "provider": None}


def enabled() -> bool:
    return _state["on"]


def install(provider: Any | None) -> None:
    """Use `provider` (an SDK TracerProvider) for this process's spans from now on;
    None turns tracing off again."""
    global _TRACER  # noqa: PLW0603 - one tracer per process, replaced when tracing is switched
    _state.update(on=provider is not None, provider=provider)
    _TRACER = (provider or trace.NoOpTracerProvider()).get_tracer("arenaflow")


def setup(settings: Any, service: str) -> None:
    """Export spans by OTLP/HTTP when the settings name an endpoint (`ARENA_OTLP_ENDPOINT`);
    otherwise stay off. Called once when a process starts."""
    endpoint = getattr(settings, "otlp_endpoint", None)
    if not endpoint or enabled():
        return
    # Imported here: a process with tracing off never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: PLC0415
    from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
    from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
    from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415

    url = endpoint.rstrip("/")
    url = url if url.endswith("/v1/traces") else f"{url}/v1/traces"
    provider = TracerProvider(resource=Resource.create({"service.name": f"arena-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    install(provider)
    log.info("traces exported to %s", url)


def shutdown() -> None:
    """Flush spans still buffered (a process stopping)."""
    provider = _state["provider"]
    if provider is not None and hasattr(provider, "force_flush"):
        provider.force_flush(2000)


def headers(base: dict[str, str] | None = None) -> dict[str, str] | None:
    """`base` plus the current span's `traceparent` (unchanged when tracing is off)."""
    if not enabled():
        return base
    carrier = dict(base or {})
    _PROPAGATOR.inject(carrier)
    return carrier


def context_of(carrier: Mapping[str, str] | None) -> Context | None:
    """The trace context a message's headers carry (None: none)."""
    return _PROPAGATOR.extract(dict(carrier)) if carrier else None


def start(name: str, carrier: Mapping[str, str] | None = None, parent: Span | None = None, **attrs) -> Span | None:
    """A span continuing the trace in `carrier` (a message's headers), or a child of
    `parent`, or of the current span; None when tracing is off. The caller ends it."""
    if not enabled():
        return None
    ctx = trace.set_span_in_context(parent) if parent is not None else context_of(carrier)
    return _TRACER.start_span(name, context=ctx, attributes=_attrs(attrs))


def span_at(name: str, parent: Span | None, start_s: float, end_s: float, **attrs) -> None:
    """A finished span over [start_s, end_s] (epoch seconds) under `parent`: a stage
    whose start and end are known only afterwards (time in the stream, prefill)."""
    if parent is None:
        return
    ctx = trace.set_span_in_context(parent)
    end_s = max(end_s, start_s)
    span = _TRACER.start_span(name, context=ctx, attributes=_attrs(attrs), start_time=_ns(start_s))
    span.end(end_time=_ns(end_s))


def within(span: Span | None):
    """Make `span` current (publishes inside carry its context); it is not ended here."""
    return nullcontext() if span is None else trace.use_span(span, end_on_exit=False)


@contextmanager
def consumed(name: str, carrier: Mapping[str, str] | None, **attrs) -> Iterator[Span | None]:
    """A span for handling one message, current while the handler runs, ended after it."""
    span = start(name, carrier, **attrs)
    if span is None:
        yield None
        return
    with trace.use_span(span, end_on_exit=True):
        yield span


def end(span: Span | None, error: str | None = None) -> None:
    """End `span` (once; later calls do nothing), marked failed with `error` if given."""
    if span is None or not span.is_recording():
        return
    if error:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def log_ids() -> dict[str, str]:
    """The current trace and span ids, for a log record (empty outside a span)."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def _attrs(attrs: dict) -> dict:
    return {f"arena.{k}": v for k, v in attrs.items() if v is not None}


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
