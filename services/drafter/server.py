"""The drafter's gRPC service: one proposer behind Info, a bidi Propose stream and Release.

Several verifiers may share a drafter, so sequence ids are scoped by the client id each
verifier sends; the proposer sees internal ids. Proposers are not thread-safe: every call
into one runs on a single worker thread, off the event loop so streams stay responsive
(an index that answers in microseconds, answers_inline, runs on the event loop itself).
State a verifier never releases (it died) goes after a TTL. With pipelined drafting (a
PipelinedProposer), the worker drafts ahead after each reply, while the verifier verifies,
until the next batch arrives (specd/proposers/pipeline.py). Whatever a caller sends, the
drafter keeps bounded state (DrafterLimits): k is clamped to its max, over-long histories get
no drafts, and the least recently used sequences go when it holds too many or too many tokens.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from opentelemetry import trace

from specd.rpc.auth import drafter_proof
from specd.proposers.base import ProposeRequest, feature_rows
from specd.rpc.grpc_server import compute_thread
from specd.rpc.telemetry import context_from_traceparent, tracer
from specd.v1 import drafter_pb2, drafter_pb2_grpc
from specd.rpc.wire import proposal_to_proto, propose_request_from_proto, tensor_from_proto

log = logging.getLogger("specd.drafter")
_tracer = tracer("specd.drafter")


class SequenceKeys:
    """(client id, sequence id) <-> the proposer's internal id, least recently used first, with
    each sequence's committed length: the bounds on what a drafter keeps are enforced here."""

    def __init__(self):
        self._ids = itertools.count(1)
        self.internal: dict[tuple[str, int], int] = {}
        self.touched: OrderedDict[int, float] = OrderedDict()  # least recently used first
        self.lengths: dict[int, int] = {}
        self.total_tokens = 0

    def get(self, client: str, seq_id: int, num_tokens: int = 0) -> int:
        key = (client, seq_id)
        internal = self.internal.get(key)
        if internal is None:
            internal = self.internal[key] = next(self._ids)
        self.touched[internal] = time.monotonic()
        self.touched.move_to_end(internal)
        self.total_tokens += num_tokens - self.lengths.get(internal, 0)
        self.lengths[internal] = num_tokens
        return internal

    def pop(self, client: str, seq_ids) -> list[int]:
        out = []
        for sid in seq_ids:
            internal = self.internal.pop((client, sid), None)
            if internal is not None:
                self._forget(internal)
                out.append(internal)
        return out

    def _forget(self, internal: int) -> None:
        self.touched.pop(internal, None)
        self.total_tokens -= self.lengths.pop(internal, 0)

    def _drop(self, internals: set[int]) -> None:
        for key in [k for k, i in self.internal.items() if i in internals]:
            del self.internal[key]
        for i in internals:
            self._forget(i)

    def pop_expired(self, ttl: float) -> list[int]:
        now = time.monotonic()
        expired = set()
        for i, t in self.touched.items():  # oldest first
            if now - t <= ttl:
                break
            expired.add(i)
        self._drop(expired)
        return sorted(expired)

    def evict(self, max_sequences: int, max_total_tokens: int, keep: set[int]) -> list[int]:
        """Least recently used sequences (never those in `keep`) until both bounds hold."""
        evicted: set[int] = set()
        count, total = len(self.touched), self.total_tokens
        for i in self.touched:
            if count <= max_sequences and total <= max_total_tokens:
                break
            if i in keep:
                continue
            evicted.add(i)
            count -= 1
            total -= self.lengths.get(i, 0)
        self._drop(evicted)
        return sorted(evicted)


@dataclass(frozen=True)
class DrafterLimits:
    """What one drafter accepts; a batch beyond them costs its sender drafts, not our memory."""

    max_k: int = 8  # drafts per sequence (larger k is clamped)
    max_history_tokens: int = 65536  # longer sequences get no drafts and no state
    max_sequences: int = 1024  # sequences kept, over all verifiers (least recently used evicted)
    max_total_tokens: int = 8 << 20  # tokens kept over all sequences (the same eviction)

    def __post_init__(self) -> None:
        for name in ("max_k", "max_history_tokens", "max_sequences", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, proposer, info: drafter_pb2.DrafterInfoResponse, ttl_seconds: float = 600.0,
                 metrics=None, limits: DrafterLimits | None = None, secret: str | None = None,
                 worker: ThreadPoolExecutor | None = None):
        """worker: the compute_thread() the proposer was built on (one is made where not given)."""
        self.proposer, self.ttl = proposer, ttl_seconds
        self.limits = limits or DrafterLimits(max_k=info.max_k or 8)
        self.info = drafter_pb2.DrafterInfoResponse()
        self.info.CopyFrom(info)
        self.info.max_history_tokens = self.limits.max_history_tokens
        self.secret = secret
        self.keys = SequenceKeys()
        self.metrics = metrics
        self.worker = worker or compute_thread("proposer")
        # A proposer that answers in microseconds (a suffix or n-gram index: no model) is called on
        # the event loop: the two thread hand-offs to the worker and back cost more than its
        # answer, and on a machine whose cores the verifier fills each hand-off waits for a core.
        self.inline = getattr(proposer, "answers_inline", False)
        # Pipelined drafting: set when a batch arrives, so drafting ahead yields the worker to it.
        self.pipelined = hasattr(proposer, "predraft")
        self.batch_waiting = threading.Event()

    async def Info(self, request, context):
        if not (request.challenge and self.secret):
            return self.info
        reply = drafter_pb2.DrafterInfoResponse()
        reply.CopyFrom(self.info)
        reply.proof = drafter_proof(self.secret, request.challenge[:64])
        return reply

    async def Release(self, request, context):
        internal = self.keys.pop(request.client_id, request.seq_ids)
        if internal:
            await self._call(self.proposer.release, internal)
        return drafter_pb2.ReleaseResponse()

    async def Propose(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for batch in request_iterator:
            # One span per batch, child of the verifier's step span (the batch's traceparent).
            with _tracer.start_as_current_span("drafter.propose", context=context_from_traceparent(batch.traceparent),
                                               kind=trace.SpanKind.SERVER) as span:
                t0 = time.perf_counter_ns()
                released = self.keys.pop(batch.client_id, batch.release)
                requests, answered, unknown = self._requests(batch, released)
                self.batch_waiting.set()
                proposals = await self._call(self._propose, requests, released)
                if self.pipelined:  # while the verifier verifies these drafts (never awaited)
                    loop.run_in_executor(self.worker, self._predraft)
                by_entry = dict(zip(answered, proposals))
                out = drafter_pb2.ProposalBatch(batch_id=batch.batch_id, propose_ns=time.perf_counter_ns() - t0)
                for i, entry in enumerate(batch.entries):
                    p = by_entry.get(i)
                    if p is None:  # beyond our limits (no drafts, no state) or unknown here (resync)
                        out.proposals.add(seq_id=entry.seq_id, resync=i in unknown)
                        continue
                    proposal_to_proto(out, entry.seq_id, p)
                num_drafts = sum(len(p.token_ids) for p in proposals)
                if self.metrics is not None:
                    self.metrics.observe_batch(len(batch.entries), num_drafts, (time.perf_counter_ns() - t0) / 1e9)
                    self.metrics.observe_state(len(self.keys.touched), self.keys.total_tokens)
                if span.is_recording():
                    span.set_attributes({"specd.drafter": self.info.name, "specd.batch_size": len(batch.entries),
                                         "specd.spec.draft_tokens": num_drafts, "specd.released": len(released)})
            yield out

    def _requests(self, batch, released: list[int]) -> tuple[list[ProposeRequest], list[int], set[int]]:
        """The batch's entries within our limits (and their indices), and the indices of deltas on
        sequences unknown here (answered "resync" without a key: only a full history makes one).
        Sequences beyond the limits are forgotten; the least recently used go when we hold too much."""
        lim = self.limits
        requests, answered, unknown = [], [], set()
        for i, e in enumerate(batch.entries):
            too_long = e.num_tokens > lim.max_history_tokens or len(e.new_tokens) > e.num_tokens
            features = self._features(e)
            if too_long or features is False or len(requests) >= lim.max_sequences:
                released += self.keys.pop(batch.client_id, [e.seq_id])
            elif not e.full_history and (batch.client_id, e.seq_id) not in self.keys.internal:
                unknown.add(i)
            else:
                requests.append(self._request(batch.client_id, e, features))
                answered.append(i)
        released += self.keys.evict(lim.max_sequences, lim.max_total_tokens, keep={r.seq_id for r in requests})
        return requests, answered, unknown

    def _request(self, client: str, e: drafter_pb2.ProposeEntry, features=None) -> ProposeRequest:
        return propose_request_from_proto(e, self.keys.get(client, e.seq_id, e.num_tokens), min(e.k, self.limits.max_k),
                                          features)

    def _features(self, e: drafter_pb2.ProposeEntry):
        """The entry's hidden states (None when this drafter takes none), or False when they are
        missing or malformed: the rows must be one per new token that has a predicting state
        (one fewer for a full history), as wide as the layers this drafter declared."""
        width = len(self.info.feature_layers) * self.info.hidden_size
        if not width:
            return None
        rows = feature_rows(e)  # a ProposeEntry has the fields a ProposeRequest has
        if not e.HasField("features"):
            return False
        try:
            t = tensor_from_proto(e.features)
        except ValueError as err:
            log.warning("dropping a sequence with malformed features: %s", err)
            return False
        return t if tuple(t.shape) == (rows, width) else False

    async def _call(self, fn, *args):
        """fn(*args) where the proposer runs: its worker thread, or here for an inline one."""
        if self.inline:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.worker, fn, *args)

    def _propose(self, requests: list[ProposeRequest], released: list[int]):
        self.batch_waiting.clear()
        if released:
            self.proposer.release(released)
        proposals = self.proposer.propose(requests) if requests else []
        if self.metrics is not None and self.pipelined:
            self.metrics.observe_cache(sum(p.cached for p in proposals),
                                       sum(1 for r, p in zip(requests, proposals) if r.k > 0 and not p.cached))
        return proposals

    def _predraft(self) -> None:
        t0 = time.perf_counter()
        try:
            drafted = self.proposer.predraft(self.batch_waiting.is_set, in_time=True)
        except Exception:  # noqa: BLE001 — drafting ahead is an optimisation: a failure costs hits only
            log.exception("drafting ahead failed")
            return
        if self.metrics is not None and drafted:
            self.metrics.observe_predraft(drafted, time.perf_counter() - t0)

    async def expire_loop(self, period: float | None = None) -> None:
        """Release sequences no verifier touched for ttl seconds (their verifier went away)."""
        while True:
            await asyncio.sleep(period or max(1.0, self.ttl / 10))
            expired = self.keys.pop_expired(self.ttl)
            if expired:
                log.info("releasing %d sequences idle for over %.0f s", len(expired), self.ttl)
                await self._call(self.proposer.release, expired)
