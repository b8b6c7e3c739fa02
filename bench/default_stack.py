"""The newcomer's measurement: `specd up` with its defaults, driven with the official client.

    python bench/default_stack.py --threads 2                       # specd only
    python bench/default_stack.py --threads 2 --llama-server "$(bash bench/build_llamacpp.sh --print-dir)/llama-server" \
        --gguf ~/.cache/specd-bench/models/smollm2-135m-instruct-bf16.gguf

What runs, in this order, on one machine:
1. `specd up --threads T` with nothing else set (the stack `make up` starts), and per workload
   (chat questions, code edits that repeat the prompt, summaries of a given text), temperature
   and batch (B concurrent streams; a batch-B cell sends max(B, --batch-prompts) prompts, B at a
   time): plain (k = 0 in the request), the server's own choice (no
   `speculative` field) and plain again, --repeats times, interleaved (at batch 1 prompt by
   prompt: each prompt goes through that whole order before the next); the server's ratio is its
   mean tok/s over the mean of the plain runs. Greedy rows also check that the server's choice gave
   plain's text for every request;
2. after each workload's cells, --rounds rounds at batch 1, greedy, each running in turn, prompt
   by prompt:
   in-process plain decode (specd.LLM in a process of its own, loaded once, the dtype `auto`
   picks, the same threads: what the service split is measured against), specd plain and
   specd's choice, specd plain read by a minimal SSE reader instead of the official client,
   and with --llama-server llama.cpp's server on a GGUF of the same weights, plain and with
   its n-gram speculation (--spec-type ngram-mod), both loaded beside the stack for the whole
   run; ratios are taken within a round.

With --warm N the stack first serves N other conversations (training prompts, none held out), so its
suffix index drafts from their answers as a server that has been up a while does; every measured
request sends `speculative: {cache_output: false}`, so no run drafts from the answers of another
run of the same prompts (without --warm the index's cache stays empty: a fresh server).
llama-server's n-gram state is not warmed (at its speed here N answers would take most of an hour).

Sampled cells (T > 0) ask for exactly max_tokens tokens per stream (ignore_eos): a sampled answer's
length changes from run to run, and with it the cell's time, more than speculation does.
Every cell (and llama-server before its rounds) first sends its prompts once for one token, untimed, so
each timed run finds them in the prefix cache. tok/s of a cell = completion tokens of all its
streams / wall time of the cell; TTFT = the median
time to the first streamed text. Results: bench/results/default_stack.{md,json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import zip_longest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name, machine_info  # noqa: E402
from real_pair_http import free_port  # noqa: E402

from specd.cli.readiness import http_ok  # noqa: E402

STARTUP_S = 300.0


# Every measured request keeps its answer out of the suffix index's cache (see main).
PRIVATE = {"cache_output": False}


def stream_one(client, model: str, messages: list[dict], max_tokens: int, temperature: float, extra: dict | None):
    """One streamed chat completion -> (text, completion tokens, seconds to first text, usage.speculative,
    seconds in all)."""
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
    return text, usage.completion_tokens if usage else 0, first or 0.0, spec, time.perf_counter() - t0


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


def one_at_a_time(prompts: list, modes: dict, order: list[str]) -> dict[str, list[dict]]:
    """Batch 1 with the modes interleaved prompt by prompt: for each prompt, every slot of `order`
    (mode names; a name repeated is that mode's next run) one after another, so the requests a
    ratio compares ran seconds apart, not a minute (this machine drifts 10-20% within minutes).
    modes[name](prompt index, messages) -> (text, completion tokens, seconds to first text, speculation,
    seconds).
    -> per mode, its runs in order, each over every prompt: tok/s, tokens, wall_s, ttft_s, texts, spec."""
    runs: dict[str, list[list]] = {name: [[] for _ in range(order.count(name))] for name in set(order)}
    for i, messages in enumerate(prompts):
        seen = dict.fromkeys(runs, 0)
        for name in order:
            runs[name][seen[name]].append(modes[name](i, messages))
            seen[name] += 1
    return {name: [{"tok_s": sum(r[1] for r in rs) / sum(r[4] for r in rs), "tokens": sum(r[1] for r in rs),
                    "wall_s": sum(r[4] for r in rs), "ttft_s": statistics.median(r[2] for r in rs),
                    "texts": [r[0] for r in rs], "spec": [r[3] for r in rs]} for rs in mode_runs]
            for name, mode_runs in runs.items()}


def in_process_worker(conn, threads: int, max_tokens: int, prompts: dict[str, list[list[dict]]]) -> None:
    """A child process holding specd.LLM (the dtype `auto` picks, `threads` torch threads, one
    thread for every call as the verifier): per (workload, prompt index) asked for over conn, that
    prompt's greedy answer -> (completion tokens, seconds). Kept loaded for the whole run, so
    in-process plain decode is measured right beside the HTTP requests it is compared with (this
    machine's speed drifts 10-20% within minutes)."""
    import torch

    from specd import LLM, SamplingParams
    from specd.models.chat import chat_prompt_ids
    from specd.models.model_store import default_target

    torch.set_num_threads(threads)
    llm = LLM(default_target())
    ids = {w: [chat_prompt_ids(llm.tokenizer, m) for m in ms] for w, ms in prompts.items()}
    for w in ids:  # every prompt once first, so its KV is in the prefix cache as in the HTTP runs (warm_up)
        llm.generate(ids[w], SamplingParams(temperature=0, max_tokens=1))
    conn.send(str(llm.engine.dtype).removeprefix("torch."))
    while (asked := conn.recv()) is not None:
        w, i = asked
        t0 = time.perf_counter()
        (out,) = llm.generate([ids[w][i]], SamplingParams(temperature=0, max_tokens=max_tokens))
        conn.send((len(out.token_ids), time.perf_counter() - t0))


class InProcess:
    def __init__(self, threads: int, max_tokens: int, prompts: dict[str, list[list[dict]]]):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=in_process_worker, args=(child, threads, max_tokens, prompts), daemon=True)
        self.proc.start()
        self.dtype = self.conn.recv()

    def one(self, workload: str, index: int) -> tuple[int, float]:
        """Prompt `index` of the workload's batch-1 prompts -> (completion tokens, seconds)."""
        self.conn.send((workload, index))
        return self.conn.recv()

    def stop(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


def raw_sse_one(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[int, float]:
    """Plain over HTTP read by a minimal SSE reader (http.client, lines, the usage chunk parsed)
    instead of the official client: the client runs on the same cores as the stack, and the
    official one's parsing of every chunk takes CPU the verifier then lacks. -> (tokens, seconds)"""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "speculative": {"num_speculative_tokens": 0, **PRIVATE}}),
        {"content-type": "application/json"})
    response, last = conn.getresponse(), b""
    while line := response.readline():
        if line.startswith(b"data: {"):
            last = line
    conn.close()
    return json.loads(last[6:])["usage"]["completion_tokens"], time.perf_counter() - t0


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


def warm_up(client, model: str, prompts, extra: dict | None = None) -> None:
    """Each prompt once, one token, untimed: with the server's prefix cache, the first run of a
    cell would otherwise be the only one to compute its prompts (a speculative run between two
    plain ones then looked up to 12% faster with no drafts at all)."""
    run_cell(client, model, prompts, 1, 1, 0.0, extra)


def warm_server(client, model: str, n: int, max_tokens: int) -> dict:
    """n conversations as a server that has been up a while has served them: half the stdlib-built
    training prompts (questions, code edits, summaries, explanations from the corpus's training split),
    half everyday questions (training/specd_train/drafter/questions.py, subjects chosen apart from the
    held-out chat questions), none of the held-out ones; 16 streams at a time, 2 in 3 greedy and 1 in 3
    at T 0.7, each seeded with its index (a seeded request drafts at the server's full k, so the index
    reads every answer whole); their answers stay in the suffix index's cache."""
    from specd_train.drafter.prompts import training_prompts
    from specd_train.drafter.questions import everyday_questions

    built, asked = training_prompts(n - n // 2), everyday_questions(n // 2)
    prompts = [m for pair in zip_longest(built, asked) for m in pair if m is not None]

    def one(i: int) -> int:
        r = client.chat.completions.create(model=model, messages=prompts[i], max_tokens=max_tokens,
                                           temperature=0.7 if i % 3 == 2 else 0.0, seed=i)
        return r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    print(f"warm: {len(prompts)} conversations, {tokens} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"conversations": len(prompts), "tokens": tokens, "seconds": round(time.perf_counter() - t0, 1)}


def interleaved(client, model: str, prompts, batch: int, args, temperature: float, modes: dict) -> dict:
    """plain, then args.repeats times each other mode followed by plain again; a mode's ratio is
    its mean tok/s over the mean of every plain run (one plain run on each side of each of its runs:
    this machine's speed drifts 10-20% between runs a minute apart, so one run each side could
    not tell 0.97x from 1.0x). At batch 1 that order runs prompt by prompt (one_at_a_time)."""
    warm_up(client, model, prompts, {"speculative": PRIVATE})
    others = [name for name in modes if name != "plain"]
    if batch == 1:  # the same order, prompt by prompt
        runs = one_at_a_time(prompts, {name: lambda _, m, extra=extra: stream_one(
            client, model, m, args.max_tokens, temperature, extra) for name, extra in modes.items()},
            ["plain"] + [x for _ in range(args.repeats) for name in others for x in (name, "plain")])
        plain, cells = runs["plain"], {name: runs[name] for name in others}
    else:
        plain = [run_cell(client, model, prompts, batch, args.max_tokens, temperature, modes["plain"])]
        cells = {name: [] for name in others}
        for _ in range(args.repeats):
            for name in cells:
                cells[name].append(run_cell(client, model, prompts, batch, args.max_tokens, temperature, modes[name]))
                plain.append(run_cell(client, model, prompts, batch, args.max_tokens, temperature, modes["plain"]))
    out = {"plain": _row(plain)}
    for name, runs in cells.items():
        row = _row(runs)
        row["ratio"] = row["tok_s"] / out["plain"]["tok_s"]
        row["ratio_runs"] = [r["tok_s"] / statistics.mean((plain[i]["tok_s"], plain[i + 1]["tok_s"]))
                             for i, r in enumerate(runs)]
        if temperature == 0:  # every run's texts against the plain run before it
            row["identical"] = min(sum(a == b for a, b in zip(r["texts"], plain[i]["texts"])) for i, r in enumerate(runs))
        specs = [s for r in runs for s in r["spec"] if s]
        row["acceptance"] = (sum(s["accepted_tokens"] for s in specs) / max(1, sum(s["draft_tokens"] for s in specs)))
        drafters: dict[str, int] = {}
        for s in specs:
            for d, n in s.get("drafters", {}).items():
                drafters[d] = drafters.get(d, 0) + n
        row["drafters"] = drafters
        out[name] = row
    return out


def _ts(tokens: int, seconds: float) -> tuple:
    """(tokens, seconds) as one_at_a_time's result tuple (no text, TTFT or speculation)."""
    return "", tokens, 0.0, None, seconds


def _row(runs: list[dict]) -> dict:
    """Runs of one mode -> their mean tok/s and TTFT, with each run's tok/s."""
    return {"tok_s": statistics.mean(r["tok_s"] for r in runs), "runs_tok_s": [r["tok_s"] for r in runs],
            "tokens": sum(r["tokens"] for r in runs), "wall_s": sum(r["wall_s"] for r in runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs)}


def comparison_rounds(w: str, prompts, args, in_process: InProcess, client, model: str, url: str, llama: dict) -> list:
    """Batch 1, greedy, the workload's prompts: args.rounds rounds, each running prompt by prompt
    (one_at_a_time) in-process plain decode, specd plain and specd's own choice (official client),
    specd plain read by a minimal SSE reader, and llama-server plain and n-gram: every ratio is taken
    within a round, the requests it compares seconds apart (this machine's speed drifts 10-20%
    within minutes)."""
    plain, choice = {"speculative": {"num_speculative_tokens": 0, **PRIVATE}}, {"speculative": PRIVATE}
    for server in llama.values():
        warm_up(server.client, "model", prompts)  # llama-server caches prompts too
    modes = {"in_process": lambda i, _: _ts(*in_process.one(w, i)),
             "specd_plain": lambda _, m: stream_one(client, model, m, args.max_tokens, 0.0, plain),
             "specd_choice": lambda _, m: stream_one(client, model, m, args.max_tokens, 0.0, choice),
             "specd_plain_raw_sse": lambda _, m: _ts(*raw_sse_one(url, model, m, args.max_tokens)),
             **{f"llama_server_{mode}": lambda _, m, c=server.client: stream_one(c, "model", m, args.max_tokens, 0.0,
                                                                                 None)
                for mode, server in llama.items()}}
    rounds = []
    for i in range(args.rounds):
        # n-gram in the first round only: its state keeps the answers of the round before, which
        # the same prompts would draft
        order = [name for name in modes if not (name == "llama_server_ngram" and i > 0)]
        runs = one_at_a_time(prompts, modes, order)
        row = {name: runs[name][0]["tok_s"] for name in order}
        rounds.append(row)
        print(f"{w} round: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=None,
                    help="the verifier's threads and in-process plain's (default: what `specd up` picks)")
    ap.add_argument("--workloads", default="chat,code_edit,summarize")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--prompts", type=int, default=5, help="prompts per batch-1 cell")
    ap.add_argument("--batch-prompts", type=int, default=24,
                    help="a batch-B cell sends max(B, this) prompts, B streams at a time (the summaries' greedy answers "
                         "are ~30 tokens: 8 of them were a 1.6-s run, TTFT a fifth of it, too short for this machine's noise)")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (bench/build_llamacpp.sh)")
    ap.add_argument("--gguf", default=None, help="the GGUF of the same weights llama-server serves")
    ap.add_argument("--llama-threads", type=int, default=os.cpu_count(), help="llama-server's -t (default: every core)")
    ap.add_argument("--repeats", type=int, default=3, help="runs of the server's choice per cell, each followed "
                    "by a plain run (the cell starts with one)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of the batch-1 greedy comparisons (in-process, "
                    "raw SSE reader, llama-server) per workload")
    ap.add_argument("--warm", type=int, default=0,
                    help="first serve this many other conversations (training prompts, none of the held-out ones) as "
                         "the server's choice, so the suffix index's cache of finished answers holds theirs, as a server "
                         "that has been serving for a while (0: a fresh server, nothing cached)")
    ap.add_argument("--up-args", default="", help="more arguments for `specd up` (e.g. \"--log-level debug\"; "
                    "the stack's log is /tmp/default_stack_<port>.log)")
    ap.add_argument("--out", default="bench/results/default_stack")
    args = ap.parse_args()
    from openai import OpenAI

    from specd.rpc.threads import default_threads

    args.threads = args.threads or default_threads()

    from specd_train.workloads import workload

    workloads = args.workloads.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    temperatures = [float(t) for t in args.temperatures.split(",")]
    info = machine_info(args.threads)
    t_start = time.time()
    prompts = {w: workload(w, max(batches + [args.prompts, args.batch_prompts])) for w in workloads}

    def cell_prompts(w: str, batch: int):
        n = args.prompts if batch == 1 else max(batch, args.batch_prompts)
        return [prompts[w][i % len(prompts[w])] for i in range(n)]

    result = {"machine": info, "args": vars(args), "specd": {}, "rounds": {}}
    in_process = InProcess(args.threads, args.max_tokens, {w: cell_prompts(w, 1) for w in workloads})
    info["dtype"] = in_process.dtype
    # llama-server, plain and with its n-gram speculation, loaded beside the stack for the whole
    # run (idle between its cells), so it is measured in the same rounds as specd.
    llama = {}
    if args.llama_server:
        for mode, flags in (("plain", []), ("ngram", ["--spec-type", "ngram-mod"])):
            lport = free_port()
            llama[mode] = Server([args.llama_server, "-m", args.gguf, "--port", str(lport), "-t", str(args.llama_threads),
                                  "-tb", str(args.llama_threads), "-c", "4096", "--jinja", *flags],
                                 f"http://127.0.0.1:{lport}/health")
            llama[mode].client = OpenAI(base_url=f"http://127.0.0.1:{lport}/v1", api_key="unused", max_retries=0,
                                        timeout=600)

    port = free_port()
    # `specd up` as it starts by default. Every measured request asks that its answer not be kept
    # in the suffix index's cache (cache_output false), or the interleaved runs (the same prompts,
    # greedy: the same answers) would draft each other; it still drafts from what --warm put there.
    up = Server([sys.executable, "-m", "specd.cli", "up", "--threads", str(args.threads), "--port", str(port),
                 "--verifier-port", str(free_port()), "--drafter-port", str(free_port()), "--metrics-port", "0", *shlex.split(args.up_args)],
                f"http://127.0.0.1:{port}/health")
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        if args.warm:
            info["warm"] = warm_server(client, model, args.warm, args.max_tokens)
        for w in workloads:
            for temperature in temperatures:
                # A sampled answer's length changes run to run (the plain runs of one batch-8 cell took
                # 1.5 to 4.1 s), more than speculation changes its speed: sampled cells decode exactly
                # max_tokens tokens per stream (ignore_eos), so every run does the same work.
                fixed = {"ignore_eos": True} if temperature > 0 else {}
                modes = {"plain": {"speculative": {"num_speculative_tokens": 0, **PRIVATE}, **fixed},
                         "default": {"speculative": PRIVATE, **fixed}}
                for batch in batches:
                    key = f"{w} T={temperature:g} batch={batch}"
                    cell = interleaved(client, model, cell_prompts(w, batch), batch, args, temperature, modes)
                    result["specd"][key] = cell
                    d = cell["default"]
                    print(f"specd {key}: plain {cell['plain']['tok_s']:.1f} tok/s, server's choice "
                          f"{d['tok_s']:.1f} ({d['ratio']:.2f}x, acceptance {d['acceptance']:.2f}, {d['drafters']}"
                          + (f", identical {d['identical']}/{len(cell_prompts(w, batch))}" if "identical" in d else "")
                          + ")", flush=True)
            result["rounds"][w] = comparison_rounds(w, cell_prompts(w, 1), args, in_process, client, model,
                                                    f"http://127.0.0.1:{port}", llama)
    finally:
        up.stop()
        in_process.stop()
        for server in llama.values():
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
             + "".join(f" --{k} {a[k]}" for k, full in (("workloads", "chat,code_edit,summarize"), ("batches", "1,8,32"),
                                                        ("temperatures", "0,0.7"), ("warm", 0), ("rounds", 2),
                                                        ("repeats", 3)) if a.get(k, full) != full)
             + (" --llama-server ... --gguf ..." if a["llama_server"] else "") + "`", "",
             f"SmolLM2-135M-Instruct in {m['dtype']} (what `auto` picks here), `specd up --threads {a['threads']}` "
             "with its defaults (drafters: the trained draft model and a suffix index), "
             + (f"after serving {m['warm']['conversations']} other conversations ({m['warm']['tokens']:,} tokens: "
                "training prompts and everyday questions, none of the held-out ones; 2 in 3 greedy, seeded: full k), "
                "whose answers the suffix index keeps and drafts from, "
                if m.get("warm") else "fresh (its suffix index holds no finished answers), ")
             + "every measured request with `speculative: {cache_output: false}` (its own answer is not kept, else the "
             "interleaved runs of the same prompts would draft each other's), the official `openai` "
             f"client, streamed chat completions, up to {a['max_tokens']} tokens (sampled cells, T > 0: exactly "
             f"{a['max_tokens']} per stream, ignore_eos, as a sampled answer's length changes run to run); batch 1 sends {a['prompts']} "
             f"held-out prompts one after another, batch B sends max(B, {a.get('batch_prompts', 0)}) prompts, "
             "B concurrent streams at a time (a stream that ends makes room for the next prompt). "
             "Plain = `num_speculative_tokens: 0` in the request's `speculative`; server's choice = no k, no drafter. "
             f"Runs interleaved: plain, then {a.get('repeats', 1)} times server's choice and plain again (at batch 1 "
             "prompt by prompt: each prompt goes through that order before the next); tok/s is a mode's "
             "mean over its runs, the ratio choice's mean over plain's, and 'runs' gives each choice run over the "
             "two plain runs around it (this machine drifts 10-20% between runs a minute apart). "
             "Every cell first sends its prompts once for one token, untimed (llama-server's cells too), so each "
             "timed run finds them in the prefix cache (TTFT below is a cache hit's).",
             "", "| workload | T | batch | plain tok/s | server's choice tok/s | ratio | TTFT plain / choice (s) "
             "| runs | acceptance | drafts by drafter | greedy identical |", "|---|---:|---:|---:|---:|---:|---|---|---:|---|---|"]
    for key, cell in r["specd"].items():
        w, t, b = key.split(" ")
        p, d = cell["plain"], cell["default"]
        n = a["prompts"] if b == "batch=1" else max(int(b.split("=")[1]), a.get("batch_prompts", 0))
        lines.append(f"| {w} | {t[2:]} | {b[6:]} | {p['tok_s']:.1f} | {d['tok_s']:.1f} | {d['ratio']:.2f}x | "
                     f"{p['ttft_s']:.2f} / {d['ttft_s']:.2f} | {' '.join(f'{x:.2f}' for x in d.get('ratio_runs', []))} | "
                     f"{d['acceptance']:.2f} | "
                     f"{', '.join(f'{k} {v}' for k, v in d['drafters'].items()) or '-'} | "
                     f"{str(d['identical']) + '/' + str(n) if 'identical' in d else '-'} |")
    if any(r.get("rounds", {}).values()):  # --rounds 0: no table (a header without rows said nothing)
        lines += rounds_table(r)
    lines += ["", f"Machine: {cpu_name(m)} ({' '.join(m['cpu_flags'])}), {m['cores']} cores, torch threads "
              f"{m['threads']} in the verifier (and in-process), 1 per drafter, torch {m['torch']}; load average {m['load_avg_start']} at start, "
              f"{m['load_avg_end']} at end; {m['date']}; {m['minutes']} min.", ""]
    return "\n".join(lines)


def rounds_table(r: dict) -> list[str]:
    """The batch-1 comparison rounds (in-process, specd, llama-server) as report lines."""
    a = r["args"]
    lines = ["", f"Batch 1, greedy, the same prompts, in {a['rounds']} rounds per workload after its cells; each round "
              "runs prompt by prompt, each prompt in turn through: in-process plain decode (specd.LLM in a process of its own, loaded once, same dtype and "
              "threads), specd plain and specd's own choice over HTTP (the official client), specd plain read by a "
              "minimal SSE reader (http.client: the client shares the stack's 2 cores, and the official client's "
              "parsing of each chunk is CPU the verifier lacks), and llama.cpp's `llama-server` on a GGUF of the same "
              f"weights (`-t {a['llama_threads']}`, plain and `--spec-type ngram-mod`; both loaded beside the stack "
              "for the whole run; n-gram in the first round only: its n-gram state keeps the answers of earlier "
              "rounds to the same prompts). HTTP / in-process ratios are taken within a round, then averaged; tok/s "
              "are the rounds' means, and specd's choice / llama-server's best is over those means:", "",
              "| workload | in-process | specd plain | HTTP / in-process | raw SSE reader / in-process | specd's choice "
              "| llama-server plain | llama-server ngram | specd's choice / llama-server's best |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w, rounds in r["rounds"].items():
        if not rounds:  # --rounds 0
            continue
        mean = {k: statistics.mean(x[k] for x in rounds if k in x) for k in rounds[0]}
        ratio = {k: statistics.mean(x[k] / x["in_process"] for x in rounds) for k in ("specd_plain", "specd_plain_raw_sse")}
        has_llama = "llama_server_plain" in mean
        best = max(mean["llama_server_plain"], mean["llama_server_ngram"]) if has_llama else None
        vs_llama = mean["specd_choice"] / best if has_llama else None
        lines.append(f"| {w} | {mean['in_process']:.1f} | {mean['specd_plain']:.1f} | {ratio['specd_plain']:.2f}x | "
                     f"{ratio['specd_plain_raw_sse']:.2f}x | {mean['specd_choice']:.1f} | "
                     + (f"{mean['llama_server_plain']:.1f} | {mean['llama_server_ngram']:.1f} | {vs_llama:.2f}x |"
                        if has_llama else "- | - | - |"))
    return lines


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
