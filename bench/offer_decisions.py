"""What the controller does with the drafts an in-process index offers, at batch 1, against what they
would have made: each step of the server's choice sorted into an offer taken, an offer dropped, no
offer, and a step that reused a plain plan (the index not asked), with the tokens each offer
made (taken) or would have made (dropped: its prefix that equals plain decoding's greedy answer);
and the server's choice against the requests asking for a fixed k (every offer taken up to k).

    python bench/offer_decisions.py --threads 2 [--workloads chat,code_edit,summarize] [--fixed-k 3,8]

One process: the default target in bf16, the suffix index with k 8 and the committed datastore, as
`specd up` runs it. Per prompt, interleaved per round: plain (k = 0: the reference answer), the
server's choice, each fixed k. Speed is modeled: every step priced by one table per round, V(tokens of
the step) = the median forward (with sampling) of the round's steps of that size, plain decoding as
V(1) a token, so this VM's drift drops out; wall tok/s over plain's beside it. The prefill step is left out of both.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_process_stack import in_process_stack  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402

LENGTHS = range(1, 9)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="chat,code_edit,summarize")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fixed-k", default="3,8")
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("bench/results/offer_decisions"))
    args = p.parse_args(argv)
    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.sampling import SamplingParams
    from specd_train.workloads import workload

    t0 = time.monotonic()
    info = machine_info(args.threads, dtype="bfloat16")
    llm, spec = in_process_stack(args.threads)
    engine, speculator = llm.engine, llm.engine.speculator
    controller = speculator.controller
    step_log: list[dict] = []  # this run's steps: forward tokens, and where a plan ran, its offer and k
    current: dict = {}
    ask, plan, reuse, step = speculator.offers.ask, controller.plan, controller.reuse_plain, engine.step

    def asked(decoding, *a, **kw):
        offers = ask(decoding, *a, **kw)
        (e,) = decoding  # batch 1
        current["at"], current["offer"] = len(e.seq), next(iter(offers.get(e.seq.seq_id, {}).values()), [])
        return offers

    def planned(seqs, *a, **kw):
        choice = plan(seqs, *a, **kw)
        current["k"] = choice[0][0]
        return choice

    def reused(seqs, base_tokens):
        choice = reuse(seqs, base_tokens)
        if choice is not None:
            current["reused"] = True
        return choice

    def logged_step():
        current.clear()
        before, verify_s = engine.timings.forward_tokens, engine.timings.verify_s
        finished = step()
        step_log.append({**current, "tokens": engine.timings.forward_tokens - before,
                         "seconds": engine.timings.verify_s - verify_s})
        return finished

    speculator.offers.ask, controller.plan, controller.reuse_plain, engine.step = asked, planned, reused, logged_step

    def run(prompt, k):
        step_log.clear()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, cache_output=False, num_speculative_tokens=k)
        start = time.perf_counter()
        (out,) = llm.generate([prompt], params)
        return {"tokens": list(out.token_ids), "wall": time.perf_counter() - start, "steps": list(step_log[1:]),
                "prompt_len": len(prompt)}

    modes = ["plain", "choice", *(f"k={k}" for k in args.fixed_k.split(","))]
    rows = []
    for name in args.workloads.split(","):
        prompts = [chat_prompt_ids(llm.tokenizer, m) for m in workload(name, args.prompts)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))  # prefix cache warm, as served cells
        for r in range(args.rounds):
            runs = {m: [] for m in modes}
            for prompt in prompts:
                for m in modes:
                    runs[m].append(run(prompt, 0 if m == "plain" else None if m == "choice" else int(m[2:])))
            cost = round_costs(runs, copy.deepcopy(controller.verify_cost))  # one table for every run of the round
            row = {"workload": name, "round": r, "prompts": len(prompts)}
            plain_wall = sum(x["wall"] for x in runs["plain"]) / sum(len(x["tokens"]) for x in runs["plain"])
            for m in modes[1:]:
                tokens = sum(len(x["tokens"]) for x in runs[m])
                modeled = sum(cost(s["tokens"]) for x in runs[m] for s in x["steps"])
                wall = sum(x["wall"] for x in runs[m]) / tokens
                row[m] = {"modeled": tokens * cost(1) / modeled, "wall": plain_wall / wall,
                          "tokens_per_step": tokens / sum(len(x["steps"]) for x in runs[m]),
                          "identical": sum(a["tokens"] == b["tokens"] for a, b in zip(runs[m], runs["plain"]))}
            row["decisions"] = decisions(runs["choice"], runs["plain"])
            rows.append(row)
            print(name, r, {m: {k: round(v, 3) for k, v in row[m].items()} for m in modes[1:]},
                  file=sys.stderr, flush=True)
    settings = {"model": Path(str(model_store.default_target())).name, "speculative_config": spec, "modes": modes,
                "rounds": args.rounds, "max_tokens": args.max_tokens}
    write_result(args.out, "bench/offer_decisions.py", argv, info, settings, rows, t0, render)
    return 0


def round_costs(runs: dict, fallback):
    """Seconds of a forward by its token count: the median over every step of the round with that
    count, in any mode (the controller's table, fallback, where none had it)."""
    by_tokens: dict[int, list[float]] = {}
    for mode_runs in runs.values():
        for x in mode_runs:
            for s in x["steps"]:
                by_tokens.setdefault(s["tokens"], []).append(s["seconds"])
    table = {t: statistics.median(v) for t, v in by_tokens.items()}
    return lambda tokens: table[tokens] if tokens in table else fallback(tokens)


def decisions(choice_runs: list[dict], plain_runs: list[dict]) -> dict:
    """Per kind of step (taken, dropped, none, reused) and offer length: steps, and the tokens the offer
    made or would have made (its prefix that equals the plain answer from where it was drafted)."""
    count: Counter = Counter()
    for run_, ref in zip(choice_runs, plain_runs):
        for s in run_["steps"]:
            if s.get("reused"):
                count["reused"] += 1
                continue
            if "k" not in s:
                continue  # no plan (the warm-up, or a step without a decoding sequence)
            offer = s.get("offer", [])
            kind = "none" if not offer else "taken" if s["k"] > 0 else "dropped"
            count[kind] += 1
            if offer:
                # the offer drafts from the answer's token at len(sequence) - len(prompt) on
                answer = ref["tokens"][s["at"] - run_["prompt_len"]:]
                made = next((j for j, (a, b) in enumerate(zip(offer, answer)) if a != b), min(len(offer), len(answer)))
                length = min(len(offer), max(LENGTHS))
                count[kind, length] += 1
                count[kind, length, "made"] += made
    return {str(k): v for k, v in count.items()}


def render(r: dict) -> str:
    s = r["settings"]
    modes = s["modes"][1:]
    lines = ["# What the controller does with an index's offers (bench/offer_decisions.py)", "",
             f"{s['model']} in bf16, suffix index k 8 with the committed datastore, one process, batch 1, greedy, "
             f"up to {s['max_tokens']} tokens; per prompt: plain (the reference), the server's choice, fixed k. "
             "modeled: plain decoding's time over the mode's, every step priced by one table per round (the median "
             "forward of the round's steps of its size); wall: the same "
             "from tok/s (this VM drifts 10-30%).", "",
             "| workload | round | " + " | ".join(f"{m}: modeled / wall / tokens a step" for m in modes)
             + " | greedy identical |", "|---|---:|" + "---|" * len(modes) + "---|"]
    for row in r["rows"]:
        lines.append(f"| {row['workload']} | {row['round']} | " + " | ".join(
            f"{row[m]['modeled']:.3f} / {row[m]['wall']:.2f}x / {row[m]['tokens_per_step']:.2f}" for m in modes)
            + " | " + ", ".join(f"{row[m]['identical']}/{row['prompts']}" for m in modes) + " |")
    lines += ["", "The server's choice, step by step: steps whose offer of L tokens was taken or dropped, and the "
              "tokens a step's offer made (taken) or would have made (dropped: its prefix equal to plain's answer), "
              "mean per step; "
              "reused: plain plans reused without asking the index.", "",
              "| workload | round | reused | no offer | "
              + " | ".join(f"L={n} taken / dropped" for n in LENGTHS) + " |",
              "|---|---:|---:|---:|" + "---|" * len(LENGTHS)]
    for row in r["rows"]:
        d = row["decisions"]

        def cell(kind, n):
            steps = d.get(str((kind, n)), 0)
            return f"{steps}: {d.get(str((kind, n, 'made')), 0) / steps:.2f}" if steps else "0"

        lines.append(f"| {row['workload']} | {row['round']} | {d.get('reused', 0)} | {d.get('none', 0)} | "
                     + " | ".join(f"{cell('taken', n)} / {cell('dropped', n)}" for n in LENGTHS) + " |")
    return "\n".join(lines + ["", f"Command: `{r['command']}`.", "", machine_line(r), ""])


if __name__ == "__main__":
    sys.exit(main())
