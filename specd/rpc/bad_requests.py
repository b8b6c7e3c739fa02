"""What a caller's bad request gets from every specd gRPC service: a status that says so.

BadRequests, the last of a server's interceptors, wraps every method so that
- request bytes that are not the method's message are INVALID_ARGUMENT. grpc's own answer is
  UNKNOWN ("Unexpected DecodeError") and a traceback in the server's log: for a unary request
  before the servicer runs, for a streamed one where the servicer reads it. The method gets a
  deserializer that turns a DecodeError into an Undecodable value, checked before the servicer
  sees it (a unary request is refused before the call, a bad message in a request stream ends
  the call where the servicer reads it);
- status details are at most MAX_DETAILS_BYTES. They travel in a trailer and quote the caller's
  values (a name, an address, a request id); past 16 KB a client drops the trailer and reports
  RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead of the status sent,
  which a gateway answers as 429, retry later.
"""
from __future__ import annotations

import contextlib
import inspect

import grpc
from google.protobuf.message import DecodeError

MAX_DETAILS_BYTES = 1024  # UTF-8; percent-encoded on the wire, at most 3 KB: under grpc's 8 KB soft limit


def bounded(details: str) -> str:
    raw = details.encode("utf-8", "replace")
    if len(raw) <= MAX_DETAILS_BYTES:
        return details
    return raw[:MAX_DETAILS_BYTES].decode("utf-8", "ignore") + f"... ({len(raw)} bytes in all)"


class Undecodable:
    def __init__(self, error: DecodeError):
        self.message = f"the request is not a valid protobuf message of its type: {error}"


class BadRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        behavior = next(b for b in (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                                    handler.stream_stream) if b is not None)
        if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
            return handler  # a synchronous servicer: grpc.aio runs it differently; none here
        slot = ("stream_" if handler.request_streaming else "unary_") + (
            "stream" if handler.response_streaming else "unary")
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer),
                                **{slot: _guard(behavior, handler.request_streaming)})


class _Context:
    """The servicer's context, its status details bounded."""

    def __init__(self, context):
        self._context = context

    def __getattr__(self, name):
        return getattr(self._context, name)

    async def abort(self, code, details: str = "", trailing_metadata=()):
        await self._context.abort(code, bounded(details), trailing_metadata)

    def set_details(self, details: str) -> None:
        self._context.set_details(bounded(details))


def _lenient(parse):
    def deserialize(raw: bytes):
        try:
            return parse(raw)
        except DecodeError as e:
            return Undecodable(e)

    return deserialize


async def _checked(requests, context):
    async for request in requests:
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _guard(behavior, request_streaming: bool):
    async def check(request, context):
        if request_streaming:
            return _checked(request, context)
        if isinstance(request, Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            # closed with this generator (the client gone), as grpc closes the servicer's own
            async with contextlib.aclosing(behavior(await check(request, context), _Context(context))) as responses:
                async for response in responses:
                    yield response

        return stream

    async def call(request, context):
        return await behavior(await check(request, context), _Context(context))

    return call
