"""What a constraint costs: decode speed and acceptance with a JSON schema vs free text, in one run.

    python bench/structured.py --threads 2

The default target in its `auto` dtype, offline (specd.LLM), greedy. Prompts: the 22 requests of
tests/json_schemas.py ("... Answer in JSON."), repeated to fill batch 32. Per batch (1 and 32) and
decoding (plain; suffix, the trained draft model and the committed EAGLE head with k = 4 and the
controller off; the model drafters with and without masking their own drafts by the schema,
specd/proposers/draft_grammar.py): the same prompts free and constrained to their schemas,
interleaved, each run twice; tok/s = generated tokens / wall time
of the run (the constrained answers end with their JSON; the free ones run to max_tokens or EOS).
Also: the share of the run spent cutting drafts at the grammar and filling masks
(StepTimings.mask_s), and acceptance (accepted / draft tokens).

Writes bench/results/structured.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from json_schemas import SCHEMAS  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--configs", default=None, help="comma list of the decodings to run (default: all)")
    p.add_argument("--append", action="store_true", help="add these rows to the existing results")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from specd import LLM, SamplingParams
    from specd.models import model_store
    from specd.models.chat import chat_prompt_ids

    info = machine_info(args.threads, "cpu", "auto")
    t0 = time.monotonic()
    configs = decodings(model_store)
    if args.configs:
        configs = {k: configs[k] for k in args.configs.split(",")}
    previous = json.loads((RESULTS / "structured.json").read_text()) if args.append else None
    rows = [x for x in previous["rows"] if x["decoding"] not in configs] if previous else []
    for name, spec in configs.items():
        llm = LLM(str(model_store.target_dir()), max_model_len=2048, speculative_config=spec)
        prompts = [chat_prompt_ids(llm.tokenizer, [{"role": "user", "content": f"{r} Answer in JSON."}])
                   for r, _, _ in SCHEMAS]
        for batch in (1, 32):
            idx = [i % len(SCHEMAS) for i in range(batch if batch > 1 else len(SCHEMAS))]
            runs = {"free": [], "json schema": []}
            for _ in range(args.repeats):
                for mode in runs:
                    params = [SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                             structured_outputs={"json": SCHEMAS[i][1]} if mode != "free" else None)
                              for i in idx]
                    timings = llm.engine.timings
                    mask0 = timings.mask_s
                    t = time.perf_counter()
                    outs = []
                    for i in range(0, len(idx), batch):  # batch 1: one request after another
                        outs += llm.generate([prompts[j] for j in idx[i:i + batch]], params[i:i + batch])
                    wall = time.perf_counter() - t
                    tokens = sum(len(o.token_ids) for o in outs)
                    drafted = sum(o.spec["draft_tokens"] for o in outs) if spec else 0
                    accepted = sum(o.spec["accepted_tokens"] for o in outs) if spec else 0
                    valid = sum(_valid(o.text, SCHEMAS[i][1]) for o, i in zip(outs, idx)) if mode != "free" else None
                    runs[mode].append({"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
                                       "mask_share": (timings.mask_s - mask0) / wall, "draft_tokens": drafted,
                                       "accepted_tokens": accepted, "valid": valid})
            for mode, rs in runs.items():
                rows.append({"decoding": name, "batch": batch, "mode": mode, "requests": len(idx),
                             "tok_s": statistics.median(r["tok_s"] for r in rs),
                             "mask_share": statistics.median(r["mask_share"] for r in rs),
                             "acceptance": (sum(r["accepted_tokens"] for r in rs) / sum(r["draft_tokens"] for r in rs)
                                            if spec and sum(r["draft_tokens"] for r in rs) else None),
                             "tokens": rs[-1]["tokens"], "valid": rs[-1]["valid"], "runs": rs})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "runs"}), file=sys.stderr, flush=True)
        del llm
    write_result(RESULTS / "structured", "bench/structured.py", argv, info, vars(args), rows, t0, render)
    return 0


def decodings(model_store) -> dict:
    k4 = {"num_speculative_tokens": 4, "adaptive": False}
    draft_model = {"method": "draft_model", "model": str(model_store.drafter_dir()), **k4}
    eagle = {"method": "eagle", "model": str(model_store.committed_head_dir("eagle")),
             "target_model": str(model_store.target_dir()), **k4}
    return {"plain": None, "suffix k=4": {"method": "suffix", "suffix_decoding_max_cached_requests": 0, **k4},
            "draft_model k=4": draft_model,
            "draft_model k=4, drafter unmasked": {**draft_model, "draft_structured_outputs": False},
            "eagle k=4": eagle, "eagle k=4, drafter unmasked": {**eagle, "draft_structured_outputs": False}}


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["# What a constraint costs: JSON schema vs free text", "", f"Command: `{r['command']}`", "",
             f"Default target, dtype `auto`, offline, greedy, up to {s['max_tokens']} tokens; the 22 requests of "
             "tests/json_schemas.py (batch 1: one after another; batch 32: the 22 repeated to 32, in one batch), "
             f"free and constrained to their schemas, interleaved, median of {s['repeats']} runs. tok/s = generated "
             "tokens / wall time, prefill included: the constrained answers end with their JSON (about 30 tokens) "
             "where the free ones run on, so prefill weighs more per constrained token and a batch of them thins out "
             "sooner; the direct cost of the grammar is its share of the run (cutting drafts and filling masks).", "",
             "| decoding | batch | output | tok/s | constrained / free | grammar share of the run | acceptance | "
             "valid |", "|---|---:|---|---:|---:|---:|---:|---|"]
    by = {(x["decoding"], x["batch"], x["mode"]): x for x in r["rows"]}
    for x in r["rows"]:
        free = by[(x["decoding"], x["batch"], "free")]["tok_s"]
        acc = "-" if x["acceptance"] is None else f"{x['acceptance']:.2f}"
        valid = "-" if x["valid"] is None else f"{x['valid']}/{x['requests']}"
        lines.append(f"| {x['decoding']} | {x['batch']} | {x['mode']} | {x['tok_s']:.1f} | {x['tok_s'] / free:.2f}x | "
                     f"{100 * x['mask_share']:.1f}% | {acc} | {valid} |")
    lines += ["", "Drafter-side masking: the model drafters mask their own drafts with the request's schema "
              "(default), or draft unmasked and the verifier cuts each draft at the first token the schema refuses. "
              "Under the JSON schema:", "",
              "| drafter | batch | acceptance masked | acceptance unmasked | accepted tokens masked / unmasked | "
              "tok/s masked / unmasked |", "|---|---:|---:|---:|---:|---:|"]
    for x in r["rows"]:
        y = by.get((x["decoding"] + ", drafter unmasked", x["batch"], x["mode"]))
        if y is None or x["mode"] == "free":
            continue
        acc = sum(z["accepted_tokens"] for z in x["runs"]) / max(1, sum(z["accepted_tokens"] for z in y["runs"]))
        lines.append(f"| {x['decoding']} | {x['batch']} | {x['acceptance']:.2f} | {y['acceptance']:.2f} | "
                     f"{acc:.2f}x | {x['tok_s'] / y['tok_s']:.2f}x |")
    lines += ["",
              machine_line(r), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
