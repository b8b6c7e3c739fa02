"""The suffix index with and without a datastore, in one process: server's choice over plain.

    python bench/suffix_datastore.py [--datastore models/SmolLM2-135M-Instruct-datastore] [--threads 2]

Two engines of the default target in bf16 (specd.LLM, suffix k 8, the adaptive controller), one
without and one with `suffix_decoding_datastore`; per workload and batch, plain (k = 0), the
index alone, the index with the datastore, plain again, interleaved (at batch 1 prompt by prompt,
2 rounds; at batch 8 the 8 prompts together, 3 rounds). Every request keeps its answer out of the
answer cache (cache_output False). Each mode's mean tok/s over the mean of the plain runs, with the
machine: bench/results/suffix_datastore.{md,json}.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402

from specd.llm import LLM
from specd.models import model_store
from specd.models.chat import chat_prompt_ids
from specd.sampling import SamplingParams
from specd_train.workloads import workload

CELLS = [("chat", 1), ("summarize", 1), ("code_edit", 8), ("chat", 8)]


def tok_s(llm: LLM, prompts: list[list[int]], k: int | None) -> float:
    params = [SamplingParams(temperature=0, max_tokens=200, cache_output=False, num_speculative_tokens=k)
              for _ in prompts]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--datastore", default=str(model_store.committed_datastore_dir()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench/results/suffix_datastore")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0, info = time.monotonic(), machine_info(args.threads, dtype="bfloat16")
    target = model_store.default_target()
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    engines = {"suffix": LLM(target, dtype="bfloat16", speculative_config=spec),
               "datastore": LLM(target, dtype="bfloat16",
                                speculative_config={**spec, "suffix_decoding_datastore": args.datastore})}
    rows = []
    for name, batch in CELLS:
        prompts = [chat_prompt_ids(engines["suffix"].tokenizer, m) for m in workload(name, 8)[:5 if batch == 1 else 8]]
        for llm in engines.values():
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
        runs = {"plain": [], "suffix": [], "datastore": []}
        groups = [[p] for p in prompts] if batch == 1 else [prompts]
        for _ in range(2 if batch == 1 else 3):
            for group in groups:
                for mode in ("plain", "suffix", "datastore", "plain"):
                    llm = engines["suffix" if mode == "plain" else mode]
                    runs[mode].append(tok_s(llm, group, 0 if mode == "plain" else None))
        plain = sum(runs["plain"]) / len(runs["plain"])
        rows.append({"workload": name, "batch": batch, "plain_tok_s": plain, "runs": runs,
                     **{f"{m}_ratio": sum(v) / len(v) / plain for m, v in runs.items() if m != "plain"}})
    write_result(Path(args.out), "bench/suffix_datastore.py", None, info,
                 {"datastore": args.datastore, "k": 8, "threads": args.threads}, rows, t0, render)


def render(r: dict) -> str:
    lines = ["# The suffix index with and without a datastore, in one process", "",
             f"Command: `{r['command']}`. The default target in bf16, suffix k 8, the adaptive controller; "
             f"datastore {r['settings']['datastore']}. Plain, index alone, index with the datastore, plain, "
             "interleaved (batch 1: prompt by prompt, 2 rounds of 5 prompts; batch 8: 8 prompts together, 3 "
             "rounds); every request keeps its answer out of the answer cache.", "",
             "| workload | batch | plain tok/s | index alone / plain | index with the datastore / plain |",
             "|---|---:|---:|---:|---:|"]
    lines += [f"| {x['workload']} | {x['batch']} | {x['plain_tok_s']:.1f} | {x['suffix_ratio']:.3f}x | "
              f"{x['datastore_ratio']:.3f}x |" for x in r["rows"]]
    return "\n".join(lines + ["", machine_line(r), ""])


if __name__ == "__main__":
    main()
