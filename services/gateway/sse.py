"""How a generation reaches its client: chat and text completion chunks as server-sent events, and a
client's disconnect cancelling its Generate call."""
from __future__ import annotations

import asyncio
import contextlib
import json
from typing import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from .errors import APIError
from .generation import Step
from .responses import Formatter


class ClientGone(Exception):
    """The client disconnected before the response started; its Generate call was cancelled."""


async def cancel_on_disconnect(request: Request, awaitable: Awaitable):
    """Awaits `awaitable`; if the client disconnects first, cancels it and raises ClientGone."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # let its finally blocks (the gRPC cancel) run
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(steps: AsyncIterator[Step]) -> list[Step]:
    async with contextlib.aclosing(steps):
        return [step async for step in steps]


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()


async def completion_events(fmt: Formatter, first: Step, steps: AsyncIterator[Step],
                            include_usage: bool) -> AsyncIterator[bytes]:
    """A chat or text completion's SSE body: its chunks from `first` on, the usage chunk if asked, [DONE]."""
    async with contextlib.aclosing(steps):
        role = fmt.role_chunk()
        if role is not None:
            yield _event(role)
        step = first
        try:
            while True:
                chunk = fmt.chunk(step)
                if chunk is not None:
                    yield _event(chunk)
                if step.done:
                    break
                step = await anext(steps)
            if include_usage:
                yield _event(fmt.usage_chunk(step))
        except APIError as e:  # the status line is gone; the error travels as an event (as vLLM's)
            yield _event(e.body())
    yield b"data: [DONE]\n\n"


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # On disconnect the body generator may be left suspended at a yield; close it
            # now (not at garbage collection) so its Generate call is cancelled at once.
            await self.body_iterator.aclose()
