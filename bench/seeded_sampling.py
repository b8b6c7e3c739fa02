"""Seeded sampled requests served: `specd up` with its defaults, the official client, held-out chat
prompts at a temperature, each request seeded (seed0 + its index); per batch size, plain (k = 0 in
the request) and the server's choice interleaved (plain, choice, plain, choice, ...). A seeded
request's token at each position is drawn by its seed and that position alone
(specd/engine/sampler.py, position_walk), so the answers must be the same text with and without
speculation, and the server picks its k as for any request (before, a seeded sampled request was
pinned to the config's k: 0.59-0.65x of plain at batch 8 in one process). Runs alternate, plain first
and last; a choice run is compared with the mean of the plain runs on either side.

    python bench/seeded_sampling.py --threads 2 [--batches 8,1] [--rounds 2] [--out bench/results/seeded_sampling]
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_stack import Server  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402
from real_pair_http import free_port  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", default="8,1")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--rounds", type=int, default=2, help="(plain, choice) pairs per batch size")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed0", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path("bench/results/seeded_sampling"))
    args = p.parse_args(argv)
    from openai import OpenAI

    from specd_train.workloads import workload

    t0 = time.monotonic()
    info = machine_info(args.threads, dtype="bfloat16")
    messages = workload("chat", args.prompts)
    port = free_port()
    up = Server([sys.executable, "-m", "specd.cli", "up", "--threads", str(args.threads), "--port", str(port),
                 "--verifier-port", str(free_port()), "--drafter-port", str(free_port()), "--metrics-port", "0"],
                f"http://127.0.0.1:{port}/health")
    rows = []
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for m in messages:  # every prompt in the prefix cache first, as every timed run finds it
            client.chat.completions.create(model=model, messages=m, max_tokens=1)

        def one(i: int, speculative: dict) -> tuple[str, int]:
            r = client.chat.completions.create(
                model=model, messages=messages[i], max_tokens=args.max_tokens, temperature=args.temperature,
                seed=args.seed0 + i, extra_body={"ignore_eos": True, "speculative": {"cache_output": False, **speculative}})
            return r.choices[0].message.content, r.usage.completion_tokens

        def run(batch: int, speculative: dict) -> tuple[list[str], float]:
            start = time.perf_counter()
            with ThreadPoolExecutor(batch) as ex:
                out = list(ex.map(lambda i: one(i, speculative), range(len(messages))))
            return [text for text, _ in out], sum(n for _, n in out) / (time.perf_counter() - start)

        for batch in (int(b) for b in args.batches.split(",")):
            plain_texts, before = run(batch, {"num_speculative_tokens": 0})
            for r in range(args.rounds):  # each choice run between two plain runs (this VM drifts within minutes)
                choice_texts, choice_tok_s = run(batch, {})
                after_texts, after = run(batch, {"num_speculative_tokens": 0})
                assert after_texts == plain_texts, "plain decoding of seeded requests changed between runs"
                rows.append({"batch": batch, "round": r, "plain_tok_s": (before + after) / 2, "choice_tok_s": choice_tok_s,
                             "identical": sum(a == b for a, b in zip(plain_texts, choice_texts)),
                             "requests": len(messages)})
                print(rows[-1], flush=True)
                before = after
    finally:
        up.stop()
    write_result(args.out, "bench/seeded_sampling.py", argv, info, vars(args) | {"out": str(args.out)}, rows, t0, render)
    return 0


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["# Seeded sampled requests served (bench/seeded_sampling.py)", "",
             f"`specd up --threads {s['threads']}` with its defaults, the official client, {s['prompts']} held-out chat "
             f"prompts, T {s['temperature']}, seed {s['seed0']} + the prompt's index, {s['max_tokens']} tokens each "
             "(ignore_eos), B streams at a time; plain (k = 0) and the server's choice alternate, plain first and last: "
             "plain tok/s is the mean of the plain runs before and after a choice run. identical: answers whose text is "
             "the same with and without speculation (the plain runs' texts are checked equal to each other).", "",
             "| batch | round | plain tok/s | server's choice tok/s | ratio | identical |", "|---:|---:|---:|---:|---:|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['batch']} | {row['round']} | {row['plain_tok_s']:.1f} | {row['choice_tok_s']:.1f} | "
                     f"{row['choice_tok_s'] / row['plain_tok_s']:.2f}x | {row['identical']}/{row['requests']} |")
    lines += ["", f"Command: `{r['command']}`.", "", machine_line(r), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
