"""What a verify block costs on this CPU: the default target's forward over T = 1..9 query tokens of
one sequence (bf16, 128 tokens of context or --context), in ms and as a multiple of the 1-token step: the curve
the speculation controller prices k by (specd/engine/spec/costs.py learns it live).

With --baseline DIR, a checkout of another commit (`git worktree add /tmp/base HEAD~1`), the same
forward with that checkout's CPU kernels (built in a cache of their own; the engine's Python is
this tree's), in processes alternating with this tree's, side by side in one run.

    python bench/verify_rows.py --threads 2 [--baseline /tmp/base] [--out bench/results/verify_rows_avx2]
    python bench/verify_rows.py --threads 2 --rows 1,16,32,33,48,64   # larger blocks (trees, batches)
    python bench/verify_rows.py --threads 2 --context 1024   # a long answer or prompt: attention's share grows
    python bench/verify_rows.py --threads 2 --random-gguf /tmp/q4km-1.5b.gguf   # a quantized 1.5B target

--random-gguf PATH writes (once) and measures a random-weight qwen2 GGUF of Qwen2.5-1.5B-Instruct's
shapes (1536 hidden, 28 layers, 12 / 2 heads, 8960 intermediate, 151,936 tokens, tied head) in a
Q4_K_M-like mix, served in its own types (--dtype auto): llama.cpp's Q4_K_M rule for the layers
(Q4_K; Q6_K for attn_v and ffn_down in its use_more_bits layers), Q5_0 for attn_q and attn_k and Q8_0
for the embeddings and head, so the file holds the four types a user's Qwen2.5-1.5B Q4_K_M file had
(its exact per-tensor map is not known here). Any bytes are valid blocks: random ones, with scales
that keep the weights small; a forward's cost does not depend on the values.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info, machine_line, write_result  # noqa: E402

ROWS = "1-9"  # T values: a range "a-b" or a list "1,8,16"


def parse_rows(text: str) -> list[int]:
    if "-" in text:
        a, b = text.split("-")
        return list(range(int(a), int(b) + 1))
    return sorted({int(t) for t in text.split(",")})


def write_random_gguf(path: Path) -> None:
    """The --random-gguf file (module docstring)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    hidden, layers, heads, kv_heads, ffn, vocab = 1536, 28, 12, 2, 8960, 151936
    kv = kv_heads * hidden // heads
    # type -> (byte offset of its fp16 scale, scale, dmin where it has one): |w| of 0.01-0.1
    scales = {Q.Q4_K: (0, 5e-5, 5e-5), Q.Q6_K: (208, 2e-5, None), Q.Q8_0: (0, 2e-4, None), Q.Q5_0: (0, 2e-3, None)}
    rng = np.random.default_rng(0)

    def blocks(qtype, rows: int, cols: int) -> np.ndarray:
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
        at, d, dmin = scales[qtype]
        raw[..., at:at + 2] = np.frombuffer(np.float16(d).tobytes(), dtype=np.uint8)
        if dmin is not None:
            raw[..., 2:4] = np.frombuffer(np.float16(dmin).tobytes(), dtype=np.uint8)
        return raw.reshape(rows, -1)

    def more_bits(i: int) -> bool:  # llama.cpp's use_more_bits
        return i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2

    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("random qwen2, Qwen2.5-1.5B-Instruct's shapes, Q4_K_M-like")
    for add, value in [(w.add_context_length, 32768), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_rope_freq_base, 1e6), (w.add_layer_norm_rms_eps, 1e-6),
                       (w.add_file_type, gguf.LlamaFileType.MOSTLY_Q4_K_M)]:
        add(value)
    # A byte-level BPE vocabulary: the 256 byte symbols, one merge, fillers, three control tokens.
    alphabet = [chr(c) for c in (*range(33, 127), *range(161, 173), *range(174, 256), *range(256, 324))]
    tokens = alphabet + ["ab"] + [f"<t{i}>" for i in range(vocab - len(alphabet) - 4)] + [
        "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i >= vocab - 3 else 1 for i in range(vocab)])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(vocab - 3)
    w.add_eos_token_id(vocab - 3)
    w.add_tensor("token_embd.weight", blocks(Q.Q8_0, vocab, hidden), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        big = Q.Q6_K if more_bits(i) else Q.Q4_K
        for name, n in (("attn_norm", hidden), ("ffn_norm", hidden)):
            w.add_tensor(f"blk.{i}.{name}.weight", (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))
        for name, n in (("attn_q", hidden), ("attn_k", kv), ("attn_v", kv)):
            w.add_tensor(f"blk.{i}.{name}.bias", (0.1 * rng.standard_normal(n)).astype(np.float32))
        for name, qtype, rows, cols in (("attn_q", Q.Q5_0, hidden, hidden), ("attn_k", Q.Q5_0, kv, hidden),
                                        ("attn_v", big, kv, hidden), ("attn_output", Q.Q4_K, hidden, hidden),
                                        ("ffn_gate", Q.Q4_K, ffn, hidden), ("ffn_up", Q.Q4_K, ffn, hidden),
                                        ("ffn_down", big, hidden, ffn)):
            w.add_tensor(f"blk.{i}.{name}.weight", blocks(qtype, rows, cols), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def use_kernels_of(checkout: Path, cache: Path) -> None:
    """Import specd.kernels from `checkout` (its sources, built under `cache`) before specd does."""
    os.environ["SPECD_CACHE"] = str(cache)
    spec = importlib.util.spec_from_file_location("specd.kernels", checkout / "kernels" / "__init__.py",
                                                  submodule_search_locations=[str(checkout / "kernels")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["specd.kernels"] = module
    spec.loader.exec_module(module)


def worker(args) -> None:
    if args.kernels_of:
        use_kernels_of(Path(args.kernels_of), Path(args.kernels_cache))
    import torch

    torch.set_num_threads(args.threads)
    from engine import verify_entry  # bench/engine.py
    from specd import LLM, SamplingParams
    from specd.engine.scheduler import ScheduledSeq
    from specd.kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the fused CPU ops do not build here")
    if args.build_only:
        return
    rows = parse_rows(args.rows)
    engine = LLM(args.model, dtype=args.dtype, max_model_len=max(512, args.context + 64)).engine
    rng = random.Random(1)
    prompt = [rng.randrange(3, 49000) for _ in range(args.context)]
    sid = engine.add_request(prompt, SamplingParams(max_tokens=max(rows) + 2, temperature=0.0, ignore_eos=True))
    engine.step()  # prefill + first token
    seq = engine.sequences[sid]
    assert engine.block_manager.allocate(seq, seq.num_computed_tokens + max(rows) + 1)
    # No forward advances num_computed_tokens: each rewrites the same KV slots.
    entries = {T: [ScheduledSeq(seq, 1, 1)] if T == 1 else [verify_entry(seq, prompt[:T - 1])] for T in rows}
    for _ in range(2):
        for entry in entries.values():
            engine.runner.run(entry)
    times = {T: [] for T in rows}
    for _ in range(args.iters):
        for T, entry in entries.items():
            t = time.perf_counter()
            engine.runner.run(entry)
            times[T].append(time.perf_counter() - t)
    print(json.dumps({T: statistics.median(v) * 1e3 for T, v in times.items()}))


def run_worker(args, side: str, cache: Path, build_only: bool = False) -> dict[int, float]:
    cmd = [sys.executable, __file__, "--worker", "--threads", str(args.threads), "--model", args.model, "--dtype", args.dtype,
           "--iters", str(args.iters), "--rows", args.rows, "--context", str(args.context)]
    if side == "baseline":
        cmd += ["--kernels-of", str(args.baseline), "--kernels-cache", str(cache)]
    if build_only:
        cmd.append("--build-only")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return {} if build_only else {int(T): ms for T, ms in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def describe(checkout: Path) -> str:
    """The checkout and its commit, as the results name the baseline."""
    out = subprocess.run(["git", "-C", str(checkout), "log", "-1", "--format=%h %s"], capture_output=True, text=True)
    return f"{checkout} ({out.stdout.strip()[:80] or 'not a git checkout'})"


def render(r: dict) -> str:
    sides = r["settings"]["sides"]
    head = "| T (query tokens) | " + " | ".join(f"{s} ms | {s} / T=1" for s in sides) + " |"
    lines = ["# A verify block's forward on this CPU (bench/verify_rows.py)", "",
             f"{r['settings']['model']} ({r['machine']['dtype']}), one sequence of {r['settings'].get('context', 128)} tokens of context, "
             f"forward over T query tokens; median of {r['settings']['iters']} per process, then the median "
             f"of {r['settings']['rounds']} processes per side, sides alternating (ABBA).",
             "" if len(sides) == 1 else f"baseline: the CPU kernels of {r['settings']['baseline']}.", "",
             head, "|---:|" + "---:|---:|" * len(sides)]
    for row in r["rows"]:
        cells = [f"{row[s]:.2f} | {row[s] / r['rows'][0][s]:.2f}x" for s in sides]
        lines.append(f"| {row['T']} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", f"Command: `{r['command']}`.", "", machine_line(r), ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="processes per side")
    p.add_argument("--iters", type=int, default=15, help="forwards per T in each process")
    p.add_argument("--baseline", type=Path, default=None, help="a checkout whose CPU kernels to compare")
    p.add_argument("--model", default=None, help="default: the fetched default target")
    p.add_argument("--dtype", default="bfloat16", help="auto serves a .gguf in its own quantized types")
    p.add_argument("--context", type=int, default=128, help="tokens of the sequence before the block")
    p.add_argument("--rows", default=ROWS, help="query token counts T: a range a-b or a list (default 1-9)")
    p.add_argument("--random-gguf", type=Path, default=None,
                   help="measure a random Qwen2.5-1.5B-shaped Q4_K_M-like GGUF at this path (written if missing)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--worker", action="store_true")
    p.add_argument("--build-only", action="store_true")
    p.add_argument("--kernels-of")
    p.add_argument("--kernels-cache")
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.random_gguf is not None:
        if not args.random_gguf.exists():
            write_random_gguf(args.random_gguf)
        args.model, args.dtype = str(args.random_gguf), "auto"
    if args.model is None:
        from specd.models import model_store

        args.model = str(model_store.target_dir())
    t0 = time.monotonic()
    info = machine_info(args.threads, dtype=args.dtype)
    sides = ["this tree"] + (["baseline"] if args.baseline else [])
    with tempfile.TemporaryDirectory(prefix="specd-verify-rows-") as cache:
        for side in sides:  # builds first, outside the timings
            run_worker(args, side, Path(cache), build_only=True)
        runs = {side: [] for side in sides}
        for i in range(args.rounds):
            for side in sides if i % 2 == 0 else sides[::-1]:  # ABBA: neither side always goes first
                runs[side].append(run_worker(args, side, Path(cache)))
                print(side, {T: round(ms, 2) for T, ms in runs[side][-1].items()}, file=sys.stderr)
    rows = [{"T": T, **{side: statistics.median(run[T] for run in runs[side]) for side in sides}} for T in parse_rows(args.rows)]
    settings = {"model": Path(args.model).name, "context": args.context, "sides": sides, "baseline": describe(args.baseline) if args.baseline else None, "rounds": args.rounds,
                "iters": args.iters, "runs": {side: runs[side] for side in sides}}
    out = args.out or Path(tempfile.gettempdir()) / "verify_rows"
    write_result(out, "bench/verify_rows.py", argv, info, settings, rows, t0, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
