"""Where the gRPC services (verifier, drafters) serve Prometheus /metrics.

The rule: --metrics-port defaults to the service's own gRPC port + 1000, so services on one
host that differ in gRPC port differ in metrics port too (two drafters, two `specd up`
stacks); where that passes 65535 (or the gRPC port is 0) the OS picks a free port. The URL
is logged at start. --metrics-port N takes N, 0 turns metrics off. A port that cannot be
bound stops the service at start with one line naming the port and the flag.

Light on imports: the CLI builds every subcommand's parser on each run.
"""
from __future__ import annotations

import logging
from typing import Callable

METRICS_PORT_OFFSET = 1000

log = logging.getLogger("specd.metrics")


def add_metrics_port_argument(p) -> None:
    """The --metrics-port flag, one help text for every gRPC service."""
    p.add_argument("--metrics-port", type=int, default=None,
                   help=f"Prometheus /metrics port (default: --port + {METRICS_PORT_OFFSET}, or a free one the OS "
                        "picks where that passes 65535; 0: off)")


def default_metrics_port(grpc_port: int) -> int:
    """grpc_port + METRICS_PORT_OFFSET; 0 (the OS picks) where that passes 65535 or grpc_port is 0."""
    port = grpc_port + METRICS_PORT_OFFSET
    return port if grpc_port > 0 and port <= 65535 else 0


def start_metrics(serve: Callable[[int, str], int], flag_value: int | None, grpc_port: int, host: str,
                  service: str) -> str | None:
    """Start a service's /metrics with serve(port, host) -> the port bound (its metrics class's
    start_http_server). flag_value: --metrics-port as given (None: the default; 0: off).
    Returns the URL, which is logged, or None when off. A port that cannot be bound raises
    RuntimeError, one line, for the CLI to print."""
    if flag_value == 0:
        log.info("%s metrics off (--metrics-port 0)", service)
        return None
    if flag_value is not None and not 0 < flag_value <= 65535:
        raise ValueError(f"--metrics-port must be in [0, 65535], got {flag_value}")
    port = flag_value if flag_value is not None else default_metrics_port(grpc_port)
    try:
        bound = serve(port, host)
    except OSError as e:
        why = f"--metrics-port {port}" if flag_value is not None else \
            f"--metrics-port defaults to --port {grpc_port} + {METRICS_PORT_OFFSET}"
        raise RuntimeError(f"cannot serve metrics on {host}:{port} ({why}): {e.strerror or e}; pass a free port "
                           "with --metrics-port N, or --metrics-port 0 to turn metrics off") from None
    url = f"http://{host}:{bound}/metrics"
    log.info("%s metrics at %s", service, url)
    return url
