"""Exactness and speed of the CUDA path on a GPU: bf16 greedy tokens with and without speculation.

    python bench/gpu_exact.py --out bench/results    # on a machine with a GPU

A random-weight Llama of a real shape (1B-class: 2048 hidden, 16 layers, GQA 32/8; nothing can be
downloaded on the lent GPU machines) is saved with transformers' save_pretrained and served by
specd's engine in bfloat16 on CUDA, batch-invariant mode on (the Triton matmul of
kernels/matmul_invariant_triton.py), with each paged-attention backend (torch, and the Triton
kernel of SPECD_PAGED_ATTENTION=triton). Prompts repeat spans of themselves so n-gram drafts hit,
and may share a leading system prompt (--shared-prefix). Per backend: greedy tokens of every prompt
decoded alone with no prefix cache (the reference); then, prefix cache on, alone and as one batch,
plain and with n-gram speculation (chains and trees, k = 4); every run must give the reference's tokens. The
load-time self-test's verdict (exact) is reported, and plain/speculative decode tok/s per run; the
script fails where a run the engine called exact changed a token.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.machine import machine_info, machine_line, write_result  # noqa: E402
from specd import LLM, SamplingParams  # noqa: E402


def make_model(path: Path, layers: int, hidden: int, device: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), max_position_embeddings=4096,
                      initializer_range=0.05, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def make_prompts(n: int, length: int, shared: int = 0) -> list[list[int]]:
    """n prompts of repeated spans (the n-gram drafter finds matches), the first `shared` tokens
    common to all (a system prompt: the prefix cache serves it)."""
    g = torch.Generator().manual_seed(1)
    system = torch.randint(3, 32000, (shared,), generator=g).tolist()
    prompts = []
    for _ in range(n):
        span = torch.randint(3, 32000, (max(1, (length - shared) // 4),), generator=g).tolist()
        prompts.append(system + (span * 4)[:length - shared])
    return prompts


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(llm: LLM, prompts: list[list[int]], new_tokens: int, batched: bool) -> tuple[list[list[int]], float]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    if batched:
        outs = [list(o.token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    else:
        outs = [list(llm.generate([{"prompt_token_ids": p}], params)[0].token_ids) for p in prompts]
    sync()
    return outs, sum(map(len, outs)) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--shared-prefix", type=int, default=0, help="leading tokens every prompt shares (prefix cache)")
    p.add_argument("--backends", default="torch,triton", help="attention paths to run (SPECD_PAGED_ATTENTION)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    prompts = make_prompts(args.prompts, args.prompt_len, args.shared_prefix)
    t_start, info = time.monotonic(), machine_info(torch.get_num_threads(), args.device, "bfloat16")
    rows, failures = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.layers, args.hidden, args.device)
        for backend in args.backends.split(","):
            os.environ["SPECD_PAGED_ATTENTION"] = backend
            kw = dict(dtype="bfloat16", device=args.device, max_model_len=1024, num_kv_blocks=2048)
            # The reference decodes each prompt alone with no prefix cache; every other run has it on.
            reference = LLM(tmp, enable_prefix_caching=False, **kw)
            llms = {"plain": LLM(tmp, **kw),
                    "ngram k=4": LLM(tmp, {"method": "ngram", "num_speculative_tokens": 4}, **kw),
                    "ngram tree k=4": LLM(tmp, {"method": "ngram", "num_speculative_tokens": 4,
                                                "tree": {"branching": [3]}}, **kw)}
            for llm in (reference, *llms.values()):
                run(llm, prompts[-2:], 8, True)  # warm-up: Triton compiles its kernels
                llm.engine.block_manager.reset_prefix_cache()
            ref, ref_tps = run(reference, prompts, args.new_tokens, batched=False)
            for name, llm in llms.items():
                for batched in (False, True):
                    label = f"{name}, {'one batch' if batched else 'batch 1'}"
                    hits = llm.engine.block_manager.stats.hits
                    outs, tps = run(llm, prompts, args.new_tokens, batched)
                    same = sum(o == r for o, r in zip(outs, ref))
                    failures += llm.engine.model.exact and same != len(ref)  # exact = true is a promise
                    rows.append(dict(attention=backend, run=label, exact_at_load=bool(llm.engine.model.exact),
                                     identical=f"{same}/{len(ref)}", tok_s=round(tps, 1),
                                     cached_tokens=llm.engine.block_manager.stats.hits - hits))
                    print(rows[-1], flush=True)
            rows.append(dict(attention=backend, run="plain, batch 1, no prefix cache (the reference)",
                             exact_at_load=bool(reference.engine.model.exact), identical="-", tok_s=round(ref_tps, 1),
                             cached_tokens=0))
            del llms, reference
            if args.device == "cuda":
                torch.cuda.empty_cache()
    settings = dict(shared_prefix=args.shared_prefix, hidden=args.hidden, layers=args.layers, prompts=args.prompts, prompt_len=args.prompt_len, new_tokens=args.new_tokens)

    def render(r: dict) -> str:
        lines = ["# Greedy exactness on a GPU (bf16, CUDA)", "",
                 f"Random-weight Llama ({args.hidden} hidden, {args.layers} layers, GQA {args.hidden // 64}/{max(1, args.hidden // 256)}, "
                 f"vocab 32000), bf16, "
                 f"batch-invariant mode; {args.prompts} prompts x {args.prompt_len} tokens of repeated spans, "
                 f"{args.new_tokens} greedy tokens each, the first {args.shared_prefix} tokens shared by all. "
                 f"Reference: each prompt decoded alone, prefix cache off; every other run has it on. "
                 f"Command: `{r['command']}`.", "",
                 "| attention | run | exact (load test) | identical to the reference | prompt tokens from the prefix cache "
                 "| tok/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {x['attention']} | {x['run']} | {x['exact_at_load']} | {x['identical']} | {x['cached_tokens']} "
                  f"| {x['tok_s']} |" for x in r["rows"]]
        return "\n".join(lines + ["", f"GPU: {r['machine'].get('gpu')}. " + machine_line(r), ""])

    write_result(Path(args.out) / "gpu_exact", "bench/gpu_exact.py", argv, info, settings, rows, t_start, render)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
