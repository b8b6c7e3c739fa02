"""Verifier replicas behind one gateway (issue 18): throughput with 1, 2 and 3 replicas, and a
replica SIGKILLed mid-run.

Starts one ngram drafter, three verifier replicas sharing it (demo target unless --target, one
torch thread each, float32 on CPU) and a gateway per replica count. Each run sends --streams
streamed greedy completions at once over HTTP (distinct prompts, --max-tokens tokens each,
ignore_eos) and compares every output with the offline engine's greedy output. The last run,
over three replicas, SIGKILLs one of them once it has streamed a token, and counts requests
that failed before their first token (they must move to another replica: 0 failures) and
those cut mid-stream (they get a clean error event; what arrived must be a prefix of the
reference: no token repeated or skipped).

    python bench/replicas.py                     # writes bench/results/replicas.{md,json}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from overload import free_port, start  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SPEC = {"drafter": "ng", "num_speculative_tokens": 3}


def prompts(n: int) -> list[str]:
    return [f"v{i} = [{i}, {i + 1}, {i + 2}, {i}, {i + 1}, {i + 2}, {i}, {i + 1}," if i % 2 else
            f"def f{i}(x):\n    return x * {i}\n\n\ndef g{i}(" for i in range(n)]


async def one(client, url: str, prompt: str, max_tokens: int, record: dict) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "speculative": SPEC}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            record["error"] = f"HTTP {r.status_code}: {r.text[:200]}"
            return
        record["replica"] = int(r.headers["x-specd-replica"])
        record["opened"] = True  # the gateway answers a stream once its first token is there
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                record["error"] = event["error"]["message"]
                return
            if event.get("choices"):
                record["text"] += event["choices"][0].get("text") or ""
                record["chunks"] += 1
        record["done"] = True


async def run(base: str, texts: list[str], max_tokens: int, kill=None,
              kill_after_chunks: int = 1) -> tuple[list[dict], float, dict | None]:
    import httpx

    records = [dict(prompt=p, opened=False, replica=None, text="", chunks=0, done=False, error=None) for p in texts]
    killed = None

    async def killer():
        nonlocal killed
        victim, proc = kill
        while not any(r["replica"] == victim and r["chunks"] >= kill_after_chunks for r in records):
            await asyncio.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        killed = {"replica": victim, "at_s": time.perf_counter() - t0,
                  "streams_open_on_it": sum(r["replica"] == victim and not r["done"] for r in records),
                  "streams_not_yet_opened": sum(not r["opened"] and r["error"] is None for r in records)}

    limits = httpx.Limits(max_connections=len(texts) + 10, max_keepalive_connections=len(texts) + 10)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        t0 = time.perf_counter()
        tasks = [one(client, f"{base}/v1/completions", p, max_tokens, r) for p, r in zip(texts, records)]
        if kill is not None:
            tasks.append(killer())
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return records, wall, killed


def gateway_counters(base: str) -> dict:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name in ("specd_gateway_replica_requests_total", "specd_gateway_replica_failovers_total"):
                out.setdefault(s.name.removeprefix("specd_gateway_replica_").removesuffix("_total"), {})[
                    s.labels["replica"]] = int(s.value)
    return out


def summarize(records: list[dict], wall: float, references: dict[str, str], max_tokens: int) -> dict:
    done = [r for r in records if r["done"]]
    cut = [r for r in records if r["opened"] and not r["done"]]
    return {
        "streams": len(records), "completed": len(done),
        "failed_before_first_token": sum(not r["opened"] for r in records),
        "cut_mid_stream": len(cut),
        "cut_with_clean_error": sum(bool(r["error"]) for r in cut),
        "cut_prefix_of_reference": sum(references[r["prompt"]].startswith(r["text"]) for r in cut),
        "completed_equal_reference": sum(r["text"] == references[r["prompt"]] for r in done),
        "by_replica": {str(i): sum(r["replica"] == i for r in records) for i in range(3)},
        "wall_s": round(wall, 2), "tokens": len(done) * max_tokens,
        "tokens_per_s": round(len(done) * max_tokens / wall, 1),
        "errors": sorted({r["error"][:160] for r in records if r["error"]}),
    }


def main() -> int:
    from specd import LLM
    from specd.models.demo_paths import demo_model_dir
    from specd.sampling import SamplingParams
    from specd.cli.readiness import drafters_registered, grpc_serving, http_ok

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(demo_model_dir("target")))
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=16,
                   help="per replica: below streams/replicas, so some requests wait (no token yet) at the kill")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="runs per replica count (the median is reported)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    texts = prompts(args.streams)
    llm = LLM(args.target, dtype="float32", device="cpu")
    references = {t: out.text for t, out in zip(texts, (llm.generate([t], SamplingParams(
        temperature=0, max_tokens=args.max_tokens, ignore_eos=True))[0] for t in texts))}
    del llm
    logs = Path(tempfile.mkdtemp(prefix="specd-replicas-"))
    load_start = os.getloadavg()
    procs, runs = [], []
    try:
        dport = free_port()
        procs.append(start(["drafter", "--method", "ngram", "--name", "ng", "--port", str(dport), "--metrics-port",
                            "0", "--threads", "1", "--log-level", "warning"], logs / "drafter.log"))
        while not grpc_serving(f"127.0.0.1:{dport}"):
            time.sleep(0.5)
        # Two phases. Equal capacity: every replica admits all the streams at once (--max-num-seqs
        # = streams), so 1, 2 and 3 replicas differ only in processes (cores). Per-replica capacity:
        # --max-num-seqs 16 each (1 replica runs 16 streams at a time, 3 run 48), and the kill, which
        # then finds requests waiting (no token yet) on the victim.
        for phase, cap in (("equal capacity", args.streams), ("capacity per replica", args.max_num_seqs)):
            vports = [free_port() for _ in range(3)]
            replicas = []
            for i, port in enumerate(vports):
                replicas.append(start(["verifier", "--model", args.target, "--port", str(port), "--metrics-port", "0",
                                       "--threads", str(args.threads), "--dtype", "float32", "--device", "cpu",
                                       "--drafter", f"ng=127.0.0.1:{dport}", "--max-num-seqs", str(cap),
                                       "--log-level", "warning"], logs / f"verifier{i}-{cap}.log"))
            procs += replicas
            for port in vports:
                while not (grpc_serving(f"127.0.0.1:{port}") and drafters_registered(f"127.0.0.1:{port}", ["ng"])):
                    time.sleep(0.5)
            plan = [(n, False) for n in (1, 2, 3) for _ in range(args.repeats)]
            if cap == args.max_num_seqs:
                plan.append((3, True))
            for n, kill in plan:
                hport = free_port()
                gateway = start(["gateway", "--verifier", ",".join(f"127.0.0.1:{p}" for p in vports[:n]), "--port",
                                 str(hport), "--log-level", "warning"], logs / f"gateway{n}-{cap}.log")
                procs.append(gateway)
                base = f"http://127.0.0.1:{hport}"
                while not http_ok(f"{base}/health"):
                    time.sleep(0.5)
                time.sleep(1.0)  # a first poll of every replica's load
                # The kill: once one of replica 1's streams is about an eighth through (chunks hold
                # one or more tokens), so it is mid-generation and has requests waiting too.
                records, wall, killed = asyncio.run(run(base, texts, args.max_tokens,
                                                        (1, replicas[1]) if kill else None,
                                                        kill_after_chunks=max(1, args.max_tokens // 8)))
                result = {"phase": phase, "max_num_seqs": cap, "replicas": n, "kill": killed,
                          "load_avg_after": [round(x, 2) for x in os.getloadavg()],
                          **summarize(records, wall, references, args.max_tokens), "gateway": gateway_counters(base)}
                runs.append(result)
                print(json.dumps(result), flush=True)
                gateway.terminate()
                gateway.wait(30)
            for proc in replicas:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            proc.wait(30)
    summary = {"machine": machine_info(args.threads), "load_avg_start": load_start,
               "load_avg_end": os.getloadavg(), "target": Path(args.target).name, "streams": args.streams,
               "max_tokens": args.max_tokens, "max_num_seqs_per_replica": args.max_num_seqs,
               "phases": {"equal capacity": args.streams, "capacity per replica": args.max_num_seqs},
               "threads_per_process": args.threads, "drafter": "one ngram drafter shared by every replica, k=3",
               "runs": runs}
    (args.out / "replicas.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_markdown(args.out / "replicas.md", summary)
    killed = runs[-1]
    ok = killed["failed_before_first_token"] == 0 and all(
        r["completed_equal_reference"] == r["completed"] and r["cut_prefix_of_reference"] == r["cut_mid_stream"]
        for r in runs)
    return 0 if ok else 1


def write_markdown(path: Path, s: dict) -> None:
    import statistics

    m, kill = s["machine"], s["runs"][-1]
    phases = list(dict.fromkeys(r["phase"] for r in s["runs"]))
    median = {ph: {n: statistics.median([r["tokens_per_s"] for r in s["runs"]
                                         if r["phase"] == ph and r["replicas"] == n and not r["kill"]])
                   for n in (1, 2, 3)} for ph in phases}
    lines = [
        "# Verifier replicas behind one gateway",
        "",
        f"`python bench/replicas.py`: {s['streams']} concurrent streamed greedy completions over HTTP "
        f"({s['max_tokens']} tokens each, distinct prompts, ignore_eos) through one gateway in front of 1, 2 "
        f"or 3 verifier replicas on {s['target']} (the tiny demo target, float32 on CPU), {s['drafter']}. "
        f"Two phases: *equal capacity*, each replica admitting all {s['streams']} streams at once "
        f"(--max-num-seqs {s['streams']}), so the replica counts differ only in processes; and *capacity per "
        f"replica*, --max-num-seqs {s['max_num_seqs_per_replica']} each (one replica runs "
        f"{s['max_num_seqs_per_replica']} streams at a time, three run {3 * s['max_num_seqs_per_replica']}), "
        "which ends with the kill. Every process (verifiers, drafter, "
        f"gateway) runs with --threads {s['threads_per_process']}; outputs are compared with the offline "
        "engine's greedy output.",
        "",
        "| phase | replicas | replica killed | completed | failed before first token | cut mid-stream (clean error, "
        "prefix of reference) | completed = reference | streams per replica | failovers | wall | tokens/s | "
        "vs 1 replica |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in s["runs"]:
        failovers = sum(r["gateway"].get("failovers", {}).values())
        per = "/".join(str(r["by_replica"][str(i)]) for i in range(r["replicas"]))
        lines.append(
            f"| {r['phase']} | {r['replicas']} | {'replica 1, at %.2f s' % r['kill']['at_s'] if r['kill'] else '-'} | "
            f"{r['completed']}/{r['streams']} | {r['failed_before_first_token']} | {r['cut_mid_stream']} "
            f"({r['cut_with_clean_error']}, {r['cut_prefix_of_reference']}) | {r['completed_equal_reference']}/"
            f"{r['completed']} | {per} | {failovers} | {r['wall_s']:.1f} s | {r['tokens_per_s']:.0f} | "
            f"{r['tokens_per_s'] / median[r['phase']][1]:.2f}x |")
    k = kill["kill"]
    lines += [
        "",
        "Throughput (tokens of completed streams per second of wall time), median of the runs without a "
        "kill; \"vs 1 replica\" divides by the phase's 1-replica median:",
        "",
        *(f"- {ph}: " + ", ".join(f"{n} replica{'s' if n > 1 else ''} {median[ph][n]:.0f} tokens/s "
                                   f"({median[ph][n] / median[ph][1]:.2f}x)" for n in (1, 2, 3)) for ph in phases),
        "",
        f"The kill: replica 1 was SIGKILLed {k['at_s']:.2f} s into the last run, when {k['streams_open_on_it']} "
        f"streams were open on it and {k['streams_not_yet_opened']} of the {kill['streams']} requests (on any "
        f"replica) had produced no token yet. {sum(kill['gateway'].get('failovers', {}).values())} requests "
        "waiting on the lost replica moved to the others (the gateway's specd_gateway_replica_failovers_total) "
        f"and completed; {kill['failed_before_first_token']} requests failed before their first token. The "
        f"{kill['cut_mid_stream']} streams it was generating ended with an error event, their text so far a "
        "prefix of the reference (never a token repeated or skipped); the kill run's tokens/s counts completed "
        "streams only.",
        "",
        f"Scaling is capped by the cores: this machine has {m['cores']} cores for three verifiers, a drafter, "
        "the gateway and this client (one thread each), and other jobs were running (load average "
        f"{', '.join(f'{x:.1f}' for x in s['load_avg_start'])} at the start, "
        f"{', '.join(f'{x:.1f}' for x in s['load_avg_end'])} at the end). Replicas add throughput only while "
        "there are idle cores for them; on a machine with a core (or a GPU) per replica the same runs "
        "measure the routing, not the CPU contention.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}.",
    ]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
