"""`specd` command line: every subcommand, each in its own module of this room (up, admin,
models_command) or of a service. Subcommands import their heavy dependencies lazily."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time


class _Parser(argparse.ArgumentParser):
    """Bad arguments give one line on stderr, like every other error here."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see `{self.prog} --help`)\n")


def default_model() -> str:
    """The default target (SmolLM2-135M-Instruct), fetched into the cache on first use."""
    from specd.models.model_store import default_target

    return default_target()


def _add_generate(sub) -> None:
    p = sub.add_parser("generate",
                       help="generate offline, no services (one JSON line per prompt; a summary line on stderr)")
    p.add_argument("--model", default=None, help="local directory, .gguf file or hub id (default: SmolLM2-135M-Instruct, fetched once)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompts-file", help='JSONL: {"prompt": "..."} or {"prompt_token_ids": [...]} per line')
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto (default): bfloat16 on an x86-64 CPU where the fused "
                        "ops build (AVX-512 or AVX2 + FMA), else float32; on GPU the checkpoint's dtype")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="recompute every prompt: no reuse of KV blocks across requests")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides --kv-cache-gb)")
    p.add_argument("--kv-cache-gb", type=float, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for this process")
    p.add_argument("--speculative-config", default=None,
                   help='JSON with vLLM\'s keys, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="per-request override of k (0 turns speculation off)")


def _read_prompts(args) -> list:
    if args.prompt is not None:
        return [args.prompt]
    if args.prompt_ids is not None:
        try:
            return [[int(t) for t in args.prompt_ids.split(",") if t.strip()]]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    prompts = []
    with open(args.prompts_file) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts_file}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not ({"prompt", "prompt_token_ids"} & obj.keys()):
                raise ValueError(f'{args.prompts_file}:{lineno}: expected {{"prompt": ...}} or {{"prompt_token_ids": [...]}}')
            prompts.append(obj)
    if not prompts:
        raise ValueError(f"{args.prompts_file} has no prompts")
    return prompts


def _run_generate(args) -> int:
    from specd.engine.loader import set_threads
    from specd.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, seed=args.seed, ignore_eos=args.ignore_eos,
                            num_speculative_tokens=args.num_speculative_tokens)
    prompts = _read_prompts(args)
    model = args.model or default_model()
    set_threads(args.threads)
    from specd.llm import LLM

    llm = LLM(model, speculative_config=args.speculative_config, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
              kv_cache_gb=args.kv_cache_gb, enable_prefix_caching=args.prefix_caching)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    for out in outs:
        print(json.dumps(out.to_dict()), flush=True)
    print(_generate_summary(outs, seconds), file=sys.stderr, flush=True)
    return 0


def _generate_summary(outs, seconds: float) -> str:
    """One line for stderr (stdout stays JSON lines): totals over every prompt, wall time of
    generation alone (model load excluded) and, with speculation, the summed counters."""
    from specd.engine.spec_stats import SpecStats

    tokens = sum(len(o.token_ids) for o in outs)
    line = (f"summary: prompts={len(outs)} generated_tokens={tokens} wall_s={seconds:.6f} "
            f"tokens_per_s={tokens / seconds if seconds > 0 else 0.0:.1f}")
    specs = [o.spec for o in outs if o.spec is not None]
    if specs:  # speculation configured (counters are zero where nothing was drafted)
        total = SpecStats(drafts=sum(s["drafts"] for s in specs), draft_tokens=sum(s["draft_tokens"] for s in specs),
                          accepted_tokens=sum(s["accepted_tokens"] for s in specs))
        line += (f" drafts={total.drafts} draft_tokens={total.draft_tokens} accepted_tokens={total.accepted_tokens}"
                 f" acceptance_rate={total.acceptance_rate:.3f}"
                 f" mean_acceptance_length={total.mean_acceptance_length:.3f}")
    return line


# Service subcommands: each module has HELP, add_arguments(parser) and run(args) -> exit
# code, and imports its heavy dependencies (torch, grpc) inside run().
SERVICE_COMMANDS = {
    "up": "specd.cli.up",
    "verifier": "specd.verifier.main",
    "drafter": "specd.drafter.main",
    "gateway": "specd.gateway.main",
    "drafters": "specd.cli.admin",
    "models": "specd.cli.models_command",
}
# Training lives apart from serving, in the specd-train package (training/: `pip install -e
# training`); without it these commands say how to get it.
TRAINING_COMMANDS = {
    "train-drafter": "specd_train.drafter.command",
    "drafter-data": "specd_train.drafter.data_command",
    "datastore": "specd_train.drafter.datastore_command",
    "demo-models": "specd_train.demo.command",
}
TRAINING_MISSING = ("`specd {name}` needs the training package, which serving installs leave out: "
                    "pip install -e training (from a clone of the repository; `make install-dev` does it)")


def _training_installed() -> bool:
    try:
        importlib.import_module("specd_train")  # its __init__ is a docstring: cheap
    except ImportError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specd", description="speculative decoding for LLM serving")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module_name in SERVICE_COMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    for name, module_name in TRAINING_COMMANDS.items():
        if not _training_installed():
            sub.add_parser(name, help="(needs the training package: pip install -e training)")
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    _add_generate(sub)
    return parser


def _version() -> str:
    from specd import __version__

    return f"specd {__version__}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TRAINING_COMMANDS and not _training_installed():  # before its arguments are read
        print(f"error: {TRAINING_MISSING.format(name=argv[0])}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            return _run_generate(args)
        if args.command in TRAINING_COMMANDS:
            return importlib.import_module(TRAINING_COMMANDS[args.command]).run(args)
        if args.command in SERVICE_COMMANDS:
            return importlib.import_module(SERVICE_COMMANDS[args.command]).run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 — the CLI's contract: one line, never a traceback
        if os.environ.get("SPECD_DEBUG"):
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    return 2


def _one_line(e: Exception) -> str:
    from specd.config import format_validation_error

    if type(e).__name__ == "ValidationError":
        return format_validation_error(e)
    if isinstance(e, FileNotFoundError) and e.filename:
        return f"no such file: {e.filename}"
    msg = str(e).strip().splitlines()
    return msg[0] if msg else type(e).__name__

