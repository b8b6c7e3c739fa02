"""Transport: the Propose round trip on loopback, and end-to-end HTTP speed with speculation.

1. Round trip of one ProposeBatch on the persistent bidi stream (the verifier's own
   DrafterClient against a real `specd drafter --method ngram` process) at batch 1, 8, 32,
   split into time inside the proposer (propose_ns, reported by the drafter) and transport.
2. The same round trip measured inside a busy verifier (its pool statistics while HTTP
   requests run), and its share of the verifier's step time.
3. End-to-end tokens/s over HTTP (official openai client, streaming) on the demo pair at
   batch 1: speculation on (draft_model drafter) against off (per request, same stack).

    python bench/transport.py            # writes bench/results/transport.{md,json}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = "specd-demo-target"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantiles(values: list[float]) -> dict:
    v = sorted(values)
    return {"p50_us": v[len(v) // 2] * 1e6, "p99_us": v[min(len(v) - 1, int(0.99 * len(v)))] * 1e6,
            "mean_us": statistics.fmean(v) * 1e6, "n": len(v)}


async def propose_round_trips(address: str, batch: int, iters: int, history: int = 256) -> dict:
    """Steady state of a decode: each entry sends one committed token and asks for k = 4."""
    from specd.v1 import drafter_pb2
    from specd.verifier.drafter_client import DrafterClient

    client = DrafterClient("bench", address, f"bench-{batch}", timeout_s=5.0, vocab_size=4096, vocab_hash="")
    await client.connect()
    lengths = {sid: history for sid in range(batch)}
    first = drafter_pb2.ProposeBatch(client_id=client.client_id)
    for sid in range(batch):
        first.entries.add(seq_id=sid, new_tokens=[(sid * 7 + i) % 4000 for i in range(history)],
                          num_tokens=history, k=4, full_history=True, num_prompt_tokens=history)
    await client.round_trip(first)
    rtts, inside, missed = [], [], 0
    for it in range(iters + 20):
        msg = drafter_pb2.ProposeBatch(client_id=client.client_id)
        for sid in range(batch):
            lengths[sid] += 1
            msg.entries.add(seq_id=sid, new_tokens=[(sid + it) % 4000], num_tokens=lengths[sid], k=4)
        t0 = time.perf_counter()
        try:
            reply = await client.round_trip(msg)
        except TimeoutError:  # a stall on a busy machine: counted, and the stream is reopened
            missed += 1
            await client.connect()
            await client.round_trip(first)
            continue
        if it >= 20:  # warm-up
            rtts.append(time.perf_counter() - t0)
            inside.append(reply.propose_ns / 1e9)
    await client.close()
    out = quantiles(rtts)
    out["proposer_mean_us"] = statistics.fmean(inside) * 1e6
    out["transport_mean_us"] = out["mean_us"] - out["proposer_mean_us"]
    out["missed_5s_deadline"] = missed
    return out


def scrape(port: int) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            values[key] = s.value
    return values


def http_run(base_url: str, prompts: list[list[int]], max_tokens: int, speculative: dict | None) -> dict:
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=600)
    extra = {"speculative": speculative} if speculative is not None else None
    client.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0, extra_body=extra)
    tokens, spec = 0, {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    start = time.perf_counter()
    for p in prompts:
        usage = None
        for chunk in client.completions.create(model=MODEL, prompt=p, max_tokens=max_tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body=extra):
            usage = chunk.usage or usage
        tokens += usage.completion_tokens
        for key in spec:
            spec[key] += usage.model_extra["speculative"][key]
    wall = time.perf_counter() - start
    return {"tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall, **spec,
            "alpha": spec["accepted_tokens"] / spec["draft_tokens"] if spec["draft_tokens"] else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads per service process")
    parser.add_argument("--iters", type=int, default=500, help="round trips per batch size")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    from spec import heldout_prompts  # bench/spec.py: the held-out stdlib code prompts
    from specd.rpc.grpc_server import install_uvloop
    from specd.cli.readiness import grpc_serving, http_ok, wait_ready
    from specd.cli.up import Stack

    stack = Stack()
    never = threading.Event()
    ports = {n: free_port() for n in ("ngram", "dm", "verifier", "metrics", "http")}
    threads = ["--threads", str(args.threads), "--log-level", "warning"]
    try:
        stack.start("ngram", ["drafter", "--method", "ngram", "--port", str(ports["ngram"]), "--metrics-port", "0",
                              *threads])
        stack.start("dm", ["drafter", "--method", "draft_model", "--name", "draft_model", "--port", str(ports["dm"]),
                           "--metrics-port", "0", *threads])
        stack.start("verifier", ["verifier", "--port", str(ports["verifier"]), "--metrics-port", str(ports["metrics"]),
                                 "--drafter", f"draft_model=127.0.0.1:{ports['dm']}", *threads])
        stack.start("gateway", ["gateway", "--verifier", f"127.0.0.1:{ports['verifier']}", "--port",
                                str(ports["http"]), "--log-level", "warning"])
        wait_ready(stack, [("ngram", lambda: grpc_serving(f"127.0.0.1:{ports['ngram']}")),
                           ("verifier", lambda: grpc_serving(f"127.0.0.1:{ports['verifier']}")),
                           ("gateway", lambda: http_ok(f"http://127.0.0.1:{ports['http']}/health"))], never)

        install_uvloop()
        round_trips = {}
        for batch in (1, 8, 32):
            round_trips[batch] = asyncio.run(propose_round_trips(f"127.0.0.1:{ports['ngram']}", batch, args.iters))
            print(f"propose batch {batch}: {round_trips[batch]}", file=sys.stderr)

        prompts = heldout_prompts(args.prompts, 128)
        base = f"http://127.0.0.1:{ports['http']}/v1"
        off = http_run(base, prompts, args.max_tokens, {"num_speculative_tokens": 0})
        before = scrape(ports["metrics"])
        on = http_run(base, prompts, args.max_tokens, None)
        after = scrape(ports["metrics"])
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        rtt_key = "specd_verifier_propose_rtt_seconds_{}{{drafter=draft_model}}"
        rtt_sum, rtt_count = delta[rtt_key.format("sum")], delta[rtt_key.format("count")]
        step_sum, steps = delta["specd_verifier_step_seconds_sum"], delta["specd_verifier_step_seconds_count"]
        busy = {"propose_mean_ms": 1e3 * rtt_sum / max(1, rtt_count), "round_trips": rtt_count,
                "step_mean_ms": 1e3 * step_sum / max(1, steps), "steps": steps,
                "propose_share_of_step_time": rtt_sum / step_sum}
        result = {"machine": machine_info(args.threads), "threads_per_process": args.threads,
                  "load_average_1m_at_end": os.getloadavg()[0],
                  "round_trips": round_trips, "in_service_draft_model": busy,
                  "http": {"off": off, "on": on, "speedup": on["tokens_per_s"] / off["tokens_per_s"]},
                  "workload": {"prompts": args.prompts, "prompt_tokens": 128, "max_tokens": args.max_tokens,
                               "temperature": 0}}
    finally:
        stack.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "transport.md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    m = r["machine"]
    lines = ["# Transport: Propose round trip and end-to-end HTTP", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {r['threads_per_process']} torch "
             f"thread(s) per service process, every process on the same {m['cores']} cores. {m['date']}. "
             f"1-minute load average at the end: {r['load_average_1m_at_end']:.1f} (other work on the machine "
             f"shows up here and in the p99s).",
             "Command: `python bench/transport.py`", "",
             "## Propose round trip on loopback (verifier's DrafterClient <-> `specd drafter --method ngram`)", "",
             "Steady decode: each entry carries one committed token and asks for k = 4; 256-token histories.", "",
             "| batch | p50 (µs) | p99 (µs) | mean (µs) | in proposer (µs) | transport (µs) |", "|---|---|---|---|---|---|"]
    for batch, q in r["round_trips"].items():
        lines.append(f"| {batch} | {q['p50_us']:.0f} | {q['p99_us']:.0f} | {q['mean_us']:.0f} | "
                     f"{q['proposer_mean_us']:.0f} | {q['transport_mean_us']:.0f} |")
    b = r["in_service_draft_model"]
    h = r["http"]
    w = r["workload"]
    lines += ["", "## Inside a busy verifier (draft_model drafter, HTTP batch 1)", "",
              f"{b['round_trips']:.0f} propose round trips (each includes the drafter's k forwards) of "
              f"{b['propose_mean_ms']:.2f} ms on average, in {b['steps']:.0f} steps of {b['step_mean_ms']:.2f} ms on "
              f"average (the controller chose k = 0 on the other steps): proposing took "
              f"{100 * b['propose_share_of_step_time']:.0f}% of all step time.", "",
              f"## End to end over HTTP, batch 1 ({w['prompts']} held-out prompts x {w['prompt_tokens']} tokens, "
              f"{w['max_tokens']} new tokens, greedy, streaming)", "",
              "| speculation | tokens/s | alpha | drafts | draft tokens | accepted |", "|---|---|---|---|---|---|"]
    for name in ("off", "on"):
        x = h[name]
        alpha = f"{x['alpha']:.3f}" if x["alpha"] is not None else "-"
        lines.append(f"| {name} | {x['tokens_per_s']:.1f} | {alpha} | {x['drafts']} | {x['draft_tokens']} | "
                     f"{x['accepted_tokens']} |")
    lines += ["", f"**Speculation on / off over HTTP: {h['speedup']:.2f}x** (same stack, per-request switch).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
