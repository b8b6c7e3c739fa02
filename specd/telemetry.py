"""Prometheus helpers shared by the services: each service owns a registry, served on
its own /metrics port. Counters are raw; rates are PromQL's job."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

# Latency buckets (seconds) from 1 ms to 60 s: covers CPU demo models and GPU serving.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
# Sub-millisecond resolution for gRPC round trips.
RTT_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1,
               0.25, 0.5, 1.0)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> None:
    """Expose registry at http://host:port/metrics on a daemon thread."""
    start_http_server(port, addr=host, registry=registry)
