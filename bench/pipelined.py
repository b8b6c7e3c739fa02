"""Pipelined drafting vs synchronous drafting over HTTP at batch 1, on the real default target.

    python bench/pipelined.py [--max-tokens 128] [--repeats 3] [--methods draft_model,eagle]

One stack: the verifier alone on one core (--verifier-core), every drafter, the gateway and
this client on the other (--drafter-core), each process with 1 torch thread. Per method two
drafter processes run the same proposer: one synchronous, one with --pipeline (it drafts ahead
while the verifier verifies). Requests name their drafter, so both modes and plain decoding
(k = 0) are measured in the same run, interleaved: per repeat, plain, then each drafter in a
rotating order, and a closing plain run. Reported per drafter: tok/s, the ratio to plain (the
mean of the plain runs around it), the pipelined/synchronous ratio (runs in the same repeat),
the draft-cache hit rate (steps whose drafts were drafted ahead / steps with drafts, from the
verifier's counters), the verifier's step time, alpha per position, and whether the greedy
text equals plain decoding's.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from real_pair_http import Client, free_port, metrics_delta, scrape  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="draft_model,eagle")
    p.add_argument("--eagle", default=None, help="EAGLE head directory (default: models/<target>-eagle)")
    p.add_argument("--prompts", type=int, default=4, help="chat prompts per run (held-out chat workload)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--verifier-core", type=int, default=0)
    p.add_argument("--drafter-core", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "pipelined"))
    return p.parse_args(argv)


class Procs:
    """`specd ...` children pinned to a core with taskset; all killed on exit."""

    def __init__(self):
        self.children: list[subprocess.Popen] = []

    def start(self, core: int, argv: list[str], log: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(log, "w") as f:
            self.children.append(subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-m", "specd.cli",
                                                   *argv], stdout=f, stderr=subprocess.STDOUT, env=env,
                                                  start_new_session=True))

    def close(self) -> None:
        for p in self.children:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        time.sleep(2)
        for p in self.children:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv=None) -> int:
    args = parse_args(argv)
    from specd.models import model_store
    from specd.cli.readiness import drafters_registered, grpc_serving, http_ok
    from specd_train.workloads import workload

    methods = args.methods.split(",")
    target = str(model_store.target_dir())
    eagle = args.eagle or str(Path(__file__).resolve().parents[1] / "models" / f"{Path(target).name}-eagle")
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "specd-bench-pipelined"
    logs.mkdir(parents=True, exist_ok=True)
    names = [n for m in methods for n in (m, f"{m}-pipelined")]
    ports = {n: free_port() for n in names}
    vport, vmetrics, http = free_port(), free_port(), free_port()
    procs = Procs()
    t0 = time.monotonic()
    info = machine_info(1, "cpu", args.dtype)
    try:
        for n in names:
            m = n.removesuffix("-pipelined")
            cmd = ["drafter", "--method", m, "--name", n, "--port", str(ports[n]), "--metrics-port", "0",
                   "--threads", "1", "--dtype", args.dtype, "--log-level", "warning"]
            cmd += ["--model", str(model_store.drafter_dir())] if m == "draft_model" else \
                ["--model", eagle, "--target", target]
            if n.endswith("-pipelined"):
                cmd.append("--pipeline")
            procs.start(args.drafter_core, cmd, logs / f"{n}.log")
        for n in names:
            _wait(lambda n=n: grpc_serving(f"127.0.0.1:{ports[n]}"), f"drafter {n}", logs)
        cmd = ["verifier", "--model", target, "--port", str(vport), "--metrics-port", str(vmetrics),
               "--threads", "1", "--dtype", args.dtype, "--log-level", "warning", "--propose-timeout-ms", "5000",
               "--speculative-config", json.dumps({"num_speculative_tokens": args.k})]
        for n in names:
            cmd += ["--drafter", f"{n}=127.0.0.1:{ports[n]}"]
        procs.start(args.verifier_core, cmd, logs / "verifier.log")
        verifier = f"127.0.0.1:{vport}"
        _wait(lambda: grpc_serving(verifier) and drafters_registered(verifier, names), "verifier", logs)
        procs.start(args.drafter_core, ["gateway", "--verifier", verifier, "--port", str(http), "--log-level",
                                        "warning"], logs / "gateway.log")
        _wait(lambda: http_ok(f"http://127.0.0.1:{http}/health"), "gateway", logs)
        os.sched_setaffinity(0, {args.drafter_core})  # this client too
        client = Client(f"http://127.0.0.1:{http}/v1")
        reqs = [{"messages": m, "seed": i} for i, m in enumerate(workload("chat", args.prompts))]
        for n in [None, *names]:  # warm-up: every path once
            client.run(reqs[:1], 1, args.temperature, 8, {"num_speculative_tokens": args.k, "drafter": n} if n
                       else {"num_speculative_tokens": 0})
        plains, runs = [], {n: [] for n in names}
        for rep in range(args.repeats + 1):
            plains.append(_measured(client, reqs, args, {"num_speculative_tokens": 0}, vmetrics, None))
            if rep == args.repeats:
                break
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                runs[n].append(_measured(client, reqs, args, {"num_speculative_tokens": args.k, "drafter": n},
                                         vmetrics, n))
                print(f"repeat {rep} {n}: {runs[n][-1]['tok_s']:.1f} tok/s, hit rate "
                      f"{runs[n][-1]['hit_rate']:.2f}, step {runs[n][-1]['step_ms']:.1f} ms", file=sys.stderr)
    finally:
        procs.close()
    rows = _rows(plains, runs, names, methods, args.temperature)
    result = {"command": " ".join(["python", "bench/pipelined.py", *(argv or sys.argv[1:])]),
              "target": target, "eagle": eagle, "k": args.k, "temperature": args.temperature,
              "max_tokens": args.max_tokens, "prompts": args.prompts, "repeats": args.repeats,
              "cores": {"verifier": args.verifier_core, "drafters, gateway, client": args.drafter_core},
              "plain_tok_s": [p["tok_s"] for p in plains], "rows": rows,
              "machine": {**info, "elapsed_s": time.monotonic() - t0}}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(result))
    print(f"wrote {out}.md", file=sys.stderr)
    return 0


def _wait(cond, what: str, logs: Path, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not come up (logs in {logs})")
        time.sleep(0.5)


def _measured(client, reqs, args, speculative: dict, vmetrics: int, drafter: str | None) -> dict:
    before = scrape(vmetrics)
    run = client.run(reqs, 1, args.temperature, args.max_tokens, speculative)
    after = scrape(vmetrics)
    d = metrics_delta(before, after, drafter or "none")
    cached = after.get(f"specd_spec_decode_num_cached_drafts_total{{drafter={drafter}}}", 0.0) - \
        before.get(f"specd_spec_decode_num_cached_drafts_total{{drafter={drafter}}}", 0.0)
    return {**run, "steps": d["steps"], "step_ms": d["step_ms"] or 0.0, "accepted_per_pos": d["accepted_per_pos"],
            "cached_steps": cached, "hit_rate": cached / run["drafts"] if run["drafts"] else 0.0}


def _rows(plains, runs, names, methods, temperature) -> list[dict]:
    rows = [{"drafter": "plain (k = 0)", "tok_s": statistics.median(p["tok_s"] for p in plains),
             "step_ms": statistics.median(p["step_ms"] for p in plains)}]
    for n in names:
        rs = runs[n]
        ratios = [r["tok_s"] / statistics.fmean([plains[i]["tok_s"], plains[i + 1]["tok_s"]]) for i, r in
                  enumerate(rs)]
        drafts = sum(r["drafts"] for r in rs)
        per_pos = [sum(r["accepted_per_pos"][i] if i < len(r["accepted_per_pos"]) else 0 for r in rs)
                   for i in range(max(len(r["accepted_per_pos"]) for r in rs))]
        reached = [drafts] + per_pos[:-1]
        row = {"drafter": n, "tok_s": statistics.median(r["tok_s"] for r in rs), "vs_plain": statistics.median(ratios),
               "hit_rate": sum(r["cached_steps"] for r in rs) / drafts if drafts else 0.0,
               "step_ms": statistics.median(r["step_ms"] for r in rs),
               "tokens_per_step": sum(r["tokens"] for r in rs) / max(1, sum(r["steps"] for r in rs)),
               "alpha_per_pos": [a / x if x else None for a, x in zip(per_pos, reached)],
               "every_tok_s": [r["tok_s"] for r in rs]}
        if temperature == 0:
            row["greedy_equal_plain"] = all(a == b for r in rs for a, b in zip(r["texts"], plains[0]["texts"]))
        if n.endswith("-pipelined"):
            sync = runs[n.removesuffix("-pipelined")]
            pairs = [p["tok_s"] / s["tok_s"] for p, s in zip(rs, sync)]
            row["vs_sync"] = statistics.median(pairs)
            row["vs_sync_each"] = pairs
        rows.append(row)
    return rows


def render(r: dict) -> str:
    m = r["machine"]
    lines = ["# Pipelined drafting vs synchronous drafting (HTTP, batch 1)", "",
             f"Command: `{r['command']}`", "",
             f"Target: {Path(r['target']).name} in {m.get('dtype', '')}; drafters: draft_model (the trained drafter) "
             f"and eagle (`{Path(r['eagle']).name}`), each as a synchronous and a `--pipeline` process. "
             f"{r['prompts']} held-out chat prompts one after another, {r['max_tokens']} tokens max, "
             f"temperature {r['temperature']}, k = {r['k']}, {r['repeats']} interleaved repeats (medians). Cores: "
             f"verifier alone on core {r['cores']['verifier']}; drafters, gateway and client on core "
             f"{r['cores']['drafters, gateway, client']}; 1 torch thread per process.", "",
             "| drafter | tok/s | vs plain | pipelined / synchronous | draft-cache hit rate | verifier step ms | "
             "tokens per step | alpha per position | greedy = plain |",
             "|---|---:|---:|---:|---:|---:|---:|---|:---:|"]
    for x in r["rows"]:
        alphas = " / ".join("-" if a is None else f"{a:.2f}" for a in x.get("alpha_per_pos", []))
        lines.append(f"| {x['drafter']} | {x['tok_s']:.1f} | {x.get('vs_plain', 1.0):.2f}x | "
                     f"{'%.2fx' % x['vs_sync'] if 'vs_sync' in x else '-'} | "
                     f"{'%.2f' % x['hit_rate'] if 'hit_rate' in x else '-'} | {x['step_ms']:.1f} | "
                     f"{'%.2f' % x['tokens_per_step'] if 'tokens_per_step' in x else '-'} | {alphas or '-'} | "
                     f"{({True: 'yes', False: 'NO'}).get(x.get('greedy_equal_plain'), '-')} |")
    lines += ["", f"Machine: {m['cpu']}, {m.get('cores', '')} cores; torch {m.get('torch', '')}; "
              f"load average {m.get('load_avg_start', '')} at start; {m.get('date', '')}; "
              f"{m['elapsed_s'] / 60:.0f} min."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
