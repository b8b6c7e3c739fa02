"""The drafter's gRPC service: one proposer behind Info, a bidi Propose stream and Release.

Several verifiers may share a drafter, so sequence ids are scoped by the client id each
verifier sends; the proposer sees internal ids. Proposers are not thread-safe: every call
into one runs on a single worker thread, off the event loop so streams stay responsive.
State a verifier never releases (it died) goes after a TTL.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from opentelemetry import trace

from specd.drafter.proposers.base import ProposeRequest
from specd.telemetry import context_from_traceparent, tracer
from specd.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger("specd.drafter")
_tracer = tracer("specd.drafter")


class SequenceKeys:
    """(client id, sequence id) <-> the proposer's internal id, with last-use times for the TTL."""

    def __init__(self):
        self._ids = itertools.count(1)
        self.internal: dict[tuple[str, int], int] = {}
        self.touched: dict[int, float] = {}

    def get(self, client: str, seq_id: int) -> int:
        key = (client, seq_id)
        internal = self.internal.get(key)
        if internal is None:
            internal = self.internal[key] = next(self._ids)
        self.touched[internal] = time.monotonic()
        return internal

    def pop(self, client: str, seq_ids) -> list[int]:
        out = []
        for sid in seq_ids:
            internal = self.internal.pop((client, sid), None)
            if internal is not None:
                self.touched.pop(internal, None)
                out.append(internal)
        return out

    def pop_expired(self, ttl: float) -> list[int]:
        now = time.monotonic()
        expired = {i for i, t in self.touched.items() if now - t > ttl}
        for key in [k for k, i in self.internal.items() if i in expired]:
            del self.internal[key]
        for i in expired:
            del self.touched[i]
        return sorted(expired)


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, proposer, info: drafter_pb2.DrafterInfoResponse, ttl_seconds: float = 600.0,
                 metrics=None):
        self.proposer, self.info, self.ttl = proposer, info, ttl_seconds
        self.keys = SequenceKeys()
        self.metrics = metrics
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proposer")

    async def Info(self, request, context):
        return self.info

    async def Release(self, request, context):
        internal = self.keys.pop(request.client_id, request.seq_ids)
        if internal:
            await asyncio.get_running_loop().run_in_executor(self.worker, self.proposer.release, internal)
        return drafter_pb2.ReleaseResponse()

    async def Propose(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for batch in request_iterator:
            # One span per batch, child of the verifier's step span (the batch's traceparent).
            with _tracer.start_as_current_span("drafter.propose", context=context_from_traceparent(batch.traceparent),
                                               kind=trace.SpanKind.SERVER) as span:
                t0 = time.perf_counter_ns()
                released = self.keys.pop(batch.client_id, batch.release)
                requests = [self._request(batch.client_id, e) for e in batch.entries]
                proposals = await loop.run_in_executor(self.worker, self._propose, requests, released)
                out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id, propose_ns=time.perf_counter_ns() - t0)
                for entry, p in zip(batch.entries, proposals):
                    msg = out.proposals.add(seq_id=entry.seq_id, token_ids=p.token_ids, resync=p.resync)
                    for ids, probs in zip(p.q_ids or [], p.q_probs or []):
                        msg.q.add(ids=ids, probs=probs)
                num_drafts = sum(len(p.token_ids) for p in proposals)
                if self.metrics is not None:
                    self.metrics.observe_batch(len(batch.entries), num_drafts, (time.perf_counter_ns() - t0) / 1e9)
                if span.is_recording():
                    span.set_attributes({"specd.drafter": self.info.name, "specd.batch_size": len(batch.entries),
                                         "specd.spec.draft_tokens": num_drafts, "specd.released": len(released)})
            yield out

    def _request(self, client: str, e: drafter_pb2.ProposeEntry) -> ProposeRequest:
        return ProposeRequest(seq_id=self.keys.get(client, e.seq_id), new_tokens=list(e.new_tokens),
                              num_tokens=e.num_tokens, k=e.k, full_history=e.full_history,
                              temperature=e.temperature, seed=e.seed if e.HasField("seed") else None,
                              num_prompt_tokens=e.num_prompt_tokens or None)

    def _propose(self, requests: list[ProposeRequest], released: list[int]):
        if released:
            self.proposer.release(released)
        return self.proposer.propose(requests) if requests else []

    async def expire_loop(self, period: float | None = None) -> None:
        """Release sequences no verifier touched for ttl seconds (their verifier went away)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period or max(1.0, self.ttl / 10))
            expired = self.keys.pop_expired(self.ttl)
            if expired:
                log.info("releasing %d sequences idle for over %.0f s", len(expired), self.ttl)
                await loop.run_in_executor(self.worker, self.proposer.release, expired)
