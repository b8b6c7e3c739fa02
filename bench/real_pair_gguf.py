"""A target and a draft model of the same family, both GGUF, as llama.cpp users run speculation:
specd and llama.cpp's llama-server on the same files, driven by the same client.

    python bench/real_pair_gguf.py --target T.gguf --draft D.gguf --threads 2 \
        --llama-server "$(bash bench/build_llamacpp.sh --print-dir)/llama-server"

Servers, all loaded for the whole run (an idle one sleeps), so every mode is measured in the same rounds:
- specd: `specd up --target T.gguf --drafter draft_model:D.gguf --threads N`, nothing else. Modes:
  plain (`speculative: {num_speculative_tokens: 0}` in the request) and the server's choice (no field);
- llama-server -m T.gguf: plain; `-md D.gguf --spec-type draft-simple` (its draft model); and
  `--spec-type ngram-mod` (its n-gram speculation). Each with -t N -tb N, -c 4096, --jinja.
Per workload (held-out chat questions, code edits that repeat the prompt, summaries of a given text),
temperature and batch: --rounds rounds, each running every mode in turn (at batch 1 prompt by prompt,
so a ratio compares requests seconds apart: this machine drifts 10-20% within minutes; at batch B a
cell of max(B, --batch-prompts) prompts, B streams at a time). tok/s of a mode = its completion tokens
over its streams' wall time, the mean over rounds; every ratio is over those means. Greedy cells check
that specd's choice gave its plain text for every request. Sampled cells (T > 0) ask for exactly
--max-tokens tokens (ignore_eos), as an answer's length changes run to run. Every server first gets each
prompt once for one token, untimed (each has a prefix cache). Every measured specd request keeps its
answer out of the suffix index's cache (cache_output false), or later rounds would draft from earlier ones.

Results: --out (default bench/results/real_pair_gguf).{md,json}.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_stack import Server, one_at_a_time, run_cell, stream_one, warm_up  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402
from real_pair_http import free_port  # noqa: E402

SPECD_MODES = {"specd plain": {"num_speculative_tokens": 0, "cache_output": False},
               "specd choice": {"cache_output": False}}
LLAMA_MODES = {"llama plain": [], "llama draft model": ["-md", "{draft}", "--spec-type", "draft-simple"],
               "llama ngram-mod": ["--spec-type", "ngram-mod"]}


def start_servers(args) -> dict:
    """mode -> (client, model name, extra body without the sampling part)."""
    from openai import OpenAI

    servers, modes = [], {}
    port = free_port()
    argv = [sys.executable, "-m", "specd.cli", "up", "--target", args.target, "--drafter", f"draft_model:{args.draft}",
            "--threads", str(args.threads), "--port", str(port), "--verifier-port", str(free_port()),
            "--drafter-port", str(free_port()), "--metrics-port", "0"]
    servers.append(Server(argv, f"http://127.0.0.1:{port}/health", env={"OMP_NUM_THREADS": str(args.threads)}))
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
    model = client.models.list().data[0].id
    for name, spec in SPECD_MODES.items():
        modes[name] = (client, model, {"speculative": spec})
    if args.llama_server:
        for name, flags in LLAMA_MODES.items():
            lport = free_port()
            argv = [args.llama_server, "-m", args.target, "--port", str(lport), "-t", str(args.threads),
                    "-tb", str(args.threads), "-c", "4096", "--jinja", *(f.format(draft=args.draft) for f in flags)]
            servers.append(Server(argv, f"http://127.0.0.1:{lport}/health"))
            modes[name] = (OpenAI(base_url=f"http://127.0.0.1:{lport}/v1", api_key="unused", max_retries=0,
                                  timeout=900), "model", {})
    return {"servers": servers, "modes": modes}


def measure(modes: dict, prompts: list, batch: int, temperature: float, args) -> dict:
    """Every mode args.rounds times, in turn -> per mode its mean tok/s, its runs and texts."""
    extra = {"ignore_eos": True} if temperature > 0 else {}
    for client, model, body in modes.values():
        warm_up(client, model, prompts, body or None)
    names = list(modes)
    if batch == 1:
        calls = {name: (lambda _, m, name=name: stream_one(modes[name][0], modes[name][1], m, args.max_tokens,
                                                           temperature, {**modes[name][2], **extra}))
                 for name in names}
        runs = one_at_a_time(prompts, calls, [n for _ in range(args.rounds) for n in names])
    else:
        runs = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                client, model, body = modes[name]
                runs[name].append(run_cell(client, model, prompts, batch, args.max_tokens, temperature,
                                           {**body, **extra}))
    out = {name: {"tok_s": statistics.mean(r["tok_s"] for r in rs), "runs_tok_s": [r["tok_s"] for r in rs],
                  "texts": rs[0]["texts"], "spec": [s for r in rs for s in r["spec"] if s]} for name, rs in runs.items()}
    if temperature == 0:  # greedy: the server's choice gives plain's text, request by request, every round
        plain, choice = runs["specd plain"], runs["specd choice"]
        out["specd choice"]["identical"] = min(sum(a == b for a, b in zip(c["texts"], p["texts"]))
                                               for c, p in zip(choice, plain))
    specs = out["specd choice"]["spec"]
    out["specd choice"]["acceptance"] = (sum(s["accepted_tokens"] for s in specs)
                                         / max(1, sum(s["draft_tokens"] for s in specs)))
    for row in out.values():
        del row["texts"], row["spec"]
    return out


def table_row(cells) -> str:
    """One markdown table row (no empty cell where a column group, llama-server's modes, is absent)."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render(r: dict) -> str:
    s = r["settings"]
    llama = [m for m in LLAMA_MODES if any(m in row["modes"] for row in r["rows"])]
    lines = ["# A GGUF target and draft model: specd and llama-server on the same files (bench/real_pair_gguf.py)", "",
             f"Target `{s['target']}`, draft model `{s['draft']}`; `specd up --target T --drafter draft_model:D "
             f"--threads {s['threads']}` (its plain: k = 0 in the request; its choice: no field); llama-server "
             f"-t {s['threads']} -tb {s['threads']}: plain, `-md D --spec-type draft-simple`, `--spec-type ngram-mod`. "
             f"The official client, streamed chat, up to {s['max_tokens']} tokens (T > 0: exactly, ignore_eos); "
             f"{s['prompts']} prompts at batch 1 (modes in turn prompt by prompt), max(B, {s['batch_prompts']}) at "
             f"batch B; {s['rounds']} rounds, tok/s the mean over rounds. identical: greedy requests where the "
             f"choice gave plain's text (of {s['prompts']} or the cell's prompts). Command: `{r['command']}`", "",
             table_row(["workload", "T", "batch", "specd plain", "specd choice", *llama, "choice / own plain",
                        "choice / llama best", "acceptance", "identical"]),
             "|---|---:|---:|" + "---:|" * (len(llama) + 6)]
    for row in r["rows"]:
        m = row["modes"]
        best = max((m[n]["tok_s"] for n in llama), default=None)
        choice = m["specd choice"]
        lines.append(table_row([row["workload"], f"{row['temperature']:g}", row["batch"],
                                f"{m['specd plain']['tok_s']:.1f}", f"{choice['tok_s']:.1f}",
                                *(f"{m[n]['tok_s']:.1f}" for n in llama),
                                f"{choice['tok_s'] / m['specd plain']['tok_s']:.2f}x",
                                f"{choice['tok_s'] / best:.2f}x" if best else "-",
                                f"{choice['acceptance']:.2f}", choice.get("identical", "-")]))
    return "\n".join(lines + ["", machine_line(r), ""])


def main(argv=None) -> int:
    from specd_train.workloads import workload

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target GGUF")
    ap.add_argument("--draft", required=True, help="the draft model GGUF (the target's tokenizer)")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server (bench/build_llamacpp.sh)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--workloads", default="chat,code_edit,summarize")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per batch-1 cell")
    ap.add_argument("--batch-prompts", type=int, default=16, help="least prompts per batch-B cell")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/real_pair_gguf"))
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    info = machine_info(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    started = start_servers(args)
    rows = []
    try:
        for w in args.workloads.split(","):
            pool = workload(w, max(batches + [args.prompts, args.batch_prompts]))
            for temperature in (float(t) for t in args.temperatures.split(",")):
                for batch in batches:
                    n = args.prompts if batch == 1 else max(batch, args.batch_prompts)
                    modes = measure(started["modes"], [pool[i % len(pool)] for i in range(n)], batch, temperature, args)
                    rows.append({"workload": w, "temperature": temperature, "batch": batch, "modes": modes})
                    print(w, temperature, batch, {k: round(v["tok_s"], 1) for k, v in modes.items()}, flush=True)
    finally:
        for server in started["servers"]:
            server.stop()
    settings = {k: getattr(args, k) for k in ("target", "draft", "threads", "max_tokens", "prompts", "batch_prompts",
                                             "rounds")}
    write_result(args.out, "bench/real_pair_gguf.py", argv, info, settings, rows, t0, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
