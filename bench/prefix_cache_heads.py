"""What prefix caching costs and gives a hidden-state drafter: the committed EAGLE-3 head on the
default target, offline, multi-turn chat behind a shared system prompt, the cache on vs off.

    python bench/prefix_cache_heads.py [--threads 2]     # writes bench/results/prefix_cache_heads.{md,json}

A cache hit skips the target's forward over the cached prefix, so the head's input there (the
target's hidden states of layers 2, 15 and 27) is not computed again: a cached block keeps those
rows beside its KV (specd/engine/scheduler.py). The head keeps its own KV of released histories
(specd/proposers/heads/prefix_cache.py), so a new turn's rows may start where both caches end
(ProposeRequest.features_from). Runs: the verifier's cache off; on with the head's cache off; both
on. Measured per run: prefill seconds per turn (each turn's prompt generated with max_tokens=1, one
conversation after another), the tokens served from the cache, the feature rows' memory (bytes kept
per cached block and in all, against the KV cache's bytes per block), the feature rows sent to the
head and the head's pairs taken from its own cache, the head's seconds in calls that start a
sequence, the head's acceptance over a greedy answer per turn, and whether every answer equals the
cache-off run's.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402
from prefix_cache import FOLLOW_UPS, system_prompt  # noqa: E402


def run(cache: bool, head_cache: bool, args, system: str) -> dict:
    import torch

    from specd import LLM, SamplingParams

    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.engine.model_runner import ModelRunner
    from specd_train.workloads import CHAT_QUESTIONS

    torch.set_num_threads(args.threads)
    target = model_store.default_target()
    spec = {"method": "eagle3", "model": str(model_store.committed_head_dir("eagle3")), "target_model": target,
            "num_speculative_tokens": 4, "adaptive": args.adaptive}
    llm = LLM(target, spec, enable_prefix_caching=cache)
    engine = llm.engine
    head = engine.speculator.proposer
    if not head_cache:
        head.prefix_cache = None  # the head alone without its cache (no other way to reach it in-process)
    sent = {"rows": 0, "first_contact_s": 0.0}
    propose = head.propose

    def counted(batch):
        t0 = time.perf_counter()
        out = propose(batch)
        sent["rows"] += sum(r.features.shape[0] for r in batch if r.features is not None)
        if any(r.full_history for r in batch):
            sent["first_contact_s"] += time.perf_counter() - t0
        return out

    head.propose = counted
    prefill, answers, drafted, accepted = [], [], 0, 0
    for question in CHAT_QUESTIONS[:args.conversations]:
        messages = [{"role": "system", "content": system}]
        for ask in (question, *FOLLOW_UPS)[:args.turns]:
            messages.append({"role": "user", "content": ask})
            ids = chat_prompt_ids(llm.tokenizer, messages)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1))
            prefill.append(time.perf_counter() - t0)
            (out,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=args.max_tokens))
            answers.append(out.token_ids)
            drafted += out.spec["draft_tokens"]
            accepted += out.spec["accepted_tokens"]
            messages.append({"role": "assistant", "content": out.text})
    kept = engine.scheduler._block_features
    row_bytes = sum(t.numel() * t.element_size() for _, t in kept.values())
    kv_block = ModelRunner.kv_bytes_per_block(engine.model, engine.config.block_size, engine.dtype)
    return {"cache": "on" if cache else "off", "head_cache": "on" if head_cache else "off",
            "rows_sent": sent["rows"], "head_pairs_from_cache": head.prefix_cache.pairs_reused if head_cache else 0,
            "first_contact_s": round(sent["first_contact_s"], 3), "prefill_s_median": round(statistics.median(prefill), 4),
            "prefill_s_total": round(sum(prefill), 2), "cached_tokens": engine.block_manager.stats.hits,
            "blocks_with_features": len(kept), "feature_bytes_per_block": row_bytes // max(1, len(kept)),
            "feature_bytes_total": row_bytes, "kv_bytes_per_block": kv_block,
            "acceptance": round(accepted / max(1, drafted), 3), "dtype": str(engine.dtype).removeprefix("torch."),
            "answers": answers}


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["# Prefix caching with a hidden-state drafter (EAGLE-3), offline", "",
             f"The committed EAGLE-3 head on SmolLM2-135M-Instruct ({r['rows'][0].get('dtype', 'auto dtype')}), "
             f"{s['conversations']} conversations x {s['turns']} turns one after another behind a "
             f"{s['system_tokens']}-token system prompt, greedy answers of {s['max_tokens']} tokens, k = 4 "
             f"{'chosen by the controller' if s['adaptive'] else 'every step (controller off)'}, "
             f"{s['threads']} threads. Prefill: each turn's prompt run with max_tokens = 1 before its answer. "
             f"Command: `{r['command']}`.", "",
             "| cache | head's cache | feature rows sent to the head | head pairs from its cache | head s in "
             "first contacts | prefill s (median per turn) | prefill s (all turns) | tokens from the cache | blocks "
             "kept with features | feature bytes per block | KV bytes per block | feature bytes in all | acceptance | "
             "answers equal to cache off |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['cache']} | {x.get('head_cache', '-')} | {x.get('rows_sent', '-')} | "
                     f"{x.get('head_pairs_from_cache', '-')} | {x.get('first_contact_s', '-')} | {x['prefill_s_median']} | {x['prefill_s_total']} | {x['cached_tokens']} | "
                     f"{x['blocks_with_features']} | {x['feature_bytes_per_block']} | {x['kv_bytes_per_block']} | "
                     f"{x['feature_bytes_total']} | {x['acceptance']} | {x['identical']} |")
    return "\n".join(lines + ["", machine_line(r), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--adaptive", action="store_true", help="let the controller pick k (default: k = 4 every step, "
                   "so acceptance compares the head's drafts, not the controller's timing)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prefix_cache_heads"))
    args = p.parse_args(argv)
    t0, info = time.monotonic(), machine_info(args.threads)
    system = system_prompt(args.system_tokens)
    rows = [run(False, False, args, system), run(True, False, args, system), run(True, True, args, system)]
    for row in rows:
        row["identical"] = f"{sum(a == b for a, b in zip(row['answers'], rows[0]['answers']))}/{len(rows[0]['answers'])}"
    write_result(Path(args.out), "bench/prefix_cache_heads.py", argv, info, vars(args), rows, t0, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
