"""`specd gateway`: the OpenAI-compatible HTTP front of a verifier.

Imported by the CLI to build its parser, so grpc, uvicorn and the app load inside run().
The gateway never imports torch: it is a light process.
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .config import DEFAULT_MAX_BODY_BYTES, GatewayConfig, ModelInfo

HELP = "serve the OpenAI HTTP API (chat/completions, SSE) in front of a verifier"
log = logging.getLogger("specd.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--verifier", required=True, help="host:port of the verifier's gRPC server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--admin-key", default=None, help="require `Authorization: Bearer KEY` on /admin/*")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the verifier's model)")
    parser.add_argument("--served-model-name", default=None, help="model name clients use (default: the verifier's)")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="largest request body accepted (413 above)")
    parser.add_argument("--verifier-wait", type=float, default=60.0,
                        help="seconds to wait at startup for the verifier to answer")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    import uvloop

    from specd.telemetry import setup_tracing

    config = GatewayConfig(verifier=args.verifier, host=args.host, port=args.port, api_key=args.api_key,
                           admin_key=args.admin_key, tokenizer=args.tokenizer,
                           served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
                           verifier_wait_s=args.verifier_wait)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    setup_tracing("specd-gateway")  # off unless OTEL_EXPORTER_OTLP_ENDPOINT (or SPECD_TRACE_FILE) is set
    # uvicorn.Server.serve() on a uvloop loop: the startup Info call and the app share that loop.
    return uvloop.run(_serve(config, args.log_level))


async def _serve(config: GatewayConfig, log_level: str) -> int:
    import uvicorn

    from .app import build_app

    info = await wait_for_info(config.verifier, config.verifier_wait_s)
    tokenizer = load_tokenizer(config.tokenizer or info.model, info.vocab_hash)
    model = ModelInfo(name=config.served_model_name or info.model_name, path=info.model,
                      max_model_len=info.max_model_len, vocab_size=info.vocab_size)
    log.info("serving %s (max_model_len %d) from the verifier at %s", model.name, model.max_model_len, config.verifier)
    server = uvicorn.Server(uvicorn.Config(build_app(config, model, tokenizer), host=config.host, port=config.port,
                                           log_level=log_level, timeout_graceful_shutdown=5))
    await server.serve()
    return 0


async def wait_for_info(address: str, wait_s: float):
    """Verifier.Info, retried until it answers or wait_s passes (the verifier may still be loading)."""
    import asyncio

    import grpc

    from specd.v1 import verifier_pb2, verifier_pb2_grpc

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        while True:
            try:
                return await stub.Info(verifier_pb2.InfoRequest(), wait_for_ready=True,
                                       timeout=max(0.1, deadline - loop.time()))
            except grpc.aio.AioRpcError as e:
                if loop.time() >= deadline:
                    raise RuntimeError(f"the verifier at {address} did not answer within {wait_s:g} s "
                                       f"({e.code().name}: {e.details()})") from None
                await asyncio.sleep(0.5)


def load_tokenizer(source: str, vocab_hash: str):
    from specd.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(Path(source)) if Path(source).is_dir() else None
    if tokenizer is None:
        raise RuntimeError(f"no tokenizer.json in {source!r}: pass --tokenizer DIR (a local model directory)")
    # Different token<->id tables would make every prompt and every output silently wrong.
    if vocab_hash and tokenizer.vocab_hash() != vocab_hash:
        raise RuntimeError(f"the tokenizer in {source} does not match the verifier's model "
                           f"(vocab hash {tokenizer.vocab_hash()[:12]} != {vocab_hash[:12]})")
    return tokenizer
