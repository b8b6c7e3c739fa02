"""Whether `specd up`'s children serve yet: gRPC health, an HTTP 200, the drafters registered at a
verifier; wait_ready polls them (bench/ starts its stacks with these too)."""
from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specd.cli.up import Stack

READY_TIMEOUT_S = 600.0  # a first start builds the CPU kernels; a large GGUF loads for minutes


def grpc_serving(address: str, security=None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from specd.rpc import auth

    try:
        with auth.sync_channel(address, security, auth.VERIFIER) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def http_ok(url: str, ca: str | None = None, all_serving: bool = False) -> bool:
    """200 from url; with all_serving, a gateway's /health also says every replica serves
    ("ok", not "degraded"), and that call puts each in its routing at once."""
    import json
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=context) as reply:
            return reply.status == 200 and (not all_serving or json.loads(reply.read()).get("status") == "ok")
    except (OSError, ValueError):
        return False


def drafters_registered(address: str, names: list[str], security=None) -> bool:
    import grpc

    from specd.rpc import auth
    from specd.v1 import verifier_pb2, verifier_pb2_grpc

    try:
        with auth.sync_channel(address, security, auth.VERIFIER) as channel:
            reply = verifier_pb2_grpc.VerifierStub(channel).ListDrafters(verifier_pb2.ListDraftersRequest(),
                                                                         timeout=1.0)
    except grpc.RpcError:
        return False
    healthy = {d.name for d in reply.drafters if d.healthy}
    return all(n in healthy for n in names)


def wait_ready(stack: Stack, checks: list[tuple[str, callable]], stopping: threading.Event,
               timeout: float = READY_TIMEOUT_S) -> None:
    pending = list(checks)
    deadline = time.monotonic() + timeout
    while pending and not stopping.is_set():
        dead = stack.dead()
        if dead:
            raise RuntimeError("; ".join(f"{n} exited with code {c}" for n, c in dead) + " (its log is above)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {timeout:.0f} s: {', '.join(n for n, _ in pending)}")
        pending = [(n, check) for n, check in pending if not check()]
        if pending:
            time.sleep(0.25)
