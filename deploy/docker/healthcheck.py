"""Container healthcheck (deploy/Dockerfile and compose.yaml): exit 0 when the service answers.

    healthcheck.py grpc HOST:PORT [CA]   grpc.health.v1 Check of the overall service "" is SERVING
    healthcheck.py http URL [CA]         GET URL answers 200 (the gateway's /health asks the verifier)

With CA (a PEM bundle, compose.secure.yaml), gRPC goes over TLS and https URLs are checked
against it; HOST must then be a name in the certificate (127.0.0.1 is, from deploy/make-secrets.sh).
"""
import sys


def grpc_ok(address: str, ca: str | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if ca:
        with open(ca, "rb") as f:
            channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        channel = grpc.insecure_channel(address)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        except grpc.RpcError as e:
            print(f"{address}: {e.code().name}", file=sys.stderr)
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str, ca: str | None = None) -> bool:
    import ssl
    import urllib.request

    context = ssl.create_default_context(cafile=ca) if ca else None
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as reply:
            return reply.status == 200
    except OSError as e:
        print(f"{url}: {e}", file=sys.stderr)
        return False


if __name__ == "__main__":
    kind, target, ca = sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else None)
    sys.exit(0 if (grpc_ok if kind == "grpc" else http_ok)(target, ca) else 1)
