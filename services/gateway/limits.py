"""What holds the gateway under abuse below the routes: idle and slow connections, too many of
them, bodies that trickle in, and the file descriptors all of them take.

uvicorn times out a keep-alive connection only after a response: a connection that never sends a
request (or sends its headers a byte at a time) is kept forever, one file descriptor and one
protocol object each, a slowloris. GuardedProtocol (uvicorn's httptools protocol) closes one whose
request headers are not complete within --header-timeout of its first byte or of its opening, and
answers 503 with Retry-After to the requests of connections past --max-connections. BodyDeadline
answers 408 to a body not all there within --body-timeout of its headers. Every refusal is counted
in specd_gateway_rejected_total by reason.
"""
from __future__ import annotations

import asyncio
import logging
import resource

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .errors import APIError
from .metrics import GatewayMetrics

FD_RESERVE = 256  # descriptors beside the HTTP connections: gRPC channels, logs, the tokenizer's files
log = logging.getLogger("specd.gateway")


def guarded_protocol(header_timeout_s: float, max_connections: int, metrics: GatewayMetrics) -> type:
    """uvicorn's HTTP protocol (pass as uvicorn.Config(http=...)) with the limits above."""

    async def too_many(scope, receive, send) -> None:
        metrics.rejected.labels("too_many_connections").inc()
        error = APIError(503, f"the gateway holds more than {max_connections} connections; retry later",
                         code="too_many_connections", headers={"Connection": "close"})
        await error.response()(scope, receive, send)

    class GuardedProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            metrics.connections.inc()
            if len(self.connections) > max_connections:
                self.app = too_many  # answered once its headers are in (or closed if they never are)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            metrics.connections.dec()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._header_timer is None:  # a keep-alive connection's next request: its headers in time too
                self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            # No request to answer (its headers are not in): the connection is closed, as nginx's
            # client_header_timeout closes it.
            self._header_timer = None
            if not self.transport.is_closing():
                metrics.rejected.labels("header_timeout").inc()
                self.transport.close()

    return GuardedProtocol


class BodyDeadline:
    """408 (and the connection closed) for a request whose body is not all in within `timeout_s`
    of its headers: a body trickled in keeps a request slot and its buffer for as long as it lasts."""

    def __init__(self, app, timeout_s: float):
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        body_done = False

        async def receive_in_time():
            nonlocal body_done
            if body_done:  # after the body only the disconnect comes, whenever it does
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.timeout_s:g} s",
                               code="body_timeout") from None
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)


def raise_fd_limit(want: int) -> int:
    """The soft limit on open files raised toward `want` (as far as the hard limit allows); returns it.
    Each connection takes a descriptor; the usual soft limit of 1024 would refuse connections (EMFILE)
    well below --max-connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if new > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
    return soft


def connection_limit(max_connections: int) -> int:
    """--max-connections, lowered to what the open-file limit leaves room for (said once, at start)."""
    fds = raise_fd_limit(max_connections + FD_RESERVE)
    if fds != resource.RLIM_INFINITY and fds < max_connections + FD_RESERVE:
        fitted = max(1, fds - FD_RESERVE)
        log.warning("--max-connections %d lowered to %d: the open-file limit is %d (raise `ulimit -n`)",
                    max_connections, fitted, fds)
        return fitted
    return max_connections
