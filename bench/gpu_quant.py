"""Weight-only int8/int4 on a GPU: the Triton kernel of kernels/quant_matmul_triton.py against cuBLAS.

    python3 bench/gpu_quant.py --out DIR      # on a machine with a CUDA GPU, torch and Triton

For Llama-1B and 8B-like linear shapes (K -> N) a random weight (randn * 0.02, bf16) is quantized by
quantize_weight (groups of 32, float16 scales). Per shape and bits: the largest absolute error of
quant_matmul on bf16 x (M = 32) against float32 F.linear with the dequantized weight, next to
cuBLAS bf16 on the same dequantized weight rounded to bf16 (the error a bf16 weight has anyway);
whether each of the 32 rows equals the same row computed alone (M = 1), bit for bit, for the Triton
kernels and, for comparison, cuBLAS; and whether quant_matmul equals the repo's batch-invariant bf16
matmul on the dequantized weight bit for bit (it need not: other tiles, other order of sums).
Then times at M = 1, 8, 32 for bf16 F.linear (cuBLAS), matmul_invariant (bf16), quant_matmul bits 8
and bits 4: torch.cuda.Event around one call, L2 flushed by writing 256 MB before each and the GPU
kept busy while the call is queued (Python's launch overhead is not timed), median of 20 after 10
warm-up calls and 1 s of bf16 matmuls to bring the clocks up; at M = 1 also GB/s of weight bytes read
(scales and mins included). --sweep also times other tile constants (BLOCK_N x BLOCK_K x warps x
stages) at M = 1 and 32, to show what the fixed choice gives up.
Writes DIR/gpu_quant.md and DIR/gpu_quant.json. Needs nothing but torch and Triton; runs from a bare
tree (the repo root goes on sys.path).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = [(2048, 2048), (2048, 8192), (8192, 2048), (4096, 14336), (14336, 4096)]  # (K, N): K -> N
MS = (1, 8, 32)
SWEEP = "16x256x4x3,32x128x4x3,32x256x4x1,32x256x4x3,32x256x4x4,32x512x4x3,64x128x4x3,64x256x8x3"
SWEEP_SHAPES = "2048x2048,14336x4096"


def import_kernels():
    """(quant module, matmul_invariant): kernels/ from the tree, or specd.kernels where installed."""
    try:
        import kernels.quant_matmul_triton as qm
        from kernels.matmul_invariant_triton import matmul_invariant
    except ImportError:
        import specd.kernels.quant_matmul_triton as qm
        from specd.kernels.matmul_invariant_triton import matmul_invariant
    return qm, matmul_invariant


def bench(fn, flush: torch.Tensor, iters: int, warmup: int = 10) -> float:
    """Median microseconds of one call: events around each call, L2 flushed before it, and the GPU
    kept busy (torch.cuda._sleep) while Python queues the call, so its launch overhead (tens of us
    for a Triton kernel, more than the flush takes) is not what is timed."""
    for _ in range(warmup):
        fn()
    if not flush.is_cuda:  # --device cpu: only to try the script
        runs = []
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t)
        return statistics.median(runs) * 1e6
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        flush.zero_()
        torch.cuda._sleep(1_000_000)  # ~0.5 ms of GPU spin: the call is queued before the GPU gets to it
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def weight_bytes(N: int, K: int, bits: int | None) -> int:
    if bits is None:
        return N * K * 2  # bf16
    groups = N * K // 32
    return N * K * bits // 8 + groups * 2 * (1 if bits == 8 else 2)  # fp16 scales (and mins)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 2)[2])
    p.add_argument("--out", default=str(ROOT / "bench" / "results"), help="folder for gpu_quant.md and .json")
    p.add_argument("--iters", type=int, default=20, help="timed calls per point (median)")
    p.add_argument("--shapes", default=",".join(f"{k}x{n}" for k, n in SHAPES), help="K x N pairs, K -> N")
    p.add_argument("--sweep", nargs="?", const=SWEEP, default="",
                   help=f"also time these BLOCK_N x BLOCK_K x warps x stages (default {SWEEP})")
    p.add_argument("--sweep-shapes", default=SWEEP_SHAPES, help="K x N pairs the sweep runs on")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself (set TRITON_INTERPRET=1 "
                   "and pass small --shapes)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/gpu_quant.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was run.",
              file=sys.stderr)
        return 2
    import triton

    qm, matmul_invariant = import_kernels()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    t0, dev = time.monotonic(), args.device
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "none (--device cpu)"
    flush = torch.empty(256 * 2**20 // 4 if dev == "cuda" else 1, dtype=torch.float32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    if dev == "cuda":  # clocks up before anything is timed
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        t = time.monotonic()
        while time.monotonic() - t < 1.0:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
        del a
    acc_rows, time_rows, sweep_rows, failures = [], [], [], 0
    for K, N in shapes:
        w = (torch.randn(N, K, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        x = torch.randn(max(MS), K, generator=g, device=dev).to(torch.bfloat16)
        quant = {bits: qm.quantize_weight(w, bits) for bits in (8, 4)}
        for bits, (q, s, m) in quant.items():
            deq = qm.dequantize_weight(q, s, m, bits)
            ref = F.linear(x.float(), deq)
            y = qm.quant_matmul(x, q, s, m, bits=bits)
            cublas = F.linear(x, deq.to(torch.bfloat16))
            d16 = deq.to(torch.bfloat16)
            inv = matmul_invariant(x, d16)
            rows_q = sum(torch.equal(qm.quant_matmul(x[i:i + 1], q, s, m, bits=bits), y[i:i + 1]) for i in range(len(x)))
            rows_c = sum(torch.equal(F.linear(x[i:i + 1], d16), cublas[i:i + 1]) for i in range(len(x)))
            rows_i = sum(torch.equal(matmul_invariant(x[i:i + 1], d16), inv[i:i + 1]) for i in range(len(x)))
            failures += rows_q != len(x)
            acc_rows.append(dict(shape=f"{K}->{N}", bits=bits, max_abs_ref=(ref.abs().max().item()),
                                 err_quant=(y.float() - ref).abs().max().item(),
                                 err_cublas_bf16=(cublas.float() - ref).abs().max().item(),
                                 rows_invariant_quant=f"{rows_q}/{len(x)}",
                                 rows_invariant_matmul_invariant=f"{rows_i}/{len(x)}",
                                 rows_invariant_cublas=f"{rows_c}/{len(x)}",
                                 equals_matmul_invariant=bool(torch.equal(y, inv))))
            print(acc_rows[-1], flush=True)
            del deq, d16, ref
        for M in MS:
            xm = x[:M].contiguous()
            fns = {"cublas_bf16": (lambda: F.linear(xm, w), None),
                   "matmul_invariant_bf16": (lambda: matmul_invariant(xm, w), None)}
            for bits, (q, s, m) in quant.items():
                fns[f"quant_int{bits}"] = ((lambda q=q, s=s, m=m, bits=bits: qm.quant_matmul(xm, q, s, m, bits=bits)), bits)
            row = dict(shape=f"{K}->{N}", M=M)
            for name, (fn, bits) in fns.items():
                us = bench(fn, flush, args.iters)
                row[f"{name}_us"] = round(us, 2)
                if M == 1:
                    row[f"{name}_gb_s"] = round(weight_bytes(N, K, bits) / us / 1e3, 1)
            time_rows.append(row)
            print(row, flush=True)
        if args.sweep and f"{K}x{N}" in args.sweep_shapes.split(","):
            saved = qm.BLOCK_N, qm.BLOCK_K, qm.NUM_WARPS, qm.NUM_STAGES
            try:
                for cfg in args.sweep.split(","):
                    bn, bk, warps, stages = (int(v) for v in cfg.split("x"))
                    qm.BLOCK_N, qm.BLOCK_K, qm.NUM_WARPS, qm.NUM_STAGES = bn, bk, warps, stages
                    for bits, (q, s, m) in quant.items():
                        r = dict(shape=f"{K}->{N}", bits=bits, BLOCK_N=bn, BLOCK_K=bk, warps=warps, stages=stages)
                        for M in (1, 32):
                            xm = x[:M].contiguous()
                            fn = lambda: qm.quant_matmul(xm, q, s, m, bits=bits)  # noqa: E731
                            r[f"M{M}_us"] = round(bench(fn, flush, args.iters), 2)
                        r["M1_gb_s"] = round(weight_bytes(N, K, bits) / r["M1_us"] / 1e3, 1)
                        sweep_rows.append(r)
                        print(r, flush=True)
            finally:
                qm.BLOCK_N, qm.BLOCK_K, qm.NUM_WARPS, qm.NUM_STAGES = saved
        if dev == "cuda":
            torch.cuda.empty_cache()

    head = (f"GPU: {gpu}; torch {torch.__version__}, Triton {triton.__version__}; tiles BLOCK_M x BLOCK_N x BLOCK_K = "
            f"{qm.BLOCK_M} x {qm.BLOCK_N} x {qm.BLOCK_K}, {qm.NUM_WARPS} warps, {qm.NUM_STAGES} stages; "
            f"{time.monotonic() - t0:.0f} s; "
            f"command: `python3 bench/gpu_quant.py {' '.join(sys.argv[1:] if argv is None else argv)}`.")
    lines = ["# Weight-only int8/int4 matmul on a GPU (kernels/quant_matmul_triton.py)", "", head, "",
             "## Error and row invariance (bf16 x, M = 32, groups of 32, fp16 scales)", "",
             "Errors are max |y - F.linear(x.float(), dequantized weight)|; cuBLAS bf16 runs on that weight rounded "
             "to bf16. Rows: rows of the M = 32 call equal to the row computed alone (M = 1), bit for bit.", "",
             "| K -> N | bits | max abs ref | max abs err quant | max abs err cuBLAS bf16 | rows quant | rows matmul_invariant "
             "| rows cuBLAS | quant = matmul_invariant(dequantized bf16) |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['bits']} | {r['max_abs_ref']:.3f} | {r['err_quant']:.2e} | {r['err_cublas_bf16']:.2e} "
              f"| {r['rows_invariant_quant']} | {r['rows_invariant_matmul_invariant']} | {r['rows_invariant_cublas']} "
              f"| {r['equals_matmul_invariant']} |" for r in acc_rows]
    names = ["cublas_bf16", "matmul_invariant_bf16", "quant_int8", "quant_int4"]
    lines += ["", "## Time per call (us, median of %d, L2 flushed) and weight GB/s at M = 1" % args.iters, "",
              "| K -> N | M | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} GB/s" for n in names) + " |",
              "|---|---|" + "---|" * (2 * len(names))]
    for r in time_rows:
        lines.append(f"| {r['shape']} | {r['M']} | " + " | ".join(f"{r[n + '_us']:.1f}" for n in names) + " | "
                     + " | ".join(f"{r[n + '_gb_s']:.0f}" if n + "_gb_s" in r else "" for n in names) + " |")
    if sweep_rows:
        lines += ["", "## Other tile constants (BLOCK_M = %d)" % qm.BLOCK_M, "",
                  "| K -> N | bits | BLOCK_N | BLOCK_K | warps | stages | M = 1 us | M = 1 GB/s | M = 32 us |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['shape']} | {r['bits']} | {r['BLOCK_N']} | {r['BLOCK_K']} | {r['warps']} | {r['stages']} "
                  f"| {r['M1_us']:.1f} "
                  f"| {r['M1_gb_s']:.0f} "
                  f"| {r['M32_us']:.1f} |" for r in sweep_rows]
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_quant.md").write_text(text)
    (out / "gpu_quant.json").write_text(json.dumps(dict(gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                                                        tiles=[qm.BLOCK_M, qm.BLOCK_N, qm.BLOCK_K], num_warps=qm.NUM_WARPS,
                                                        num_stages=qm.NUM_STAGES,
                                                        accuracy=acc_rows, times=time_rows, sweep=sweep_rows,
                                                        elapsed_s=time.monotonic() - t0), indent=1) + "\n")
    print(text)
    if failures:
        print(f"{failures} shape/bits cases had rows that changed with the row count", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
