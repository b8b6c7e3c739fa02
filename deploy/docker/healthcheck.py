"""Container healthcheck (Dockerfiles and compose.yaml): exit 0 when the service answers.

    healthcheck.py grpc HOST:PORT   grpc.health.v1 Check of the overall service "" is SERVING
    healthcheck.py http URL         GET URL answers 200 (the gateway's /health asks the verifier)
"""
import sys


def grpc_ok(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}", file=sys.stderr)
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=3) as reply:
            return reply.status == 200
    except OSError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    kind, target = sys.argv[1], sys.argv[2]
    sys.exit(0 if (grpc_ok if kind == "grpc" else http_ok)(target) else 1)
