"""OpenTelemetry traces across processes: one trace per request, with a span per stage.

The API opens the request's root span and puts its W3C `traceparent` in the tokenize job (`trace`); every
stage starts its own span as a child of it (tokenize; schedule, from admission to the request's end, with the
engine steps it took; detokenize for a choice's first and last range) and passes the same traceparent on
inside its messages, since a stream entry has no headers. The root span ends when the API has sent the last
byte. Tracing is off unless `--otlp-endpoint` is set: then nothing is imported, no field is written, and every
call here is a no-op, so a request costs nothing. Spans are exported over OTLP/HTTP in batches.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


class Span:
    """A started span, or nothing (tracing off). `end` is idempotent."""

    def __init__(self, span: Any = None, traceparent: str | None = None):
        self._span, self.traceparent = span, traceparent

    def event(self, name: str, **attributes: Any) -> None:
        if self._span is not None:
            self._span.add_event(name, attributes)

    def set(self, **attributes: Any) -> None:
        if self._span is not None:
            self._span.set_attributes(attributes)

    def end(self, error: str | None = None) -> None:
        if self._span is None:
            return
        if error:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end()
        self._span = None


NO_SPAN = Span()


class Tracer:
    def __init__(self, role: str, endpoint: str | None):
        self.enabled = bool(endpoint)
        self._provider = self._tracer = self._propagator = None
        if not self.enabled:
            return
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = TracerProvider(resource=Resource.create({"service.name": f"rsinfer-{role}"}))
        self._provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")))
        self._tracer = self._provider.get_tracer("rsinfer")
        self._propagator = TraceContextTextMapPropagator()
        log.info("tracing to %s", endpoint)

    def start(self, name: str, parent: str | None = None, root: bool = False, **attributes: Any) -> Span:
        """A span under the request's trace (`parent`, a traceparent); with `root`, a new trace. Nothing
        when tracing is off, or when the request carries no trace (its API process does not trace)."""
        if not self.enabled or (parent is None and not root):
            return NO_SPAN
        context = self._propagator.extract({"traceparent": parent}) if parent else None
        span = self._tracer.start_span(name, context=context, attributes=attributes)
        from opentelemetry.trace import set_span_in_context

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=set_span_in_context(span))
        return Span(span, carrier.get("traceparent"))

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what is still batched
