"""What the sampler costs a step on this CPU: Sampler.__call__ on the default target's vocabulary
(49,152 float32 logits a row) for batch 1, 8 and 32, without drafts and with 4 each, greedy and at
T 0.7, three ways, each in processes of its own, alternating, side by side in one run:
  torch   torch alone (SPECD_CPU_KERNELS=0);
  rows    the general path with the fused ops (kernels/cpu_sampling_ops.cpp: argmax, inverse CDF) on
          every row: the filtered softmax of all rows, then the rejection sampler;
  walk    what the sampler does on a CPU (the fused walk, verify_chains: a row read only while its
          chain of drafts is accepted).
Every draft is its row's favourite by far (accepted, at T 0.7 too): every row is read, the walk's
dearest case; with drafts rejected early it reads fewer.

    python bench/sampler_cpu.py --threads 1 [--rounds 3] [--out bench/results/sampler_cpu]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402

VOCAB = 49152
CELLS = [(t, b, k) for t in (0.0, 0.7) for b in (1, 8, 32) for k in (0, 4)]


def worker(threads: int, calls: int, mode: str) -> None:
    import torch

    torch.set_num_threads(threads)
    from specd.engine.sampler import Sampler, SamplingMetadata
    from specd.kernels import cpu_ops
    from specd.sampling import SamplingParams

    out = {"fused": cpu_ops.available()}
    g = torch.Generator().manual_seed(0)
    for t, b, k in CELLS:
        meta = SamplingMetadata.build([SamplingParams(temperature=t, max_tokens=100)] * b, "cpu",
                                      drafts=[list(range(5, 5 + k))] * b)
        sampler = Sampler(torch.device("cpu"))
        logits = torch.randn(b * (k + 1), VOCAB, generator=g) * 4
        logits[meta.draft_rows, meta.spec.draft_token_ids] = 80.0  # every draft accepted
        if mode == "rows":  # the general path on every row, with the randomness __call__ draws
            def call():
                return sampler._sample(logits, meta, sampler.randomness(logits, meta))
        else:
            def call():
                return sampler(logits, meta)
        accepted = call().num_accepted  # and warm-up
        if accepted != [k] * b:
            raise SystemExit(f"{mode}: drafts were meant to be accepted, got {accepted}")
        start = time.perf_counter()
        for _ in range(calls):
            call()
        out[f"{t} {b} {k}"] = (time.perf_counter() - start) / calls * 1e3
    print(json.dumps(out))


def render(r: dict) -> str:
    lines = ["# The sampler on a CPU: fused ops against torch", "",
             f"Command: `{r['command']}`", "",
             "Sampler.__call__ per step, ms (median over rounds; each round one process per mode, alternating), "
             f"random logits of {VOCAB} tokens a row; k drafts per sequence (one-hot, each its row's favourite by "
             "far: all accepted, every row read). torch: SPECD_CPU_KERNELS=0; rows: the fused argmax and inverse "
             "CDF on every row after the softmax of all rows (the path before the walk); walk: the fused walk "
             "(verify_chains), what the sampler runs on a CPU:", "",
             "| T | batch | k | rows | torch (ms) | rows (ms) | walk (ms) | rows / walk |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in r["rows"]:
        lines.append(f"| {row['temperature']} | {row['batch']} | {row['k']} | {row['rows']} | {row['torch_ms']:.2f} | "
                     f"{row['rows_ms']:.2f} | {row['walk_ms']:.2f} | {row['rows_ms'] / row['walk_ms']:.1f}x |")
    return "\n".join(lines + ["", machine_line(r), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--out", default="bench/results/sampler_cpu")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="walk", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.threads, args.calls, args.mode)
    t0, info = time.monotonic(), machine_info(args.threads, dtype="float32")
    runs = {"torch": [], "rows": [], "walk": []}
    for _ in range(args.rounds):
        for mode in runs:
            env = {**os.environ, "SPECD_CPU_KERNELS": "0" if mode == "torch" else "1"}
            done = subprocess.run([sys.executable, __file__, "--worker", "--mode", mode, "--threads", str(args.threads),
                                   "--calls", str(args.calls)], env=env, capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            if result.pop("fused") != (mode != "torch"):
                raise SystemExit(f"the {mode} run did not get the path it asked for")
            runs[mode].append(result)
    rows = [{"temperature": t, "batch": b, "k": k, "rows": b * (k + 1),
             **{f"{mode}_ms": statistics.median(run[f"{t} {b} {k}"] for run in runs[mode]) for mode in runs}}
            for t, b, k in CELLS]
    write_result(Path(args.out), "bench/sampler_cpu.py", None, info, vars(args), rows, t0, render)


if __name__ == "__main__":
    main()
