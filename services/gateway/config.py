"""The gateway's settings (from the command line) and what it learns from the verifier at startup."""
from __future__ import annotations

from dataclasses import dataclass, field

from specd.rpc.auth import Security

DEFAULT_MAX_BODY_BYTES = 4 << 20
ROUTINGS = ("prefix", "least-loaded")  # how a request without a session key picks its replica


@dataclass
class GatewayConfig:
    # host:port of the verifier's gRPC server; several (a list, or comma-separated): replicas;
    # dns:host:port: every address host resolves to, looked up again while serving
    verifier: str | list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # required on /v1/* when set
    admin_key: str | None = None  # required on /admin/*; without it /admin/* is disabled...
    open_admin: bool = False  # ...unless opened explicitly (no key: for a trusted network only)
    tokenizer: str | None = None  # directory; default: the verifier's model directory
    served_model_name: str | None = None  # default: the verifier's model name
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    verifier_wait_s: float = 60.0  # how long startup waits for the verifier to answer Info
    security: Security = field(default_factory=Security)  # the verifier hop: shared secret, TLS CA
    request_timeout_s: float = 600.0  # deadline of one generation (504 past it)
    verifier_timeout_s: float = 60.0  # longest silence of the verifier within a generation (503 past it)
    max_concurrent_requests: int = 1024  # generations in the gateway at once; more get 429
    verifier_retry_s: float = 15.0  # a request the verifier was lost under before its first token waits this
                                    # long for it to be back (then tried again), else 503
    routing: str = "prefix"  # without a session key: "prefix" (where its prompt's KV likely is) or "least-loaded"
    max_connections: int = 4096  # open HTTP connections; requests on more get 503 (bounded memory and descriptors)
    header_timeout_s: float = 10.0  # a connection's request headers complete within this, else it is closed
    body_timeout_s: float = 30.0  # a request's body all in within this of its headers, else 408

    verifiers: list[str] = field(init=False)  # the replicas, in order (derived from `verifier`)

    def __post_init__(self) -> None:
        given = [self.verifier] if isinstance(self.verifier, str) else list(self.verifier)
        self.verifiers = [a.strip() for v in given for a in v.split(",") if a.strip()]
        if not self.verifiers:
            raise ValueError(f"--verifier must be host:port, got {self.verifier!r}")
        for address in self.verifiers:
            host, _, port = address.removeprefix("dns:").rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"--verifier must be host:port or dns:host:port, got {address!r}")
        if len(set(self.verifiers)) != len(self.verifiers):
            raise ValueError(f"--verifier names a replica twice: {', '.join(self.verifiers)}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be between 0 and 65535, got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"--max-body-bytes must be >= 1, got {self.max_body_bytes}")
        if self.open_admin and self.admin_key:
            raise ValueError("--open-admin serves /admin/* without a key; it cannot be combined with --admin-key")
        for name in ("request_timeout_s", "verifier_timeout_s", "verifier_retry_s", "header_timeout_s",
                     "body_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name[:-2].replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_concurrent_requests < 1:
            raise ValueError(f"--max-concurrent-requests must be >= 1, got {self.max_concurrent_requests}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.verifier_wait_s <= 0:
            raise ValueError(f"--verifier-wait must be > 0 seconds, got {self.verifier_wait_s}")


@dataclass(frozen=True)
class ModelInfo:
    """The served model, from Verifier.Info (and --served-model-name)."""

    name: str  # what clients put in "model"
    path: str  # the verifier's --model (directory or hub id)
    max_model_len: int
    vocab_size: int
    vocab_hash: str = ""  # of its tokenizer; a replica whose Info says otherwise gets no requests
    exact: bool = False  # Info.exact: greedy output does not depend on batching or speculation
    dtype: str = ""  # Info.dtype: what the weights compute in
    quantization: str = ""  # Info.quantization: a GGUF file's types, served as they are ("" for float weights)
