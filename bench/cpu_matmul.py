"""specd's bf16 CPU matmul (kernels/cpu_bf16_matmul.cpp) vs oneDNN with prepacked weights, side by side.

    python bench/cpu_matmul.py --threads 2

Every linear of the default target (SmolLM2-135M: 30 layers of qkv, o, gate_up, down, and the tied
head), with random weights of those shapes, so they stream from memory as in a real step; rows
1 to 128 (decode, verify blocks, batches, prefill chunks). Median of 7 interleaved runs.
Writes bench/results/cpu_matmul.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1)]  # K, N, count


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,5,9,16,32,64,128")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default="cpu_matmul", help="results name under bench/results/")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from specd.engine.model.linear import InvariantCpuLinear, PlainLinear, PrepackedLinear
    from specd.kernels import cpu_ops

    if not cpu_ops.available():
        raise SystemExit("the fused CPU ops do not build here")
    info = machine_info(args.threads, "cpu", "bfloat16")
    layers, peer = [], "oneDNN (prepacked)"
    for K, N, count in SHAPES:
        for _ in range(count):
            w = torch.randn(N, K).bfloat16() * K ** -0.5
            try:
                other = PrepackedLinear(w, None)
            except RuntimeError:  # oneDNN's bf16 needs AVX-512 (or AVX-NE-CONVERT): torch's own F.linear then
                other, peer = PlainLinear(w, None), "torch F.linear"
            layers.append((K, other, InvariantCpuLinear(w, None)))
    rows = []
    for M in (int(m) for m in args.rows.split(",")):
        xs = {K: torch.randn(M, K).bfloat16() for K, _, _ in SHAPES}
        times = {"onednn": [], "specd": []}
        for _ in range(args.repeats):
            for name, i in (("onednn", 1), ("specd", 2)):
                t = time.perf_counter()
                for layer in layers:
                    layer[i].forward(xs[layer[0]])
                times[name].append(time.perf_counter() - t)
        on, sp = statistics.median(times["onednn"]), statistics.median(times["specd"])
        rows.append({"rows": M, "onednn_ms": on * 1e3, "specd_ms": sp * 1e3, "ratio": sp / on})
        print(f"{M:4d} rows: oneDNN {on * 1e3:.2f} ms, specd {sp * 1e3:.2f} ms, {sp / on:.2f}x", file=sys.stderr)
    result = {"machine": info, "command": " ".join(["python", "bench/cpu_matmul.py", *(argv or sys.argv[1:])]),
              "rows": rows, "peer": peer}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    m = info
    lines = [f"# bf16 CPU matmul: specd (batch-invariant) vs {peer}", "", f"Command: `{result['command']}`",
             "", "All linears of one SmolLM2-135M step (random weights of its shapes), median of interleaved runs "
             "(the oneDNN column is the peer named in the title).", "",
             "| rows | oneDNN ms | specd ms | specd / oneDNN |", "|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['onednn_ms']:.2f} | {r['specd_ms']:.2f} | {r['ratio']:.2f} |" for r in rows]
    lines += ["", f"Machine: {m['cpu']} ({' '.join(m['cpu_flags'])}), {m['cores']} cores, torch threads "
              f"{m['threads']}, torch {m['torch']}; load average {m['load_avg_start']:.2f} at start; {m['date']}.", ""]
    (RESULTS / f"{args.out}.md").write_text("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
