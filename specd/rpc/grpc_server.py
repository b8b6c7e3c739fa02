"""What every specd gRPC service shares: the aio server with the standard health and
reflection services, uvloop, a clean stop on SIGINT/SIGTERM, and the one thread a service's model
runs on."""
from __future__ import annotations

import asyncio
import logging
import signal
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specd.rpc.auth import Security, server_credentials, server_interceptors
from specd.rpc.bad_requests import BadRequests
from specd.rpc.heap import freeze_startup_heap

log = logging.getLogger("specd")

# Large enough for a full-history resync of a long sequence plus sparse q for a batch.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
SERVER_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                  ("grpc.so_reuseport", 0)]
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   # reconnect quickly after a peer restarts (default backoff grows to 2 min)
                   ("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 2000),
                   ("grpc.enable_http_proxy", 0)]


def compute_thread(name: str) -> ThreadPoolExecutor:
    """The one thread every call into a service's model runs on, loading included. OpenMP keeps a
    team of threads per thread that starts parallel work; once their threads outnumber the cores
    (a second team: the model loaded on one thread, run on another), libgomp stops spinning at its
    barriers and sleeps at each one: on a 2-core EPYC, 2 torch threads then decoded at 1 thread's
    speed (50 vs 90 tok/s, bf16)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # not on every platform; asyncio's loop works too
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(add_services: Callable[[grpc.aio.Server], list[str]], host: str, port: int,
                on_ready: Callable[[], Awaitable[None]] | None = None, name: str = "specd",
                security: Security | None = None, audience: str = "",
                on_health: Callable[[health.aio.HealthServicer, list[str]], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM. add_services registers servicers and returns their full names.
    security: the token callers must send (for `audience`) and TLS; on_health gets the health
    servicer once serving, for services that report more than "the process is up"."""
    security = security or Security()
    # BadRequests last: an unauthenticated call is refused (UNAUTHENTICATED) before its request is read
    server = grpc.aio.server(options=SERVER_OPTIONS,
                             interceptors=[*server_interceptors(security, audience), BadRequests()])
    names = add_services(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    creds = server_credentials(security)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    await server.start()
    for service in ("", *names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_ready is not None:
        await on_ready()
    for service in ("", *names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    if on_health is not None:
        on_health(health_servicer, ["", *names])
    freeze_startup_heap(name)
    log.info("%s listening on %s:%d%s%s", name, host, port, " (TLS)" if creds is not None else "",
             "" if security.secret else "; gRPC authentication off (no shared secret)")
    await stop.wait()
    log.info("%s stopping", name)
    for service in ("", *names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2.0)


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(UndeliveredStatus())


class UndeliveredStatus(logging.Filter):
    """grpc's aio server logs a traceback (ExecuteBatchError, as ERROR) when a handler ends after its
    caller has gone: the batch that sends the call's status fails. A cancelled stream (a client that
    disconnected, a gateway that dropped a finished request) is routine for a server, so that record
    becomes one INFO line; any other failure of grpc's core keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if type(error).__name__ != "ExecuteBatchError" or "SendStatusFromServerOperation" not in str(error):
            return True
        record.msg, record.args = "%s: the caller had gone before its status was sent", (record.getMessage(),)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)
