"""Where a token's CPU goes when plain decode runs over HTTP: per process and per verifier thread.

    python bench/http_cpu.py --threads 2 --rounds 3

`specd up` as bench/default_stack.py starts it (the default stack), and in each round, in turn:
in-process plain decode (specd.LLM in a process of its own, the same threads), then batch-1
greedy plain decode of the chat questions over HTTP with the official client, while the CPU
seconds of every process of the stack, of the client (this process) and of each verifier thread
are read from /proc before and after, then the same over a minimal SSE reader. Per round: tok/s
of each, HTTP over in-process, and CPU milliseconds per token by process and by verifier thread
(the two busiest are the engine's OpenMP team; the others are the event loop and gRPC's).

`--env` sets variables for the stack only (e.g. '{"GOMP_SPINCOUNT": "10000"}'): the in-process
engine keeps the defaults. Results: bench/results/http_cpu.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_stack import InProcess, Server, raw_sse_one, stream_one  # noqa: E402
from machine import machine_info  # noqa: E402
from real_pair_http import free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int, thread: str | None = None) -> float:
    """utime + stime of a process (or one of its threads) from /proc."""
    path = f"/proc/{pid}/task/{thread}/stat" if thread else f"/proc/{pid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def threads_of(pid: int) -> list[str]:
    return sorted(os.listdir(f"/proc/{pid}/task"), key=int)


def stack_processes(root: int) -> dict[str, int]:
    """The stack's services by role, from their command lines (/proc: every descendant of root)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    family, out = {root}, {}
    for _ in range(4):  # up -> services (a wrapper process or two deep at most)
        family |= {pid for pid, ppid in parent.items() if ppid in family}
    for pid in sorted(family - {root}):
        try:
            line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        for role in ("verifier", "gateway", "drafter"):
            if f" {role}" in line and role not in out:
                out[role] = pid
    return out


def measure_round(client, model: str, url: str, prompts, max_tokens: int, procs: dict[str, int]) -> dict:
    plain = {"speculative": {"num_speculative_tokens": 0}}
    me = os.getpid()
    verifier_threads = threads_of(procs["verifier"])
    before = {role: cpu_seconds(pid) for role, pid in procs.items()} | {"client": cpu_seconds(me)}
    threads_before = {t: cpu_seconds(procs["verifier"], t) for t in verifier_threads}
    tokens, t0 = 0, time.perf_counter()
    for messages in prompts:
        tokens += stream_one(client, model, messages, max_tokens, 0.0, plain)[1]
    seconds = time.perf_counter() - t0
    after = {role: cpu_seconds(pid) for role, pid in procs.items()} | {"client": cpu_seconds(me)}
    threads_after = {t: cpu_seconds(procs["verifier"], t) for t in verifier_threads}
    per_token = {role: (after[role] - before[role]) / tokens * 1e3 for role in before}
    by_thread = sorted(((threads_after[t] - threads_before[t]) / tokens * 1e3 for t in verifier_threads), reverse=True)
    return {"tok_s": tokens / seconds, "ms_per_token": seconds / tokens * 1e3, "cpu_ms_per_token": per_token,
            "verifier_threads_ms_per_token": [round(x, 3) for x in by_thread if x > 0.005],
            "raw_sse_tok_s": tok_s([raw_sse_one(url, model, m, max_tokens) for m in prompts])}


def tok_s(answers: list[tuple[int, float]]) -> float:
    """(tokens, seconds) of requests made one after another -> tok/s over them all."""
    return sum(n for n, _ in answers) / sum(s for _, s in answers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--env", default="{}", help="JSON: environment variables for the stack only")
    ap.add_argument("--out", default="bench/results/http_cpu")
    args = ap.parse_args()

    from openai import OpenAI

    from specd_train.workloads import workload

    prompts = workload("chat", args.prompts)
    info = machine_info(args.threads)
    in_process = InProcess(args.threads, args.max_tokens, {"chat": prompts})
    info["dtype"] = in_process.dtype
    port = free_port()
    up = Server([sys.executable, "-m", "specd.cli", "up", "--drafter", "draft_model", "--local-drafter",
                 'suffix:{"suffix_decoding_max_cached_requests": 0}', "--threads", str(args.threads), "--port",
                 str(port), "--verifier-port", str(free_port()), "--drafter-port", str(free_port()),
                 "--metrics-port", "0"], f"http://127.0.0.1:{port}/health", env=json.loads(args.env))
    rounds = []
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        for messages in prompts:  # every prompt in the prefix cache first, as in-process does
            stream_one(client, model, messages, 1, 0.0, {"speculative": {"num_speculative_tokens": 0}})
        procs = stack_processes(up.proc.pid)
        for i in range(args.rounds):
            in_process_tok_s = tok_s([in_process.one("chat", j) for j in range(len(prompts))])
            r = measure_round(client, model, f"http://127.0.0.1:{port}", prompts, args.max_tokens, procs)
            r["in_process_tok_s"] = in_process_tok_s
            rounds.append(r)
            print(f"round {i}: in-process {in_process_tok_s:.1f} tok/s, HTTP {r['tok_s']:.1f} "
                  f"({r['tok_s'] / in_process_tok_s:.2f}x), raw SSE {r['raw_sse_tok_s']:.1f}; CPU ms a token: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_token"].items())
                  + f"; verifier threads {r['verifier_threads_ms_per_token']}", flush=True)
    finally:
        up.stop()
        in_process.stop()
    result = {"machine": info, "args": vars(args), "rounds": rounds}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))
    print(f"wrote {out}.md")


def report(r: dict) -> str:
    m, a = r["machine"], r["args"]
    lines = [f"# Plain decode over HTTP: where a token's CPU goes ({m['date']})", "",
             f"{m['cpu']} ({m.get('cpu_id', '')}), flags {' '.join(m['cpu_flags'])}, {m['cores']} cores; "
             f"{m['dtype']}, verifier and in-process engine {a['threads']} threads; the default stack "
             f"(`specd up`), chat questions, batch 1, greedy, {a['prompts']} x {a['max_tokens']} tokens per round; "
             f"stack environment {a['env']}.", "",
             "| round | in-process tok/s | HTTP tok/s (official client) | HTTP / in-process | raw SSE / in-process "
             "| ms a token over HTTP | CPU ms a token: verifier | gateway | client | drafter | verifier threads (ms a token) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for i, x in enumerate(r["rounds"]):
        c = x["cpu_ms_per_token"]
        lines.append(f"| {i} | {x['in_process_tok_s']:.1f} | {x['tok_s']:.1f} | {x['tok_s'] / x['in_process_tok_s']:.2f}x "
                     f"| {x['raw_sse_tok_s'] / x['in_process_tok_s']:.2f}x | {x['ms_per_token']:.1f} "
                     f"| {c['verifier']:.1f} | {c['gateway']:.2f} | {c['client']:.2f} | {c.get('drafter', 0):.2f} "
                     f"| {', '.join(f'{t:.2f}' for t in x['verifier_threads_ms_per_token'])} |")
    ratios = [x["tok_s"] / x["in_process_tok_s"] for x in r["rounds"]]
    lines += ["", f"HTTP / in-process: median {statistics.median(ratios):.2f}x over {len(ratios)} rounds."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
