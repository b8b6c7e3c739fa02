"""Authentication and TLS for the gRPC hops (gateway → verifier, verifier → drafters, admin).

One shared secret per stack (`--auth-token-file FILE` or $SPECD_AUTH_TOKEN; never a command-line
value, which `ps` shows). Callers send `authorization: Bearer <token>` metadata, where the token
is an HMAC of the secret for the service called ("verifier" or "drafter"): a drafter learns
only the drafter token from the verifier's calls, which opens no verifier RPC. The standard
health service stays open for probes; everything else, reflection included, needs the token.

A drafter proves it holds the secret itself (not just the drafter token) by answering the
verifier's random challenge in Info with an HMAC of it: only such drafters may be trusted with
their sparse q (docs/architecture.md, "Services": trust and bounds). TLS (server certificate and key; clients verify against a CA
file) is independent of the secret and can be combined with it.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import grpc

TOKEN_ENV = "SPECD_AUTH_TOKEN"
OPEN_METHODS_PREFIX = "/grpc.health.v1.Health/"
VERIFIER, DRAFTER = "verifier", "drafter"


@dataclass(frozen=True)
class Security:
    """What one process needs to serve and to call over gRPC."""

    secret: str | None = None  # None: no authentication
    tls_cert: str | None = None  # server certificate chain (PEM) and key: serve TLS
    tls_key: str | None = None
    tls_ca: str | None = None  # CA bundle (PEM) to verify the servers this process calls: call with TLS
    # The name the servers' certificates must carry, instead of the host called: drafters that
    # `specd drafters swap` starts are reached by container names no certificate can list ahead.
    tls_server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"--{name.replace('_', '-')}: no such file: {path}")

    def token(self, audience: str) -> str | None:
        return token(self.secret, audience) if self.secret else None


def generate_secret() -> str:
    return secrets.token_urlsafe(32)


def up_token_file(verifier_address: str) -> Path:
    """Where `specd up` leaves the secret it generated for the stack whose verifier listens at
    verifier_address (host:port), for `specd drafters` to find (one file per stack)."""
    from specd.cache import cache_root

    port = verifier_address.rpartition(":")[2]
    return cache_root() / "up" / f"verifier-{port}.token"


def write_secret(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")


def read_secret(path: str | None, fallback: Path | None = None) -> str | None:
    """The secret from a file (its first line), else $SPECD_AUTH_TOKEN, else the fallback file if
    it exists; None when there is none."""
    if not path and not os.environ.get(TOKEN_ENV) and fallback is not None and fallback.is_file():
        path = str(fallback)
    if path:
        try:
            text = Path(path).read_text().strip()
        except OSError as e:
            raise ValueError(f"--auth-token-file: cannot read {path}: {e.strerror}") from None
        if not text:
            raise ValueError(f"--auth-token-file: {path} is empty")
        return text.splitlines()[0].strip()
    return os.environ.get(TOKEN_ENV) or None


def token(secret: str, audience: str) -> str:
    return hmac.new(secret.encode(), f"specd/{audience}".encode(), hashlib.sha256).hexdigest()


def drafter_proof(secret: str, challenge: bytes) -> bytes:
    return hmac.new(secret.encode(), b"specd/drafter-proof/" + challenge, hashlib.sha256).digest()


def check_proof(secret: str, challenge: bytes, proof: bytes) -> bool:
    return bool(challenge) and hmac.compare_digest(drafter_proof(secret, challenge), proof)


def add_arguments(p, server: bool = True, client: bool = True) -> None:
    p.add_argument("--auth-token-file", default=None, metavar="FILE",
                   help=f"shared secret of the stack's gRPC hops (default: ${TOKEN_ENV}; neither: no auth)")
    if server:
        p.add_argument("--tls-cert", default=None, metavar="PEM", help="serve gRPC over TLS with this certificate")
        p.add_argument("--tls-key", default=None, metavar="PEM", help="the certificate's private key")
    if client:
        p.add_argument("--tls-ca", default=None, metavar="PEM",
                       help="call gRPC services over TLS, verifying them against this CA bundle")
        p.add_argument("--tls-server-name", default=None, metavar="NAME",
                       help="with --tls-ca: the name the services' certificates must carry (default: the host called)")


def from_args(args, fallback: Path | None = None) -> Security:
    return Security(secret=read_secret(getattr(args, "auth_token_file", None), fallback),
                    tls_cert=getattr(args, "tls_cert", None), tls_key=getattr(args, "tls_key", None),
                    tls_ca=getattr(args, "tls_ca", None), tls_server_name=getattr(args, "tls_server_name", None))


# ---- server side ---------------------------------------------------------------------------

class RequireToken(grpc.aio.ServerInterceptor):
    """Every call but health checks must carry `authorization: Bearer <token>`."""

    def __init__(self, expected_token: str):
        self.expected = f"Bearer {expected_token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS_PREFIX):
            return handler
        sent = next((v for k, v in (details.invocation_metadata or ()) if k == "authorization"), None)
        if isinstance(sent, str) and hmac.compare_digest(sent.encode(), self.expected):
            return handler
        return _denied(handler, "missing authorization metadata" if sent is None else "invalid token")


def _denied(handler, reason: str):
    async def deny(request_or_iterator, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"{reason}: this service needs `authorization: Bearer <token>` derived from the "
                            f"stack's shared secret ({TOKEN_ENV} or --auth-token-file)")

    kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return kind[(handler.request_streaming, handler.response_streaming)](
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)


def server_interceptors(security: Security, audience: str) -> list[grpc.aio.ServerInterceptor]:
    tok = security.token(audience)
    return [RequireToken(tok)] if tok else []


def server_credentials(security: Security) -> grpc.ServerCredentials | None:
    if security.tls_cert is None:
        return None
    return grpc.ssl_server_credentials([(Path(security.tls_key).read_bytes(), Path(security.tls_cert).read_bytes())])


# ---- client side ---------------------------------------------------------------------------

class _WithToken:
    """A multicallable that adds the token to each call's metadata."""

    def __init__(self, multicallable, pair: tuple[str, str]):
        self._multicallable, self._pair = multicallable, pair

    def __call__(self, *args, metadata=None, **kwargs):
        return self._multicallable(*args, metadata=(*(metadata or ()), self._pair), **kwargs)


class _TokenChannel:
    """A grpc.aio channel whose calls carry `authorization: Bearer <token>`. Added per call
    rather than by a client interceptor: grpc.aio routes every message of an intercepted stream
    through one more task, a cost paid per streamed token."""

    def __init__(self, channel: grpc.aio.Channel, tok: str):
        self._channel, self._pair = channel, ("authorization", f"Bearer {tok}")

    def unary_unary(self, *args, **kwargs):
        return _WithToken(self._channel.unary_unary(*args, **kwargs), self._pair)

    def unary_stream(self, *args, **kwargs):
        return _WithToken(self._channel.unary_stream(*args, **kwargs), self._pair)

    def stream_unary(self, *args, **kwargs):
        return _WithToken(self._channel.stream_unary(*args, **kwargs), self._pair)

    def stream_stream(self, *args, **kwargs):
        return _WithToken(self._channel.stream_stream(*args, **kwargs), self._pair)

    def __getattr__(self, name):  # close, channel_ready, get_state, ...
        return getattr(self._channel, name)

    async def __aenter__(self):
        await self._channel.__aenter__()
        return self

    async def __aexit__(self, *exc):
        return await self._channel.__aexit__(*exc)


class _SyncToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, tok: str):
        self.tok = tok

    def _details(self, d):
        return _CallDetails(d.method, d.timeout, [*(d.metadata or ()), ("authorization", f"Bearer {self.tok}")],
                            d.credentials, getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _CallDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression):
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def _channel_credentials(security: Security) -> grpc.ChannelCredentials | None:
    if security.tls_ca is None:
        return None
    return grpc.ssl_channel_credentials(root_certificates=Path(security.tls_ca).read_bytes())


def _tls_options(security: Security, options):
    if security.tls_ca is None or security.tls_server_name is None:
        return options
    return [*(options or ()), ("grpc.ssl_target_name_override", security.tls_server_name)]


def aio_channel(address: str, security: Security | None, audience: str, options=None) -> grpc.aio.Channel:
    """A grpc.aio channel to a service of `audience`, with TLS and the token as configured."""
    security = security or Security()
    options = _tls_options(security, options)
    creds = _channel_credentials(security)
    channel = (grpc.aio.secure_channel(address, creds, options=options) if creds is not None
               else grpc.aio.insecure_channel(address, options=options))
    tok = security.token(audience)
    return _TokenChannel(channel, tok) if tok else channel


def sync_channel(address: str, security: Security | None, audience: str, options=None) -> grpc.Channel:
    security = security or Security()
    options = _tls_options(security, options)
    creds = _channel_credentials(security)
    channel = (grpc.secure_channel(address, creds, options=options) if creds is not None
               else grpc.insecure_channel(address, options=options))
    tok = security.token(audience)
    return grpc.intercept_channel(channel, _SyncToken(tok)) if tok else channel
