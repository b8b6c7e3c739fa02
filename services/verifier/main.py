"""`specd verifier`: the target model, its KV cache, the batch loop and the drafter pool, over gRPC."""
from __future__ import annotations

import argparse

from specd.rpc.kv_pages import add_lazy_kv_argument, take_kv_memory
from specd.rpc.threads import threads_arg

HELP = "run the verifier service (gRPC): target model, KV cache, batching, drafter pool"
DEFAULT_PORT = 50051


def _drafter_arg(value: str) -> tuple[str, str]:
    name, sep, address = value.partition("=")
    if not sep or not name or not address:
        raise argparse.ArgumentTypeError(f"expected NAME=HOST:PORT, got {value!r}")
    return name, address


def _local_drafter_arg(value: str) -> tuple[str, dict]:
    """METHOD[:JSON options] of an index drafter -> (method, options)."""
    import json

    method, _, rest = value.partition(":")
    if method not in ("suffix", "ngram"):
        raise argparse.ArgumentTypeError(f"a local drafter is an index drafter, suffix or ngram (model drafters run "
                                         f"as drafter services: --drafter), got {method!r}")
    try:
        options = json.loads(rest) if rest else {}
    except json.JSONDecodeError:
        options = None
    if not isinstance(options, dict):
        raise argparse.ArgumentTypeError(f"--local-drafter {method}: options after the colon are a JSON object "
                                         f"(e.g. {method}:{{\"num_speculative_tokens\": 8}}), got {rest!r}")
    return method, options


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specd.rpc import auth
    from specd.rpc.metrics_port import add_metrics_port_argument

    p.add_argument("--model", default=None, help="target model directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    add_metrics_port_argument(p)
    p.add_argument("--drafter", action="append", default=[], type=_drafter_arg, metavar="NAME=ADDR",
                   help="a drafter service to register at start (repeatable; more can be added at runtime); "
                        "its drafts are verified as one-hot")
    p.add_argument("--trusted-drafter", action="append", default=[], type=_drafter_arg, metavar="NAME=ADDR",
                   help="like --drafter, and its sparse q is used (sampled drafts accepted more often); needs the "
                        "shared secret here and at the drafter, which must prove it holds it")
    p.add_argument("--local-drafter", action="append", default=[], type=_local_drafter_arg, metavar="METHOD[:OPTIONS]",
                   help="an index drafter (suffix or ngram, OPTIONS its JSON keys) inside this process, named by its "
                        "method: asked every step before the plan, for tens of microseconds instead of a round trip")
    p.add_argument("--allow-drafter-address", action="append", default=None, metavar="HOST:PORT",
                   help="where RegisterDrafter may point (repeatable; globs per part, e.g. 'drafter-*:*'; '*': "
                        "anywhere). Default: loopback and the hosts of --drafter/--trusted-drafter")
    p.add_argument("--speculative-config", default=None,
                   help='JSON with vLLM\'s keys (num_speculative_tokens, rejection_sample_method, adaptive, ...); '
                        'with "method" the proposer runs in-process instead of in drafter services')
    p.add_argument("--drafter-registry", default=None, metavar="FILE",
                   help="keep drafters registered at runtime in this JSON file and register them again at start "
                        "(default: forgotten on restart)")
    p.add_argument("--no-speculation", action="store_true", help="plain decoding; no drafter pool")
    p.add_argument("--propose-timeout-ms", type=float, default=250.0,
                   help="deadline of one propose round trip; a late drafter costs that step its drafts")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests admitted but not started yet; more are refused (RESOURCE_EXHAUSTED: HTTP 429)")
    p.add_argument("--max-queued-tokens", type=int, default=1 << 18,
                   help="prompt tokens of those requests; more are refused the same way")
    p.add_argument("--stream-interval-ms", type=float, default=None,
                   help="a running request's new tokens are sent at most this often, several per chunk when steps "
                        "are faster (its first token and its end go at once; 0: a chunk every step; default 40)")
    p.add_argument("--stall-timeout", type=float, default=30.0,
                   help="seconds one engine step may run before gRPC health reports NOT_SERVING")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    add_lazy_kv_argument(p)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt: no reuse of KV blocks across requests")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on an x86-64 CPU where the fused "
                        "ops build (AVX-512 or AVX2 + FMA), else float32; on GPU the checkpoint's dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                   help="let a token's logits depend on the rest of the step (faster on some machines; in bf16, "
                        "greedy output with speculation may then differ from plain decoding)")
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="torch CPU threads for this process: a number, or auto (every core it may run on, "
                        "at most 8; default: torch's own choice)")
    p.add_argument("--log-level", default="info")
    auth.add_arguments(p, server=True, client=True)  # --tls-ca: verify drafters' certificates


def run(args) -> int:
    import asyncio

    from specd.engine.loader import set_threads
    from specd.models.model_store import default_target
    from specd.config import EngineConfig, SpeculativeConfig
    from specd.rpc.grpc_server import install_uvloop, setup_logging
    from specd.rpc.metrics_port import start_metrics
    from specd.rpc.telemetry import setup_tracing
    from specd.verifier.metrics import VerifierMetrics

    from specd.rpc import auth

    setup_logging(args.log_level)
    security = auth.from_args(args)  # a bad secret file or certificate fails before the model loads
    setup_tracing("specd-verifier")  # off unless OTEL_EXPORTER_OTLP_ENDPOINT (or SPECD_TRACE_FILE) is set
    set_threads(args.threads)
    model = args.model or default_target()
    config = EngineConfig(model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                          block_size=args.block_size, kv_cache_gb=args.kv_cache_gb, num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          seed=args.seed, batch_invariant=args.batch_invariant,
                          enable_prefix_caching=args.prefix_caching)
    spec = None if args.no_speculation else (SpeculativeConfig.parse(args.speculative_config) or SpeculativeConfig())
    startup = [(name, address, False) for name, address in args.drafter] + [
        (name, address, True) for name, address in args.trusted_drafter]
    if startup and spec is None:
        raise ValueError("--drafter needs speculation; drop --no-speculation")
    registry = None
    if args.drafter_registry:
        from specd.verifier.drafter_registry import DrafterRegistry

        if spec is None or spec.method is not None:
            raise ValueError("--drafter-registry needs drafter services (speculation without an in-process method)")
        registry = DrafterRegistry(args.drafter_registry)
        registry.load()  # a bad file fails before the model loads
    args.registry = registry
    if args.trusted_drafter and not security.secret:
        raise ValueError(f"--trusted-drafter needs authentication: give the shared secret (--auth-token-file or "
                         f"${auth.TOKEN_ENV}) here and to the drafter")
    if spec is not None and spec.method is not None and startup:
        raise ValueError("--drafter and an in-process speculative method are exclusive; drop 'method' "
                         "from --speculative-config to use drafter services")
    if args.local_drafter and (spec is None or spec.method is not None):
        raise ValueError("--local-drafter joins the drafter pool: it needs speculation without an in-process "
                         "'method' (drop --no-speculation, or 'method' from --speculative-config)")
    methods = [m for m, _ in args.local_drafter]
    if len(set(methods)) != len(methods):
        raise ValueError(f"--local-drafter: each method once (a drafter is named by its method), got {methods}")
    from specd.verifier.async_engine import Admission

    Admission(args.max_queued_requests, args.max_queued_tokens)  # bad bounds fail before the model loads
    if args.stream_interval_ms is not None and args.stream_interval_ms < 0:
        raise ValueError(f"--stream-interval-ms must be >= 0, got {args.stream_interval_ms:g}")
    if args.stall_timeout <= 0:
        raise ValueError(f"--stall-timeout must be > 0 seconds, got {args.stall_timeout}")
    metrics = VerifierMetrics()
    # Before the model loads: a busy metrics port fails at once, not after the load.
    start_metrics(metrics.start_http_server, args.metrics_port, args.port, args.host, "verifier")
    install_uvloop()
    asyncio.run(_serve(args, config, spec, metrics, security, startup))
    return 0


# A local index drafts up to this many tokens unless its options say (or the verifier's k is larger):
# its draft is made before the plan and costs only the rows verified where taken, and a suffix index's
# 7-8-token drafts were accepted 0.70-0.86 per token on chat, code edits and summaries alike (12 prompts
# each, SmolLM2-135M-Instruct, EPYC family 25); on the code edits max k 8 gave 1.83-1.96x of plain
# in-process against 1.71x at 4.
LOCAL_DRAFTER_K = 8


def local_drafters(entries: list[tuple[str, dict]], spec, vocab_hash: str | None = None):
    """(method, proposer) of each --local-drafter; a datastore must share the target's vocabulary."""
    from specd.config import SpeculativeConfig
    from specd.proposers.factory import make_proposer

    for method, options in entries:
        k = max(LOCAL_DRAFTER_K, spec.num_speculative_tokens)
        config = SpeculativeConfig.parse({"num_speculative_tokens": k, **options, "method": method})
        yield method, make_proposer(config, target_vocab_size=None, target_vocab_hash=vocab_hash)


def allowed_addresses(patterns: list[str] | None, startup: list[tuple[str, str, bool]]) -> list[str]:
    """--allow-drafter-address, else loopback plus the hosts the command line names."""
    from specd.verifier.drafter_pool import LOOPBACK

    if patterns is not None:
        return patterns
    return [*LOOPBACK, *sorted({f"{address.rpartition(':')[0]}:*" for _, address, _ in startup})]


async def _serve(args, config, spec, metrics, security, startup) -> None:
    import asyncio
    import logging
    from pathlib import Path

    from specd.rpc.auth import VERIFIER
    from specd.engine.llm_engine import LLMEngine
    from specd.rpc.grpc_server import compute_thread, serve
    from specd.models.tokenizer import vocab_hash_of
    from specd.v1 import verifier_pb2, verifier_pb2_grpc
    from specd.verifier.async_engine import STREAM_INTERVAL_S, Admission, AsyncEngine
    from specd.verifier.drafter_pool import DrafterPool
    from specd.verifier.pool_proposer import PoolProposer
    from specd.verifier.server import VerifierService

    log = logging.getLogger("specd.verifier")
    loop = asyncio.get_running_loop()
    pool = None
    if spec is not None and spec.method is None:
        from specd.engine.loader import read_arch_config, resolve_model_dir

        model_dir = resolve_model_dir(config.model, weights=False)  # config and tokenizer: a .gguf is not converted
        vocab_hash = vocab_hash_of(model_dir)
        pool = DrafterPool(read_arch_config(model_dir).vocab_size, vocab_hash,
                           args.propose_timeout_ms / 1e3, metrics, security,
                           allowed_addresses(args.allow_drafter_address, startup))
        for method, proposer in local_drafters(args.local_drafter, spec, vocab_hash):
            pool.add_local(method, proposer)
    from specd.proposers.factory import in_process_proposer

    # Loading takes a while: off the loop, so the health service answers NOT_SERVING meanwhile.
    worker = compute_thread("engine")  # loading and every step, one OpenMP team
    engine = await loop.run_in_executor(worker, lambda: LLMEngine(config, spec, PoolProposer(pool, loop) if pool else None,
                                                                proposer_factory=in_process_proposer))
    await loop.run_in_executor(worker, take_kv_memory, args)
    if pool is not None:
        from specd.verifier.drafter_client import FeatureTarget

        pool.target = FeatureTarget(engine.arch.hidden_size, engine.arch.num_layers, engine.model.fingerprint)
    info = verifier_pb2.InfoResponse(
        model=config.model, model_name=Path(config.model.rstrip("/")).name, max_model_len=engine.max_model_len,
        vocab_size=engine.arch.vocab_size, vocab_hash=vocab_hash_of(engine.model_dir),
        eos_token_ids=sorted(engine.eos_token_ids), speculation=spec is not None, exact=engine.model.exact,
        dtype=str(engine.dtype).removeprefix("torch."), quantization=engine.model.quantization or "")
    metrics.exact.set(int(engine.model.exact))
    interval_s = STREAM_INTERVAL_S if args.stream_interval_ms is None else args.stream_interval_ms / 1e3
    async_engine = AsyncEngine(engine, pool, metrics, Admission(args.max_queued_requests, args.max_queued_tokens),
                               worker, interval_s)

    if pool is not None:
        pool.registry = args.registry

    def add(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierService(async_engine, info), server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    async def register_at_start(name: str, address: str, rank: int, trusted: bool) -> None:
        """Drafters named on the command line may start after us (compose): retry until one answers."""
        delay = 0.5
        while True:
            try:
                await pool.register(name, address, rank, trusted)
                return
            except (KeyError, ValueError, PermissionError) as e:  # duplicate, wrong vocabulary, no proof: final
                log.error("drafter %s at %s refused: %s", name, address, e)
                return
            except Exception as e:  # noqa: BLE001
                log.warning("drafter %s at %s not reachable yet (%s); retrying", name, address, e)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def watch_health(servicer, services: list[str]) -> None:
        """Health says NOT_SERVING while one step runs longer than --stall-timeout (a stuck
        engine answers Info, but serves nobody)."""
        from grpc_health.v1 import health_pb2

        serving = True
        while True:
            await asyncio.sleep(min(0.5, args.stall_timeout / 4))
            stalled = async_engine.stalled_for() > args.stall_timeout
            if stalled == serving:
                serving = not stalled
                if stalled:
                    log.error("engine step running for over %.1f s: health NOT_SERVING", args.stall_timeout)
                else:
                    log.warning("engine steps again: health SERVING")
                status = health_pb2.HealthCheckResponse.NOT_SERVING if stalled else \
                    health_pb2.HealthCheckResponse.SERVING
                for service in services:
                    await servicer.set(service, status)

    def on_health(servicer, services) -> None:
        background.append(asyncio.create_task(watch_health(servicer, services)))

    async def ready():
        async_engine.start()
        for rank, (name, address, trusted) in enumerate(startup):  # the first named is the default drafter
            background.append(asyncio.create_task(register_at_start(name, address, rank, trusted)))
        named = {name for name, _, _ in startup}
        for entry in args.registry.load() if args.registry is not None else []:
            if entry["name"] in named:
                continue  # the command line says where it is now
            try:
                pool.check_address(entry["address"])
            except PermissionError as e:
                log.error("drafter %s from %s not restored: %s", entry["name"], args.registry.path, e)
                continue
            background.append(asyncio.create_task(pool.restore(entry["name"], entry["address"], entry["trusted"])))

    background: list[asyncio.Task] = []

    try:
        await serve(add, args.host, args.port, on_ready=ready, name=f"verifier ({info.model_name})",
                    security=security, audience=VERIFIER, on_health=on_health)
    finally:
        for task in background:
            task.cancel()
        await async_engine.stop()
        if pool is not None:
            await pool.close()
