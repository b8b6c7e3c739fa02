"""The verifier's Prometheus metrics (its own registry, on --metrics-port).

Speculation counters follow vLLM's spec_decode names, prefixed specd_, one series per
drafter; a request that never speculated adds nothing to them.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from specd.engine.spec_stats import SpecStats
from specd.rpc.telemetry import LATENCY_BUCKETS, RTT_BUCKETS, register_kv_memory, serve_metrics

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class VerifierMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specd_verifier_requests", "Finished requests by finish reason",
                                ["finish_reason"], registry=r)
        self.ttft = Histogram("specd_verifier_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specd_verifier_inter_token_latency_seconds",
                             "Time between token deltas, divided by the tokens in the delta",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specd_verifier_e2e_request_latency_seconds", "Arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("specd_verifier_num_requests_running", "Sequences scheduled (running)", registry=r)
        self.waiting = Gauge("specd_verifier_num_requests_waiting", "Queue depth: sequences waiting", registry=r)
        self.rejected = Counter("specd_verifier_requests_rejected", "Requests refused because the queue was full",
                                registry=r)
        self.exact = Gauge("specd_verifier_exact", "1 when greedy output does not depend on batching or "
                           "speculation (batch-invariant mode on, its load-time self-test passed)", registry=r)
        self.kv_used = Gauge("specd_verifier_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_free = Gauge("specd_verifier_kv_blocks_free", "KV cache blocks free", registry=r)
        register_kv_memory(r)
        self.batch_size = Histogram("specd_verifier_batch_size", "Sequences per engine step",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram("specd_verifier_step_seconds", "Engine step time (propose + verify)",
                                      buckets=LATENCY_BUCKETS, registry=r)
        labels = ["drafter"]
        self.num_drafts = Counter("specd_spec_decode_num_drafts", "Verify steps that carried drafts",
                                  labels, registry=r)
        self.num_draft_tokens = Counter("specd_spec_decode_num_draft_tokens", "Draft tokens verified",
                                        labels, registry=r)
        self.num_accepted = Counter("specd_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                    labels, registry=r)
        self.num_cached_drafts = Counter("specd_spec_decode_num_cached_drafts",
                                         "Verify steps whose drafts a pipelined drafter drafted ahead (cache hits)",
                                         labels, registry=r)
        self.accepted_per_pos = Counter("specd_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each position (0-based)",
                                        ["drafter", "position"], registry=r)
        self.propose_rtt = Histogram("specd_verifier_propose_rtt_seconds", "Propose round trip per drafter",
                                     labels, buckets=RTT_BUCKETS, registry=r)
        self.propose_feature_bytes = Counter("specd_verifier_propose_feature_bytes",
                                             "Bytes of the target's hidden states sent to each drafter", labels,
                                             registry=r)
        self.prompt_tokens = Counter("specd_verifier_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=r)
        self.generation_tokens = Counter("specd_verifier_generation_tokens", "Tokens generated (emitted)",
                                         registry=r)
        self.prefill_tokens = Counter("specd_verifier_prefill_tokens", "Prompt tokens the target's forward "
                                      "computed (not those whose KV came from the prefix cache or a fork: the n "
                                      "choices of a request compute their prompt once)", registry=r)
        self.structured = Counter("specd_verifier_structured_requests", "Finished requests whose output was "
                                  "constrained (JSON schema, regex, choice, grammar, tool calls)", ["kind"], registry=r)
        self.mask_seconds = Counter("specd_verifier_grammar_mask_seconds", "Time spent cutting drafts at the grammar "
                                    "and filling its token masks", registry=r)
        self.masked_rows = Counter("specd_verifier_grammar_masked_rows", "Logits rows masked by a grammar (verify "
                                   "positions of constrained sequences)", registry=r)
        self.constrained_draft_tokens = Counter("specd_spec_decode_constrained_draft_tokens",
                                                "Draft tokens verified for constrained requests", registry=r)
        self.constrained_accepted = Counter("specd_spec_decode_constrained_accepted_tokens",
                                            "Draft tokens accepted for constrained requests", registry=r)
        # Prefix caching, in tokens like vLLM's prefix_cache_queries / prefix_cache_hits.
        self.prefix_queries = Counter("specd_verifier_prefix_cache_queries", "Prompt tokens looked up in the "
                                      "prefix cache when a sequence was admitted", registry=r)
        self.prefix_hits = Counter("specd_verifier_prefix_cache_hits", "Of those, tokens whose KV came from the "
                                   "cache", registry=r)
        self.prefix_evictions = Counter("specd_verifier_prefix_cache_evictions", "Cached KV blocks dropped for "
                                        "new ones", registry=r)
        self.prefix_blocks = Gauge("specd_verifier_prefix_cache_blocks", "KV blocks held in the prefix cache "
                                   "(in use or reusable; counted free when no sequence holds them)", registry=r)
        self.ttft_by_cache = Histogram("specd_verifier_time_to_first_token_by_prefix_cache_seconds",
                                       "Arrival to first token, by whether the prompt's KV came partly from the "
                                       "prefix cache (hit) or not (miss)", ["prefix_cache"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self._prefix = (0, 0, 0)  # the block manager's (queries, hits, evictions) at the last export
        self._exported: dict[str, SpecStats] = {}
        self._mask = (0.0, 0)  # the engine's (mask_s, masked_rows) at the last export
        self._prefill = 0  # the engine's prefill_tokens at the last export

    def export_spec(self, stats_by_drafter: dict[str, SpecStats]) -> None:
        """Add what the speculator counted since the last call."""
        for name, s in list(stats_by_drafter.items()):
            seen = self._exported.setdefault(name, SpecStats())
            if s.drafts == seen.drafts:
                continue
            self.num_drafts.labels(name).inc(s.drafts - seen.drafts)
            self.num_draft_tokens.labels(name).inc(s.draft_tokens - seen.draft_tokens)
            self.num_accepted.labels(name).inc(s.accepted_tokens - seen.accepted_tokens)
            if s.cached_drafts > seen.cached_drafts:
                self.num_cached_drafts.labels(name).inc(s.cached_drafts - seen.cached_drafts)
            for pos, count in enumerate(s.accepted_per_pos):
                before = seen.accepted_per_pos[pos] if pos < len(seen.accepted_per_pos) else 0
                self.accepted_per_pos.labels(name, str(pos)).inc(count - before)
            self._exported[name] = SpecStats(s.drafts, s.draft_tokens, s.accepted_tokens, list(s.accepted_per_pos),
                                             s.cached_drafts)

    def export_prefix_cache(self, blocks) -> None:
        """The block manager's prefix-cache counters since the last call, and its cached blocks."""
        st, (queries, hits, evictions) = blocks.stats, self._prefix
        if (st.queries, st.hits, st.evictions) != self._prefix:
            self.prefix_queries.inc(st.queries - queries)
            self.prefix_hits.inc(st.hits - hits)
            self.prefix_evictions.inc(st.evictions - evictions)
            self._prefix = (st.queries, st.hits, st.evictions)
        self.prefix_blocks.set(blocks.num_cached_blocks)

    def export_grammar(self, timings) -> None:
        """Add the engine's grammar work (StepTimings.mask_s, masked_rows) and the prompt tokens it
        computed (prefill_tokens) since the last call."""
        self.prefill_tokens.inc(timings.prefill_tokens - self._prefill)
        self._prefill = timings.prefill_tokens
        seconds, rows = self._mask
        if timings.masked_rows != rows or timings.mask_s != seconds:
            self.mask_seconds.inc(timings.mask_s - seconds)
            self.masked_rows.inc(timings.masked_rows - rows)
            self._mask = (timings.mask_s, timings.masked_rows)

    def structured_finished(self, kind: str, spec: SpecStats) -> None:
        self.structured.labels(kind).inc()
        self.constrained_draft_tokens.inc(spec.draft_tokens)
        self.constrained_accepted.inc(spec.accepted_tokens)

    def watch_drafters(self, drafters) -> None:
        """specd_verifier_drafter_healthy{drafter}, read at scrape time from drafters() (name -> healthy),
        so it is right while the verifier idles; a removed drafter's series goes away."""
        self.registry.register(_DrafterHealth(drafters))

    def start_http_server(self, port: int, host: str = "0.0.0.0") -> int:
        return serve_metrics(self.registry, port, host)


class _DrafterHealth:
    def __init__(self, drafters):
        self.drafters = drafters

    def collect(self):
        gauge = GaugeMetricFamily("specd_verifier_drafter_healthy", "1 when the drafter takes traffic",
                                  labels=["drafter"])
        for name, healthy in self.drafters().items():
            gauge.add_metric([name], 1.0 if healthy else 0.0)
        yield gauge
