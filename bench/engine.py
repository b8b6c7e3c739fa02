"""Decode throughput of the specd engine vs transformers, same weights, dtype and device.

    python bench/engine.py                  # CPU, float32, 2 threads, batch 1 and 16
    python bench/engine.py --threads 4 --batch-sizes 1,4,16 --device cuda

Method. A random Llama checkpoint (default ~30M parameters: hidden 512, 8 layers,
8 heads, intermediate 1408, vocab 8192, tied embeddings) is written with transformers'
save_pretrained into a temp dir and loaded by both sides. Every request has a
128-token prompt and generates exactly 128 tokens greedily (EOS ignored on our side;
min_new_tokens = max_new_tokens on the transformers side). Decode throughput excludes
prefill:

    decode tok/s = batch * (new_tokens - 1) / (t(new_tokens) - t(1))

where t(n) is the wall time of a whole generate call for n new tokens (same prompts),
and t(1) -- prefill plus the first token -- is reported as time to first token. Each
measurement is the median of --repeats runs after --warmup runs; the two sides are
interleaved run by run so a change in machine load hits both alike.

Writes bench/results/engine.md (table + machine info) and engine.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads, for both sides")
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default=None, help="existing HF checkpoint dir (default: build a random one)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--name", default="engine", help="basename of the result files")
    p.add_argument("--skip-hf", action="store_true", help="only time our engine")
    return p.parse_args(argv)


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


def make_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed + batch)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


class Ours:
    name = "specd"

    def __init__(self, model_dir, args):
        from specd import LLM

        self.llm = LLM(str(model_dir), dtype=args.dtype, device=args.device,
                       max_model_len=args.prompt_len + args.new_tokens)

    def generate(self, prompts, n) -> list[list[int]]:
        from specd import SamplingParams

        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
        return [list(o.token_ids) for o in outs]

    def num_params(self) -> int:
        model = self.llm.engine.model
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


class HF:
    name = "transformers"

    def __init__(self, model_dir, args):
        import torch
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, args.dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(args.device).eval()
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

    def num_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def matmul_floor(model_dir, args, batch: int, iters: int = 30) -> float:
    """Seconds per decode step for the weight matmuls alone (every Linear + lm_head, no
    attention, no framework): the floor any engine pays per step at this batch size."""
    import torch
    from safetensors.torch import load_file

    dtype = getattr(torch, args.dtype)
    weights = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            if w.dim() == 2:  # Linear weights and the (tied) embedding used as lm_head
                weights.append(w.to(args.device, dtype))
    xs = {k: torch.randn(batch, k, device=args.device, dtype=dtype) for k in {w.shape[1] for w in weights}}

    def step():
        for w in weights:
            xs[w.shape[1]] @ w.T

    for _ in range(3):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        step()
    if args.device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters


def timed(side, prompts, n, device) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    side.generate(prompts, n)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    info = machine_info(args.threads, args.device, args.dtype)

    with tempfile.TemporaryDirectory(prefix="specd-bench-") as tmp:
        model_dir = Path(args.model) if args.model else build_model(args, Path(tmp) / "model")
        sides = [Ours(model_dir, args)] + ([] if args.skip_hf else [HF(model_dir, args)])
        params = sides[0].num_params()
        print(f"model: {params / 1e6:.1f}M parameters; {info['cpu']}; threads={args.threads}", file=sys.stderr)

        rows = []
        for b in batch_sizes:
            prompts = make_prompts(b, args.prompt_len, args.vocab)
            # correctness guard: both sides must produce the same greedy tokens
            outs = {s.name: s.generate(prompts, args.new_tokens) for s in sides}
            same = None if args.skip_hf else outs["specd"] == outs["transformers"]
            for _ in range(max(args.warmup - 1, 0)):
                for s in sides:
                    s.generate(prompts, args.new_tokens)
            t1 = {s.name: [] for s in sides}
            tn = {s.name: [] for s in sides}
            for _ in range(args.repeats):
                for s in sides:  # interleaved so load changes hit both sides
                    t1[s.name].append(timed(s, prompts, 1, args.device))
                    tn[s.name].append(timed(s, prompts, args.new_tokens, args.device))
            row = {"batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "greedy_identical": same}
            for s in sides:
                m1, mn = statistics.median(t1[s.name]), statistics.median(tn[s.name])
                decode = b * (args.new_tokens - 1) / (mn - m1)
                row[s.name] = {"ttft_s": m1, "total_s": mn, "decode_tok_s": decode,
                               "t1_runs": t1[s.name], "tn_runs": tn[s.name]}
                print(f"batch {b:3d} {s.name:12s} ttft {m1 * 1e3:8.1f} ms  total {mn:6.2f} s  "
                      f"decode {decode:8.1f} tok/s", file=sys.stderr)
            floor = matmul_floor(model_dir, args, b)
            row["matmul_floor"] = {"step_s": floor, "decode_tok_s": b / floor}
            print(f"batch {b:3d} weight-matmul floor {floor * 1e3:.2f} ms/step = {b / floor:.1f} tok/s",
                  file=sys.stderr)
            if not args.skip_hf:
                row["speedup"] = row["specd"]["decode_tok_s"] / row["transformers"]["decode_tok_s"]
                print(f"batch {b:3d} speedup {row['speedup']:.2f}x  greedy identical: {same}", file=sys.stderr)
            rows.append(row)

    info["load_avg_end"] = os.getloadavg()[0]
    hf_attn = None if args.skip_hf else sides[1].attn
    result = {"machine": info, "model": {"params": params, "hidden": args.hidden, "layers": args.layers,
                                         "heads": args.heads, "kv_heads": args.kv_heads,
                                         "intermediate": args.intermediate, "vocab": args.vocab,
                                         "tied": not args.untied, "source": args.model or "random (save_pretrained)"},
              "hf_attn_implementation": hf_attn,
              "command": " ".join(["python", "bench/engine.py"] + list(sys.argv[1:] if argv is None else argv)), "warmup": args.warmup, "repeats": args.repeats, "rows": rows}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"{args.name}.md").write_text(render_md(result, args))
    print(f"wrote {out / (args.name + '.md')} and {args.name}.json", file=sys.stderr)
    return 0


def render_md(r: dict, args) -> str:
    m, mo = r["machine"], r["model"]
    lines = [
        "# Engine decode throughput: specd vs transformers",
        "",
        f"Command: `{r['command']}`",
        "",
        f"Model: random Llama, {mo['params'] / 1e6:.1f}M parameters (hidden {mo['hidden']}, {mo['layers']} layers, "
        f"{mo['heads']} heads / {mo['kv_heads']} kv heads, intermediate {mo['intermediate']}, vocab {mo['vocab']}, "
        f"{'tied' if mo['tied'] else 'untied'} embeddings), {m['dtype']} on {m['device']}. "
        f"Prompts {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, EOS ignored.",
        "",
        "Decode tok/s = batch × (new − 1) / (t(new) − t(1)), so prefill is excluded; TTFT = t(1) "
        f"(prefill + first token). Median of {r['repeats']} runs after {r['warmup']} warm-up, sides interleaved.",
        "",
        "| batch | specd decode tok/s | transformers decode tok/s | speedup | specd TTFT ms | transformers TTFT ms "
        "| greedy identical | weight-matmul floor tok/s |",
        "|---:|---:|---:|---:|---:|---:|:---:|---:|",
    ]
    for row in r["rows"]:
        ours, hf = row["specd"], row.get("transformers")
        lines.append(
            f"| {row['batch']} | {ours['decode_tok_s']:.1f} | {hf['decode_tok_s']:.1f} | {row['speedup']:.2f}× | "
            f"{ours['ttft_s'] * 1e3:.1f} | {hf['ttft_s'] * 1e3:.1f} | {'yes' if row['greedy_identical'] else 'NO'} | "
            f"{row['matmul_floor']['decode_tok_s']:.1f} |"
            if hf else f"| {row['batch']} | {ours['decode_tok_s']:.1f} | – | – | {ours['ttft_s'] * 1e3:.1f} | – | – | "
            f"{row['matmul_floor']['decode_tok_s']:.1f} |"
        )
    lines += [
        "",
        "Weight-matmul floor: the same batch pushed through every weight matrix of the model with bare "
        "`x @ W.T` calls (no attention, norms, sampling or framework), i.e. the ceiling for any engine "
        "at this dtype on this machine. Where specd is close to it, decode is bound by streaming the "
        "weights from memory, and a larger speedup over transformers is not available without "
        "changing dtype, batch or hardware.",
        "",
        "Machine:",
        "",
        f"- CPU: {m['cpu']} ({m['cores']} cores visible), torch threads: {m['threads']}",
        f"- load average (1 min) at start / end: {m['load_avg_start']:.2f} / {m['load_avg_end']:.2f} "
        "(shared machine)",
        f"- Python {m['python']}, torch {m['torch']}, transformers {m['transformers']} "
        f"(attention: {r['hf_attn_implementation']})",
        f"- date: {m['date']}",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
