"""The server's choice against fixed drafters and k, served: `specd up` with its defaults, the official
client, one held-out workload at one batch size and temperature; plain (k = 0 in the request), the
server's choice (no k, no drafter) and each fixed mode (`drafter:k` in the request's `speculative`)
interleaved as bench/default_stack.py interleaves its cells (plain first, then each mode followed by
plain again, --repeats times; at batch 1 prompt by prompt). Where the choice falls short of a fixed
mode, the controller leaves speed there; where a fixed mode loses, the choice should not take it.

    python bench/served_modes.py --threads 2 --workload code_edit --batch 8 --modes suffix:8
    python bench/served_modes.py --threads 2 --workload chat --batch 1 --temperature 0.7 \
        --modes draft_model:1,draft_model:2,draft_model:3 --prompts 8 --max-tokens 128
"""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_stack import PRIVATE, Server, interleaved  # noqa: E402
from machine import machine_info, machine_line, write_result  # noqa: E402
from real_pair_http import free_port  # noqa: E402


def modes_of(spec: str, temperature: float) -> dict[str, dict]:
    """'suffix:8,draft_model:1' -> each request's extra body by mode name (plain and choice first)."""
    fixed = {"ignore_eos": True} if temperature > 0 else {}  # a sampled cell: the same work every run
    modes = {"plain": {"speculative": {"num_speculative_tokens": 0, **PRIVATE}, **fixed},
             "choice": {"speculative": PRIVATE, **fixed}}
    for item in filter(None, spec.split(",")):
        drafter, k = item.split(":")
        modes[item] = {"speculative": {"drafter": drafter, "num_speculative_tokens": int(k), **PRIVATE}, **fixed}
    return modes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workload", default="chat")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--modes", default="suffix:8", help="fixed modes, drafter:k, comma-separated")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--up-args", default="", help="more arguments for `specd up`")
    p.add_argument("--out", type=Path, default=Path("bench/results/served_modes"))
    args = p.parse_args(argv)
    from openai import OpenAI

    from specd_train.workloads import workload

    t0 = time.monotonic()
    info = machine_info(args.threads, dtype="bfloat16")
    port = free_port()
    up = Server([sys.executable, "-m", "specd.cli", "up", "--threads", str(args.threads), "--port", str(port),
                 "--verifier-port", str(free_port()), "--drafter-port", str(free_port()), "--metrics-port", "0",
                 *shlex.split(args.up_args)], f"http://127.0.0.1:{port}/health")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        cell = interleaved(client, model, workload(args.workload, args.prompts), args.batch,
                           SimpleNamespace(repeats=args.repeats, max_tokens=args.max_tokens), args.temperature,
                           modes_of(args.modes, args.temperature))
    finally:
        up.stop()
    rows = [{"mode": name, **{k: v for k, v in row.items() if k in ("tok_s", "ratio", "ratio_runs", "acceptance",
                                                                     "drafters", "identical")}}
            for name, row in cell.items()]
    write_result(args.out, "bench/served_modes.py", argv, info, vars(args) | {"out": str(args.out)}, rows, t0, render)
    return 0


def render(r: dict) -> str:
    s = r["settings"]
    lines = ["# The server's choice against fixed modes, served (bench/served_modes.py)", "",
             f"`specd up --threads {s['threads']}` with its defaults{' ' + s['up_args'] if s['up_args'] else ''}, "
             f"the official client, {s['prompts']} held-out {s['workload']} prompts, {s['batch']} streams at a time, "
             f"T {s['temperature']:g}, up to {s['max_tokens']} tokens"
             + (" (exactly, ignore_eos)" if s["temperature"] > 0 else "") + "; plain first, then each mode followed "
             f"by plain, {s['repeats']} times" + (" (prompt by prompt)" if s["batch"] == 1 else "")
             + ". ratio: the mode's mean tok/s over the mean of every plain run; runs: each run over the two plain "
             "runs around it. A fixed mode names its drafter and k in the request's `speculative`.", "",
             "| mode | tok/s | ratio | runs | acceptance | drafts by drafter | greedy identical |",
             "|---|---:|---:|---|---:|---|---|"]
    for row in r["rows"]:
        lines.append(f"| {row['mode']} | {row['tok_s']:.1f} | {row.get('ratio', 1.0):.2f}x | "
                     f"{' '.join(f'{x:.2f}' for x in row.get('ratio_runs', []))} | {row.get('acceptance', 0):.2f} | "
                     f"{', '.join(f'{k} {v}' for k, v in (row.get('drafters') or {}).items()) or '-'} | "
                     f"{row.get('identical', '-')} |")
    lines += ["", f"Command: `{r['command']}`.", "", machine_line(r), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
