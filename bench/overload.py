"""Overload: a burst of concurrent streamed requests against a bounded verifier queue (issue 14).

Starts a verifier (demo target unless --target) and a gateway as processes, sends --requests
streamed completions at once through one HTTP client, and reports how many were admitted and
how many refused (429 with Retry-After), whether every admitted request completed, and the time
to first token (p50/p99) of the admitted ones. Before the bound, 600 requests all queued and
the median time to first token was 92 s; now the excess is refused at once.

    python bench/overload.py                     # writes bench/results/overload.{md,json}
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def one(client, url: str, max_tokens: int) -> dict:
    body = {"prompt": "def fibonacci(n):\n    ", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "retry_after": r.headers.get("retry-after"),
                    "error_type": r.json()["error"]["type"], "latency": time.perf_counter() - t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text") and ttft is None:
                ttft = time.perf_counter() - t0
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"status": 200, "ttft": ttft, "tokens": tokens, "latency": time.perf_counter() - t0}


async def burst(base: str, n: int, max_tokens: int) -> list[dict]:
    import httpx

    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        return await asyncio.gather(*(one(client, f"{base}/v1/completions", max_tokens) for _ in range(n)))


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(log, "w") as f:
        return subprocess.Popen([sys.executable, "-m", "specd.cli", *argv], stdout=f, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)


def main() -> int:
    from specd.models.demo_paths import demo_model_dir
    from specd.cli.readiness import grpc_serving, http_ok

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=str(demo_model_dir("target")))
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-queued-requests", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()

    args.out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="specd-overload-"))
    vport, hport = free_port(), free_port()
    procs = [start(["verifier", "--model", args.target, "--port", str(vport), "--metrics-port", "0", "--threads",
                    str(args.threads), "--no-speculation", "--max-num-seqs", str(args.max_num_seqs),
                    "--max-queued-requests", str(args.max_queued_requests), "--log-level", "warning"],
                   logs / "verifier.log")]
    try:
        while not grpc_serving(f"127.0.0.1:{vport}"):
            time.sleep(0.5)
        procs.append(start(["gateway", "--verifier", f"127.0.0.1:{vport}", "--port", str(hport), "--log-level",
                            "warning"], logs / "gateway.log"))
        base = f"http://127.0.0.1:{hport}"
        while not http_ok(f"{base}/health"):
            time.sleep(0.5)
        t0 = time.perf_counter()
        results = asyncio.run(burst(base, args.requests, args.max_tokens))
        wall = time.perf_counter() - t0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    admitted = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    ttfts = [r["ttft"] for r in admitted if r["ttft"] is not None]
    summary = {
        "machine": machine_info(args.threads), "load_average": os.getloadavg(), "target": Path(args.target).name, "requests": args.requests,
        "max_tokens": args.max_tokens, "max_num_seqs": args.max_num_seqs,
        "max_queued_requests": args.max_queued_requests, "admitted": len(admitted), "refused_429": len(refused),
        "other": sorted({r["status"] for r in results} - {200, 429}),
        "admitted_completed": sum(r["tokens"] == args.max_tokens for r in admitted),
        "refused_with_retry_after": sum(bool(r["retry_after"]) and r["error_type"] == "rate_limit_error"
                                        for r in refused),
        "refusal_latency_p99_s": quantile([r["latency"] for r in refused], 0.99),
        "ttft_p50_s": quantile(ttfts, 0.5), "ttft_p99_s": quantile(ttfts, 0.99),
        "e2e_p99_s": quantile([r["latency"] for r in admitted], 0.99), "wall_s": wall,
    }
    (args.out / "overload.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# Overload: a burst against a bounded queue",
        "",
        f"{args.requests} streamed completions sent at once ({args.max_tokens} tokens each, greedy) to the gateway "
        f"in front of a verifier on {summary['target']} (--max-num-seqs {args.max_num_seqs}, "
        f"--max-queued-requests {args.max_queued_requests}, {args.threads} thread(s), no speculation), "
        "`python bench/overload.py`.",
        "",
        "| admitted | refused (429) | other | admitted that completed | 429s with Retry-After | refusal p99 |"
        " TTFT p50 | TTFT p99 (admitted) | e2e p99 | wall |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {len(admitted)} | {len(refused)} | {summary['other'] or '-'} | {summary['admitted_completed']} | "
        f"{summary['refused_with_retry_after']} | {summary['refusal_latency_p99_s']:.2f} s | "
        f"{summary['ttft_p50_s']:.2f} s | {summary['ttft_p99_s']:.2f} s | {summary['e2e_p99_s']:.2f} s | {wall:.1f} s |",
        "",
        f"Machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores, load average "
        f"{', '.join(f'{x:.1f}' for x in summary['load_average'])} when it finished (other jobs were running), "
        f"{summary['machine']['date']}.",
    ]
    (args.out / "overload.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if summary["admitted_completed"] == len(admitted) and not summary["other"] else 1


if __name__ == "__main__":
    sys.exit(main())
