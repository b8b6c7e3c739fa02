"""`specd up`'s metrics ports: each service's, picked before the children start so that they can be printed."""
from __future__ import annotations


def metrics_ports(args, num_drafters: int, num_replicas: int = 1) -> tuple[int, list[int]]:
    """The verifier's (replica 0's) and the drafters' metrics ports (0: off). --metrics-port N: N
    (replica i: N+i, replica_metrics_port), then the next ones for the drafters; by default each
    service's own rule (specd.rpc.metrics_port), where a port the OS would pick is picked here, so
    the ports can be printed."""
    if args.metrics_port is not None:
        n = args.metrics_port
        return n, [n + num_replicas + i if n else 0 for i in range(num_drafters)]
    return _derived_metrics_port(args.verifier_port), [_derived_metrics_port(args.drafter_port + i)
                                                       for i in range(num_drafters)]


def replica_metrics_port(args, first: int, i: int) -> int:
    """Replica i's metrics port, given replica 0's (from metrics_ports)."""
    if i == 0 or args.metrics_port is not None:
        return first + i if first else 0
    return _derived_metrics_port(args.verifier_port + i)


def _derived_metrics_port(grpc_port: int) -> int:
    from specd.rpc.metrics_port import default_metrics_port

    return default_metrics_port(grpc_port) or _free_port()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
