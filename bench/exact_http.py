"""Exact greedy over HTTP: every method through the real services, token for token against plain alone.

    python bench/exact_http.py --threads 1        # 32 held-out chat prompts x 256 tokens
    python bench/exact_http.py --threads 2 --out bench/results/exact_http_t2
    python bench/exact_http.py --prompts 4 --max-tokens 32 --methods suffix    # a quick check

The services as separate processes on loopback (bench/real_pair_http.Services): one drafter per
method (1 torch thread each), the verifier on the default target (its dtype `auto`, --threads T,
batch-invariant mode on, the controller off so every step drafts k = 4), the gateway; driven
with the official openai client, chat completions with `logprobs: true`. Reference: plain decoding
(`speculative: {num_speculative_tokens: 0}`), each prompt alone. Then plain with 16 requests in
flight (different lengths: prefill chunks and decode rows share steps), and each method
(`speculative: {drafter: METHOD, num_speculative_tokens: 4}`) alone and with 16 in flight. A
request is identical when its tokens (the logprobs' token strings, in order) are the reference's;
the largest difference of the chosen tokens' logprobs is reported too (0 where the logits are the
same bits). eagle runs the committed EAGLE head; eagle3, medusa and mlp_speculator random-weight
heads in their published layouts (they draft nonsense, but every verify step still holds k + 1 rows).

Writes bench/results/exact_http.{md,json} (or --out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exact_bf16 import EAGLE_HEAD, RANDOM_HEADS, random_head  # noqa: E402
from machine import machine_info  # noqa: E402
from real_pair_http import Services  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("ngram", "suffix", "draft_model", "eagle", "combined", "draft_model_tree", *RANDOM_HEADS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the verifier")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    p.add_argument("--propose-timeout-ms", type=float, default=2000.0,
                   help="the verifier's propose deadline: generous, so a drafter slowed by the other processes on "
                        "the cores still drafts (past it, the verifier routes around it; the table says who drafted)")
    p.add_argument("--out", default=str(RESULTS / "exact_http"))
    return p.parse_args(argv)


def complete(client, model: str, messages: list[dict], max_tokens: int, speculative: dict) -> dict:
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0.0,
                                       logprobs=True, extra_body={"speculative": speculative})
    content = r.choices[0].logprobs.content or []
    spec = (r.usage.model_extra or {}).get("speculative") or {}
    return {"tokens": [c.token for c in content], "logprobs": [c.logprob for c in content],
            "exact": (r.model_extra or {}).get("exact"), "draft_tokens": spec.get("draft_tokens", 0),
            "accepted_tokens": spec.get("accepted_tokens", 0), "drafts_by_drafter": spec.get("drafters", {})}


def run(client, model, prompts, max_tokens, speculative, batch) -> list[dict]:
    one = lambda m: complete(client, model, m, max_tokens, speculative)  # noqa: E731
    if batch == 1:
        return [one(m) for m in prompts]
    with ThreadPoolExecutor(batch) as pool:
        return list(pool.map(one, prompts))


def compare(ref: list[dict], got: list[dict]) -> dict:
    first, lp_diff = [], 0.0
    for a, b in zip(ref, got):
        x, y = a["tokens"], b["tokens"]
        first.append(next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), None if len(x) == len(y) else min(len(x), len(y))))
        if first[-1] is None:
            lp_diff = max([lp_diff] + [abs(p - q) for p, q in zip(a["logprobs"], b["logprobs"])])
    by = {}
    for g in got:
        for name, n in g["drafts_by_drafter"].items():
            by[name] = by.get(name, 0) + n
    return {"identical": sum(f is None for f in first), "of": len(ref), "first_divergence": first,
            "max_logprob_diff_identical": lp_diff, "draft_tokens": sum(g["draft_tokens"] for g in got),
            "accepted_tokens": sum(g["accepted_tokens"] for g in got), "drafts_by_drafter": by,
            "exact_reported": sorted({str(g["exact"]) for g in got})}


def main(argv=None) -> int:
    args = parse_args(argv)
    import openai

    from specd.models import model_store
    from specd_train.workloads import workload

    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods: {', '.join(sorted(unknown))}")
    t0 = time.monotonic()
    info = machine_info(args.threads, "cpu", "auto")
    tmp = tempfile.TemporaryDirectory()
    heads = {m: random_head(m, Path(tmp.name)) for m in methods if m in RANDOM_HEADS}
    if "eagle" in methods:
        heads["eagle"] = str(EAGLE_HEAD)
    prompts = workload("chat", args.prompts)
    rows = []
    with Services(str(model_store.target_dir()), str(model_store.drafter_dir()), methods, args.threads, "auto",
                  args.k, propose_timeout_ms=args.propose_timeout_ms, heads=heads,
                  verifier_spec={"adaptive": False}) as svc:
        client = openai.OpenAI(base_url=svc.base_url, api_key="unused", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        plain = {"num_speculative_tokens": 0}
        ref = run(client, model, prompts, args.max_tokens, plain, 1)
        cells = [("plain", args.batch, plain)]
        cells += [(m, b, {"num_speculative_tokens": args.k, "drafter": m}) for m in methods for b in (1, args.batch)]
        for method, batch, spec in cells:
            got = run(client, model, prompts, args.max_tokens, spec, batch)
            rows.append({"method": method, "batch": batch, **compare(ref, got)})
            r = rows[-1]
            print(f"{method:16s} batch {batch:3d}: {r['identical']}/{r['of']} identical, draft tokens "
                  f"{r['draft_tokens']} ({r['drafts_by_drafter']}), accepted {r['accepted_tokens']}",
                  file=sys.stderr, flush=True)
    info["load_avg_end"] = os.getloadavg()[0]
    result = {"machine": info, "command": " ".join(["python", "bench/exact_http.py", *(argv or sys.argv[1:])]),
              "settings": vars(args) | {"dtype": "auto", "workload": "chat", "drafter_threads": 1},
              "reference_tokens": sum(len(r["tokens"]) for r in ref), "rows": rows,
              "elapsed_s": time.monotonic() - t0}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(f"wrote {out}.md", file=sys.stderr)
    return 0


def render(r: dict) -> str:
    m, s = r["machine"], r["settings"]
    lines = ["# Exact greedy over HTTP: every method through the real services", "", f"Command: `{r['command']}`", "",
             f"SmolLM2-135M-Instruct (default target), its dtype `auto`, the services as processes on loopback "
             f"(verifier {s['threads']} torch thread(s), each drafter 1), the official openai client; "
             f"{s['prompts']} held-out chat prompts x up to {s['max_tokens']} tokens (EOS ends a request; "
             f"{r['reference_tokens']} reference tokens), greedy, k = {s['k']} with the controller off. "
             f"Propose deadline {s.get('propose_timeout_ms', 250):g} ms. "
             "Reference: plain decoding, each prompt alone, over HTTP. Batch "
             f"{s['batch']}: {s['batch']} requests in flight. eagle: the committed EAGLE head; "
             f"{', '.join(RANDOM_HEADS)}: random-weight heads in their published layouts (they draft nonsense, "
             "but every verify step still holds k + 1 rows).", "",
             "| decoding | batch | identical to the reference | first divergence (token index) | largest logprob "
             "difference (identical rows) | draft tokens (drafts by drafter) | accepted tokens | `exact` in responses |",
             "|---|---:|---:|---|---:|---|---:|---|"]
    for row in r["rows"]:
        div = sorted(f for f in row["first_divergence"] if f is not None)
        by = ", ".join(f"{k} {v}" for k, v in sorted(row["drafts_by_drafter"].items())) or "-"
        lines.append(f"| {row['method']} | {row['batch']} | {row['identical']}/{row['of']} | "
                     f"{', '.join(map(str, div[:8])) or '-'} | {row['max_logprob_diff_identical']:.3g} | "
                     f"{row['draft_tokens']} ({by}) | {row['accepted_tokens']} | {', '.join(row['exact_reported'])} |")
    lines += ["", f"Machine: {m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m['cores']} cores, torch {m['torch']}; "
              f"load average {m['load_avg_start']:.2f} at start, {m['load_avg_end']:.2f} at end; {m['date']}; "
              f"{r['elapsed_s'] / 60:.0f} min.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
