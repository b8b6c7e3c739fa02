"""The engine loop as an asyncio task: requests come and go on the event loop, every
step (schedule → propose → verify → accept) runs on one worker thread so the loop keeps
serving gRPC while the model computes.

The engine is touched from one place at a time: adds and aborts queue up and are applied
by the loop task between steps; the step itself runs alone on the worker thread.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from opentelemetry import trace

from specd.engine.llm_engine import LLMEngine
from specd.engine.sequence import SeqStatus, Sequence
from specd.sampling import SamplingParams
from specd.rpc.grpc_server import compute_thread
from specd.rpc.telemetry import tracer

log = logging.getLogger("specd.verifier.engine")
_tracer = tracer("specd.verifier")


@dataclass
class Delta:
    """What one step committed for one request (the gRPC layer turns it into a chunk)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: dict | None  # the request's speculation totals, on its last delta only (built per token otherwise)
    top_logprobs: list[tuple[list[int], list[float]]] = field(default_factory=list)  # per token, when asked
    index: int = 0  # which of the request's n choices


class EngineFailure(RuntimeError):
    pass


class Overloaded(RuntimeError):
    """The queue of requests not yet started is full: the caller should retry later (429)."""

    def __init__(self, message: str, retry_after_s: float):
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Admission:
    """Bounds on requests admitted but not started (no token yet): beyond them a request is
    refused at once instead of waiting minutes for its first token."""

    max_queued_requests: int = 256
    max_queued_tokens: int = 1 << 18  # prompt tokens of those requests

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    drafter: str | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    sent: int = 0
    arrival: float = field(default_factory=time.monotonic)
    last_emit: float | None = None
    span_context: trace.SpanContext | None = None  # its verifier.generate span, when traced
    index: int = 0  # which of the request's n choices; the other choices are forks
    forks: list["_Request"] = field(default_factory=list)


# A running request's tokens go out at most this often (its first token and its end at once).
# Why: every delta is a gRPC message, a gateway event and an SSE chunk the client parses (the
# official client took 0.8 ms of CPU per chunk on the 2-core Xeon, beside a 15 ms step sharing
# those cores); a chunk every step of a few ms is finer than anyone reads. 40 ms: 25 updates a
# second; at batch 1 on that Xeon the client's CPU per token halved (0.83 -> 0.39 ms).
STREAM_INTERVAL_S = 0.04


class AsyncEngine:
    def __init__(self, engine: LLMEngine, pool=None, metrics=None, admission: Admission | None = None,
                 worker: ThreadPoolExecutor | None = None, stream_interval_s: float = STREAM_INTERVAL_S):
        """worker: the compute_thread() the engine was loaded on (one is made where not given).
        stream_interval_s: a running request's new tokens wait for its next step's until this long
        has passed since its last delta (0: a delta every step)."""
        if stream_interval_s < 0:
            raise ValueError(f"--stream-interval-ms must be >= 0, got {stream_interval_s * 1e3:g}")
        self.stream_interval_s = stream_interval_s
        self.engine, self.pool, self.metrics = engine, pool, metrics
        self.admission = admission or Admission()
        self.requests: dict[str, _Request] = {}
        self._queued: dict[str, int] = {}  # request id -> prompt tokens, until its first token
        self._queued_tokens = 0
        self.step_started: float | None = None  # monotonic time the running step began
        self.last_step_s = 0.0
        self._to_add: list[_Request] = []
        self._to_abort: list[str] = []
        self._wake = asyncio.Event()
        self._worker = worker or compute_thread("engine")
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._worker.shutdown(wait=True, cancel_futures=True)

    # -- requests (event loop) ------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               drafter: str | None = None, span_context: trace.SpanContext | None = None) -> _Request:
        """Validate and queue a request; raises ValueError (a client error) right away."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.engine.check_prompt(prompt_token_ids)
        self.engine.check_params(params)
        if drafter:
            if self.pool is None:
                raise ValueError("this verifier has no drafter pool (it runs without speculation "
                                 "or with an in-process proposer)")
            self.pool.check_choice(drafter)
        self._admit(len(prompt_token_ids))
        req = _Request(request_id, list(prompt_token_ids), params, drafter, span_context=span_context)
        # Choices after the first: requests of their own (own queues, deltas, ends), whose sequences the
        # engine forks from the first's prompt; the first's id names them all in Abort.
        req.forks = [_Request(f"{request_id}/{i}", req.prompt_token_ids, params, drafter, span_context=span_context,
                              index=i) for i in range(1, params.n)]
        for r in (req, *req.forks):
            self.requests[r.request_id] = r
        self._queued[request_id] = len(prompt_token_ids)
        self._queued_tokens += len(prompt_token_ids)
        self._to_add.append(req)
        self._wake.set()
        return req

    def _admit(self, num_tokens: int) -> None:
        adm = self.admission
        if len(self._queued) >= adm.max_queued_requests:
            why = f"{len(self._queued)} requests are waiting to start (the limit is {adm.max_queued_requests})"
        elif self._queued and self._queued_tokens + num_tokens > adm.max_queued_tokens:
            why = (f"{self._queued_tokens} prompt tokens are waiting to start and this request adds {num_tokens} "
                   f"(the limit is {adm.max_queued_tokens})")
        else:
            return
        if self.metrics is not None:
            self.metrics.rejected.inc()
        # A rough hint: one step's time per queued request that the batch cannot take at once.
        behind = max(1, len(self._queued) - self.engine.config.max_num_seqs + len(self.engine.scheduler.running))
        raise Overloaded(f"the server is overloaded: {why}; retry later",
                         retry_after_s=min(60.0, max(1.0, behind * self.last_step_s)))

    def _started(self, request_id: str) -> None:
        tokens = self._queued.pop(request_id, None)
        if tokens is not None:
            self._queued_tokens -= tokens

    def load(self) -> tuple[int, int, int, int]:
        """(requests in, of which waiting for their first token, KV blocks used, KV blocks total):
        what Info reports to gateways routing across replicas. Read on the event loop while a
        step may run: plain ints and lengths, so at worst one step stale."""
        blocks = self.engine.block_manager
        total = blocks.num_total_blocks
        return len(self.requests), len(self._queued), total - blocks.num_free_blocks, total

    def stalled_for(self) -> float:
        """Seconds the running step has taken so far (0 between steps)."""
        started = self.step_started
        return 0.0 if started is None else time.monotonic() - started

    async def stream(self, req: _Request):
        """Deltas of one request until it finishes; leaving early (cancelled) aborts it."""
        try:
            while True:
                delta = await req.queue.get()
                if isinstance(delta, ValueError):  # the engine refused the request
                    raise delta
                if isinstance(delta, BaseException):
                    raise EngineFailure(f"engine step failed: {delta}")
                yield delta
                if delta.finish_reason:
                    return
        finally:
            if req.request_id in self.requests:
                self.abort(req.request_id)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self._started(request_id)  # it no longer waits, whatever happens next
        self._to_abort += [r.request_id for r in (req, *req.forks) if r.request_id in self.requests]
        self._wake.set()
        return True

    # -- the loop --------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._iteration()
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():
                    raise  # stop() cancelled us
                # a gRPC call cancelled under us (e.g. a drafter's channel closed): keep going
                log.warning("engine loop: an inner call was cancelled; continuing")
            except Exception as e:  # noqa: BLE001 — a bug must fail requests, not freeze the loop
                log.exception("engine loop iteration failed")
                self._fail_all(e)

    async def _iteration(self) -> None:
        """Apply queued adds/aborts, then one step (or sleep until there is work)."""
        loop = asyncio.get_running_loop()
        self._apply_pending()
        if not self.engine.has_unfinished():
            self._export_gauges()
            if self.pool is not None:
                self.pool.flush_releases()
            if not self._to_add and not self._to_abort:
                self._wake.clear()
                await self._wake.wait()
            return
        t0 = time.perf_counter()
        with self._step_span() as span:
            before = self._step_counts() if span.is_recording() else None
            self.step_started = time.monotonic()
            try:
                # The worker runs the step in a copy of this context, so the drafter pool's
                # propose (called from the step) sees the step span as its parent.
                finished = await loop.run_in_executor(self._worker, contextvars.copy_context().run, self.engine.step)
            except Exception as e:  # noqa: BLE001 — fail the requests in flight, keep serving
                log.exception("engine step failed")
                span.set_status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}")
                self._fail_all(e)
                return
            finally:
                self.last_step_s = time.monotonic() - self.step_started
                self.step_started = None
            if before is not None:
                after = self._step_counts()
                span.set_attributes({"specd.batch_size": len(self.engine.scheduler.running) + len(finished),
                                     **{k: after[k] - before[k] for k in after}})
        self._emit()
        if self.metrics is not None:
            self.metrics.step_seconds.observe(time.perf_counter() - t0)
            self.metrics.batch_size.observe(len(self.engine.scheduler.running) + len(finished))
            self._export_gauges()
            if self.engine.speculator is not None:
                self.metrics.export_spec(self.engine.speculator.stats_by_drafter)
            self.metrics.export_grammar(self.engine.timings)

    def _step_span(self):
        """The step serves many requests but a span has one parent: the oldest traced request in
        flight is the parent, and every traced request in flight gets a link (none when untraced)."""
        traced = [r.span_context for r in self.requests.values() if r.span_context is not None and r.seq is not None]
        if not traced:
            return _tracer.start_as_current_span("verifier.step")
        parent = trace.set_span_in_context(trace.NonRecordingSpan(traced[0]))
        return _tracer.start_as_current_span("verifier.step", context=parent,
                                             links=[trace.Link(c) for c in traced])

    def _step_counts(self) -> dict[str, int]:
        """Running totals whose difference over a step describes it (read only when traced)."""
        stats = list(self.engine.speculator.stats_by_drafter.values()) if self.engine.speculator else []
        return {"specd.step.tokens": self.engine.timings.forward_tokens,
                "specd.spec.drafts": sum(s.drafts for s in stats),
                "specd.spec.draft_tokens": sum(s.draft_tokens for s in stats),
                "specd.spec.accepted_tokens": sum(s.accepted_tokens for s in stats)}

    def _apply_pending(self) -> None:
        adds, self._to_add = self._to_add, []
        for req in adds:
            if req.request_id not in self.requests:
                continue  # aborted before it started
            try:
                seq_id = self.engine.add_request(req.prompt_token_ids, req.params)
            except Exception as e:  # noqa: BLE001 — refused (ValueError), or a fault of ours: this request alone
                if not isinstance(e, ValueError):  # fails (INTERNAL), and the requests in flight go on
                    log.exception("adding request %s failed", req.request_id)
                self._started(req.request_id)
                for r in (req, *req.forks):
                    self.requests.pop(r.request_id, None)
                    r.queue.put_nowait(e)
                continue
            req.seq = self.engine.sequences[seq_id]
            for fork, seq in zip(req.forks, req.seq.forks):
                fork.seq = seq
            for r in (req, *req.forks):
                if self.pool is not None:
                    self.pool.assign(r.seq.seq_id, req.drafter)
        aborts, self._to_abort = self._to_abort, []
        for request_id in aborts:
            req = self.requests.get(request_id)
            if req is None or req.seq is None:
                self.requests.pop(request_id, None)
                self._started(request_id)
                continue
            self.engine.abort(req.seq.seq_id)
            self._emit_one(req)

    def _emit(self) -> None:
        """After a step: each request's new tokens, unless its last delta is under stream_interval_s
        old and it runs on (then they go with a later step's; it has one while it is running)."""
        now = time.monotonic()
        for req in list(self.requests.values()):
            seq = req.seq
            if seq is None:
                continue
            if (req.sent and not seq.is_finished and seq.status == SeqStatus.RUNNING
                    and now - req.last_emit < self.stream_interval_s):
                continue
            self._emit_one(req)

    def _emit_one(self, req: _Request) -> None:
        seq = req.seq
        new = seq.output_token_ids[req.sent:]
        if not new and not seq.is_finished:
            return
        now = time.monotonic()
        if new or seq.is_finished:
            self._started(req.request_id)
        if self.metrics is not None and new:
            self.metrics.generation_tokens.inc(len(new))
            if req.sent == 0:
                self.metrics.ttft.observe(now - req.arrival)
                self.metrics.ttft_by_cache.labels("hit" if seq.num_cached_tokens else "miss").observe(now - req.arrival)
            elif req.last_emit is not None:
                self.metrics.itl.observe((now - req.last_emit) / len(new))
        end = len(seq.output_token_ids)
        logprobs = seq.output_logprobs[req.sent:end] if seq.params.want_logprobs else []
        top = seq.output_top_logprobs[req.sent:end] if seq.params.num_top_logprobs else []
        req.sent, req.last_emit = end, now
        reason = seq.finish_reason if seq.is_finished else None
        req.queue.put_nowait(Delta(list(new), list(logprobs), reason, len(seq.prompt_token_ids),
                                   end, seq.spec_stats.to_dict() if reason else None, top, req.index))
        if reason:
            self.requests.pop(req.request_id, None)
            if self.metrics is not None:
                self.metrics.requests.labels(reason).inc()
                self.metrics.prompt_tokens.inc(len(seq.prompt_token_ids))
                if seq.params.structured_outputs is not None:
                    self.metrics.structured_finished(seq.params.structured_outputs.kind, seq.spec_stats)
                self.metrics.e2e.observe(now - req.arrival)

    def _fail_all(self, error: BaseException) -> None:
        for req in list(self.requests.values()):
            if req.seq is not None and not req.seq.is_finished:
                try:
                    self.engine.abort(req.seq.seq_id)
                except Exception:  # noqa: BLE001 — every other request must still get its error
                    log.exception("aborting request %s after a failed step", req.request_id)
            req.queue.put_nowait(error)
            if self.metrics is not None:
                self.metrics.requests.labels("error").inc()
        self.requests.clear()
        self._queued.clear()
        self._queued_tokens = 0

    def _export_gauges(self) -> None:
        if self.metrics is None:
            return
        sched, blocks = self.engine.scheduler, self.engine.block_manager
        self.metrics.running.set(len(sched.running))
        self.metrics.waiting.set(len(sched.waiting))
        free = blocks.num_free_blocks
        self.metrics.kv_free.set(free)
        self.metrics.kv_used.set(blocks.num_total_blocks - free)
        self.metrics.export_prefix_cache(blocks)
