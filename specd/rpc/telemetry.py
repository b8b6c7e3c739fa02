"""Telemetry shared by the services.

Prometheus: each service owns a registry, served on its own /metrics port. Counters are
raw; rates are PromQL's job.

OpenTelemetry: off unless `setup_tracing` finds OTEL_EXPORTER_OTLP_ENDPOINT (OTLP/gRPC export,
needs the `otel` extra) or SPECD_TRACE_FILE (finished spans as JSON lines, for tests and
debugging). Off, every tracer is the API's no-op one and nothing travels on the wire.
Spans and how they join into one trace (W3C trace context):

  gateway.request     per HTTP generation request; its context goes in the Generate call's metadata
  verifier.generate   per request, child of the gateway's span (extracted from that metadata)
  verifier.step       per engine step: child of the oldest in-flight request's verifier.generate
                      span, with a link to every in-flight request's span (a step serves many
                      requests, a span has one parent: the others reach their steps by link)
  drafter.propose     per ProposeBatch, child of the step span; the batch carries a `traceparent`
                      string, since a bidi stream's metadata is fixed when the stream opens
"""
from __future__ import annotations

import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Gauge, start_http_server

log = logging.getLogger("specd.rpc.telemetry")

# Latency buckets (seconds) from 1 ms to 60 s: covers CPU demo models and GPU serving.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
# Sub-millisecond resolution for gRPC round trips.
RTT_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
               0.25, 0.5, 1.0)

TRACE_FILE_ENV = "SPECD_TRACE_FILE"
_W3C = TraceContextTextMapPropagator()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> int:
    """Expose registry at http://host:port/metrics on a daemon thread; returns the port bound
    (port 0: one the OS picks). A port that cannot be bound raises OSError."""
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port


def register_kv_memory(registry: CollectorRegistry) -> None:
    """The process's CPU KV caches: their size and how much of them is resident (read at scrape
    time). RSS that grows while resident bytes grow is a cache filling its pages, not a leak."""
    from specd.engine import kv_memory  # here: the gateway imports this module and never torch

    Gauge("specd_kv_cache_bytes", "Size of the CPU KV caches (blocks never written take no memory)",
          registry=registry).set_function(kv_memory.cache_bytes)
    resident = Gauge("specd_kv_cache_resident_bytes",
                     "Bytes of the CPU KV caches mapped: pages written at least once (or read as zero)",
                     registry=registry)
    resident.set_function(kv_memory.resident_bytes)


# ---- OpenTelemetry -------------------------------------------------------------------

def setup_tracing(service_name: str) -> bool:
    """Install a TracerProvider when OTEL_EXPORTER_OTLP_ENDPOINT or SPECD_TRACE_FILE is set;
    otherwise do nothing (tracing off: the API's no-op tracer). Returns whether it installed one."""
    endpoint, path = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), os.environ.get(TRACE_FILE_ENV)
    processors = []
    if endpoint:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but opentelemetry-exporter-otlp-proto-grpc is not "
                        "installed (pip install 'specd[otel]'); spans are not exported")
        else:
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            processors.append(BatchSpanProcessor(OTLPSpanExporter()))  # endpoint etc. from the OTEL_* env
    if path:
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

        out = open(path, "a", encoding="utf-8")  # noqa: SIM115 — lives as long as the process
        processors.append(SimpleSpanProcessor(ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    if not processors:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider

    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    for processor in processors:
        provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)  # flushed and shut down at exit by the SDK
    return True


def tracer(name: str) -> trace.Tracer:
    """A tracer that follows the global provider (a no-op one until setup_tracing installs one)."""
    return trace.get_tracer(name)


def inject_metadata() -> tuple[tuple[str, str], ...] | None:
    """The current trace context as gRPC metadata (None when there is nothing to send)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items()) or None


def extract_metadata(metadata) -> Context | None:
    """The trace context from gRPC invocation metadata (key/value pairs); None without one."""
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier) if carrier else None


def current_traceparent() -> str:
    """The current span as a W3C traceparent string; "" when no span is being recorded."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return carrier.get("traceparent", "")


def context_from_traceparent(traceparent: str) -> Context | None:
    return _W3C.extract({"traceparent": traceparent}) if traceparent else None
