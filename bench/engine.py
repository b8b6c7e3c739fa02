"""Decode throughput of the specd engine vs transformers and llama.cpp, with the memory roofline.

    python bench/engine.py --model default --dtypes bfloat16,float32 --batch-sizes 1,8,32 --threads 2
    python bench/engine.py --model random --dtypes bfloat16,float32 --batch-sizes 1,8,32 --threads 2
    python bench/engine.py --threads 4 --batch-sizes 1,4,16 --device cuda

--model default is the real target (SmolLM2-135M-Instruct, `specd.models.model_store.fetch()`),
--model random (the default) a random Llama of ~30M parameters (hidden 512, 8 layers, 8 heads,
intermediate 1408, vocab 8192, tied embeddings) written with save_pretrained into a temp dir;
any other value is an HF checkpoint dir. Results: bench/results/engine_real.{md,json} for the
real target, engine.{md,json} otherwise (--name overrides).

Method. Every request has a --prompt-len token prompt (random ids in the model's vocab) and
generates exactly --new-tokens tokens greedily (EOS ignored on our side; min_new_tokens =
max_new_tokens on the transformers side). Decode throughput excludes prefill:

    decode tok/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1))

where t(n) is the wall time of a whole generate call for n new tokens (same prompts), and
t(1) -- prefill plus the first token -- is reported as time to first token. Each number is
the median of --repeats runs after --warmup runs; the sides are interleaved run by run so a
change in machine load hits all alike. llama.cpp (batch 1 only) runs llama-bench
`-p 0 -n NEW -d PROMPT_LEN -r 1` once per repeat in the same interleaving, on a GGUF of the
same weights at the same precision, KV cache in that precision too (f16 for f32: llama-bench
has no f32 cache type).

Roofline: read bandwidth (machine.read_bandwidth: torch.sum over a 512 MB tensor of ones, same
thread count) measured at the start and the end of the run; the higher of the two divided by
the weight bytes one batch-1 decode step must read (every weight at the bench dtype; a tied
embedding counted once, as the head; an untied input embedding as one row) is the roofline.

Verify cost: after a prefill, one engine forward (LLMEngine.runner.run) over k+1 query
tokens of one sequence (the last token + k drafts) vs the 1-token forward, median of
--verify-iters interleaved pairs; the sampler is not included.

GGUFs for the real target, if absent (needs bash bench/build_llamacpp.sh first):

    python bench/llamacpp.py convert --hf-dir "$(specd models path target)" --outtype bf16 \\
        --out ~/.cache/specd-bench/models/smollm2-135m-instruct-bf16.gguf   # and --outtype f32
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp  # noqa: E402
from machine import machine_info, read_bandwidth  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GGUF_TYPES = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
# llama.cpp KV cache type per dtype: llama-bench offers no f32 cache, so f32 weights run with
# its default f16 cache (at 256 tokens of context the cache is ~1% of the weight bytes).
KV_TYPES = {"bfloat16": "bf16", "float32": "f16", "float16": "f16"}
DEFAULT_GGUF = str(llamacpp.DEFAULT_BENCH_DIR / "models" / "smollm2-135m-instruct-{type}.gguf")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="random", help="default (real target), random, or an HF checkpoint dir")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads and llama.cpp -t")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtypes", "--dtype", default="float32", help="comma list of float32, bfloat16, float16")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--name", default=None, help="basename of the result files (default: engine_real / engine)")
    p.add_argument("--skip-hf", action="store_true", help="do not time transformers")
    p.add_argument("--skip-llamacpp", action="store_true")
    p.add_argument("--bin-dir", default=str(llamacpp.DEFAULT_BIN_DIR), help="llama.cpp binaries (llama-bench)")
    p.add_argument("--gguf", default=None, help="GGUF path with {type} for bf16/f32/f16 "
                   f"(default for --model default: {DEFAULT_GGUF})")
    p.add_argument("--omp-wait-policy", default=None, help="OMP_WAIT_POLICY for llama.cpp (passive on shared cores)")
    p.add_argument("--verify-k", type=int, default=4, help="drafts in the verify-cost forward (k+1 query tokens)")
    p.add_argument("--verify-iters", type=int, default=20)
    p.add_argument("--bandwidth-mb", type=int, default=512)
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in args.dtypes if d not in GGUF_TYPES]
    if bad:
        p.error(f"unknown dtype(s) {bad}; choose from {sorted(GGUF_TYPES)}")
    args.name = args.name or ("engine_real" if args.model == "default" else "engine")
    if args.gguf is None and args.model == "default":
        args.gguf = DEFAULT_GGUF
    return args


def resolve_model(args, tmp: Path) -> Path:
    if args.model == "default":
        from specd.models.model_store import fetch

        return fetch(log=lambda m: print(m, file=sys.stderr))[0]
    if args.model == "random":
        return build_model(args, tmp / "model")
    return Path(args.model)


def build_model(args, out_dir: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(512, args.prompt_len + args.new_tokens),
        tie_word_embeddings=not args.untied, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def model_facts(model_dir: Path) -> dict:
    """Config summary, parameter count and the elements one batch-1 decode step reads."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    shapes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            shapes.update({k: st.get_slice(k).get_shape() for k in st.keys()})
    numel = {k: math.prod(s) for k, s in shapes.items()}
    params = sum(numel.values())
    tied = "lm_head.weight" not in shapes
    read = params
    if not tied:  # the input embedding is a lookup: one row per token, not the whole matrix
        emb = next(k for k in shapes if k.endswith("embed_tokens.weight"))
        read += shapes[emb][1] - numel[emb]
    return {"params": params, "elements_read_per_step": read, "tied": tied,
            **{k: cfg.get(k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                       "num_key_value_heads", "intermediate_size", "vocab_size")}}


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


class Ours:
    name = "specd"

    def __init__(self, model_dir, args, dtype):
        from specd import LLM

        # + room for the verify-cost forward (k+1 tokens after prefill + first token)
        self.llm = LLM(str(model_dir), dtype=dtype, device=args.device,
                       max_model_len=args.prompt_len + max(args.new_tokens, args.verify_k + 2))

    def generate(self, prompts, n) -> list[list[int]]:
        from specd import SamplingParams

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return [list(o.token_ids) for o in outs]


class HF:
    name = "transformers"

    def __init__(self, model_dir, args, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        self.model = self.model.to(args.device).eval()
        self.device = args.device
        self.attn = getattr(self.model.config, "_attn_implementation", None)

    def generate(self, prompts, n) -> list[list[int]]:
        import torch

        # left padding (a no-op when all prompts have the same length, as here)
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                      min_new_tokens=n, pad_token_id=0)
        return out[:, width:].tolist()


def matmul_floor(model_dir, args, dtype: str, batch: int, iters: int = 30) -> float:
    """Seconds per decode step for the weight matmuls alone (every Linear + lm_head, no
    attention, no framework), each through the engine's own matmul path (specd.engine.model.linear:
    prepacked oneDNN weights in bf16 on CPU): the floor of this engine's step at this batch size."""
    import torch
    from safetensors.torch import load_file

    from specd.engine.model.linear import fast_linear

    dt = getattr(torch, dtype)
    weights = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if w.dim() == 2:  # Linear weights and the (tied) embedding used as lm_head
                weights.append(w.to(args.device, dt))
    xs = {k: torch.randn(batch, k, device=args.device, dtype=dt) for k in {w.shape[1] for w in weights}}
    linears = [fast_linear(w) for w in weights]

    def step():
        for w, linear in zip(weights, linears):
            linear.forward(xs[w.shape[1]])

    for _ in range(3):
        step()
    sync(args.device)
    t = time.perf_counter()
    for _ in range(iters):
        step()
    sync(args.device)
    return (time.perf_counter() - t) / iters


def sync(device):
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


class LlamaBench:
    """llama-bench on the GGUF of this dtype, batch 1; `error` says why it is not run."""

    def __init__(self, args, dtype):
        self.args, self.type, self.kv, self.runs = args, GGUF_TYPES[dtype], KV_TYPES[dtype], []
        self.info = self.error = None
        self.gguf = Path(args.gguf.format(type=self.type)).expanduser() if args.gguf else None
        if args.skip_llamacpp:
            self.error = "skipped (--skip-llamacpp)"
        elif self.gguf is None:
            self.error = "no GGUF for this checkpoint (pass --gguf PATH_WITH_{type})"
        elif not self.gguf.is_file():
            self.error = (f"{self.gguf} missing; make it with: python bench/llamacpp.py convert "
                          f"--hf-dir MODEL_DIR --outtype {self.type} --out {self.gguf}")
        else:
            try:
                llamacpp.find_binary(args.bin_dir, "llama-bench")
            except llamacpp.BinaryMissing as e:
                self.error = str(e)  # names the build command: bash bench/build_llamacpp.sh
        if self.error:
            print(f"llama.cpp {self.type}: not run: {self.error}", file=sys.stderr)

    def run_once(self):
        if self.error:
            return
        a = self.args
        try:
            r = llamacpp.bench_decode(a.bin_dir, self.gguf, threads=a.threads, n_gen=a.new_tokens,
                                      depth=a.prompt_len, repetitions=1, cache_type=self.kv,
                                      omp_wait_policy=a.omp_wait_policy)
        except llamacpp.LlamaCppError as e:
            self.error = str(e).splitlines()[0]
            print(f"llama.cpp {self.type}: failed: {e}", file=sys.stderr)
            return
        self.runs.append(r["tok_s"])
        self.info = {k: v for k, v in r.items() if k not in ("tok_s", "samples_tok_s")}
        self.info["argv"] = " ".join(self.info["argv"])

    def result(self) -> dict:
        if not self.runs:
            return {"error": self.error, "gguf": str(self.gguf) if self.gguf else None}
        return {"decode_tok_s": statistics.median(self.runs), "runs_tok_s": self.runs, "gguf": str(self.gguf),
                **self.info}


def bench_batch(sides, llama, b, args, vocab, dtype, model_dir) -> dict:
    prompts = make_prompts(b, args.prompt_len, vocab)
    # correctness guard: both sides should produce the same greedy tokens (bf16 may differ)
    outs = {s.name: s.generate(prompts, args.new_tokens) for s in sides}
    same = outs["specd"] == outs["transformers"] if "transformers" in outs else None
    for _ in range(max(args.warmup - 1, 0)):
        for s in sides:
            s.generate(prompts, args.new_tokens)
    t1 = {s.name: [] for s in sides}
    tn = {s.name: [] for s in sides}
    for _ in range(args.repeats):
        for s in sides:  # interleaved so load changes hit every side
            t1[s.name].append(timed(lambda: s.generate(prompts, 1), args.device))
            tn[s.name].append(timed(lambda: s.generate(prompts, args.new_tokens), args.device))
        if b == 1:
            llama.run_once()
    row = {"batch": b, "greedy_identical": same}
    for s in sides:
        m1, mn = statistics.median(t1[s.name]), statistics.median(tn[s.name])
        decode = b * (args.new_tokens - 1) / (mn - m1)
        row[s.name] = {"ttft_s": m1, "total_s": mn, "decode_tok_s": decode,
                       "t1_runs": t1[s.name], "tn_runs": tn[s.name]}
        print(f"{dtype} batch {b:3d} {s.name:12s} ttft {m1 * 1e3:8.1f} ms  total {mn:6.2f} s  "
              f"decode {decode:8.1f} tok/s", file=sys.stderr)
    if b == 1:
        row["llama.cpp"] = llama.result()
        if "decode_tok_s" in row["llama.cpp"]:
            print(f"{dtype} batch   1 llama.cpp    decode {row['llama.cpp']['decode_tok_s']:8.1f} tok/s",
                  file=sys.stderr)
    floor = matmul_floor(model_dir, args, dtype, b)
    row["matmul_floor"] = {"step_s": floor, "decode_tok_s": b / floor}
    return row


def verify_entry(seq, drafts: list[int]):
    """A ScheduledSeq that verifies `drafts` after seq's last token (both layouts of the field)."""
    from specd.engine import scheduler

    n = len(drafts) + 1
    if "drafts" in {f.name for f in dataclasses.fields(scheduler.ScheduledSeq)}:
        return scheduler.ScheduledSeq(seq, n, n, drafts=scheduler.Drafts(list(drafts)))
    return scheduler.ScheduledSeq(seq, n, n, draft_token_ids=list(drafts))


def verify_cost(engine, args, vocab) -> dict:
    """Forward over k+1 query tokens of one sequence vs a 1-token step, after a prefill."""
    from specd import SamplingParams
    from specd.engine.scheduler import ScheduledSeq

    k = args.verify_k
    prompt = make_prompts(1, args.prompt_len, vocab, seed=1)[0]
    sid = engine.add_request(prompt, SamplingParams(max_tokens=k + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token; the sequence now has one token without KV
    seq = engine.sequences[sid]
    if not engine.block_manager.allocate(seq, seq.num_computed_tokens + 1 + k):
        raise RuntimeError("no KV blocks for the verify forward")
    # Neither forward advances num_computed_tokens, so each rewrites the same KV slots.
    one, many = [ScheduledSeq(seq, 1, 1)], [verify_entry(seq, prompt[:k])]
    for _ in range(3):
        engine.runner.run(one), engine.runner.run(many)
    t1, tk = [], []
    for _ in range(args.verify_iters):
        t1.append(timed(lambda: engine.runner.run(one), args.device))
        tk.append(timed(lambda: engine.runner.run(many), args.device))
    engine.abort(sid)
    m1, mk = statistics.median(t1), statistics.median(tk)
    return {"k": k, "context": args.prompt_len, "one_token_s": m1, "verify_s": mk, "ratio": mk / m1}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    info = machine_info(args.threads, args.device, ",".join(args.dtypes))
    bw_start = read_bandwidth(args.bandwidth_mb)
    print(f"read bandwidth at start: {bw_start['gb_s']:.1f} GB/s", file=sys.stderr)

    per_dtype, hf_attn = {}, None
    with tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp:
        model_dir = resolve_model(args, Path(tmp))
        facts = model_facts(model_dir)
        print(f"model {model_dir}: {facts['params'] / 1e6:.1f}M parameters; {info['cpu']}; "
              f"threads={args.threads}", file=sys.stderr)
        for dtype in args.dtypes:
            sides = [Ours(model_dir, args, dtype)] + ([] if args.skip_hf else [HF(model_dir, args, dtype)])
            hf_attn = sides[1].attn if len(sides) > 1 else hf_attn
            llama = LlamaBench(args, dtype)
            rows = [bench_batch(sides, llama, b, args, facts["vocab_size"], dtype, model_dir) for b in batch_sizes]
            verify = verify_cost(sides[0].llm.engine, args, facts["vocab_size"])
            print(f"{dtype} verify {verify['k'] + 1} tokens / 1 token: {verify['ratio']:.2f}x", file=sys.stderr)
            per_dtype[dtype] = {"rows": rows, "verify": verify, "llama_cpp_note": llama.error,
                                "weight_bytes_per_step": facts["elements_read_per_step"]
                                * getattr(torch, dtype).itemsize}
            del sides
            gc.collect()

    bw_end = read_bandwidth(args.bandwidth_mb)
    info["load_avg_end"] = round(os.getloadavg()[0], 2)
    # The higher of the two measurements: the roofline is a ceiling, so err on the high side.
    bw = max(bw_start["gb_s"], bw_end["gb_s"])
    for dtype, d in per_dtype.items():
        d["roofline_tok_s"] = bw * 1e9 / d["weight_bytes_per_step"]
        add_ratios(d)
    result = {"machine": info, "model": {"source": args.model, "dir": str(model_dir), **facts},
              "hf_attn_implementation": hf_attn,
              "bandwidth": {"start": bw_start, "end": bw_end, "used_gb_s": bw},
              "command": " ".join(["python", "bench/engine.py"] + list(sys.argv[1:] if argv is None else argv)),
              "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
              "warmup": args.warmup, "repeats": args.repeats, "dtypes": per_dtype}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(render_md(result))
    print(f"wrote {out / (args.name + '.md')} and {args.name}.json", file=sys.stderr)
    return 0


def add_ratios(d: dict) -> None:
    for row in d["rows"]:
        ours = row["specd"]["decode_tok_s"]
        if "transformers" in row:
            row["specd_over_transformers"] = ours / row["transformers"]["decode_tok_s"]
        if "decode_tok_s" in row.get("llama.cpp", {}):
            row["specd_over_llamacpp"] = ours / row["llama.cpp"]["decode_tok_s"]
        if row["batch"] == 1:
            row["specd_pct_of_roofline"] = 100 * ours / d["roofline_tok_s"]


def targets(r: dict) -> list[str]:
    """Issue 13's benchmark targets, batch 1, per dtype (the issue states them for bf16)."""
    out = ["## Targets (issue 13, batch 1)", "",
           "The issue states them for bfloat16; float32 is checked against the same numbers for reference.", ""]
    for dtype, d in r["dtypes"].items():
        row = next((row for row in d["rows"] if row["batch"] == 1), None)
        checks = [("≥ 50% of roofline", row and row.get("specd_pct_of_roofline"), 50, "%"),
                  ("≥ 2× transformers", row and row.get("specd_over_transformers"), 2, "×"),
                  ("≥ 0.6× llama.cpp", row and row.get("specd_over_llamacpp"), 0.6, "×"),
                  (f"verify {d['verify']['k'] + 1} tokens ≤ 1.3× a 1-token step", 1.3 / d["verify"]["ratio"],
                   1, None)]
        parts = []
        for label, x, need, unit in checks:
            if x is None:
                parts.append(f"{label}: not measured")
            elif unit is None:
                parts.append(f"{label}: {d['verify']['ratio']:.2f}× {'met' if x >= need else 'NOT met'}")
            else:
                parts.append(f"{label}: {x:.{0 if unit == '%' else 2}f}{unit} {'met' if x >= need else 'NOT met'}")
        out.append(f"- {dtype}: " + "; ".join(parts))
    return out + [""]


def fmt(x, spec=".1f", suffix=""):
    return "–" if x is None else f"{x:{spec}}{suffix}"


def render_md(r: dict) -> str:
    m, mo, bw = r["machine"], r["model"], r["bandwidth"]
    name = "SmolLM2-135M-Instruct (the default target)" if mo["source"] == "default" else (
        "random Llama (save_pretrained)" if mo["source"] == "random" else mo["dir"])
    lines = [
        "# Engine decode throughput: specd vs transformers vs llama.cpp, and the memory roofline",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Model: {name}, {mo['params'] / 1e6:.1f}M parameters (hidden {mo['hidden_size']}, "
        f"{mo['num_hidden_layers']} layers, {mo['num_attention_heads']} heads / {mo['num_key_value_heads']} kv "
        f"heads, intermediate {mo['intermediate_size']}, vocab {mo['vocab_size']}, "
        f"{'tied' if mo['tied'] else 'untied'} embeddings) on {m['device']}. Prompts {r['prompt_len']} random "
        f"tokens, {r['new_tokens']} new tokens, greedy, EOS ignored. Median of {r['repeats']} runs after "
        f"{r['warmup']} warm-up, sides interleaved.",
        "",
        f"Read bandwidth: {bw['start']['gb_s']:.1f} GB/s at start, {bw['end']['gb_s']:.1f} GB/s at end; "
        f"roofline uses {bw['used_gb_s']:.1f} GB/s.",
        "",
    ]
    for dtype, d in r["dtypes"].items():
        v = d["verify"]
        lines += [
            f"## {dtype}",
            "",
            f"Weights read per batch-1 decode step: {d['weight_bytes_per_step'] / 1e6:.1f} MB → roofline "
            f"{d['roofline_tok_s']:.1f} tok/s. Verify cost: forward over {v['k'] + 1} tokens "
            f"{v['verify_s'] * 1e3:.1f} ms vs 1 token {v['one_token_s'] * 1e3:.1f} ms = **{v['ratio']:.2f}×**."
            + (f" llama.cpp not run: {d['llama_cpp_note']}" if d["llama_cpp_note"] else ""),
            "",
            "| batch | specd tok/s | transformers tok/s | specd / transformers | llama.cpp tok/s | specd / llama.cpp "
            "| roofline tok/s | specd % of roofline | specd TTFT ms | transformers TTFT ms | greedy identical "
            "| weight-matmul floor tok/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|",
        ]
        for row in d["rows"]:
            hf, lc = row.get("transformers", {}), row.get("llama.cpp", {})
            same = row["greedy_identical"]
            lines.append(" | ".join([
                f"| {row['batch']}", fmt(row["specd"]["decode_tok_s"]), fmt(hf.get("decode_tok_s")),
                fmt(row.get("specd_over_transformers"), ".2f", "×"), fmt(lc.get("decode_tok_s")),
                fmt(row.get("specd_over_llamacpp"), ".2f", "×"),
                fmt(d["roofline_tok_s"] if row["batch"] == 1 else None),
                fmt(row.get("specd_pct_of_roofline"), ".0f", "%"),
                fmt(row["specd"]["ttft_s"] * 1e3), fmt(hf["ttft_s"] * 1e3 if hf else None),
                "–" if same is None else ("yes" if same else "no"),
                fmt(row["matmul_floor"]["decode_tok_s"]) + " |"]))
        lc = next((row["llama.cpp"] for row in d["rows"] if "decode_tok_s" in row.get("llama.cpp", {})), None)
        if lc:
            lines += ["", f"llama.cpp: `{lc['argv']}` (build {lc['build_commit']}, KV {lc['type_k']}, "
                          f"OMP_WAIT_POLICY {lc['omp_wait_policy'] or 'unset'}, GGUF {lc['model_size'] / 1e6:.1f} MB)"]
        lines.append("")
    lines += targets(r) + [
        "## Method",
        "",
        "Decode tok/s = batch × (new − 1) / (t(new) − t(1)) from whole generate calls, so prefill is "
        "excluded; TTFT = t(1) (prefill + first token). transformers runs `generate` on the same "
        "checkpoint and dtype (min_new_tokens = max_new_tokens). llama.cpp (batch 1) is llama-bench "
        "`-p 0 -n NEW -d PROMPT_LEN` on a GGUF of the same weights at the same precision with the KV "
        "cache in that precision (f16 for f32 weights: llama-bench has no f32 cache), one repetition "
        "per repeat, interleaved with the other sides. The roofline is read bandwidth (median "
        f"torch.sum over a {bw['start']['bytes'] / 2**20:.0f} MB tensor of ones, same thread count, "
        "the higher of the start/end measurements) divided by the bytes of every weight at the dtype "
        "(tied embedding once, as the head); KV and activations are ignored, so it is a ceiling. "
        "Verify cost: one engine forward (ModelRunner.run) over the last token + k drafts of one "
        f"sequence after a {r['prompt_len']}-token prefill vs the 1-token forward, median of interleaved "
        "pairs, sampler excluded. Greedy identical compares specd's and transformers' tokens (bf16 "
        "rounding can differ legitimately). Weight-matmul floor: the batch pushed through every weight "
        "matrix through the engine's own matmul path (specd.engine.model.linear; prepacked oneDNN in bf16 on CPU), "
        "one call per checkpoint matrix (q/k/v and gate/up unfused: a few more calls than the engine's "
        "step), no attention or framework.",
        "",
        "Machine:",
        "",
        f"- CPU: {m['cpu']} ({m['cores']} cores visible), threads: {m['threads']} (torch and llama.cpp)",
        f"- load average (1 min) at start / end: {m['load_avg_start']:.2f} / {m['load_avg_end']:.2f}",
        f"- Python {m['python']}, torch {m['torch']}, transformers {m['transformers']} "
        f"(attention: {r['hf_attn_implementation']})",
        f"- date: {m['date']}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
