"""The newcomer's measurement: `specd up` with its defaults, driven with the official client.

    python bench/default_stack.py --threads 2                       # specd only
    python bench/default_stack.py --threads 2 --llama-server "$(bash bench/build_llamacpp.sh --print-dir)/llama-server" \
        --gguf ~/.cache/specd-bench/models/smollm2-135m-instruct-bf16.gguf

What runs, in this order, on one machine:
1. in-process plain decode (specd.LLM, the dtype `auto` picks, the same threads), batch 1 and the
   same prompts: what the service split is measured against;
2. `specd up --threads T` with nothing else set (the stack `make up` starts), and per workload
   (chat questions, code edits that repeat the prompt, summaries of a given text), temperature
   and batch (B concurrent streams): plain (k = 0 in the request), the server's own choice (no
   `speculative` field) and plain again, interleaved; the server's ratio is its tok/s over the
   mean of the two plain runs around it. Greedy rows also check that the server's choice gave
   plain's text for every request;
3. with --llama-server: llama.cpp's server on a GGUF of the same weights, the same client and
   prompts, plain and with its n-gram speculation (--spec-type ngram-mod), then stopped.

Every cell (and every llama-server cell) first sends its prompts once for one token, untimed, so
each timed run finds them in the prefix cache. tok/s of a cell = completion tokens of all its
streams / wall time of the cell; TTFT = the median
time to the first streamed text. Results: bench/results/default_stack.{md,json,png}.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402
from real_pair_http import free_port  # noqa: E402

from specd.cli.up import http_ok  # noqa: E402

STARTUP_S = 300.0


def stream_one(client, model: str, messages: list[dict], max_tokens: int, temperature: float, extra: dict | None):
    """One streamed chat completion -> (text, completion tokens, seconds to first text, usage.speculative)."""
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=temperature, seed=None, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    spec = (usage.model_extra or {}).get("speculative") if usage is not None else None
    return text, usage.completion_tokens if usage else 0, first or 0.0, spec


def run_cell(client, model: str, prompts: list[list[dict]], batch: int, max_tokens: int, temperature: float,
             extra: dict | None) -> dict:
    """Every prompt once, `batch` streams at a time -> tok/s, TTFT, texts, speculation per request."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        results = list(pool.map(lambda m: stream_one(client, model, m, max_tokens, temperature, extra), prompts))
    wall = time.perf_counter() - t0
    tokens = sum(r[1] for r in results)
    return {"tok_s": tokens / wall, "tokens": tokens, "wall_s": wall,
            "ttft_s": statistics.median(r[2] for r in results), "texts": [r[0] for r in results],
            "spec": [r[3] for r in results]}


def in_process_plain(prompts: list[list[dict]], threads: int, max_tokens: int) -> dict:
    import torch

    from specd import LLM, SamplingParams
    from specd.models.chat import chat_prompt_ids
    from specd.models.model_store import default_target

    torch.set_num_threads(threads)
    llm = LLM(default_target())
    # Every prompt once first, so its KV is in the prefix cache as in the HTTP runs (warm_up).
    llm.generate([chat_prompt_ids(llm.tokenizer, m) for m in prompts], SamplingParams(temperature=0, max_tokens=1))
    tokens, seconds = 0, 0.0
    for m in prompts:
        t0 = time.perf_counter()
        (out,) = llm.generate([chat_prompt_ids(llm.tokenizer, m)], SamplingParams(temperature=0, max_tokens=max_tokens))
        seconds += time.perf_counter() - t0
        tokens += len(out.token_ids)
    return {"tok_s": tokens / seconds, "tokens": tokens, "dtype": str(llm.engine.dtype).removeprefix("torch.")}


class Server:
    """A server child process in its own process group, stopped (group killed) on exit."""

    def __init__(self, argv: list[str], url: str, env: dict | None = None):
        self.url, self.log = url, Path(f"/tmp/default_stack_{free_port()}.log")
        self.proc = subprocess.Popen(argv, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + STARTUP_S
        while not http_ok(url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{argv[0]} did not come up; its log:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def warm_up(client, model: str, prompts) -> None:
    """Each prompt once, one token, untimed: with the server's prefix cache, the first run of a
    cell would otherwise be the only one to compute its prompts (a speculative run between two
    plain ones then looked up to 12% faster with no drafts at all)."""
    run_cell(client, model, prompts, 1, 1, 0.0, None)


def interleaved(client, model: str, prompts, batch: int, args, temperature: float, modes: dict) -> dict:
    """plain, then each other mode followed by plain again; a mode's ratio is over the plain runs around it."""
    warm_up(client, model, prompts)
    cells = {"plain": [run_cell(client, model, prompts, batch, args.max_tokens, temperature, modes["plain"])]}
    for name, extra in modes.items():
        if name == "plain":
            continue
        cells[name] = [run_cell(client, model, prompts, batch, args.max_tokens, temperature, extra)]
        cells["plain"].append(run_cell(client, model, prompts, batch, args.max_tokens, temperature, modes["plain"]))
    out = {}
    for i, (name, runs) in enumerate(cells.items()):
        run = runs[0]
        row = {k: run[k] for k in ("tok_s", "tokens", "wall_s", "ttft_s")}
        if name != "plain":
            around = cells["plain"][i - 1:i + 1]
            row["ratio"] = run["tok_s"] / statistics.mean(r["tok_s"] for r in around)
            if temperature == 0:
                row["identical"] = sum(a == b for a, b in zip(run["texts"], around[0]["texts"]))
            specs = [s for s in run["spec"] if s]
            row["acceptance"] = (sum(s["accepted_tokens"] for s in specs) / max(1, sum(s["draft_tokens"] for s in specs)))
            drafters: dict[str, int] = {}
            for s in specs:
                for d, n in s.get("drafters", {}).items():
                    drafters[d] = drafters.get(d, 0) + n
            row["drafters"] = drafters
        out[name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="the verifier's threads and in-process plain's (default: what `specd up` picks)")
    ap.add_argument("--workloads", default="chat,code_edit,summarize")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per batch-1 cell; a batch-B cell sends B")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (bench/build_llamacpp.sh)")
    ap.add_argument("--gguf", default=None, help="the GGUF of the same weights llama-server serves")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server's -t (default: every core)")
    ap.add_argument("--out", default="bench/results/default_stack")
    args = ap.parse_args()
    from openai import OpenAI

    from specd.cli.up import default_threads

    args.threads = args.threads or default_threads()

    from specd_train.workloads import workload

    workloads = args.workloads.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    info = machine_info(args.threads)
    t_start = time.time()
    prompts = {w: workload(w, max(batches + [args.prompts])) for w in workloads}

    def cell_prompts(w: str, batch: int):
        n = args.prompts if batch == 1 else batch
        return [prompts[w][i % len(prompts[w])] for i in range(n)]

    result = {"machine": info, "args": vars(args), "in_process": {}, "specd": {}, "llama_server": {}}
    for w in workloads:
        result["in_process"][w] = in_process_plain(cell_prompts(w, 1), args.threads, args.max_tokens)
        print(f"in-process plain {w}: {result['in_process'][w]['tok_s']:.1f} tok/s", flush=True)
    info["dtype"] = result["in_process"][workloads[0]]["dtype"]

    port = free_port()
    # The one departure from the defaults: the suffix index keeps no answers of finished requests,
    # or the interleaved runs (the same prompts, greedy: the same answers) would draft each other.
    up = Server([sys.executable, "-m", "specd.cli", "up", "--drafter", "draft_model", "--drafter",
                 'suffix:{"suffix_decoding_max_cached_requests": 0}', "--threads", str(args.threads), "--port", str(port),
                 "--verifier-port", str(free_port()), "--drafter-port", str(free_port()), "--metrics-port", "0"],
                f"http://127.0.0.1:{port}/health")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        modes = {"plain": {"speculative": {"num_speculative_tokens": 0}}, "default": None}
        for w in workloads:
            for temperature in temperatures:
                for batch in batches:
                    key = f"{w} T={temperature:g} batch={batch}"
                    cell = interleaved(client, model, cell_prompts(w, batch), batch, args, temperature, modes)
                    result["specd"][key] = cell
                    d = cell["default"]
                    print(f"specd {key}: plain {cell['plain']['tok_s']:.1f} tok/s, server's choice "
                          f"{d['tok_s']:.1f} ({d['ratio']:.2f}x, acceptance {d['acceptance']:.2f}, {d['drafters']}"
                          + (f", identical {d['identical']}/{len(cell_prompts(w, batch))}" if "identical" in d else "")
                          + ")", flush=True)
    finally:
        up.stop()

    if args.llama_server:
        for mode, flags in (("plain", []), ("ngram", ["--spec-type", "ngram-mod"])):
            port = free_port()
            server = Server([args.llama_server, "-m", args.gguf, "--port", str(port), "-t", str(args.llama_threads),
                             "-tb", str(args.llama_threads), "-c", "4096", "--jinja", *flags],
                            f"http://127.0.0.1:{port}/health")
            try:
                client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
                for w in workloads:
                    for batch in [1]:
                        key = f"{w} T=0 batch={batch} {mode}"
                        warm_up(client, "model", cell_prompts(w, batch))  # llama-server caches prompts too
                        run = run_cell(client, "model", cell_prompts(w, batch), batch, args.max_tokens, 0.0, None)
                        result["llama_server"][key] = {k: run[k] for k in ("tok_s", "tokens", "wall_s", "ttft_s")}
                        print(f"llama-server {key}: {run['tok_s']:.1f} tok/s", flush=True)
            finally:
                server.stop()

    info["minutes"] = round((time.time() - t_start) / 60, 1)
    info["load_avg_end"] = round(os.getloadavg()[0], 2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(report(result))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out}.md", flush=True)


def report(r: dict) -> str:
    m, a = r["machine"], r["args"]
    lines = ["# The default stack: `specd up` as a newcomer starts it", "",
             f"Command: `python bench/default_stack.py --threads {a['threads']}"
             + "".join(f" --{k} {a[k]}" for k, full in (("batches", "1,8,32"), ("temperatures", "0,0.7"))
                       if a[k] != full)
             + (" --llama-server ... --gguf ..." if a["llama_server"] else "") + "`", "",
             f"SmolLM2-135M-Instruct in {m['dtype']} (what `auto` picks here), `specd up --threads {a['threads']}` "
             f"with its defaults (drafters: the trained draft model and a suffix index; the one change: the suffix "
             "index keeps no answers of finished requests, else the interleaved runs of the same prompts would draft "
             "each other's answers), the official `openai` "
             f"client, streamed chat completions, up to {a['max_tokens']} tokens; batch 1 sends {a['prompts']} "
             "held-out prompts one after another, batch B sends B prompts as B concurrent streams. "
             "Plain = `speculative: {num_speculative_tokens: 0}` in the request; server's choice = no field. "
             "Runs interleaved: plain, server's choice, plain; the ratio is over the mean of the plain runs around it. "
             "Every cell first sends its prompts once for one token, untimed (llama-server's cells too), so each "
             "timed run finds them in the prefix cache (TTFT below is a cache hit's).",
             "", "| workload | T | batch | plain tok/s | server's choice tok/s | ratio | TTFT plain / choice (s) "
             "| acceptance | drafts by drafter | greedy identical |", "|---|---:|---:|---:|---:|---:|---|---:|---|---|"]
    for key, cell in r["specd"].items():
        w, t, b = key.split(" ")
        p, d = cell["plain"], cell["default"]
        n = a["prompts"] if b == "batch=1" else int(b.split("=")[1])
        lines.append(f"| {w} | {t[2:]} | {b[6:]} | {p['tok_s']:.1f} | {d['tok_s']:.1f} | {d['ratio']:.2f}x | "
                     f"{p['ttft_s']:.2f} / {d['ttft_s']:.2f} | {d['acceptance']:.2f} | "
                     f"{', '.join(f'{k} {v}' for k, v in d['drafters'].items()) or '-'} | "
                     f"{str(d['identical']) + '/' + str(n) if 'identical' in d else '-'} |")
    lines += ["", "In-process plain decode (specd.LLM, same dtype and threads, batch 1, same prompts) against "
              "plain over HTTP at batch 1, greedy:", "", "| workload | in-process tok/s | HTTP plain tok/s | HTTP / in-process |",
              "|---|---:|---:|---:|"]
    for w, ip in r["in_process"].items():
        http = r["specd"].get(f"{w} T=0 batch=1", {}).get("plain")
        if http:
            lines.append(f"| {w} | {ip['tok_s']:.1f} | {http['tok_s']:.1f} | {http['tok_s'] / ip['tok_s']:.2f}x |")
    if r["llama_server"]:
        lines += ["", "llama.cpp's `llama-server` on a GGUF of the same weights, same client and prompts, "
                  f"`-t {a['llama_threads']}`, greedy, batch 1 (ngram: `--spec-type ngram-mod`):", "",
                  "| workload | mode | tok/s | TTFT (s) | specd server's choice / this |", "|---|---|---:|---:|---:|"]
        for key, row in r["llama_server"].items():
            w, _, _, mode = key.split(" ")
            ours = r["specd"].get(f"{w} T=0 batch=1", {}).get("default")
            lines.append(f"| {w} | {mode} | {row['tok_s']:.1f} | {row['ttft_s']:.2f} | "
                         + (f"{ours['tok_s'] / row['tok_s']:.2f}x |" if ours else "- |"))
    lines += ["", f"Machine: {m['cpu']} ({' '.join(m['cpu_flags'])}), {m['cores']} cores, torch threads "
              f"{m['threads']} in the verifier (and in-process), 1 per drafter, torch {m['torch']}; load average {m['load_avg_start']} at start, "
              f"{m['load_avg_end']} at end; {m['date']}; {m['minutes']} min.", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    keys = list(r["specd"])
    fig, ax = plt.subplots(figsize=(max(6, len(keys) * 0.5), 4))
    ax.bar(range(len(keys)), [r["specd"][k]["default"]["ratio"] for k in keys])
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(keys)), keys, rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("server's choice / plain (tok/s)")
    ax.set_title(f"specd up defaults, {r['machine']['cpu']}, {r['machine']['threads']} threads")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
