"""`specd drafter`: host one proposer (draft_model, ngram, suffix, a hidden-state head: eagle,
eagle3, medusa, mlp_speculator, or several of them merged into one token tree: combined) as a
gRPC service."""
from __future__ import annotations

import argparse

from specd.rpc.kv_pages import add_lazy_kv_argument, take_kv_memory
from specd.rpc.threads import threads_arg

HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator")
HELP = "run a drafter service (gRPC) hosting one proposer"
DEFAULT_PORT = 50061


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specd.rpc import auth
    from specd.rpc.metrics_port import add_metrics_port_argument

    p.add_argument("--method", required=True, choices=["draft_model", "ngram", "suffix", *HEAD_METHODS, "combined"])
    p.add_argument("--model", default=None,
                   help="draft model directory or hub id (draft_model; default: the trained drafter of the default "
                        "target, fetched once), or the head's checkpoint (eagle, eagle3, medusa, mlp_speculator; "
                        "default for the default target: its trained head in models/)")
    p.add_argument("--target", default=None,
                   help="hidden-state heads: the target model they draft for (directory, hub id or GGUF; default: "
                        "the default target, fetched once): its layer count and hidden size, and EAGLE's "
                        "embeddings and LM head. The verifier refuses a head built for another target")
    p.add_argument("--name", default=None, help="name reported by Info (default: the method)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=DEFAULT_PORT)
    add_metrics_port_argument(p)
    p.add_argument("--options", default=None,
                   help='proposer options as JSON with vLLM\'s keys, e.g. \'{"prompt_lookup_max": 3}\' '
                        "or '{\"draft_sample_method\": \"sampled\"}'; combined: "
                        "'{\"members\": [{\"method\": \"draft_model\"}, {\"method\": \"suffix\"}]}' (a draft_model "
                        "member without 'model' takes the default drafter, a head without 'target_model' --target)")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="the most drafts per request (max k)")
    p.add_argument("--ttl-seconds", type=float, default=600.0,
                   help="forget a sequence no verifier touched for this long")
    p.add_argument("--max-history-tokens", type=int, default=None,
                   help="longest sequence it drafts for (default: 65536, or the draft model's context)")
    p.add_argument("--max-sequences", type=int, default=1024,
                   help="sequences it keeps state for, over all verifiers (least recently used go first)")
    p.add_argument("--max-total-tokens", type=int, default=8 << 20,
                   help="tokens of history it keeps over all sequences (the same eviction)")
    p.add_argument("--pipeline", action="store_true",
                   help="pipelined drafting: after each reply, draft ahead for the likely outcomes of the step the "
                        "verifier is verifying, answered at once when one happens (draft_model and eagle; worth it "
                        "when this drafter has its own core or GPU: drafting ahead keeps it busy)")
    p.add_argument("--pipeline-branches", type=int, default=None,
                   help="outcomes drafted ahead per sequence at most (default 16; best first)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_lazy_kv_argument(p)
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="draft model or head dtype (default auto: bfloat16 on an x86-64 CPU where the "
                        "fused ops build, else float32)")
    auth.add_arguments(p, server=True, client=False)
    p.add_argument("--threads", type=threads_arg, default=None,
                   help="torch CPU threads for this process: a number, or auto (every core it may run on, "
                        "at most 8; default: torch's own choice)")
    p.add_argument("--log-level", default="info")


def build_proposer(args):
    """The proposer and its Info message; vocabulary identity comes from the model's tokenizer."""
    import json

    from specd.config import SpeculativeConfig
    from specd.proposers.factory import make_proposer
    from specd.models.tokenizer import vocab_hash_of
    from specd.v1 import drafter_pb2

    options = json.loads(args.options) if args.options else {}
    if not isinstance(options, dict):
        raise ValueError("--options must be a JSON object")
    if args.target and args.method not in (*HEAD_METHODS, "combined"):
        raise ValueError("--target is for hidden-state heads (eagle, eagle3, medusa, mlp_speculator)")
    if args.method == "combined":
        if not isinstance(options.get("members"), list):
            raise ValueError('--method combined needs --options \'{"members": [{"method": ...}, ...]}\'')
        options["members"] = [_with_defaults(m, m.get("method") if isinstance(m, dict) else None, args)
                              for m in options["members"]]
        spec = SpeculativeConfig.parse({**options, "method": "combined", "model": args.model,
                                        "num_speculative_tokens": args.num_speculative_tokens})
    else:
        options = _with_defaults({**options, "model": args.model}, args.method, args)
        spec = SpeculativeConfig.parse({**options, "method": args.method,
                                        "num_speculative_tokens": args.num_speculative_tokens})
    proposer = make_proposer(spec, target_vocab_size=None, device=args.device)
    vocab_size, vocab_hash = 0, ""
    source = _vocabulary_of(spec)
    model = spec.model
    if source:
        from specd.engine.loader import resolve_model_dir

        # A head drafts the target's ids: its vocabulary is the target's tokenizer.
        vocab_size, vocab_hash = proposer.vocab_size, vocab_hash_of(resolve_model_dir(source, weights=False))
    info = drafter_pb2.DrafterInfoResponse(name=args.name or args.method, method=args.method, model=model or "",
                                           vocab_size=vocab_size, vocab_hash=vocab_hash,
                                           max_k=args.num_speculative_tokens)
    describe_features(proposer, info)
    info.one_forward = bool(getattr(proposer, "one_forward", False))
    if getattr(args, "pipeline", False):
        from specd.proposers.pipeline import DEFAULT_BRANCHES, PipelinedProposer

        proposer = PipelinedProposer(proposer, args.pipeline_branches or DEFAULT_BRANCHES)
    return proposer, info


def _with_defaults(options, method: str | None, args):
    """A proposer's options with the service's defaults filled in: the default drafter for
    draft_model, the target (--target, or the default one) for heads and, for the default
    target, its committed trained head, --dtype."""
    if not isinstance(options, dict):
        return options  # SpeculativeConfig names what is wrong
    options = dict(options)
    if method == "draft_model" and options.get("model") is None:
        from specd.models.model_store import default_drafter

        options["model"] = default_drafter()
    if method in HEAD_METHODS and options.get("target_model") is None:
        from specd.models.model_store import default_target

        options["target_model"] = args.target or default_target()
        if options.get("model") is None and args.target is None:
            from specd.models.model_store import committed_head_dir

            head = committed_head_dir(method)
            options["model"] = None if head is None else str(head)
    if args.dtype is not None and method in ("draft_model", *HEAD_METHODS):
        options["draft_dtype"] = args.dtype
    return options


def _vocabulary_of(spec) -> str | None:
    """The model whose tokenizer names the ids this proposer drafts (None: token-only proposers)."""
    if spec.method == "combined":
        return next((s for s in map(_vocabulary_of, spec.members) if s), None)
    return spec.target_model if spec.method in HEAD_METHODS else spec.model


def describe_features(proposer, info) -> None:
    """A hidden-state proposer's needs, in Info: the verifier checks them against its target."""
    layers = tuple(getattr(proposer, "feature_layers", None) or ())
    if layers:
        info.feature_layers.extend(layers)
        info.hidden_size = proposer.hidden_size
        info.target_layers = proposer.target_layers
        info.target_fingerprint = getattr(proposer, "target_fingerprint", "") or ""


def run(args) -> int:
    import asyncio

    from specd.engine.loader import set_threads
    from specd.drafter.metrics import DrafterMetrics
    from specd.rpc.grpc_server import compute_thread, install_uvloop, setup_logging
    from specd.rpc.metrics_port import start_metrics
    from specd.rpc.telemetry import setup_tracing

    from specd.rpc import auth
    from specd.drafter.server import DrafterLimits

    setup_logging(args.log_level)
    security = auth.from_args(args)  # a bad secret file or certificate fails before the model loads
    setup_tracing("specd-drafter")  # off unless OTEL_EXPORTER_OTLP_ENDPOINT (or SPECD_TRACE_FILE) is set
    set_threads(args.threads)
    name = args.name or args.method
    metrics = DrafterMetrics(name)
    # Before the model loads: a busy metrics port fails at once, not after the load.
    start_metrics(metrics.start_http_server, args.metrics_port, args.port, args.host, f"drafter {name}")
    worker = compute_thread("proposer")  # loading and every call, one OpenMP team
    proposer, info = worker.submit(build_proposer, args).result()
    worker.submit(take_kv_memory, args).result()  # a draft model's cache
    history = args.max_history_tokens or min(65536, getattr(proposer, "max_model_len", None) or 65536)
    limits = DrafterLimits(max_k=info.max_k, max_history_tokens=history, max_sequences=args.max_sequences,
                           max_total_tokens=args.max_total_tokens)
    install_uvloop()
    asyncio.run(_serve(args, proposer, info, metrics, limits, security, worker))
    return 0


async def _serve(args, proposer, info, metrics, limits, security, worker) -> None:
    import asyncio

    from specd.rpc.auth import DRAFTER
    from specd.drafter.server import DrafterService
    from specd.rpc.grpc_server import serve
    from specd.v1 import drafter_pb2, drafter_pb2_grpc

    service = DrafterService(proposer, info, args.ttl_seconds, metrics, limits, security.secret, worker)

    def add(server):
        drafter_pb2_grpc.add_DrafterServicer_to_server(service, server)
        return [drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name]

    expiry = asyncio.create_task(service.expire_loop())
    try:
        await serve(add, args.host, args.port, name=f"drafter {info.name} ({info.method})", security=security,
                    audience=DRAFTER)
    finally:
        expiry.cancel()
