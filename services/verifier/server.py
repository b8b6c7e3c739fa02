"""The Verifier gRPC service: Generate (server stream), Abort, Info and the drafter admin RPCs."""
from __future__ import annotations

import asyncio
import uuid

import grpc
from opentelemetry import trace

from specd.rpc.telemetry import extract_metadata, tracer
from specd.v1 import verifier_pb2, verifier_pb2_grpc
from specd.verifier.async_engine import AsyncEngine, EngineFailure, Overloaded
from specd.verifier.drafter_client import TrustUnavailable, VocabularyMismatch
from specd.models.tokenizer import TOKENIZER_FILES
from specd.rpc.wire import params_from_proto, tokenizer_chunks

_tracer = tracer("specd.verifier")


class VerifierService(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: AsyncEngine, info: verifier_pb2.InfoResponse):
        self.engine, self.info = engine, info

    async def Generate(self, request, context):
        # One span per request, child of the caller's (W3C trace context in the call's metadata);
        # the engine's step spans link to it.
        # The span is not made current: this async generator may be closed (client gone) from
        # another context, where detaching a current span's context fails noisily. Nothing
        # below needs it current (the engine gets its context explicitly).
        parent = extract_metadata(context.invocation_metadata())
        span = _tracer.start_span("verifier.generate", context=parent, kind=trace.SpanKind.SERVER)
        try:
            async for chunk in self._generate(request, context, span):
                yield chunk
        except Exception as e:
            span.set_status(trace.StatusCode.ERROR, f"{type(e).__name__}: {e}")
            raise
        finally:
            span.end()

    async def _generate(self, request, context, span):
        try:
            params = params_from_proto(request.params)
            req = self.engine.submit(request.request_id or uuid.uuid4().hex, list(request.prompt_token_ids),
                                     params, request.params.drafter or None,
                                     span_context=span.get_span_context() if span.is_recording() else None)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except Overloaded as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e),
                                trailing_metadata=(("retry-after", str(max(1, round(e.retry_after_s)))),))
        if span.is_recording():
            span.set_attributes({"specd.request_id": req.request_id,
                                 "gen_ai.usage.input_tokens": len(req.prompt_token_ids)})
        try:
            async for d in _merged([self.engine.stream(r) for r in (req, *req.forks)]):
                chunk = verifier_pb2.GenerateChunk(index=d.index, token_ids=d.token_ids, logprobs=d.logprobs,
                                                   top_logprobs=[verifier_pb2.TopLogprobs(token_ids=ids, logprobs=lps)
                                                                 for ids, lps in d.top_logprobs],
                                                   finish_reason=d.finish_reason or "",
                                                   prompt_tokens=d.prompt_tokens,
                                                   completion_tokens=d.completion_tokens)
                if d.spec is not None:  # the last chunk
                    chunk.spec.drafts = d.spec["drafts"]
                    chunk.spec.draft_tokens = d.spec["draft_tokens"]
                    chunk.spec.accepted_tokens = d.spec["accepted_tokens"]
                    chunk.spec.accepted_per_pos.extend(d.spec["accepted_per_pos"])
                    chunk.spec.drafts_by_drafter.update(d.spec["drafts_by_drafter"])
                if d.finish_reason and span.is_recording():
                    span.set_attributes({"gen_ai.usage.output_tokens": d.completion_tokens,
                                         "gen_ai.response.finish_reasons": [d.finish_reason],
                                         "specd.spec.drafts": d.spec["drafts"],
                                         "specd.spec.draft_tokens": d.spec["draft_tokens"],
                                         "specd.spec.accepted_tokens": d.spec["accepted_tokens"]})
                yield chunk
        except EngineFailure as e:
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except ValueError as e:  # rejected when the engine added it
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def Abort(self, request, context):
        return verifier_pb2.AbortResponse(found=self.engine.abort(request.request_id))

    async def Info(self, request, context):
        reply = verifier_pb2.InfoResponse()
        reply.CopyFrom(self.info)
        requests, waiting, kv_used, kv_total = self.engine.load()
        reply.load.num_requests, reply.load.num_waiting = requests, waiting
        reply.load.kv_blocks_used, reply.load.kv_blocks_total = kv_used, kv_total
        return reply

    async def GetTokenizer(self, request, context):
        model_dir = self.engine.engine.model_dir  # a .gguf target's converted directory
        files = {name: (model_dir / name).read_bytes() for name in TOKENIZER_FILES if (model_dir / name).is_file()}
        if "tokenizer.json" not in files:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"the model at {self.info.model} has no tokenizer.json")
        for chunk in tokenizer_chunks(files, self.info.vocab_hash):
            yield chunk

    # -- drafter administration -------------------------------------------------------
    def _pool(self):
        return self.engine.pool

    async def RegisterDrafter(self, request, context):
        pool = self._pool()
        if pool is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this verifier runs without a drafter pool (started with an in-process "
                                "speculative method or --no-speculation)")
        try:
            pool.check_address(request.address)
            await pool.register(request.name, request.address, trusted=request.trusted, persist=True)
        except PermissionError as e:  # an address not allowed, a trusted drafter without proof
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(e))
        except (VocabularyMismatch, TrustUnavailable) as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except KeyError as e:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, e.args[0])
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (grpc.aio.AioRpcError, asyncio.TimeoutError, TimeoutError, ConnectionError) as e:
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"cannot reach drafter {request.name!r} at {request.address}: {detail}")
        return verifier_pb2.RegisterDrafterResponse(drafter=self._status(request.name))

    async def RemoveDrafter(self, request, context):
        pool = self._pool()
        try:
            if pool is None:
                raise LookupError(f"no drafter named {request.name!r}")
            await pool.remove(request.name, drain=request.drain)
        except LookupError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except PermissionError as e:  # a local drafter: part of the verifier process
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        return verifier_pb2.RemoveDrafterResponse()

    async def ListDrafters(self, request, context):
        pool = self._pool()
        return verifier_pb2.ListDraftersResponse(drafters=pool.status(self._stats()) if pool else [])

    def _stats(self):
        speculator = self.engine.engine.speculator
        return dict(speculator.stats_by_drafter) if speculator is not None else {}

    def _status(self, name: str):
        return next(s for s in self._pool().status(self._stats()) if s.name == name)


async def _merged(streams: list):
    """The deltas of a request's n choices as they come, one stream (one choice: its own stream).
    Leaving early closes every choice's stream, which aborts it."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream):
        try:
            async for d in stream:
                await queue.put(d)
            await queue.put(None)
        except BaseException as e:  # noqa: BLE001 - the merged stream raises it
            await queue.put(e)
        finally:
            await stream.aclose()

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        open_streams = len(streams)
        while open_streams:
            d = await queue.get()
            if d is None:
                open_streams -= 1
            elif isinstance(d, BaseException):
                raise d
            else:
                yield d
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
