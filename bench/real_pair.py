"""Speculative decoding on the default pair (SmolLM2-135M-Instruct + its trained drafter): offline,
over HTTP, and against peers, on the held-out workloads (specd_train.workloads: chat, code_edit, summarize).

1. offline: specd.LLM in-process. Per workload, batch (1, 8) and temperature (0, 0.7, seeded per
   prompt): plain decoding, then draft_model / ngram / suffix at each fixed k (controller off).
   tok/s, ratio to plain, acceptance α per position, mean accepted length, and the cost model
   (docs/architecture.md, "The controller's cost model") from engine step timings over decode
   steps (prefill steps left out):
       P = propose time per step, d = P / k, V(1) = plain verify time per step,
       V(k+1) = verify time per step with drafts, E = 1 + accepted / drafts,
       ideal = E·V(1) / (k·d + V(k+1)), measured / ideal = ratio / ideal.
2. http: `specd drafter` x methods, `specd verifier`, `specd gateway` on loopback, the openai
   client; interleaved plain/spec runs, median ratio (bench/real_pair_http.py). Then batch 32:
   the adaptive controller (no k in the request) against k = 0; it must keep >= 0.97.
3. peers: transformers generate and assisted generation (batch 1, greedy, float32), llama.cpp
   (bench/llamacpp.py: plain, draft model, prompt lookup) where built.

Ratios are always against plain runs interleaved with the spec runs (offline: one before and one
after each cell's spec runs; HTTP: plain before each repeat and once more at the end), as a
shared 2-core machine drifts by more than the effects measured. Every row records threads,
dtype, batch, temperature, k, workload, method, prompts, requests and max tokens.

    python bench/real_pair.py --quick            # 2 prompts x 32 tokens, k=4, 1 repeat: checks the harness
    python bench/real_pair.py                    # the full run -> bench/results/real_pair.{json,md,png}
    python bench/real_pair.py --only http --workloads chat --methods suffix --temps 0   # one slice

Defaults: the fetched pair (specd.models.model_store), 1 torch thread per process, 4 prompts per
workload (batch-8 runs: 8), 128 tokens, offline k 2 and 4, HTTP k 4, 3 repeats. Needs the dev
extras (openai, transformers) and matplotlib for the plot.
"""
from __future__ import annotations

import argparse
import gc
import os
import shlex
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = Path(__file__).resolve().parent / "results"
WARMUP = [{"role": "user", "content": "Say hello in five words."}]  # in no workload (suffix caches answers)
METHODS = ("draft_model", "ngram", "suffix", "eagle", "combined", "eagle3", "medusa", "mlp_speculator",
           "draft_model_tree")
HEADS = ("eagle", "eagle3", "medusa", "mlp_speculator")  # trained heads: models/SmolLM2-135M-Instruct-<method>
WORKLOADS = ("chat", "code_edit", "summarize")
STAGES = ("offline", "http", "peers")
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def csv(cast):
    return lambda s: [cast(x) for x in s.split(",") if x.strip()]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=None, help="target directory (default: specd.models.model_store.target_dir())")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: specd.models.model_store.drafter_dir())")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of this process, the verifier and each drafter (default 1)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per workload (default 4; --quick 2); batch-B runs use the first max(this, B)")
    ap.add_argument("--max-tokens", type=int, default=None, help="default 128; --quick 32")
    ap.add_argument("--k", type=csv(int), default=None, help="offline k list (default 2,4; --quick 4)")
    ap.add_argument("--http-k", type=int, default=None, help="k over HTTP (default: the largest of --k)")
    ap.add_argument("--repeats", type=int, default=None, help="HTTP repeats per cell (default 3; --quick 1)")
    ap.add_argument("--only", type=csv(str), default=list(STAGES), help="offline,http,peers")
    ap.add_argument("--workloads", type=csv(str), default=list(WORKLOADS))
    ap.add_argument("--methods", type=csv(str), default=None,
                    help="default: draft_model, ngram, suffix, and eagle where an EAGLE head is found")
    ap.add_argument("--head", action="append", default=[], metavar="METHOD=DIR",
                    help="a hidden-state head's directory (default: models/SmolLM2-135M-Instruct-<method> where it "
                         "exists, e.g. -eagle, -eagle3, -medusa, -mlp-speculator)")
    ap.add_argument("--batches", type=csv(int), default=[1, 8])
    ap.add_argument("--temps", type=csv(float), default=[0.0, 0.7])
    ap.add_argument("--http-batches", type=csv(int), default=None, help="default: --batches")
    ap.add_argument("--b32-size", type=int, default=32, help="requests in flight in the batch-32 check")
    ap.add_argument("--b32-repeats", type=int, default=None, help="default 3; --quick 1; 0 skips")
    ap.add_argument("--b32-drafters", type=csv(str), default=["draft_model"])
    ap.add_argument("--peers", type=csv(str), default=["transformers", "llamacpp"])
    ap.add_argument("--peer-prompts", type=int, default=None, help="prompts per workload for peers (default --prompts)")
    ap.add_argument("--llamacpp-bin", default=None, help="default: bench/llamacpp.py's DEFAULT_BIN_DIR")
    ap.add_argument("--llamacpp-model", default=None, help="target GGUF (default: --target converted once to f32)")
    ap.add_argument("--llamacpp-draft", default=None, help="draft GGUF (default: --drafter converted once to f32)")
    ap.add_argument("--propose-timeout-ms", type=float, default=None,
                    help="the verifier's propose deadline (default: the verifier's own, 250 ms)")
    ap.add_argument("--quick", action="store_true", help="2 prompts, 32 tokens, k=4, 1 repeat: checks everything runs")
    ap.add_argument("--out", default=None, help="output path without suffix (default bench/results/real_pair"
                                                "[_quick])")
    args = ap.parse_args(argv)
    q = args.quick
    for name, full, quick in (("prompts", 4, 2), ("max_tokens", 128, 32), ("k", [2, 4], [4]), ("repeats", 3, 1),
                              ("b32_repeats", 3, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.http_k = args.http_k or max(args.k)
    args.peer_prompts = args.peer_prompts or args.prompts
    args.http_batches = args.http_batches or args.batches
    args.out = Path(args.out or RESULTS / ("real_pair_quick" if q else "real_pair"))
    bad = ([m for m in (args.methods or []) + args.b32_drafters if m not in METHODS]
           + [w for w in args.workloads if w not in WORKLOADS] + [o for o in args.only if o not in STAGES])
    if bad:
        ap.error(f"unknown method/workload/stage: {', '.join(bad)}")
    if "http" in args.only and set(args.b32_drafters) - set(args.methods):
        ap.error("--b32-drafters must be among --methods (the drafters started)")
    from specd.models import model_store

    args.target = str(args.target or model_store.target_dir())
    args.drafter = str(args.drafter or model_store.drafter_dir())
    models = Path(__file__).resolve().parents[1] / "models"
    args.heads = {m: str(models / f"SmolLM2-135M-Instruct-{m.replace('_', '-')}") for m in HEADS
                  if (models / f"SmolLM2-135M-Instruct-{m.replace('_', '-')}" / "config.json").is_file()}
    args.heads.update(dict(h.split("=", 1) for h in args.head))
    if args.methods is None:
        args.methods = ["draft_model", "ngram", "suffix"] + (["eagle"] if "eagle" in args.heads else [])
    for m in set(args.methods) & set(HEADS) - set(args.heads):
        ap.error(f"method {m} needs --head {m}=DIR (a head: specd train-drafter --method {m})")
    for what in ("target", "drafter"):
        if not (Path(getattr(args, what)) / "config.json").is_file():
            ap.error(f"--{what} {getattr(args, what)}: no config.json (run `specd models fetch`, or pass --{what})")
    return args


def load_prompts(target: str, workloads: list[str], n: int) -> dict[str, list[dict]]:
    from specd.models.chat import chat_prompt_ids
    from specd.models.tokenizer import Tokenizer
    from specd_train.workloads import workload

    tok = Tokenizer.from_dir(Path(target))
    return {w: [{"messages": m, "ids": chat_prompt_ids(tok, m), "seed": 1000 * WORKLOADS.index(w) + i}
                for i, m in enumerate(workload(w, n))] for w in workloads}


def requests_for(prompts: list[dict], n: int, batch: int) -> list[dict]:
    """The first n prompts, or the first `batch` where that is more (one full batch of distinct
    prompts); cycled (copies get their own seeds) only if the workload has fewer."""
    n = max(n, batch)
    return [{**prompts[i % len(prompts)], "seed": prompts[i % len(prompts)]["seed"] + 100 * (i // len(prompts))}
            for i in range(n)]


# ---------------------------------------------------------------- offline


class StepLog:
    """Replaces engine.timings: per step (wall, propose, verify, decode-only?, sequences)."""

    def __init__(self):
        self.steps, self.decode, self.seqs, self.pv = [], True, 0, None

    def observe(self, propose_s: float, verify_s: float, tokens: int) -> None:
        self.pv = (propose_s, verify_s)


def instrument(llm) -> StepLog:
    eng, rec = llm.engine, StepLog()
    run, step = eng.runner.run, eng.step

    def run_logged(batch):
        rec.decode = all(e.num_new_tokens == e.num_logits for e in batch)  # no prefill chunk in the step
        rec.seqs = len(batch)
        return run(batch)

    def step_logged():
        rec.pv = None
        t0 = time.perf_counter()
        out = step()
        if rec.pv is not None:
            rec.steps.append((time.perf_counter() - t0, *rec.pv, rec.decode, rec.seqs))
        return out

    eng.runner.run, eng.step, eng.timings = run_logged, step_logged, rec
    return rec


def spec_config(method: str, k: int, temperature: float, drafter: str, dtype: str = "auto",
                heads: dict[str, str] | None = None, target: str | None = None) -> dict:
    tree = method == "draft_model_tree"  # draft_model's token trees (dynamic where greedy)
    method = "draft_model" if tree else method
    cfg = {"method": method, "num_speculative_tokens": k, "adaptive": False}
    if tree:
        cfg["tree"] = {"branching": [2, 2, 2, 2], "dynamic": temperature == 0, "max_nodes": 8}
    if method == "draft_model" or method in HEADS:
        cfg["model"] = drafter if method == "draft_model" else heads[method]
        if method in HEADS:
            cfg["target_model"] = target
        cfg["draft_dtype"] = dtype  # the drafter runs in the target's dtype
        if temperature > 0:
            cfg["draft_sample_method"] = "sampled"
    elif method == "ngram":
        cfg.update(prompt_lookup_min=2, prompt_lookup_max=5)
    elif method == "combined":  # one tree from the draft model's chain and suffix's match
        model = spec_config("draft_model", k, temperature, drafter, dtype)
        cfg["members"] = [{key: v for key, v in model.items() if key not in ("num_speculative_tokens", "adaptive")},
                          {"method": "suffix"}]
    return cfg


def offline_run(llm, rec: StepLog, reqs: list[dict], batch: int, temperature: float, max_tokens: int) -> dict:
    from specd import SamplingParams

    rec.steps.clear()
    tokens, outs = 0, []
    spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    per_pos: list[int] = []
    start = time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                 seed=r["seed"] if temperature > 0 else None) for r in group]
        for o in llm.generate([{"prompt_token_ids": r["ids"]} for r in group], params):
            tokens += len(o.token_ids)
            outs.append(o.token_ids)
            for key in spec:
                spec[key] += (o.spec or {}).get(key, 0)
            for j, a in enumerate((o.spec or {}).get("accepted_per_pos", [])):
                per_pos.extend([0] * (j + 1 - len(per_pos)))
                per_pos[j] += a
    wall = time.perf_counter() - start
    dec = [s for s in rec.steps if s[3]]
    n = max(len(dec), 1)
    dec_wall = sum(s[0] for s in dec)
    return {"tok_s": tokens / wall, "wall_s": wall, "new_tokens": tokens, "decode_steps": len(dec),
            "decode_seq_steps": sum(s[4] for s in dec),
            "decode_tok_s": (tokens - len(reqs)) / dec_wall if dec_wall else None,
            "P_ms": 1e3 * sum(s[1] for s in dec) / n, "V_ms": 1e3 * sum(s[2] for s in dec) / n,
            "accepted_per_pos": per_pos, "outputs": outs, **spec}


def offline_stage(args, prompts: dict) -> list[dict]:
    import torch

    from specd import LLM

    torch.set_num_threads(args.threads)
    cache: dict[tuple, tuple] = {}

    def get(key: tuple, cfg: dict | None):
        if key not in cache:
            llm = LLM(args.target, speculative_config=cfg, dtype=args.dtype, max_model_len=2048, kv_cache_gb=0.25)
            rec = instrument(llm)
            from specd import SamplingParams
            from specd.models.chat import chat_prompt_ids

            llm.generate({"prompt_token_ids": chat_prompt_ids(llm.tokenizer, WARMUP)},
                         SamplingParams(max_tokens=8, temperature=0))
            cache[key] = (llm, rec)
        return cache[key]

    rows = []
    for wl in args.workloads:
        for temp in args.temps:
            for batch in args.batches:
                reqs = requests_for(prompts[wl], args.prompts, batch)
                cell = {"stage": "offline", "threads": args.threads, "dtype": args.dtype, "batch": batch,
                        "temperature": temp, "workload": wl, "prompts": min(len(reqs), len(prompts[wl])),
                        "requests": len(reqs),
                        "max_tokens": args.max_tokens}
                # plain before and after the cell's spec runs: ratios are against their mean, and the
                # drift between the two shows how steady the machine was
                before = offline_run(*get(("plain",), None), reqs, batch, temp, args.max_tokens)
                log(f"[offline] {wl} T={temp} b={batch} plain: {before['tok_s']:.1f} tok/s, "
                    f"V(1) {before['V_ms']:.1f} ms")
                runs = []
                for method in args.methods:
                    for k in args.k:
                        cfg = spec_config(method, k, temp, args.drafter, args.dtype, args.heads, args.target)
                        key = (method, k, cfg.get("draft_sample_method"))
                        runs.append((method, k, offline_run(*get(key, cfg), reqs, batch, temp, args.max_tokens)))
                        if method == "suffix":  # its global cache of answers must not outlive the run
                            del cache[key]
                            gc.collect()
                        log(f"[offline] {wl} T={temp} b={batch} {method} k={k}: {runs[-1][2]['tok_s']:.1f} tok/s")
                after = offline_run(*get(("plain",), None), reqs, batch, temp, args.max_tokens)
                plain = {**before, "tok_s": (before["tok_s"] + after["tok_s"]) / 2,
                         "V_ms": (before["V_ms"] + after["V_ms"]) / 2, "tok_s_before": before["tok_s"],
                         "tok_s_after": after["tok_s"], "drift": after["tok_s"] / before["tok_s"]}
                if before["outputs"] != after["outputs"] and temp == 0:
                    log(f"[offline] {wl} b={batch}: two plain greedy runs gave different tokens")
                rows.append({**cell, "method": "plain", "k": 0, **_drop(plain)})
                for method, k, r in runs:
                    rows.append(_spec_row(cell, method, k, r, plain))
                    x = rows[-1]
                    log(f"[offline] {wl} T={temp} b={batch} {method} k={k}: x{x['ratio']:.2f} (plain drift "
                        f"{plain['drift']:.2f}), alpha/pos {_fmt(x['alpha_per_pos'])}, E {x['E']:.2f}, "
                        f"ideal x{x['ideal']:.2f}"
                        + ("" if x.get("greedy_identical", True) else " GREEDY MISMATCH"))
    cache.clear()
    gc.collect()
    return rows


def _drop(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "outputs"}


def _spec_row(cell: dict, method: str, k: int, r: dict, plain: dict) -> dict:
    drafts = r["drafts"]
    k_mean = r["draft_tokens"] / drafts if drafts else float(k)
    E = 1 + r["accepted_tokens"] / drafts if drafts else 1.0
    # Tokens per sequence per decode step, steps without drafts (no ngram/suffix match) included:
    # the E that goes with P and V, which are means over all decode steps.
    E_step = 1 + r["accepted_tokens"] / max(r["decode_seq_steps"], 1)
    per_pos = r["accepted_per_pos"]
    d_ms = r["P_ms"] / k_mean if k_mean else 0.0
    ideal = E_step * plain["V_ms"] / (r["P_ms"] + r["V_ms"]) if r["V_ms"] else float("nan")
    ratio = r["tok_s"] / plain["tok_s"]
    row = {**cell, "method": method, "k": k, **_drop(r), "plain_tok_s": plain["tok_s"], "ratio": ratio,
           "alpha_per_pos": [a / n if n else None for a, n in zip(per_pos, [drafts] + per_pos[:-1])],
           "alpha": sum(per_pos) / max(drafts + sum(per_pos[:-1]), 1),
           "acceptance_rate": r["accepted_tokens"] / max(r["draft_tokens"], 1),
           "mean_accepted_len": r["accepted_tokens"] / drafts if drafts else 0.0, "E": E, "E_step": E_step,
           "drafted_share": drafts / max(r["decode_seq_steps"], 1), "k_mean": k_mean,
           "d_ms": d_ms, "V1_ms": plain["V_ms"], "Vk1_ms": r["V_ms"], "ideal": ideal,
           "measured_over_ideal": ratio / ideal}
    if cell["temperature"] == 0:
        row["greedy_identical"] = r["outputs"] == plain["outputs"]
    return row


def _fmt(xs) -> str:
    return "/".join("-" if x is None else f"{x:.2f}" for x in xs) or "-"


# ---------------------------------------------------------------- peers


def transformers_peer(args, prompts: dict) -> tuple[list[dict], list[str]]:
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        return [], [f"transformers peer skipped: {e}"]
    torch.set_num_threads(args.threads)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(args.drafter, dtype=torch.float32).eval()
    k = args.http_k
    drafter.generation_config.num_assistant_tokens = k
    drafter.generation_config.num_assistant_tokens_schedule = "constant"
    drafter.generation_config.assistant_confidence_threshold = 0.0
    eos = target.generation_config.eos_token_id

    def gen(ids, max_new, extra):
        x = torch.tensor([ids])
        with torch.no_grad():
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new,
                                  pad_token_id=eos if isinstance(eos, int) else eos[0], **extra)
        return out.shape[1] - len(ids)

    rows = []
    for name, extra, kk in (("transformers generate", {}, 0),
                            ("transformers assisted", {"assistant_model": drafter}, k)):
        gen(prompts[args.workloads[0]][0]["ids"], 8, extra)  # warm-up
        for wl in args.workloads:
            ps = prompts[wl][:args.peer_prompts]
            start = time.perf_counter()
            n = sum(gen(p["ids"], args.max_tokens, extra) for p in ps)
            wall = time.perf_counter() - start
            rows.append({"stage": "peers", "threads": args.threads, "dtype": "float32", "batch": 1, "temperature": 0.0,
                         "k": kk, "workload": wl, "method": name, "prompts": len(ps), "requests": len(ps),
                         "max_tokens": args.max_tokens, "tok_s": n / wall, "new_tokens": n, "wall_s": wall,
                         "note": "drafter loaded as a plain Llama: full 49152-token head" if kk else ""})
            log(f"[peers] {name} {wl}: {n / wall:.1f} tok/s")
    return rows, []


def llamacpp_peer(args, prompts: dict) -> tuple[list[dict], list[str]]:
    try:
        import llamacpp as lc

        from specd.models import model_store
        from specd.cache import file_sha256
    except Exception as e:  # noqa: BLE001
        return [], [f"llama.cpp peer skipped: bench/llamacpp.py not importable ({e})"]
    bin_dir = args.llamacpp_bin or str(lc.DEFAULT_BIN_DIR)
    if not lc.available_binaries(bin_dir):
        return [], [f"llama.cpp peer skipped: no binaries in {bin_dir} (bash bench/build_llamacpp.sh)"]
    notes = []

    def f32_gguf(hf_dir: str) -> str | None:
        """hf_dir converted once with llama.cpp's converter (cached by the weights' sha256)."""
        digest = file_sha256(Path(hf_dir) / "model.safetensors")[:12]
        out = lc.DEFAULT_BENCH_DIR / "models" / f"{Path(hf_dir).name}-{digest}-f32.gguf"
        if not out.is_file():
            try:
                log(f"[peers] converting {hf_dir} to {out}")
                lc.convert_hf_to_gguf(hf_dir, str(out), "f32")
            except Exception as e:  # noqa: BLE001
                notes.append(f"llama.cpp: converting {hf_dir} failed: {str(e)[:300]}")
                return None
        return str(out)

    model = args.llamacpp_model or f32_gguf(args.target)
    if model is None:
        model = str(model_store.target_gguf())
        notes.append(f"llama.cpp runs the pair's GGUF {model} instead (not float32)")
    draft = args.llamacpp_draft or f32_gguf(args.drafter)
    template_file = Path(args.target) / "chat_template.jinja"
    template = template_file.read_text() if template_file.is_file() else None
    gguf_type = next((q for q in ("f32", "bf16", "f16", "q8_0", "q4_1", "q4_0") if q in Path(model).name.lower()),
                     "gguf")
    rows = []
    for mode, label in (("plain", "llama.cpp plain"), ("spec", "llama.cpp draft model"),
                        ("lookup", "llama.cpp lookup")):
        if mode == "spec" and draft is None:
            continue
        cfg = lc.RunConfig(bin_dir=bin_dir, model=model, draft=draft, max_tokens=args.max_tokens,
                           threads=args.threads, temperature=0.0, draft_max=args.http_k)
        for wl in args.workloads:
            try:
                s = lc.summarize(lc.run_prompts(mode, [p["messages"] for p in prompts[wl][:args.peer_prompts]], cfg,
                                                chat_template=template, warmup=1))
            except Exception as e:  # noqa: BLE001 — a missing binary or a failed run: note it, go on
                notes.append(f"{label} {wl} skipped: {str(e).splitlines()[0][:300]}")
                break
            rows.append({"stage": "peers", "threads": args.threads, "dtype": gguf_type,
                         "batch": 1, "temperature": 0.0, "k": args.http_k if mode != "plain" else 0, "workload": wl,
                         "method": label, "prompts": s["prompts"], "requests": s["prompts"],
                         "max_tokens": args.max_tokens, "decode_tok_s": s["decode_tok_s"],
                         "new_tokens": s["generated_tokens"], "accept_pct": s.get("accept_pct"),
                         "note": f"{Path(model).name}; decode only (llama.cpp's own timers)"
                                 + ("; drafter with its full head" if mode == "spec" else "")})
            log(f"[peers] {label} {wl}: {s['decode_tok_s']:.1f} decode tok/s")
    return rows, notes


# ---------------------------------------------------------------- main


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # children too; each also gets --threads
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks (services stop)
    from machine import machine_info
    from real_pair_report import write

    batches = args.batches + args.http_batches + [-(-args.b32_size // len(args.workloads)), args.peer_prompts]
    prompts = load_prompts(args.target, args.workloads, max(args.prompts, *batches))
    result = {"machine": machine_info(args.threads, dtype=args.dtype),
              "command": "python bench/real_pair.py " + shlex.join(argv),
              "models": {"target": args.target, "drafter": args.drafter,
                         "heads": {m: args.heads[m] for m in args.methods if m in args.heads}},
              "settings": {k: v for k, v in vars(args).items() if k not in ("out",)},
              "offline": [], "http": [], "batch32": [], "peers": [], "notes": []}
    log(f"{args.target} + {args.drafter}; prompts per workload {args.prompts}, max tokens {args.max_tokens}, "
        f"k {args.k}, threads {args.threads}")
    cells = len(args.workloads) * len(args.temps)
    plan = {"offline": cells * len(args.batches) * (2 + len(args.methods) * len(args.k))
            if "offline" in args.only else 0,
            "http": cells * len(args.http_batches) * (1 + args.repeats * (1 + len(args.methods)))
            + (1 + args.b32_repeats * (1 + len(args.b32_drafters))) if "http" in args.only else 0}
    log(f"plan: {plan['offline']} offline runs, {plan['http']} HTTP runs (batch-1 runs of {args.prompts} prompts x "
        f"up to {args.max_tokens} tokens, batch-B runs of max({args.prompts}, B) requests), peers: "
        f"{', '.join(args.peers) if 'peers' in args.only else 'none'}")
    try:
        if "offline" in args.only:
            result["offline"] = offline_stage(args, prompts)
            write(result, args.out)
        if "http" in args.only:
            from real_pair_http import http_stage

            result["http"], result["batch32"], notes = http_stage(
                args, prompts, lambda ps, batch: requests_for(ps, args.prompts, batch), log)
            result["notes"] += notes
            write(result, args.out)
        if "peers" in args.only:
            for peer, fn in (("transformers", transformers_peer), ("llamacpp", llamacpp_peer)):
                if peer in args.peers:
                    rows, notes = fn(args, prompts)
                    result["peers"] += rows
                    result["notes"] += notes
            write(result, args.out)
    finally:
        result["machine"]["load_avg_end"] = round(os.getloadavg()[0], 2)
        result["elapsed_s"] = round(time.monotonic() - T0, 1)
        write(result, args.out)
        log(f"wrote {args.out}.json, .md, .png ({result['elapsed_s']:.0f} s)")
    for n in result["notes"]:
        log(f"note: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
