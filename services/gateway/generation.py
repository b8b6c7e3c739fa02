"""One Verifier.Generate call turned into detokenized, stop-checked steps."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from specd.models.detokenizer import IncrementalDetokenizer, StopStrings
from specd.sampling import SamplingParams
from specd.rpc.telemetry import inject_metadata
from specd.models.tokenizer import Tokenizer
from specd.v1 import verifier_pb2
from specd.rpc.wire import params_to_proto, spec_to_dict

from .errors import APIError, from_grpc
from .metrics import GatewayMetrics
from .replicas import Replica, ReplicaSet, prefix_key

ABORT_TIMEOUT_S = 5.0
RETRIES = 2  # more attempts for a request the verifier was lost under before its first token
# before its first token, a call refused or lost with these moves to another replica (one not tried yet)
_MOVABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
log = logging.getLogger("specd.gateway")


@dataclass
class Step:
    """What one GenerateChunk adds to the response."""

    text: str  # may be "" (held back: partial character or possible stop string)
    token_ids: list[int]
    logprobs: list[float] | None  # one per token id, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None  # per token id, the most likely first, when asked for
    text_offsets: list[int]  # where each token's text starts in the completion text
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    spec: dict | None  # the choice's speculation totals: on its last step (None before it)
    replica: int = 0  # the verifier replica that generated it
    index: int = 0  # which of the request's n choices
    done: bool = False  # the request's last step: every choice has finished


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    drafter: str
    stop: list[str]
    arrival: float  # time.perf_counter() when the HTTP request arrived (latency metrics)
    deadline_s: float | None = None  # the whole Generate call (gRPC deadline: 504 past it)
    silence_s: float | None = None  # longest wait for the verifier's next chunk (503 past it: stalled)
    retry_s: float = 15.0  # how long a retry waits for a lost verifier to be back (503 past it)
    affinity: str | None = None  # session key: the same key goes to the same (healthy) replica
    keep_token_ids: frozenset[int] = frozenset()  # special tokens decoded as text all the same (tool markers)


async def generate(replicas: ReplicaSet, tokenizer: Tokenizer, job: Job,
                   metrics: GatewayMetrics) -> AsyncIterator[Step]:
    """Yields one Step per chunk; the last has finish_reason set. gRPC errors become APIErrors.

    Closing or cancelling this generator (client gone) cancels the call, and the
    verifier aborts the sequence when its stream is cancelled.
    """
    n = job.params.n  # each choice its own detokenizer and stop strings; the call ends when all are done
    detoks = [IncrementalDetokenizer(tokenizer, job.prompt_ids, keep=job.keep_token_ids) for _ in range(n)]
    stops = [StopStrings(job.stop) for _ in range(n)]
    span = trace.get_current_span()  # the gateway's request span: its context travels in the metadata
    timer = metrics.track(job.arrival)
    completed, finished = False, set()
    try:
        async with contextlib.aclosing(_chunks(replicas, job, metrics)) as chunks:
            async for chunk in chunks:
                i = chunk.index
                if not 0 <= i < n:
                    raise APIError(502, f"the verifier sent choice {i} of a request for {n}")
                if i in finished:  # cut by a stop string here while the verifier ran on: nothing more of it
                    continue
                detok = detoks[i]
                if chunk.token_ids:
                    timer.tokens()
                offsets, text = [], ""
                for token_id in chunk.token_ids:
                    offsets.append(len(detok.text))
                    text += detok.add(token_id)
                finish = chunk.finish_reason or None
                if finish:
                    text += detok.flush()
                text, stopped = stops[i].feed(text, final=finish is not None)
                if stopped and not finish:
                    # (a verifier applies stop strings itself; this is for one that did not, and ends the
                    # call only where no other choice runs on)
                    if n == 1:
                        await _abort(chunks.replica.stub, chunks.request_id)
                    finish = "stop"
                elif stopped:
                    finish = "stop"
                if finish is not None:
                    finished.add(i)
                completed = len(finished) == n
                if completed and span.is_recording():
                    span.set_attributes({"gen_ai.usage.output_tokens": chunk.completion_tokens,
                                         "gen_ai.response.finish_reasons": [finish]})
                yield Step(text=text, token_ids=list(chunk.token_ids),
                           logprobs=list(chunk.logprobs) if job.params.want_logprobs else None,
                           top_logprobs=[list(zip(t.token_ids, t.logprobs)) for t in chunk.top_logprobs]
                           if job.params.num_top_logprobs else None,
                           text_offsets=offsets, finish_reason=finish, prompt_tokens=chunk.prompt_tokens,
                           completion_tokens=chunk.completion_tokens,
                           spec=spec_to_dict(chunk.spec) if chunk.HasField("spec") else None,
                           replica=chunks.replica.index, index=i, done=completed)
                if completed:
                    return
        raise APIError(502, "the verifier ended the stream without a finish reason")
    except grpc.aio.AioRpcError as e:
        raise from_grpc(e) from None
    except APIError:
        raise
    except Exception as e:  # a stream still ends with an error event, never cut without one
        log.exception("request %s failed", job.request_id)
        raise APIError(500, f"internal error: {type(e).__name__}") from e
    finally:
        timer.finish(completed)


class _chunks:
    """The Generate call's chunks, within the job's deadline and silence bound.

    A call refused or lost (UNAVAILABLE: the verifier down, restarting, connection broken;
    RESOURCE_EXHAUSTED: its queue full) before its first chunk is made again: the client has
    seen nothing, so nothing is repeated. It goes to a replica this request has not tried yet
    while there is one; once all are tried, a lost one is waited for (up to retry_s) to be back.
    Once a chunk arrived, a failure is the client's to see: tokens are never sent twice or skipped.
    """

    def __init__(self, replicas: ReplicaSet, job: Job, metrics: GatewayMetrics):
        self.replicas, self.job, self.metrics = replicas, job, metrics
        self.request_id = job.request_id
        self.replica: Replica | None = None
        self._call = None
        self._gen = self._run()

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()
        if self._call is not None:
            self._call.cancel()

    async def _run(self):
        job, loop = self.job, asyncio.get_running_loop()
        deadline = loop.time() + job.deadline_s if job.deadline_s else None
        request = verifier_pb2.GenerateRequest(prompt_token_ids=job.prompt_ids,
                                               params=params_to_proto(job.params, drafter=job.drafter))
        tried: set[int] = set()
        prefix = prefix_key(job.prompt_ids)
        attempts = RETRIES + len(self.replicas.replicas)  # one replica: RETRIES + 1, as before replicas
        for attempt in range(attempts):
            replica = self.replica = self.replicas.pick(job.affinity, exclude=tried, prefix=prefix)
            back = replica.index in tried  # every replica failed this request once: wait for this one to return
            tried.add(replica.index)
            # A fresh id per attempt: the verifier may not have noticed the last one's end yet.
            self.request_id = job.request_id if attempt == 0 else f"{job.request_id}-retry{attempt}"
            request.request_id = self.request_id
            remaining = None if deadline is None else max(0.001, deadline - loop.time())
            call = self._call = replica.stub.Generate(request, metadata=inject_metadata(), timeout=remaining,
                                                      wait_for_ready=back)
            label = replica.address
            self.metrics.replica_requests.labels(label).inc()
            self.metrics.replica_in_flight.labels(label).inc()
            replica.in_flight += 1
            replica.routed += 1
            received = False
            try:
                while True:
                    wait = job.silence_s if received or not back else min(job.silence_s or job.retry_s,
                                                                          job.retry_s)
                    try:
                        # (a timer per chunk, where wait_for would also make a task per chunk)
                        async with asyncio.timeout(wait):
                            chunk = await call.read()
                    except TimeoutError:
                        if back and not received:
                            raise APIError(503, f"verifier: UNAVAILABLE: lost, and not back within {wait:g} s; "
                                                "retry later", code="verifier_unavailable") from None
                        raise APIError(503, f"verifier: no reply for {wait:g} s (stalled or overloaded); "
                                            "retry later", code="verifier_stalled") from None
                    if chunk is grpc.aio.EOF:
                        return
                    received = True
                    yield chunk
            except grpc.aio.AioRpcError as e:
                code = e.code()
                if code == grpc.StatusCode.UNAVAILABLE:
                    # Mid-stream too: new requests go around it now, not after the next poll.
                    self.replicas.lost(replica, e.details() or code.name)
                last = attempt == attempts - 1
                if received or code not in _MOVABLE or last:
                    raise
                if code == grpc.StatusCode.RESOURCE_EXHAUSTED and len(tried) == len(self.replicas.replicas):
                    raise  # every replica's queue is full: the client's 429
                self.metrics.replica_failovers.labels(label).inc()
                log.warning("request %s: verifier %s %s before the first token (%s); trying again",
                            job.request_id, replica.address, code.name, e.details())
            finally:
                call.cancel()  # synchronous: this may run inside a cancelled scope
                replica.in_flight -= 1
                self.metrics.replica_in_flight.labels(label).dec()


async def _abort(stub, request_id: str) -> None:
    """A stop string ended the request here; the verifier stops generating for it at once."""
    try:
        await stub.Abort(verifier_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
    except grpc.aio.AioRpcError:
        pass  # the call cancel in generate() ends the sequence anyway
