"""Exact greedy in bfloat16: speculation on vs off, token for token, and what the mode costs.

    python bench/exact_bf16.py                    # 32 chat prompts x 256 tokens, bf16, 2 threads
    python bench/exact_bf16.py --prompts 4 --max-tokens 32    # a quick check

On the default target (SmolLM2-135M-Instruct) in bfloat16 with batch-invariant mode on (the
default): the reference is plain decoding of each held-out chat prompt alone (batch 1). Then,
token for token against it: plain decoding in mixed batches of 16 (prompts of different
lengths, so prefill and decode rows share steps), and each method (ngram, suffix, draft_model
with the trained drafter, eagle with the committed EAGLE head, k = 4) at batch 1 and in mixed
batches of 16. `--methods eagle3,medusa,mlp_speculator --append` adds the other heads: the trained
ones committed under models/, or where one is missing a random-weight head in its published layout
(the ones the tests write, tests/head_layouts.py), which drafts nonsense while every verify step
still holds k + 1 rows. The same comparison with the mode off is the control. Cost: plain decode tok/s with the mode on vs off, interleaved
runs, batch 1 and 16 (decode tok/s = tokens / (t(n) - t(1)) as in bench/engine.py).

Writes bench/results/exact_bf16.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("ngram", "suffix", "draft_model", "eagle", "combined", "draft_model_tree")
RANDOM_HEADS = {"eagle3": "eagle3", "medusa": "medusa_st", "mlp_speculator": "mlp"}  # method -> test layout
EAGLE_HEAD = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct-eagle"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cost-repeats", type=int, default=3)
    p.add_argument("--no-control", action="store_true", help="skip the mode-off comparison")
    p.add_argument("--skip-cost", action="store_true", help="token comparison only (measure the cost later, quietly)")
    p.add_argument("--cost-only", action="store_true",
                   help="measure only the cost, into the existing --out results (on a quiet machine)")
    p.add_argument("--out", default=str(RESULTS / "exact_bf16"))
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of {', '.join(METHODS + tuple(RANDOM_HEADS))}")
    p.add_argument("--append", action="store_true", help="add these rows to the existing --out results")
    return p.parse_args(argv)


def head_dir(method: str, root: Path) -> tuple[str, str]:
    """(directory, "trained" or "random"): the committed trained `method` head for the default
    target, else a random-weight one in its published layout."""
    from specd.models import model_store

    trained = model_store.committed_head_dir(method)
    return (str(trained), "trained") if trained else (random_head(method, root), "random")


def random_head(method: str, root: Path) -> str:
    """A random-weight `method` head for the default target, in its published layout."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import transformers
    from head_layouts import write_layout

    from specd.models import model_store

    target = transformers.AutoModelForCausalLM.from_pretrained(str(model_store.target_dir()))
    return str(write_layout(RANDOM_HEADS[method], root / method, target)[1])


def spec_config(method: str, heads: dict[str, str] | None = None) -> dict:
    from specd.models import model_store

    cfg = {"method": method, "num_speculative_tokens": 4, "adaptive": False}
    if method == "draft_model_tree":  # draft_model's dynamic token trees (EAGLE-2's idea)
        return {**spec_config("draft_model"), "tree": {"branching": [2, 2, 2, 2], "dynamic": True, "max_nodes": 8}}
    if method == "combined":  # one token tree merging the drafter's chain and suffix's match
        model = spec_config("draft_model")
        return {**cfg, "members": [{key: v for key, v in model.items() if key not in ("num_speculative_tokens", "adaptive")},
                                   {"method": "suffix"}]}
    if method in RANDOM_HEADS:
        return {**cfg, "model": heads[method], "target_model": str(model_store.target_dir()),
                "draft_dtype": "bfloat16"}
    if method == "eagle":  # the committed EAGLE head, reading the target's hidden states
        return {**cfg, "model": str(EAGLE_HEAD), "target_model": str(model_store.target_dir()),
                "draft_dtype": "bfloat16"}
    return {**cfg, "model": str(model_store.drafter_dir()), "draft_dtype": "bfloat16"} if method == "draft_model" else cfg


def make_llm(method: str | None, invariant: bool, heads: dict[str, str] | None = None):
    from specd import LLM

    from specd.models import model_store
    return LLM(str(model_store.target_dir()), dtype="bfloat16", max_model_len=2048, batch_invariant=invariant,
               speculative_config=spec_config(method, heads) if method else None)


def generate(llm, prompts, params, batch: int) -> list[list[int]]:
    out = []
    for i in range(0, len(prompts), batch):
        out += [o.token_ids for o in llm.generate(prompts[i:i + batch], params)]
    return out


def compare(ref, got) -> dict:
    first = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))
             for x, y in zip(ref, got)]
    return {"identical": sum(f is None for f in first), "of": len(ref), "first_divergence": first}


def decode_tok_s(llm, prompts, params, batch: int) -> float:
    from dataclasses import replace

    t = time.perf_counter()
    generate(llm, prompts, replace(params, max_tokens=1), batch)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    toks = sum(len(x) - 1 for x in generate(llm, prompts, params, batch))
    return toks / (time.perf_counter() - t - t1)


def measure_cost(args, prompts) -> list[dict]:
    """Plain decode tok/s with the mode on vs off, interleaved runs, batch 1 and args.batch."""
    from specd import SamplingParams

    llms = {inv: make_llm(None, inv) for inv in (True, False)}
    cost_prompts = prompts[:max(4, args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    cost = []
    for batch, ps in ((1, cost_prompts[:4]), (args.batch, cost_prompts[:args.batch])):
        runs = {True: [], False: []}
        for _ in range(args.cost_repeats):
            for inv in (True, False):
                runs[inv].append(decode_tok_s(llms[inv], ps, params, batch))
        on, off = statistics.median(runs[True]), statistics.median(runs[False])
        cost.append({"batch": batch, "prompts": len(ps), "tok_s_on": on, "tok_s_off": off, "ratio": on / off,
                     "runs_on": runs[True], "runs_off": runs[False]})
        print(f"cost batch {batch}: on {on:.1f} tok/s, off {off:.1f} tok/s, {on / off:.3f}x", file=sys.stderr)
    return cost


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from specd import SamplingParams
    from specd.models.chat import chat_prompt_ids
    from specd_train.workloads import workload

    t0 = time.monotonic()
    info = machine_info(args.threads, "cpu", "bfloat16")
    out = Path(args.out)
    if args.cost_only:
        result = json.loads(out.with_suffix(".json").read_text())
        llm = make_llm(None, True)
        prompts = [chat_prompt_ids(llm.tokenizer, m) for m in workload("chat", args.prompts)]
        del llm
        result["cost"] = measure_cost(args, prompts)
        result["cost_machine"] = {**info, "load_avg_end": os.getloadavg()[0], "elapsed_s": time.monotonic() - t0}
        result["cost_command"] = " ".join(["python", "bench/exact_bf16.py", *(argv or sys.argv[1:])])
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(render(result))
        print(f"wrote {out}.md", file=sys.stderr)
        return 0
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    methods = [m for m in args.methods.split(",") if m]
    unknown = set(methods) - set(METHODS) - set(RANDOM_HEADS)
    if unknown:
        raise SystemExit(f"unknown methods: {', '.join(sorted(unknown))}")
    tmp = tempfile.TemporaryDirectory()
    chosen = {m: head_dir(m, Path(tmp.name)) for m in methods if m in RANDOM_HEADS}
    heads = {m: d for m, (d, _) in chosen.items()}
    rows = []
    for invariant in ([True] if args.no_control else [True, False]):
        plain = make_llm(None, invariant)
        prompts = [chat_prompt_ids(plain.tokenizer, m) for m in workload("chat", args.prompts)]
        ref = generate(plain, prompts, greedy, 1)
        cells = {} if args.append else {("plain", args.batch): generate(plain, prompts, greedy, args.batch)}
        del plain
        for method in methods:
            llm = make_llm(method, invariant, heads)
            for batch in (1, args.batch):
                cells[(method, batch)] = generate(llm, prompts, greedy, batch)
            del llm
        for (method, batch), got in cells.items():
            rows.append({"batch_invariant": invariant, "method": method, "batch": batch, **compare(ref, got),
                         "tokens": sum(len(x) for x in got), "head": chosen.get(method, (None, None))[1]})
            print(f"invariant={invariant} {method:12s} batch {batch:3d}: {rows[-1]['identical']}/{args.prompts} identical",
                  file=sys.stderr, flush=True)
    info["load_avg_end"] = os.getloadavg()[0]
    command = " ".join(["python", "bench/exact_bf16.py", *(argv or sys.argv[1:])])
    if args.append:
        result = json.loads(out.with_suffix(".json").read_text())
        result["rows"] += rows
        result["appended"] = result.get("appended", []) + [{"command": command, "machine": info,
                                                           "elapsed_s": time.monotonic() - t0}]
    else:
        cost = [] if args.skip_cost else measure_cost(args, prompts)
        result = {"machine": info, "command": command,
                  "settings": vars(args) | {"k": 4, "dtype": "bfloat16", "workload": "chat"},
                  "rows": rows, "cost": cost, "elapsed_s": time.monotonic() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(f"wrote {out}.md", file=sys.stderr)
    return 0


def render(r: dict) -> str:
    m, s = r["machine"], r["settings"]
    lines = ["# Exact greedy in bfloat16: speculation on vs off", "", f"Command: `{r['command']}`", "",
             f"SmolLM2-135M-Instruct (default target) in bfloat16, {s['prompts']} held-out chat prompts x up to "
             f"{s['max_tokens']} tokens (EOS ends a request), greedy, k = 4 (controller off), draft_model = the "
             "trained drafter in bf16. Reference: plain decoding, each prompt alone. Mixed batches: the prompts "
             f"in groups of {s['batch']} (different lengths, prefill and decode rows in the same steps).", ""]
    # rows from before heads were trained carry no "head": those were random
    random = sorted({x["method"] for x in r["rows"] if x["method"] in RANDOM_HEADS and x.get("head", "random") == "random"})
    trained = sorted({x["method"] for x in r["rows"] if x.get("head") == "trained"})
    if random:
        lines += [f"{', '.join(random)}: random-weight heads in their published layouts (tests/head_layouts.py); "
                  "they draft nonsense, but every verify step still holds k + 1 rows.", ""]
    if trained:
        lines += [f"{', '.join(trained)}: the trained heads committed under models/.", ""]
    lines += ["| batch-invariant mode | decoding | batch | identical to the reference | first divergence (token index) |",
              "|---|---|---:|---:|---|"]
    for row in r["rows"]:
        div = sorted(f for f in row["first_divergence"] if f is not None)
        head = f" ({row.get('head') or 'random'} head)" if row["method"] in RANDOM_HEADS else ""
        lines.append(f"| {'on' if row['batch_invariant'] else 'off (control)'} | {row['method']}{head} | {row['batch']} | "
                     f"{row['identical']}/{row['of']} | {', '.join(map(str, div[:8])) or '-'} |")
    lines += ["", "Cost of the mode (plain decode, 128 tokens, median of interleaved runs):", "",
              "| batch | mode on tok/s | mode off tok/s | on / off |", "|---:|---:|---:|---:|"]
    lines += [f"| {c['batch']} | {c['tok_s_on']:.1f} | {c['tok_s_off']:.1f} | {c['ratio']:.3f} |" for c in r["cost"]]
    if "cost_machine" in r:
        c = r["cost_machine"]
        lines += ["", f"The cost was measured separately (`{r['cost_command']}`): torch threads {c['threads']}; load "
                  f"average {c['load_avg_start']:.2f} at start, {c['load_avg_end']:.2f} at end; {c['date']}."]
    lines += ["", f"Machine: {m['cpu']} ({' '.join(m.get('cpu_flags', []))}), {m['cores']} cores, torch threads {m['threads']}, torch {m['torch']}; "
              f"load average {m['load_avg_start']:.2f} at start, {m['load_avg_end']:.2f} at end; {m['date']}; "
              f"{r['elapsed_s'] / 60:.0f} min.", ""]
    for a in r.get("appended", []):
        lines += [f"Rows added by `{a['command']}` against a fresh reference: load average "
                  f"{a['machine']['load_avg_start']:.2f} at start, {a['machine']['load_avg_end']:.2f} at end; "
                  f"{a['machine']['date']}; {a['elapsed_s'] / 60:.0f} min.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
