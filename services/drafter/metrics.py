"""The drafter's Prometheus metrics (its own registry, on --metrics-port)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from specd.rpc.telemetry import LATENCY_BUCKETS, register_kv_memory, serve_metrics


class DrafterMetrics:
    def __init__(self, name: str):
        self.registry = CollectorRegistry()
        labels = ["drafter"]
        self.batches = Counter("specd_drafter_propose_batches", "Propose batches served", labels,
                               registry=self.registry).labels(name)
        self.entries = Counter("specd_drafter_propose_entries", "Sequences in propose batches", labels,
                               registry=self.registry).labels(name)
        self.draft_tokens = Counter("specd_drafter_draft_tokens", "Draft tokens proposed", labels,
                                    registry=self.registry).labels(name)
        self.propose_seconds = Histogram("specd_drafter_propose_seconds", "Time to answer one propose batch",
                                         labels, buckets=LATENCY_BUCKETS, registry=self.registry).labels(name)
        self.sequences = Gauge("specd_drafter_sequences", "Sequences the drafter keeps state for", labels,
                               registry=self.registry).labels(name)
        self.history_tokens = Gauge("specd_drafter_history_tokens", "Tokens of history kept over all sequences",
                                    labels, registry=self.registry).labels(name)
        # Pipelined drafting (--pipeline): lookups in the draft cache, and drafting ahead.
        self.cache_hits = Counter("specd_drafter_draft_cache_hits", "Proposals answered from the draft cache",
                                  labels, registry=self.registry).labels(name)
        self.cache_misses = Counter("specd_drafter_draft_cache_misses",
                                    "Proposals drafted on request (no outcome drafted ahead matched)", labels,
                                    registry=self.registry).labels(name)
        self.predrafted = Counter("specd_drafter_predrafted_outcomes", "Verification outcomes drafted ahead",
                                  labels, registry=self.registry).labels(name)
        self.predraft_seconds = Counter("specd_drafter_predraft_seconds", "Time spent drafting ahead", labels,
                                        registry=self.registry).labels(name)
        self.up = Gauge("specd_drafter_up", "1 while the drafter serves", labels, registry=self.registry).labels(name)
        self.up.set(1)
        register_kv_memory(self.registry)  # a draft model's own cache

    def observe_batch(self, entries: int, draft_tokens: int, seconds: float) -> None:
        self.batches.inc()
        self.entries.inc(entries)
        self.draft_tokens.inc(draft_tokens)
        self.propose_seconds.observe(seconds)

    def observe_cache(self, hits: int, misses: int) -> None:
        self.cache_hits.inc(hits)
        self.cache_misses.inc(misses)

    def observe_predraft(self, outcomes: int, seconds: float) -> None:
        self.predrafted.inc(outcomes)
        self.predraft_seconds.inc(seconds)

    def observe_state(self, sequences: int, tokens: int) -> None:
        self.sequences.set(sequences)
        self.history_tokens.set(tokens)

    def start_http_server(self, port: int, host: str = "0.0.0.0") -> int:
        return serve_metrics(self.registry, port, host)
