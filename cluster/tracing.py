"""OpenTelemetry spans along a request's path, behind `observability.tracing` (off by default).

    ingress      the HTTP/gRPC request (the Frontend replica): request id, model, prompt tokens, outcome
    ├─ router    the routing decision: chosen decode / prefill worker, cached tokens, reason
    ├─ prefill   on the prefill worker (disaggregated only): cached tokens, first token
    └─ decode    on the decode worker: tokens generated, finish reason
       └─ kv_handoff   the KV import from the prefill worker: bytes, seconds

One trace per request: the ingress injects a W3C `traceparent` into each worker call (the call's
`trace_context` keyword), and the worker extracts it as the parent of its span. A `traceparent` header
(HTTP) or metadata entry (gRPC) from the client becomes the ingress span's parent.

Each process sets its tracer up once from the config (`configure`); spans go to an OTLP/HTTP endpoint
(`otlp_endpoint`, batched) and/or a JSON-lines file (`trace_file`, one line per span, written as it
ends). Sampling (`trace_sample_ratio`) is decided at the ingress; the workers follow the parent's flag.

Disabled, every helper returns at once (no span objects, nothing extra sent with a worker call), and even
enabled there is no per-token work: spans are per request and per hop.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Mapping

from .config import ObservabilityConfig

_tracer = None  # this process's tracer while tracing is on
_provider = None  # ... and its provider
_NO_SPAN = contextlib.nullcontext()  # what `span` gives while tracing is off (reusable)


def configure(cfg: ObservabilityConfig, component: str, exporter=None) -> None:
    """Sets this process's tracer up from the config (or turns tracing off). `component` names the
    process in the spans' resource (e.g. "ingress", "decode"); `exporter` is one more span exporter,
    fed as each span ends (tests use an in-memory one)."""
    global _tracer, _provider
    if not cfg.tracing:
        _tracer = _provider = None
        return
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create({"service.name": "moray", "moray.component": component, "process.pid": os.getpid()})
    # Our own provider, not the global one: Ray or the application may own that.
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(cfg.trace_sample_ratio)))
    if cfg.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.otlp_endpoint)))
    if cfg.trace_file:
        provider.add_span_processor(SimpleSpanProcessor(JSONLinesSpanExporter(cfg.trace_file)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("moray.cluster")


def enabled() -> bool:
    return _tracer is not None


def flush(timeout_s: float = 5.0) -> bool:
    """Sends the spans still batched (an OTLP exporter sends every few seconds otherwise)."""
    return _provider is None or _provider.force_flush(int(timeout_s * 1000))


# ---- spans ---------------------------------------------------------------------------------------------


def start_span(name: str, parent=None, attributes: Mapping[str, Any] | None = None, server: bool = False, start_time: int | None = None):
    """A started span (None while tracing is off). `parent`: a span, or a context from `extract`."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, dict):  # a Context is a dict; anything else is a span
        parent = trace.set_span_in_context(parent)
    kind = trace.SpanKind.SERVER if server else trace.SpanKind.INTERNAL
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_time)


def end_span(span, attributes: Mapping[str, Any] | None = None, error: BaseException | None = None, end_time: int | None = None) -> None:
    """Ends `span` (None: nothing to do) with these attributes; an `error` marks it failed."""
    if span is None:
        return
    if attributes:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
    if error is not None:
        _record_error(span, error)
    span.end(end_time=end_time)


def set_attributes(span, attributes: Mapping[str, Any]) -> None:
    if span is not None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})


def span(name: str, parent=None, attributes: Mapping[str, Any] | None = None):
    """`with span(...) as s:` a span around a block (s is None while tracing is off); an exception
    leaving the block marks it failed."""
    if _tracer is None:
        return _NO_SPAN
    return _span_block(name, parent, attributes)


@contextlib.contextmanager
def _span_block(name, parent, attributes):
    s = start_span(name, parent, attributes)
    try:
        yield s
    except BaseException as e:
        _record_error(s, e)
        raise
    finally:
        s.end()


def _record_error(span, error: BaseException) -> None:
    import asyncio

    from opentelemetry.trace import Status, StatusCode

    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # the client left: not a failure of ours
        span.set_attribute("moray.cancelled", True)
        return
    span.record_exception(error)
    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))


# ---- propagation across Ray calls ----------------------------------------------------------------------


def inject(span) -> dict[str, str] | None:
    """The W3C trace context (`traceparent`) of `span`, for a request to another process (the messages'
    `trace_context` field); None while tracing is off."""
    if span is None:
        return None
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def extract(carrier: Mapping[str, str] | None):
    """The parent context in a carrier (a worker call's trace_context, HTTP headers, gRPC metadata), or
    None (no carrier, no traceparent in it, or tracing off)."""
    if _tracer is None or not carrier or carrier.get("traceparent") is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier)


# ---- the hops ------------------------------------------------------------------------------------------


def decision_attributes(decision) -> dict[str, Any]:
    """The router span's attributes from a `RouteDecision`."""
    return {
        "moray.decode_worker": decision.decode_worker,
        "moray.prefill_worker": decision.prefill_worker or "",
        "moray.cached_tokens": decision.expected_cached_tokens,
        "moray.uncached_tokens": decision.uncached_tokens,
        "moray.route_reason": decision.reason,
        "moray.degraded": decision.degraded,
    }


def handoff_span(parent, seconds: float, nbytes: int, chunks: int, skipped_bytes: int, error: BaseException | None = None) -> None:
    """The `kv_handoff` span under `parent` (a decode span; None: tracing off): the import that just ended,
    `seconds` long, with the bytes moved and skipped (the decode side's prefix cache held them)."""
    if parent is None:
        return
    end = time.time_ns()
    s = start_span("kv_handoff", parent, start_time=end - int(seconds * 1e9))
    attributes = {
        "moray.handoff_bytes": nbytes,
        "moray.handoff_seconds": seconds,
        "moray.chunks": chunks,
        "moray.skipped_bytes": skipped_bytes,
    }
    end_span(s, attributes, error=error, end_time=end)


# ---- the JSON-lines file -------------------------------------------------------------------------------


class JSONLinesSpanExporter:
    """Appends each span as one JSON line (the SDK's own span JSON) to a file that every process of the
    node may share: one `write` per batch to a file opened for appending, so lines never interleave."""

    def __init__(self, path: str):
        self.path = path

    def export(self, spans) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        data = "".join(s.to_json(indent=None) + "\n" for s in spans).encode()
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
