"""The gateway's ASGI app: OpenAI routes, auth, body limits, health, metrics, admin proxy."""
from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import AsyncIterator, Awaitable, Callable

from opentelemetry import trace
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from specd.models.tokenizer import Tokenizer

from . import admin, tools
from .config import GatewayConfig, ModelInfo
from .errors import SHED, APIError, bad_request
from .generation import Job, Step, generate
from .limits import BodyDeadline
from .metrics import CONTENT_TYPE, GatewayMetrics
from .middleware import TOKENIZE_PATHS, CountRequests, LimitConcurrency, TraceRequests, disabled, require_key
from .replicas import ReplicaSet
from .prompts import check_prompt_size, chat_prompt_ids, completion_prompt_ids, resolve_max_tokens
from .responses import Formatter
from .responses_output import ResponsesFormatter
from .responses_request import ResponsesRequest, responses_names
from .schemas import ChatCompletionRequest, CompletionRequest, read_json
from .sse import ClientGone, SSEResponse, cancel_on_disconnect, collect, completion_events
from .tokenization import DetokenizeRequest, TokenizeRequest

SESSION_HEADER = "x-session-id"  # session affinity: requests with one value go to one replica
REPLICA_HEADER = "x-specd-replica"  # in responses: the index of the replica that generated it


class Gateway:
    def __init__(self, config: GatewayConfig, model: ModelInfo, tokenizer: Tokenizer):
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.tool_format = tools.tool_format(tokenizer)  # how this model writes tool calls (None: it takes none)
        self.metrics = GatewayMetrics()
        self.created = int(time.time())
        self.replicas = ReplicaSet(config.verifiers, config.security, self.metrics, model.vocab_hash,
                                   config.routing)
        # Templates and tokenizers run here, off the event loop (a long prompt takes a while).
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.replicas.start()  # its channels belong to this, the serving, loop
        try:
            yield
        finally:
            await self.replicas.close()
            self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # ---- generation

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        arrival = time.perf_counter()
        body = await read_json(request, ChatCompletionRequest if chat else CompletionRequest, self.config.max_body_bytes)
        job = await self._job(request, body, chat, arrival)
        fmt = Formatter(chat=chat, request_id=job.request_id, model=self.model.name, tokenizer=self.tokenizer,
                        exact=self.model.exact, tool_names=body.tool_names if chat else None,
                        tool_format=self.tool_format, n=job.params.n)
        return await self._respond(request, job, bool(body.stream), fmt.response,
                                   partial(completion_events, fmt, include_usage=body.include_usage))

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, stateless: served as the chat completion it translates to."""
        arrival = time.perf_counter()
        body = await read_json(request, ResponsesRequest, self.config.max_body_bytes)
        chat = body.to_chat()
        with responses_names():
            job = await self._job(request, chat, True, arrival, id_prefix="resp_")
        fmt = ResponsesFormatter(request_id=job.request_id, model=self.model.name, echo=body.echo(),
                                 exact=self.model.exact, tool_names=chat.tool_names, tool_format=self.tool_format)
        return await self._respond(request, job, bool(body.stream), fmt.response, fmt.events)

    async def _job(self, request: Request, body, chat: bool, arrival: float, id_prefix: str = "") -> Job:
        """A parsed chat or completion body checked and its prompt tokenized, as the Generate call's
        Job; APIError (400, 404) naming the field."""
        if body.model is not None and body.model != self.model.name:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        body.check_supported()
        if chat:
            body.check_tools(self.tokenizer.chat_template, self.tool_format)
        prompt_ids = await self._prompt_ids(body, chat)
        max_tokens = resolve_max_tokens(len(prompt_ids), body.requested_max_tokens, self.model.max_model_len,
                                        prompt_param="messages" if chat else "prompt")
        request_id = f"{id_prefix or ('chatcmpl-' if chat else 'cmpl-')}{uuid.uuid4().hex}"
        span = trace.get_current_span()  # TraceRequests' span (the no-op span when tracing is off)
        if span.is_recording():
            span.set_attributes({"gen_ai.request.model": self.model.name, "specd.request_id": request_id,
                                 "gen_ai.usage.input_tokens": len(prompt_ids),
                                 "specd.stream": bool(body.stream)})
        params = body.sampling_params(max_tokens, self.tool_format)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = next((t for t in ids if t >= self.model.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{name} token ids must be in [0, {self.model.vocab_size}), got {bad}", param=name)
        job = Job(request_id=request_id, prompt_ids=prompt_ids, params=params,
                  drafter=body.speculative.drafter if body.speculative else "", stop=body.stop_strings,
                  arrival=arrival, deadline_s=self.config.request_timeout_s,
                  silence_s=self.config.verifier_timeout_s, retry_s=self.config.verifier_retry_s,
                  affinity=request.headers.get(SESSION_HEADER) or body.user,
                  keep_token_ids=self.tool_format.keep_token_ids if chat and body.tool_names else frozenset())
        return job

    async def _respond(self, request: Request, job: Job, stream: bool, whole: Callable[[list[Step]], dict],
                       events: Callable[[Step, AsyncIterator[Step]], AsyncIterator[bytes]]) -> Response:
        """The Generate call's steps as one JSON object (whole) or an SSE body (events)."""
        steps = generate(self.replicas, self.tokenizer, job, self.metrics)
        if not stream:
            collected = await cancel_on_disconnect(request, collect(steps))
            return JSONResponse(whole(collected), headers={REPLICA_HEADER: str(collected[-1].replica)})
        # Wait for the first chunk before answering, so errors the verifier reports at once
        # (bad argument, queue full, down) get their HTTP status instead of an in-stream event.
        first = await cancel_on_disconnect(request, anext(steps))  # on error the generator is already closed
        return SSEResponse(events(first, steps), headers={REPLICA_HEADER: str(first.replica)})

    async def _prompt_ids(self, body, chat: bool) -> list[int]:
        """Size first (a prompt certainly over the context is refused before any work), then the
        template and tokenizer on a worker thread: the event loop keeps serving meanwhile."""
        if chat:
            messages = tools.template_messages([m.to_template() for m in body.messages])
            texts = [m["content"] for m in messages] + [m.get("name") or "" for m in messages]
            check_prompt_size(self.tokenizer, texts, self.model.max_model_len, "messages")
            work = partial(chat_prompt_ids, self.tokenizer, messages, body.tools if body.tool_names else None)
        else:
            prompt = body.prompt
            if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
                texts = [prompt] if isinstance(prompt, str) else prompt
                check_prompt_size(self.tokenizer, texts, self.model.max_model_len, "prompt")
            elif isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                if sum(len(p) for p in prompt) > 4 * self.model.max_model_len:
                    raise bad_request(f"This model's maximum context length is {self.model.max_model_len} tokens; "
                                      "the prompt is far longer", param="prompt")
            work = partial(completion_prompt_ids, self.tokenizer, prompt, self.model.vocab_size)
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work)

    # ---- plain routes

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, TokenizeRequest, self.config.max_body_bytes)
        work = body.work(self.tokenizer, self.model, self.tool_format)
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work))

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, DetokenizeRequest, self.config.max_body_bytes)
        work = body.work(self.tokenizer, self.model)
        return JSONResponse(await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, work))

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model.name, "object": "model", "created": self.created, "owned_by": "specd",
            "root": self.model.path, "parent": None, "max_model_len": self.model.max_model_len,
            "exact": self.model.exact, "dtype": self.model.dtype,
            "quantization": self.model.quantization or None}]})

    async def health(self, request: Request) -> Response:
        """200 while a verifier replica's gRPC health says SERVING for its Verifier service (that
        turns NOT_SERVING when an engine step stalls, while the process still answers Info). Asked
        now, of every replica: one down is reported in `replicas` while another serves."""
        replicas = self.replicas.replicas
        single = len(replicas) == 1 and not self.replicas.names  # the single-verifier gateway's answers
        if not replicas:
            return APIError(503, f"verifier: no replica found at {', '.join(self.replicas.addresses)}").response()
        whys = [why or r.mismatch for r, why in zip(replicas, await asyncio.gather(*(r.check() for r in replicas)))]
        for r, why in zip(replicas, whys):
            self.replicas.checked(r, why)
        if all(whys):
            if single:
                return APIError(503, f"verifier: {whys[0]}").response()
            return APIError(503, "no verifier replica serves: " + "; ".join(
                f"{r.address}: {why}" for r, why in zip(replicas, whys))).response()
        if single:
            return JSONResponse({"status": "ok"})
        now = time.monotonic()
        return JSONResponse({"status": "degraded" if any(whys) else "ok", "replicas": [
            {"replica": r.index, "address": r.address, "healthy": not why,
             **({"error": why, "down_for_s": round(now - (r.down_since or now), 1)} if why else {}),
             "requests": r.load.num_requests, "waiting": r.load.num_waiting, "kv_use": round(r.kv_use(), 4)}
            for r, why in zip(replicas, whys)]})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)


def _api_error(metrics: GatewayMetrics) -> Callable[[Request, APIError], Awaitable[Response]]:
    async def answer(request: Request, exc: APIError) -> Response:
        response = exc.response()
        if exc.status in SHED:
            metrics.rejected.labels(exc.reason).inc()
        if exc.status in (408, 413):  # the rest of the body is never read: not worth the connection
            response.headers["Connection"] = "close"
        return response

    return answer


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return APIError(exc.status_code, exc.detail).response()  # unknown route (404), wrong method (405)


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=499)  # nginx's "client closed request"; nobody reads it, metrics do


async def _internal_error(request: Request, exc: Exception) -> Response:
    return APIError(500, f"internal error: {type(exc).__name__}").response()


def build_app(config: GatewayConfig, model: ModelInfo, tokenizer: Tokenizer) -> Starlette:
    gw = Gateway(config, model, tokenizer)
    api = config.api_key
    # Admin fails closed: no key means no admin API, unless --open-admin says otherwise.
    guard_admin = (lambda h: require_key(config.admin_key, h)) if config.admin_key or config.open_admin else disabled
    drafters = admin.DrafterAdmin(gw.replicas, config.max_body_bytes)
    routes = [
        Route("/v1/chat/completions", require_key(api, gw.chat_completions), methods=["POST"]),
        Route("/v1/completions", require_key(api, gw.completions), methods=["POST"]),
        Route("/v1/responses", require_key(api, gw.responses), methods=["POST"]),
        *[Route(path, require_key(api, gw.detokenize if "detok" in path else gw.tokenize), methods=["POST"])
          for path in TOKENIZE_PATHS],
        Route("/v1/models", require_key(api, gw.models), methods=["GET"]),
        Route("/health", gw.health, methods=["GET"]),
        Route("/metrics", gw.metrics_endpoint, methods=["GET"]),
        Route("/admin/drafters", guard_admin(drafters.list), methods=["GET"]),
        Route("/admin/drafters", guard_admin(drafters.register), methods=["POST"]),
        Route("/admin/drafters/{name}", guard_admin(drafters.remove), methods=["DELETE"]),
    ]
    app = Starlette(routes=routes, lifespan=gw.lifespan,
                    middleware=[Middleware(CountRequests, metrics=gw.metrics), Middleware(TraceRequests),
                                Middleware(LimitConcurrency, limit=config.max_concurrent_requests,
                                           metrics=gw.metrics),
                                Middleware(BodyDeadline, timeout_s=config.body_timeout_s)],
                    exception_handlers={APIError: _api_error(gw.metrics), HTTPException: _http_error,
                                        ClientGone: _client_gone, ClientDisconnect: _client_gone,
                                        Exception: _internal_error})
    app.state.metrics = gw.metrics  # for the HTTP protocol's limits (limits.guarded_protocol)
    return app
