"""What wraps the gateway's routes: the concurrency limit, request counts, a trace span per
generation request (ASGI middleware), and the API-key guards of the handlers."""
from __future__ import annotations

import hmac
from typing import Awaitable, Callable

from opentelemetry import trace
from starlette.requests import Request
from starlette.responses import Response

from specd.rpc.telemetry import tracer

from .errors import APIError, overloaded
from .metrics import GatewayMetrics

Handler = Callable[[Request], Awaitable[Response]]
TRACED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
TOKENIZE_PATHS = ("/tokenize", "/detokenize", "/v1/tokenize", "/v1/detokenize")  # vLLM's, and under /v1
_tracer = tracer("specd.gateway")


class LimitConcurrency:
    """At most `limit` generation (and tokenize) requests in the gateway at once (a streamed one
    counts until its last byte); the next are answered 429 with Retry-After before their body is read."""

    def __init__(self, app, limit: int, metrics: GatewayMetrics):
        self.app, self.limit, self.metrics, self.active = app, limit, metrics, 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS + TOKENIZE_PATHS:
            return await self.app(scope, receive, send)
        if self.active >= self.limit:
            self.metrics.rejected.labels("overloaded").inc()
            response = overloaded(f"the gateway is handling {self.active} requests (the limit is {self.limit}); "
                                  "retry later").response()
            return await response(scope, receive, send)
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


class CountRequests:
    """requests_total{endpoint,status}; endpoint is the route template, so ids never become labels."""

    def __init__(self, app, metrics: GatewayMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(route.path if route is not None else "other", str(status)).inc()


class TraceRequests:
    """One span per generation request, around its whole handling (an SSE body included);
    the handler and generate() add model, token counts and finish reason to it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            return await self.app(scope, receive, send)
        with _tracer.start_as_current_span(f"gateway {scope['path']}", kind=trace.SpanKind.SERVER) as span:
            async def send_and_note(message) -> None:
                if message["type"] == "http.response.start" and span.is_recording():
                    span.set_attribute("http.response.status_code", message["status"])
                    if message["status"] >= 500:
                        span.set_status(trace.StatusCode.ERROR)
                await send(message)

            await self.app(scope, receive, send_and_note)


def disabled(handler: Handler) -> Handler:
    async def refuse(request: Request) -> Response:
        raise APIError(403, "the admin API is disabled: start the gateway with --admin-key KEY (or --open-admin, "
                            "without a key, on a trusted network only)", code="admin_disabled")

    return refuse


def require_key(key: str | None, handler: Handler) -> Handler:
    if key is None:
        return handler
    expected = f"Bearer {key}".encode()

    async def guarded(request: Request) -> Response:
        if not hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            raise APIError(401, "missing or incorrect API key (expected an `Authorization: Bearer <key>` header)",
                           code="invalid_api_key")
        return await handler(request)

    return guarded
