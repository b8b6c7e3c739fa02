"""Probe: exit 0 when the gRPC health service at ADDRESS says SERVING, over TLS.

    python grpc_health_tls.py HOST:PORT CA_FILE [SERVER_NAME]

Kubernetes' own gRPC probes speak plaintext only, so the TLS overlay runs this instead. The
health service needs no token; the certificate must name HOST (or SERVER_NAME).
"""
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

address, ca = sys.argv[1], sys.argv[2]
options = [("grpc.ssl_target_name_override", sys.argv[3])] if len(sys.argv) > 3 else []
with open(ca, "rb") as f:
    credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
with grpc.secure_channel(address, credentials, options=options) as channel:
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=4)
    except grpc.RpcError as e:
        sys.exit(f"{address}: {e.code().name}: {e.details()}")
sys.exit(0 if reply.status == health_pb2.HealthCheckResponse.SERVING else f"{address}: {reply.status}")
