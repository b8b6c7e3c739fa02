"""The wire the services share: conversions between the core's types and the gRPC messages
(wire), server helpers, auth and TLS, metrics ports and tracing. The stubs are specd/v1/."""
