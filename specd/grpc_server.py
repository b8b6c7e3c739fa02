"""What every specd gRPC service shares: the aio server with the standard health and
reflection services, uvloop, and a clean stop on SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

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


def install_uvloop() -> None:
    try:
        import uvloop
    except ImportError:  # not on every platform; asyncio's loop works too
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve(add_services: Callable[[grpc.aio.Server], list[str]], host: str, port: int,
                on_ready: Callable[[], Awaitable[None]] | None = None, name: str = "specd") -> None:
    """Run until SIGINT/SIGTERM. add_services registers servicers and returns their full names."""
    server = grpc.aio.server(options=SERVER_OPTIONS)
    names = add_services(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
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
    log.info("%s listening on %s:%d", name, host, port)
    await stop.wait()
    log.info("%s stopping", name)
    for service in ("", *names):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=2.0)


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
