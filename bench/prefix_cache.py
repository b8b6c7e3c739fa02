"""Prefix caching over HTTP: multi-turn chat with a shared system prompt, the cache on vs off, and
prefix-aware vs least-loaded routing across replicas.

    python bench/prefix_cache.py                   # writes bench/results/prefix_cache.{md,json}

Workload: 10 conversations x 6 turns, every request opening with the same 500-token system prompt
(cut from held-out stdlib docstrings with the target's tokenizer); turn 1 asks one of the held-out
chat questions, turns 2-6 follow up, each resending the whole history (as chat clients do). The
10 conversations run concurrently, each turn after the previous answer; greedy, 48 tokens each.
Runs, each a fresh `specd up` with its defaults (the default target and drafters) but the flags
named: one replica with the cache on and with --no-prefix-caching; three replicas with
--routing prefix and --routing least-loaded. Per run: TTFT p50 and p95 (all turns, and turns
2-6), prompt tokens and the tokens the verifiers computed (prompt tokens less cache hits), the
hit rate from the verifiers' Prometheus counters (specd_verifier_prefix_cache_queries / _hits),
and whether every answer equals the single-replica cache-off run's (greedy must not change).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_stack import Server, stream_one  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402
from real_pair_http import free_port  # noqa: E402

FOLLOW_UPS = ("Can you say more about that?", "Give me a concrete example.", "What is a common misconception "
              "about it?", "How would you explain it to a child?", "Summarize our conversation in one sentence.")


def free_ports(n: int) -> int:
    """The first of n consecutive ports that are all free now."""
    import socket

    while True:
        base = free_port()
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue


def system_prompt(tokens: int) -> str:
    from specd.models.model_store import default_target
    from specd.models.tokenizer import Tokenizer
    from specd_train.workloads import workload

    text = "You are a careful assistant. Background notes follow; use them only when they help.\n\n" + "\n\n".join(
        m[0]["content"].split("\n\n", 1)[1] for m in workload("summarize", 64))
    tok = Tokenizer.from_dir(default_target())
    ids = tok.encode(text)
    if len(ids) < tokens:
        raise ValueError(f"only {len(ids)} tokens of notes; need {tokens}")
    return tok.decode(ids[:tokens])


def conversation(client, model: str, system: str, question: str, turns: int, max_tokens: int) -> list[dict]:
    messages, out = [{"role": "system", "content": system}], []
    for turn, ask in enumerate((question, *FOLLOW_UPS)[:turns]):
        messages.append({"role": "user", "content": ask})
        text, _, ttft, *_ = stream_one(client, model, messages, max_tokens, 0.0, None)
        messages.append({"role": "assistant", "content": text})
        out.append({"turn": turn, "ttft_s": ttft, "text": text})
    return out


def scrape(urls: list[str]) -> dict:
    """Summed verifier counters across replicas."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    want = {"specd_verifier_prefix_cache_queries_total": "queries", "specd_verifier_prefix_cache_hits_total": "hits",
            "specd_verifier_prompt_tokens_total": "prompt_tokens"}
    total = dict.fromkeys(want.values(), 0.0)
    for url in urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
            for s in family.samples:
                if s.name in want:
                    total[want[s.name]] += s.value
    return total


def one_run(name: str, flags: list[str], replicas: int, system: str, args) -> dict:
    from openai import OpenAI

    from specd_train.workloads import CHAT_QUESTIONS

    # specd up counts metrics ports up from --metrics-port: one per replica, then one per drafter
    port, metrics = free_port(), free_ports(replicas + 2)
    argv = [sys.executable, "-m", "specd.cli", "up", "--port", str(port), "--verifier-port", str(free_port()),
            "--drafter-port", str(free_port()), "--metrics-port", str(metrics), "--replicas", str(replicas), *flags]
    up = Server(argv, f"http://127.0.0.1:{port}/health")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.conversations) as pool:
            convs = list(pool.map(lambda q: conversation(client, model, system, q, args.turns, args.max_tokens),
                                  CHAT_QUESTIONS[:args.conversations]))
        wall = time.perf_counter() - t0
        counters = scrape([f"http://127.0.0.1:{metrics + i}/metrics" for i in range(replicas)])
    finally:
        up.stop()
    ttft = sorted(t["ttft_s"] for c in convs for t in c)
    later = sorted(t["ttft_s"] for c in convs for t in c if t["turn"] > 0)

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    row = {"run": name, "replicas": replicas, "flags": " ".join(flags), "wall_s": round(wall, 1),
           "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p95_s": round(pct(ttft, 0.95), 3),
           "later_ttft_p50_s": round(statistics.median(later), 3), "later_ttft_p95_s": round(pct(later, 0.95), 3),
           "prompt_tokens": int(counters["prompt_tokens"]), "hits": int(counters["hits"]),
           "computed_prompt_tokens": int(counters["prompt_tokens"] - counters["hits"]),
           "hit_rate": round(counters["hits"] / counters["queries"], 3) if counters["queries"] else 0.0,
           "texts": [[t["text"] for t in c] for c in convs]}
    print({k: v for k, v in row.items() if k != "texts"}, flush=True)
    return row


def render(r: dict) -> str:
    lines = ["# Prefix caching: multi-turn chat over HTTP", "",
             f"{r['settings']['conversations']} conversations x {r['settings']['turns']} turns, a "
             f"{r['settings']['system_tokens']}-token system prompt shared by every request, greedy, "
             f"{r['settings']['max_tokens']} tokens per answer, conversations concurrent; `specd up` defaults "
             "(default target and drafters) but the flags named. Computed: prompt tokens the verifiers ran "
             "(prompt tokens less cache hits). Command: `" + r["command"] + "`.", "",
             "| run | replicas | TTFT p50 s | TTFT p95 s | turns 2-6 TTFT p50 s | p95 s | prompt tokens | computed "
             "| hit rate | answers equal to the first run's |", "|---|---|---|---|---|---|---|---|---|---|"]
    for x in r["rows"]:
        lines.append(f"| {x['run']} | {x['replicas']} | {x['ttft_p50_s']} | {x['ttft_p95_s']} | "
                     f"{x['later_ttft_p50_s']} | {x['later_ttft_p95_s']} | {x['prompt_tokens']} | "
                     f"{x['computed_prompt_tokens']} | {x['hit_rate']:.1%} | {x['identical']} |")
    return "\n".join(lines + ["", machine_line(r), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--runs", default="off,on,prefix3,least3")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "prefix_cache"))
    args = p.parse_args(argv)
    from specd.rpc.threads import default_threads

    t0, info = time.monotonic(), machine_info(default_threads())
    system = system_prompt(args.system_tokens)
    runs = {"off": ("cache off", ["--no-prefix-caching"], 1), "on": ("cache on", [], 1),
            "prefix3": ("cache on, prefix routing", ["--routing", "prefix"], 3),
            "least3": ("cache on, least-loaded routing", ["--routing", "least-loaded"], 3)}
    rows = [one_run(*runs[k], system, args) for k in args.runs.split(",")]
    reference = rows[0]["texts"]
    for row in rows:
        row["identical"] = f"{sum(a == b for c, d in zip(row['texts'], reference) for a, b in zip(c, d))}/" \
                           f"{sum(map(len, reference))}"
    write_result(Path(args.out), "bench/prefix_cache.py", argv, info, vars(args) | {"runs": args.runs}, rows, t0,
                 render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
