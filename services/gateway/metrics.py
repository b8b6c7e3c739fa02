"""The gateway's Prometheus metrics, in a registry of its own (raw counters; rates are PromQL's job)."""
from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets as vLLM's serving metrics, so existing dashboards read these the same way.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specd_gateway_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("specd_gateway_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("specd_gateway_inter_token_latency_seconds",
                             "Time between token chunks of one request (a chunk may hold several tokens)",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specd_gateway_e2e_request_latency_seconds", "Request arrival to last token",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.running = Gauge("specd_gateway_requests_running", "Generate calls in flight",
                             registry=self.registry)
        # Per verifier replica (label: its address); one replica is the single-verifier gateway.
        self.replica_requests = Counter("specd_gateway_replica_requests", "Generate calls sent to a verifier "
                                        "replica (a request moved to another replica counts on both)",
                                        ["replica"], registry=self.registry)
        self.replica_failovers = Counter("specd_gateway_replica_failovers", "Requests moved off a replica "
                                         "before their first token (it was lost or refused them)",
                                         ["replica"], registry=self.registry)
        self.replica_in_flight = Gauge("specd_gateway_replica_requests_running", "Generate calls in flight "
                                       "on a replica", ["replica"], registry=self.registry)
        self.routed = Counter("specd_gateway_routed", "Replica choices (a moved request and an /admin call "
                              "count too) by reason: session (its key), prefix (where its prompt's KV likely "
                              "is), prefix_overloaded (that replica too busy or its KV full), least_loaded (no "
                              "key, or --routing least-loaded)", ["reason"], registry=self.registry)
        self.rejected = Counter("specd_gateway_rejected", "Requests and connections refused or cut by a limit, "
                                "by reason: overloaded (--max-concurrent-requests, 429), verifier_overloaded "
                                "(every replica's queue full, 429), body_too_large (413), body_timeout (408), "
                                "too_many_connections (--max-connections, 503), header_timeout (a connection "
                                "closed: no request headers within --header-timeout), verifier_unavailable and "
                                "verifier_stalled (503)", ["reason"], registry=self.registry)
        self.connections = Gauge("specd_gateway_http_connections", "Open HTTP connections",
                                 registry=self.registry)
        self.replica_healthy = Gauge("specd_gateway_replica_healthy", "1 while a replica serves (polled "
                                     "health and Info), else 0", ["replica"], registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def track(self, arrival: float) -> "RequestTimer":
        return RequestTimer(self, arrival)


class RequestTimer:
    """Latencies of one generation request; counts it as running until finish()."""

    def __init__(self, metrics: GatewayMetrics, arrival: float):
        self._m = metrics
        self._arrival = arrival
        self._last: float | None = None
        metrics.running.inc()

    def tokens(self) -> None:
        now = time.perf_counter()
        if self._last is None:
            self._m.ttft.observe(now - self._arrival)
        else:
            self._m.itl.observe(now - self._last)
        self._last = now

    def finish(self, completed: bool) -> None:
        self._m.running.dec()
        if completed:
            self._m.e2e.observe(time.perf_counter() - self._arrival)
