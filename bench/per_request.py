"""What each request of a batch gets from the server's choice, against plain decoding of the same
prompts: the per-request never-slower rule (specd/engine/spec/ledger.py) on and off, in one process.

The in-process part of the default stack (the default target in bf16, a suffix index with k 8 and
the committed datastore), one wave of B held-out prompts per run, runs interleaved per round:
plain (k = 0), the server's choice, the server's choice with the ledger's slack made unlimited (the
controller as it was before the rule), plain again. Per request, its finishing time in each run:
wall-clock, and modeled, i.e. the sum over the steps it ran in of one verify-cost table (the
controller's own, read at the end of the round, V(tokens of the step)), so this VM's drift
between runs drops out of the modeled ratios. A ratio is plain's time over the other's: below 1 the
request finished later than plain decoding would have it.

    python bench/per_request.py --threads 2 [--workloads code_edit,summarize,chat] [--batches 8,32]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from in_process_stack import in_process_stack  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402

UNLIMITED = 1e9  # the ledger's slack where the rule is off


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="code_edit,summarize,chat")
    p.add_argument("--batches", default="8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path("bench/results/per_request"))
    args = p.parse_args(argv)
    import specd.engine.spec.ledger as ledger
    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids
    from specd.sampling import SamplingParams
    from specd_train.workloads import workload

    t0 = time.monotonic()
    info = machine_info(args.threads, dtype="bfloat16")
    llm, spec = in_process_stack(args.threads)
    engine, slack = llm.engine, ledger.SLACK
    controller = engine.speculator.controller
    steps: list[tuple[float, int, list[int]]] = []  # (end, tokens in the forward, sequences finished)
    step = engine.step

    def timed_step():
        before = engine.timings.forward_tokens
        finished = step()
        steps.append((time.perf_counter(), engine.timings.forward_tokens - before, [s.seq_id for s in finished]))
        return finished

    engine.step = timed_step

    def run(prompts, k, rule_slack):
        ledger.SLACK = rule_slack
        steps.clear()
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, cache_output=False, num_speculative_tokens=k)
        kept, start = controller.slack_plain_steps, time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        return {"tok_s": sum(len(o.token_ids) for o in outs) / wall, "start": start, "log": list(steps),
                "kept_plain": controller.slack_plain_steps - kept, "steps": len(steps), "tokens": [o.token_ids for o in outs]}

    def finishing(run_, cost) -> tuple[list[float], list[float]]:
        """Each request's finishing time, wall and modeled, in submission order (sequence ids ascend)."""
        done_wall, done_model, model = {}, {}, 0.0
        for end, tokens, finished in run_["log"]:
            model += cost(tokens)
            for sid in finished:
                done_wall[sid], done_model[sid] = end - run_["start"], model
        return [done_wall[s] for s in sorted(done_wall)], [done_model[s] for s in sorted(done_model)]

    rows = []
    for name in args.workloads.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [chat_prompt_ids(llm.tokenizer, m) for m in workload(name, batch)]
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))  # prefix cache warm, as served cells
            for r in range(args.rounds):
                runs = {"plain": run(prompts, 0, slack), "rule": run(prompts, None, slack),
                        "no rule": run(prompts, None, UNLIMITED), "plain 2": run(prompts, 0, slack)}
                ledger.SLACK = slack
                cost = copy.deepcopy(controller.verify_cost)
                times = {mode: finishing(x, cost) for mode, x in runs.items()}
                plain_tok_s = (runs["plain"]["tok_s"] + runs["plain 2"]["tok_s"]) / 2
                row = {"workload": name, "batch": batch, "round": r, "plain_tok_s": plain_tok_s, "plain_steps": runs["plain"]["steps"]}
                for mode in ("rule", "no rule"):
                    per_request = [a / b for a, b in zip(times["plain"][1], times[mode][1])]
                    row[mode] = {"wall_ratio": runs[mode]["tok_s"] / plain_tok_s,
                                 "modeled_min": min(per_request), "modeled_median": statistics.median(per_request),
                                 "modeled_wave": max(times["plain"][1]) / max(times[mode][1]),
                                 "steps": runs[mode]["steps"], "kept_plain": runs[mode]["kept_plain"],
                                 "greedy_identical": sum(a == b for a, b in zip(runs["plain"]["tokens"], runs[mode]["tokens"])),
                                 "requests": len(prompts)}
                rows.append(row)
                print(name, batch, r, {m: {k: round(v, 3) for k, v in row[m].items()} for m in ("rule", "no rule")},
                      file=sys.stderr, flush=True)
    settings = {"model": Path(str(model_store.default_target())).name, "speculative_config": spec, "rounds": args.rounds,
                "max_tokens": args.max_tokens, "slack": slack}
    write_result(args.out, "bench/per_request.py", argv, info, settings, rows, t0, render)
    return 0


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["# Each request against plain decoding: the per-request never-slower rule on and off (bench/per_request.py)", "",
             f"{s['model']} in bf16, suffix index k 8 with the committed datastore, one process, greedy, up to "
             f"{s['max_tokens']} tokens, one wave of B held-out prompts per run; per round: plain, server's choice "
             f"(rule: each request within {s['slack']:.0%} of plain, spec/ledger.py), server's choice without the rule, "
             "plain. Per request: plain's finishing time over the other's, modeled (one verify-cost table per round "
             "over the steps it ran in: no VM drift) - min and median over the batch; wave: the last request's. "
             "wall: tok/s over the two plain runs' mean (this VM drifts 10-30%).", "",
             "| workload | batch | round | plain steps | rule: per request min / median | wave | wall | steps | kept plain "
             "| no rule: per request min / median | wave | wall | steps | greedy identical (rule, no rule) |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for row in r["rows"]:
        a, b = row["rule"], row["no rule"]
        lines.append(f"| {row['workload']} | {row['batch']} | {row['round']} | {row['plain_steps']} "
                     f"| {a['modeled_min']:.3f} / {a['modeled_median']:.3f} | {a['modeled_wave']:.3f} | {a['wall_ratio']:.2f}x "
                     f"| {a['steps']} | {a['kept_plain']} | {b['modeled_min']:.3f} / {b['modeled_median']:.3f} "
                     f"| {b['modeled_wave']:.3f} | {b['wall_ratio']:.2f}x | {b['steps']} "
                     f"| {a['greedy_identical']}/{a['requests']}, {b['greedy_identical']}/{b['requests']} |")
    return "\n".join(lines + ["", f"Command: `{r['command']}`.", "", machine_line(r), ""])


if __name__ == "__main__":
    sys.exit(main())
