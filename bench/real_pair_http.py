"""The HTTP half of bench/real_pair.py: the real services on loopback, driven with the openai client.

Drafters (one process per method), the verifier and the gateway are started as `specd ...`
processes on free loopback ports, every one with explicit --threads; they are stopped (and
their process groups killed) whatever happens. Per (workload, temperature, batch) cell the
runs are interleaved: plain, then each drafter, R times, and one closing plain run; a
drafter's ratio in repeat r is its tok/s over the mean of the plain runs before and after
it, and the reported ratio is the median over repeats. The suffix drafter keeps a global
cache of finished answers, so it is restarted before each of its runs: otherwise repeats
of the same prompts would be drafted from their own earlier answers.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from specd.cli.readiness import drafters_registered, grpc_serving, http_ok, wait_ready
from specd.cli.up import Stack

DRAFTER_OPTIONS = {  # what the offline rows use, as drafter-side options
    "draft_model": {"draft_sample_method": "sampled"},  # sampled drafts only where temperature > 0
    "ngram": {"prompt_lookup_min": 2, "prompt_lookup_max": 5},
    "suffix": {},
    "eagle": {"draft_sample_method": "sampled"},
    "eagle3": {"draft_sample_method": "sampled"},
    "medusa": {"draft_sample_method": "sampled"},
    "mlp_speculator": {"draft_sample_method": "sampled"},
    # draft_model drafting EAGLE-2 style dynamic token trees (greedy drafts, verified one-hot) instead of chains
    "draft_model_tree": {"tree": {"branching": [2, 2, 2, 2], "dynamic": True, "max_nodes": 8}},
    # one tree from the draft model's chain and suffix's match (the drafter is filled in below)
    "combined": {"members": [{"method": "draft_model", "draft_sample_method": "sampled"}, {"method": "suffix"}]},
}
HEAD_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator")  # read the target's hidden states
VARIANT_OF = {"draft_model_tree": "draft_model"}  # bench name -> the drafter's --method


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Services:
    """Drafters + verifier + gateway as child processes; a context manager that always cleans up."""

    def __init__(self, target: str, drafter: str, methods: list[str], threads: int, dtype: str, max_k: int,
                 propose_timeout_ms: float | None = None, heads: dict[str, str] | None = None,
                 verifier_spec: dict | None = None):
        self.target, self.drafter, self.methods, self.threads, self.dtype = target, drafter, methods, threads, dtype
        self.verifier_spec = verifier_spec or {}  # more --speculative-config keys (e.g. adaptive: false)
        self.heads = heads or {}  # method -> head directory
        self.max_k, self.propose_timeout_ms = max_k, propose_timeout_ms
        self.stack = Stack()
        self.ports = {m: free_port() for m in methods}
        self.verifier_port, self.metrics_port, self.http_port = free_port(), free_port(), free_port()
        self.verifier = f"127.0.0.1:{self.verifier_port}"
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"

    def _drafter_argv(self, method: str) -> list[str]:
        argv = ["drafter", "--method", VARIANT_OF.get(method, method), "--name", method,
                "--port", str(self.ports[method]), "--metrics-port", "0", "--threads", str(self.threads),
                "--log-level", "warning", "--num-speculative-tokens", str(max(8, self.max_k))]
        if VARIANT_OF.get(method, method) == "draft_model":
            argv += ["--model", self.drafter, "--dtype", self.dtype]
        elif method in HEAD_METHODS:
            argv += ["--model", self.heads[method], "--target", self.target, "--dtype", self.dtype]
        options = DRAFTER_OPTIONS[method]
        if method == "combined":
            argv += ["--dtype", self.dtype]
            options = {"members": [{**m, "model": self.drafter} if m["method"] == "draft_model" else m
                                   for m in options["members"]]}
        if options:
            argv += ["--options", json.dumps(options)]
        return argv

    def __enter__(self) -> "Services":
        try:
            checks = []
            for m in self.methods:
                self.stack.start(f"drafter {m}", self._drafter_argv(m))
                checks.append((f"drafter {m}", lambda a=f"127.0.0.1:{self.ports[m]}": grpc_serving(a)))
            argv = ["verifier", "--model", self.target, "--port", str(self.verifier_port),
                    "--metrics-port", str(self.metrics_port), "--threads", str(self.threads), "--dtype", self.dtype,
                    "--log-level", "warning",
                    "--speculative-config", json.dumps({"num_speculative_tokens": max(4, self.max_k), **self.verifier_spec})]
            for m in self.methods:
                argv += ["--drafter", f"{m}=127.0.0.1:{self.ports[m]}"]
            if self.propose_timeout_ms is not None:
                argv += ["--propose-timeout-ms", str(self.propose_timeout_ms)]
            self.stack.start("verifier", argv)
            checks.append(("verifier", lambda: grpc_serving(self.verifier)
                           and drafters_registered(self.verifier, self.methods)))
            self.stack.start("gateway", ["gateway", "--verifier", self.verifier, "--port", str(self.http_port),
                                         "--log-level", "warning"])
            checks.append(("gateway", lambda: http_ok(f"http://127.0.0.1:{self.http_port}/health")))
            wait_ready(self.stack, checks, threading.Event(), timeout=600)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.stack.stop(timeout=10)
        finally:
            for _, proc in self.stack.children:  # each child leads its own session: take its group down too
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def restart_drafter(self, method: str) -> None:
        """A fresh drafter process on the same port; waits until the verifier uses it again."""
        name = f"drafter {method}"
        old = next(p for n, p in self.stack.children if n == name)
        old.terminate()
        try:
            old.wait(10)
        except Exception:  # noqa: BLE001
            old.kill()
            old.wait()
        self.stack.children = [(n, p) for n, p in self.stack.children if p is not old]
        deadline = time.monotonic() + 15  # let the verifier notice, so "healthy" below means the new one
        while drafters_registered(self.verifier, [method]) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stack.start(name, self._drafter_argv(method))
        wait_ready(self.stack, [(name, lambda: grpc_serving(f"127.0.0.1:{self.ports[method]}")),
                                ("verifier", lambda: drafters_registered(self.verifier, [method]))],
                   threading.Event(), timeout=120)

    def scrape(self) -> dict[str, float]:
        return scrape(self.metrics_port)


def scrape(port: int) -> dict[str, float]:
    """A loopback /metrics page as {'name{label=value,...}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def metrics_delta(before: dict, after: dict, drafter: str) -> dict:
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    per_pos, i = [], 0
    while f"specd_spec_decode_num_accepted_tokens_per_pos_total{{drafter={drafter},position={i}}}" in d:
        per_pos.append(int(d[f"specd_spec_decode_num_accepted_tokens_per_pos_total{{drafter={drafter},position={i}}}"]))
        i += 1
    rtt_n = d.get(f"specd_verifier_propose_rtt_seconds_count{{drafter={drafter}}}", 0.0)
    rtt_s = d.get(f"specd_verifier_propose_rtt_seconds_sum{{drafter={drafter}}}", 0.0)
    steps = d.get("specd_verifier_step_seconds_count", 0.0)
    prefix = "specd_spec_decode_num_draft_tokens_total{drafter="
    by_drafter = {k[len(prefix):-1]: int(v) for k, v in d.items() if k.startswith(prefix) and v}
    feature_bytes = d.get(f"specd_verifier_propose_feature_bytes_total{{drafter={drafter}}}", 0.0)
    return {"accepted_per_pos": per_pos, "round_trips": int(rtt_n), "draft_tokens_by_drafter": by_drafter,
            "feature_bytes": int(feature_bytes),
            "rtt_ms": 1e3 * rtt_s / rtt_n if rtt_n else None,
            "steps": int(steps),
            "step_ms": 1e3 * d.get("specd_verifier_step_seconds_sum", 0.0) / steps if steps else None}


class Client:
    def __init__(self, base_url: str):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=1800)
        self.model = self.client.models.list().data[0].id

    def one(self, req: dict, temperature: float, max_tokens: int, speculative: dict | None) -> dict:
        kw = {"model": self.model, "messages": req["messages"], "max_tokens": max_tokens, "temperature": temperature}
        if temperature > 0:
            kw["seed"] = req["seed"]
        if speculative is not None:
            kw["extra_body"] = {"speculative": speculative}
        r = self.client.chat.completions.create(**kw)
        spec = (r.usage.model_extra or {}).get("speculative") or {}
        return {"completion_tokens": r.usage.completion_tokens, "prompt_tokens": r.usage.prompt_tokens,
                "text": r.choices[0].message.content, "spec": spec}

    def run(self, reqs: list[dict], batch: int, temperature: float, max_tokens: int, speculative: dict | None) -> dict:
        """batch 1: one request after another; batch B: B requests in flight at a time (B workers)."""
        start = time.perf_counter()
        if batch == 1:
            outs = [self.one(r, temperature, max_tokens, speculative) for r in reqs]
        else:
            with ThreadPoolExecutor(batch) as pool:
                outs = list(pool.map(lambda r: self.one(r, temperature, max_tokens, speculative), reqs))
        wall = time.perf_counter() - start
        tokens = sum(o["completion_tokens"] for o in outs)
        spec = {key: sum(o["spec"].get(key, 0) for o in outs) for key in ("drafts", "draft_tokens", "accepted_tokens")}
        return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, **spec, "texts": [o["text"] for o in outs],
                "prompt_tokens": [o["prompt_tokens"] for o in outs]}


def _bracketed_ratios(plains: list[dict], runs: list[dict]) -> list[float]:
    """Run r against the mean of the plain runs before (r) and after (r + 1) it."""
    return [x["tok_s"] / statistics.fmean([plains[r]["tok_s"], plains[r + 1]["tok_s"]]) for r, x in enumerate(runs)]


def http_stage(args, prompts: dict, requests_for, log) -> tuple[list[dict], list[dict], list[str]]:
    """Rows for batch 1/8 per workload, temperature and drafter; rows for the batch-32 check; notes."""
    rows, b32_rows, notes = [], [], []
    base = {"stage": "http", "threads": args.threads, "dtype": args.dtype, "max_tokens": args.max_tokens}
    with Services(args.target, args.drafter, args.methods, args.threads, args.dtype, max(args.k + [args.http_k]),
                  args.propose_timeout_ms, args.heads) as svc:
        client = Client(svc.base_url)
        warm = [{"messages": [{"role": "user", "content": "Say hello in five words."}], "seed": 0}]
        for m in [None, *args.methods]:
            client.run(warm, 1, 0.0, 8, {"num_speculative_tokens": args.http_k, "drafter": m} if m else
                       {"num_speculative_tokens": 0})
        k = args.http_k
        for wl in args.workloads:
            for temp in args.temps:
                for batch in args.batches:
                    reqs = requests_for(prompts[wl], batch)
                    plains, runs, deltas = [], {m: [] for m in args.methods}, {m: [] for m in args.methods}
                    for rep in range(args.repeats + 1):
                        plains.append(client.run(reqs, batch, temp, args.max_tokens, {"num_speculative_tokens": 0}))
                        if rep == args.repeats:
                            break
                        order = args.methods[rep % len(args.methods):] + args.methods[:rep % len(args.methods)]
                        for m in order:
                            if m == "suffix":
                                svc.restart_drafter("suffix")
                            before = svc.scrape()
                            runs[m].append(client.run(reqs, batch, temp, args.max_tokens,
                                                      {"num_speculative_tokens": k, "drafter": m}))
                            deltas[m].append(metrics_delta(before, svc.scrape(), m))
                    bad_prompt = sum(p != len(r["ids"]) for p, r in zip(plains[0]["prompt_tokens"], reqs))
                    if bad_prompt:
                        notes.append(f"http {wl}: {bad_prompt} request(s) whose prompt_tokens differ from "
                                     "chat_prompt_ids (gateway template != offline template)")
                    cell = {**base, "workload": wl, "temperature": temp, "batch": batch,
                            "prompts": min(len(reqs), len(prompts[wl])),
                            "requests": len(reqs), "repeats": args.repeats}
                    plain_tok_s = statistics.median(p["tok_s"] for p in plains)
                    rows.append({**cell, "method": "plain", "k": 0, "tok_s": plain_tok_s,
                                 "every_tok_s": [p["tok_s"] for p in plains]})
                    for m in args.methods:
                        ratios = _bracketed_ratios(plains, runs[m])
                        rows.append(_spec_row(cell, m, k, runs[m], ratios, deltas[m], plain_tok_s,
                                              plains if temp == 0 else None))
                        if rows[-1]["draft_tokens_other"]:
                            notes.append(f"http {wl} T={temp} b={batch} {m}: {rows[-1]['draft_tokens_other']} of the "
                                         f"draft tokens came from other drafters "
                                         f"({rows[-1]['draft_tokens_elsewhere']}): "
                                         f"{m} was unhealthy (missed propose deadlines?) and the verifier rerouted")
                        log(f"[http] {wl} T={temp} b={batch} {m} k={k}: {rows[-1]['tok_s']:.1f} tok/s, median ratio "
                            f"{rows[-1]['ratio']:.3f} ({', '.join(f'{x:.2f}' for x in ratios)}), "
                            f"acceptance {rows[-1]['acceptance_rate']:.2f}")
        if args.b32_repeats > 0:
            b32_rows = batch32(args, prompts, client, svc, base, log)
            for x in b32_rows[1:]:
                if x["draft_tokens_other"]:
                    notes.append(f"batch {x['batch']} {x['method']}: {x['draft_tokens_other']} draft tokens came from "
                                 f"other drafters ({x['draft_tokens_elsewhere']})")
    return rows, b32_rows, notes


def _spec_row(cell: dict, method: str, k: int, runs: list[dict], ratios: list[float], deltas: list[dict],
              plain_tok_s: float, plains: list[dict] | None) -> dict:
    drafts = sum(r["drafts"] for r in runs)
    draft_tokens = sum(r["draft_tokens"] for r in runs)
    accepted = sum(r["accepted_tokens"] for r in runs)
    per_pos = [sum(d["accepted_per_pos"][i] if i < len(d["accepted_per_pos"]) else 0 for d in deltas)
               for i in range(max((len(d["accepted_per_pos"]) for d in deltas), default=0))]
    reached = [drafts] + per_pos[:-1]
    rtts = [d["rtt_ms"] for d in deltas if d["rtt_ms"] is not None]
    row = {**cell, **_by_drafter(method, deltas), "method": method, "k": k,
           "tok_s": statistics.median(r["tok_s"] for r in runs),
           "plain_tok_s": plain_tok_s, "ratio": statistics.median(ratios), "ratios": ratios,
           "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
           "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
           "mean_accepted_len": accepted / drafts if drafts else 0.0, "E": 1 + accepted / drafts if drafts else 1.0,
           "alpha_per_pos": [a / n if n else None for a, n in zip(per_pos, reached)],
           "rtt_ms": statistics.fmean(rtts) if rtts else None,
           # the target's hidden states shipped per propose round trip (hidden-state heads only)
           "feature_bytes_per_step": sum(d.get("feature_bytes", 0) for d in deltas) / max(
               1, sum(d["round_trips"] for d in deltas)),
           "step_ms": statistics.fmean([d["step_ms"] for d in deltas if d["step_ms"] is not None] or [0.0])}
    if plains is not None:  # greedy: the text must equal plain decoding's (lossless)
        row["greedy_mismatches"] = sum(a != b for r in runs for a, b in zip(r["texts"], plains[0]["texts"]))
    return row


def _by_drafter(method: str, deltas: list[dict]) -> dict:
    """Who drafted, from the verifier's per-drafter counters: a request names its drafter, but while
    that one is unhealthy the verifier routes to another, and usage.speculative does not say so."""
    total: dict[str, int] = {}
    for d in deltas:
        for name, n in d["draft_tokens_by_drafter"].items():
            total[name] = total.get(name, 0) + n
    other = {n: v for n, v in total.items() if n != method}
    return {"draft_tokens_own": total.get(method, 0), "draft_tokens_other": sum(other.values()),
            "draft_tokens_elsewhere": other}


def batch32(args, prompts: dict, client: Client, svc: Services, base: dict, log) -> list[dict]:
    """32 concurrent greedy requests, no k in the request (the adaptive controller decides) vs k = 0."""
    mixed = [p for group in zip(*(prompts[w] for w in args.workloads)) for p in group]
    reqs = [mixed[i % len(mixed)] for i in range(args.b32_size)]
    plains, runs, deltas = [], {m: [] for m in args.b32_drafters}, {m: [] for m in args.b32_drafters}
    for rep in range(args.b32_repeats + 1):
        plains.append(client.run(reqs, len(reqs), 0.0, args.max_tokens, {"num_speculative_tokens": 0}))
        if rep == args.b32_repeats:
            break
        for m in args.b32_drafters:
            before = svc.scrape()
            runs[m].append(client.run(reqs, len(reqs), 0.0, args.max_tokens, {"drafter": m}))
            deltas[m].append(metrics_delta(before, svc.scrape(), m))
    cell = {**base, "stage": "http_b32", "workload": "+".join(args.workloads), "temperature": 0.0,
            "batch": len(reqs), "prompts": min(len(mixed), len(reqs)), "requests": len(reqs),
            "repeats": args.b32_repeats}
    rows = [{**cell, "method": "plain", "k": 0, "tok_s": statistics.median(p["tok_s"] for p in plains),
             "every_tok_s": [p["tok_s"] for p in plains]}]
    for m in args.b32_drafters:
        ratios = _bracketed_ratios(plains, runs[m])
        draft_tokens = sum(r["draft_tokens"] for r in runs[m])
        accepted = sum(r["accepted_tokens"] for r in runs[m])
        tokens = sum(r["tokens"] for r in runs[m])
        rows.append({**cell, **_by_drafter(m, deltas[m]), "method": f"{m} adaptive", "k": "auto",
                     "tok_s": statistics.median(r["tok_s"] for r in runs[m]),
                     "ratio": statistics.median(ratios), "ratios": ratios, "draft_tokens": draft_tokens,
                     "accepted_tokens": accepted, "draft_tokens_per_token": draft_tokens / max(tokens, 1),
                     "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
                     "pass": statistics.median(ratios) >= 0.97})
        log(f"[http b{len(reqs)}] {m} adaptive: median ratio {rows[-1]['ratio']:.3f} "
            f"({', '.join(f'{x:.3f}' for x in ratios)}), "
            f"draft tokens per token {rows[-1]['draft_tokens_per_token']:.3f}")
    return rows
