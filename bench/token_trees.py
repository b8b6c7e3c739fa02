"""Token trees against chains on the default real pair, offline, batch 1, greedy, chat workload.

    python bench/token_trees.py [--prompts 4] [--max-tokens 64] [--dtype bfloat16]

Per configuration (plain, a draft_model chain, draft_model trees; adaptive off so k is fixed):
tokens committed per step, output tok/s, nodes verified per step, and whether greedy output
equals plain decoding. Writes bench/results/token_trees.{md,json} with the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

CONFIGS = {
    "plain": None,
    "chain k=4": {"num_speculative_tokens": 4},
    "tree [2,2,1,1]": {"num_speculative_tokens": 4, "tree": {"branching": [2, 2, 1, 1]}},
    "tree [3,2,2,1]": {"num_speculative_tokens": 4, "tree": {"branching": [3, 2, 2, 1]}},
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from machine import machine_info

    from specd import LLM, SamplingParams

    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.models.tokenizer import Tokenizer
    from specd_train.workloads import workload

    target, drafter = str(model_store.target_dir()), str(model_store.drafter_dir())
    tok = Tokenizer.from_dir(Path(target))
    prompts = [chat_prompt_ids(tok, m) for m in workload("chat", args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    info = machine_info(args.threads, "cpu", args.dtype)
    rows, plain_ids = [], None
    for name, extra in CONFIGS.items():
        spec = None if extra is None else {"method": "draft_model", "model": drafter, "adaptive": False,
                                           "draft_dtype": args.dtype, **extra}
        llm = LLM(target, dtype=args.dtype, device="cpu", speculative_config=spec)
        llm.generate([prompts[0][:16]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        ids, steps, tokens, nodes, accepted, wall = [], 0, 0, 0, 0, 0.0
        for p in prompts:  # batch 1: one request at a time
            t0 = llm.engine.timings.steps
            t = time.perf_counter()
            (out,) = llm.generate([p], params)
            wall += time.perf_counter() - t
            steps += llm.engine.timings.steps - t0 - 1  # the prefill step commits one token
            tokens += len(out.token_ids) - 1
            ids.append(out.token_ids)
            if out.spec:
                nodes += out.spec["draft_tokens"]
                accepted += out.spec["accepted_tokens"]
        plain_ids = ids if plain_ids is None else plain_ids
        row = {"config": name, "tokens_per_step": tokens / steps, "tok_s": sum(map(len, ids)) / wall,
               "nodes_per_step": nodes / steps, "accepted_per_step": accepted / steps,
               "greedy_equals_plain": ids == plain_ids, "wall_s": wall, "steps": steps}
        rows.append(row)
        print(json.dumps(row), flush=True)
    info["load_avg_end"] = round(os.getloadavg()[0], 2)
    base = rows[0]["tok_s"]
    out_dir = ROOT / "results"
    (out_dir / "token_trees.json").write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows},
                                                         indent=2) + "\n")
    lines = ["# Token trees vs chains (draft_model, offline, batch 1, greedy, chat)", "",
             f"Target {Path(target).name}, drafter {Path(drafter).name}, {args.dtype}, {args.threads} thread, "
             f"{args.prompts} chat prompts x {args.max_tokens} tokens, adaptive off (fixed k / tree), batch-invariant.",
             f"Machine: {info['cpu']}, {info['cores']} cores, load average {info['load_avg_start']} at start, "
             f"{info['load_avg_end']} at end (shared with other jobs: tok/s is noisy; tokens/step is not).",
             f"Date: {info['date']}, torch {info['torch']}.", "",
             "| config | tokens/step | accepted/step | nodes/step | tok/s | vs plain | greedy = plain |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['config']} | {r['tokens_per_step']:.2f} | {r['accepted_per_step']:.2f} | "
                     f"{r['nodes_per_step']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
                     f"{'yes' if r['greedy_equals_plain'] else 'NO'} |")
    (out_dir / "token_trees.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
