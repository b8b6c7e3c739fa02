"""`specd gateway`: the OpenAI-compatible HTTP front of a verifier.

Imported by the CLI to build its parser, so grpc, uvicorn and the app load inside run().
The gateway never imports torch: it is a light process.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specd.rpc import auth
from specd.rpc.heap import freeze_startup_heap

from .config import DEFAULT_MAX_BODY_BYTES, ROUTINGS, GatewayConfig, ModelInfo

HELP = "serve the OpenAI HTTP API (chat/completions, SSE) in front of a verifier"
log = logging.getLogger("specd.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", required=True, action="append", metavar="HOST:PORT",
                        help="the verifier's gRPC server; several replicas: repeat it or separate by commas "
                             "(requests go by session: X-Session-Id header or `user`, else see --routing); "
                             "dns:HOST:PORT: a replica per address HOST resolves to, looked up every 2 s "
                             "(compose --scale, a headless Service)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--admin-key", default=None,
                        help="enable /admin/* behind `Authorization: Bearer KEY` (without it /admin/* answers 403)")
    parser.add_argument("--open-admin", action="store_true",
                        help="enable /admin/* without a key (a trusted network only)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the verifier's model "
                        "directory, else the tokenizer the verifier loaded, e.g. from a .gguf, over gRPC)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the verifier's)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--verifier-wait", type=float, default=60.0,
                        help="seconds to wait at startup for the verifier to answer")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="deadline of one generation in seconds (504 past it)")
    parser.add_argument("--verifier-timeout", type=float, default=60.0,
                        help="longest the verifier may stay silent within a generation (503 past it: stalled)")
    parser.add_argument("--verifier-retry", type=float, default=15.0,
                        help="seconds a request that lost the verifier before its first token waits for it to be "
                             "back, to be sent again (503 past it)")
    parser.add_argument("--max-concurrent-requests", type=int, default=1024,
                        help="generations handled at once; more are answered 429 with Retry-After")
    parser.add_argument("--max-connections", type=int, default=4096,
                        help="open HTTP connections; requests on more are answered 503 with Retry-After (the "
                             "open-file limit is raised to fit, or this lowered to it)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a connection has to send its request headers (from its opening or the "
                             "request's first byte); then it is closed (slowloris)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a request has to send its whole body after its headers (408 past it)")
    parser.add_argument("--routing", default="prefix", choices=ROUTINGS,
                        help="replicas for requests without a session: prefix (the replica likely to hold the "
                             "prompt's first 512 tokens' KV, unless it has over 4 requests more pending than the "
                             "least loaded) or least-loaded")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    auth.add_arguments(parser, server=False, client=True)  # the verifier hop: shared secret, --tls-ca
    parser.add_argument("--ssl-certfile", default=None, metavar="PEM", help="serve HTTPS with this certificate")
    parser.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")


def run(args: argparse.Namespace) -> int:
    import uvloop

    from specd.rpc.telemetry import setup_tracing

    if (args.ssl_certfile is None) != (args.ssl_keyfile is None):
        raise ValueError("--ssl-certfile and --ssl-keyfile go together")
    config = GatewayConfig(verifier=args.verifier, host=args.host, port=args.port, api_key=args.api_key,
                           admin_key=args.admin_key, open_admin=args.open_admin, tokenizer=args.tokenizer,
                           served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                           verifier_wait_s=args.verifier_wait, security=auth.from_args(args),
                           request_timeout_s=args.request_timeout, verifier_timeout_s=args.verifier_timeout,
                           max_concurrent_requests=args.max_concurrent_requests,
                           verifier_retry_s=args.verifier_retry, routing=args.routing,
                           max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                           body_timeout_s=args.body_timeout)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("specd-gateway")  # off unless OTEL_EXPORTER_OTLP_ENDPOINT (or SPECD_TRACE_FILE) is set
    # uvicorn.Server.serve() on a uvloop loop: the startup Info call and the app share that loop.
    return uvloop.run(_serve(config, args.log_level, args.ssl_certfile, args.ssl_keyfile))


async def _serve(config: GatewayConfig, log_level: str, ssl_certfile: str | None = None,
                 ssl_keyfile: str | None = None) -> int:
    import uvicorn

    from .app import build_app
    from .limits import connection_limit, guarded_protocol

    info, address = await wait_for_any_info(config.verifiers, config.verifier_wait_s, config.security)
    local = config.tokenizer or info.model
    if config.tokenizer or (Path(local) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(local, info.vocab_hash)
    else:  # a .gguf target or a hub id: the verifier has the tokenizer it loaded
        tokenizer = await tokenizer_from_verifier(address, config.security, info.vocab_hash)
    model = ModelInfo(name=config.served_model_name or info.model_name, path=info.model,
                      max_model_len=info.max_model_len, vocab_size=info.vocab_size, vocab_hash=info.vocab_hash,
                      exact=info.exact, dtype=info.dtype, quantization=info.quantization)
    log.info("serving %s (max_model_len %d) from the verifier at %s", model.name, model.max_model_len,
             ", ".join(config.verifiers))
    # Idle keep-alive connections live 75 s (nginx's default), not uvicorn's 5: a client's pool that
    # pauses between bursts (a batch of requests, then the next) otherwise reuses connections the
    # server is closing that very moment ("Server disconnected without sending a response").
    app = build_app(config, model, tokenizer)
    protocol = guarded_protocol(config.header_timeout_s, connection_limit(config.max_connections), app.state.metrics)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, http=protocol,
                                           log_level=log_level, timeout_graceful_shutdown=5, timeout_keep_alive=75,
                                           ssl_certfile=ssl_certfile, ssl_keyfile=ssl_keyfile))
    freeze_startup_heap("gateway")
    await server.serve()
    return 0


async def wait_for_any_info(addresses: list[str], wait_s: float, security=None):
    """(Info, address) of the first replica to answer: the gateway serves as soon as one does (the
    others are polled, and get requests once they serve the same vocabulary)."""
    import asyncio

    tasks = [asyncio.ensure_future(_wait_for_info_at(a, wait_s, security)) for a in addresses]
    try:
        errors = []
        for next_done in asyncio.as_completed(tasks):
            try:
                return await next_done
            except RuntimeError as e:
                errors.append(str(e))
        raise RuntimeError("; ".join(errors))
    finally:
        for task in tasks:
            task.cancel()


async def _wait_for_info_at(address: str, wait_s: float, security=None):
    """wait_for_info; for dns:HOST:PORT, at the first address HOST resolves to (once it does)."""
    import asyncio
    import dataclasses
    import socket

    from .replicas import resolve, split_dns

    name = split_dns(address)
    if name is None:
        return await wait_for_info(address, wait_s, security), address
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            found = await resolve(*name)
            break
        except (socket.gaierror, OSError) as e:
            if loop.time() >= deadline:
                raise RuntimeError(f"{address} did not resolve within {wait_s:g} s: {e}") from None
            await asyncio.sleep(0.5)
    if security is not None and security.tls_ca and not security.tls_server_name:
        security = dataclasses.replace(security, tls_server_name=name[0])
    return await wait_for_info(found[0], max(0.1, deadline - loop.time()), security), found[0]


async def wait_for_info(address: str, wait_s: float, security=None):
    """Verifier.Info, retried until it answers or wait_s passes (the verifier may still be loading)."""
    import asyncio

    import grpc

    from specd.v1 import verifier_pb2, verifier_pb2_grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with auth.aio_channel(address, security, auth.VERIFIER) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        while True:
            try:
                return await stub.Info(verifier_pb2.InfoRequest(), wait_for_ready=True,
                                       timeout=max(0.1, deadline - loop.time()))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise RuntimeError(f"the verifier at {address} refused our credentials: {e.details()}") from None
                if loop.time() >= deadline:
                    raise RuntimeError(f"the verifier at {address} did not answer within {wait_s:g} s "
                                       f"({e.code().name}: {e.details()})") from None
                await asyncio.sleep(0.5)


async def tokenizer_from_verifier(address: str, security, vocab_hash: str):
    """The verifier's own tokenizer files (Verifier.GetTokenizer, streamed in chunks), loaded from a
    temporary directory."""
    import tempfile

    import grpc

    from specd.rpc.wire import tokenizer_files
    from specd.v1 import verifier_pb2, verifier_pb2_grpc

    async with auth.aio_channel(address, security, auth.VERIFIER) as channel:
        try:
            call = verifier_pb2_grpc.VerifierStub(channel).GetTokenizer(verifier_pb2.GetTokenizerRequest(), timeout=120)
            files, _ = tokenizer_files([chunk async for chunk in call])
        except grpc.aio.AioRpcError as e:
            raise RuntimeError(f"the verifier at {address} gave no tokenizer ({e.code().name}: {e.details()}); "
                               "pass --tokenizer DIR (a local model directory)") from None
        except ValueError as e:
            raise RuntimeError(f"the verifier at {address} sent a broken tokenizer: {e}") from None
    with tempfile.TemporaryDirectory(prefix="specd-tokenizer-") as tmp:
        for name, data in files.items():
            if "/" in name or name.startswith(".") or not name:  # file names only, never a path out of tmp
                raise RuntimeError(f"the verifier at {address} sent a tokenizer file named {name!r}")
            (Path(tmp) / name).write_bytes(data)
        return load_tokenizer(tmp, vocab_hash, f"the tokenizer of the verifier at {address}")


def load_tokenizer(source: str, vocab_hash: str, what: str | None = None):
    from specd.models.tokenizer import Tokenizer

    what = what or f"the tokenizer in {source}"
    tokenizer = Tokenizer.from_dir(Path(source)) if Path(source).is_dir() else None
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer.json in {source!r}: pass --tokenizer DIR (a local model directory)")
    # Different token<->id tables would make every prompt and every output silently wrong.
    if vocab_hash and tokenizer.vocab_hash() != vocab_hash:
        raise RuntimeError(f"{what} does not match the verifier's model "
                           f"(vocab hash {tokenizer.vocab_hash()[:12]} != {vocab_hash[:12]})")
    return tokenizer
